"""``fp8-compare``: the table arithmetic against hand-computed numbers, and one real two-precision run."""

import json

import pytest

from fp8_lightning import compare


def fake_run(name: str, val_loss: float, tokens_per_s: float, converted: int) -> dict:
    return {
        "config_name": name.replace("-", "_"), "precision": name, "recipe": None, "steps": 10, "parameters": 1000,
        "val_loss": val_loss, "val_ppl": 2.718281828 ** val_loss, "tokens_per_s": tokens_per_s,
        "peak_memory_mib": 500.0, "peak_memory_kind": "process_peak_rss",
        "layers": {"converted": [f"l{i}" for i in range(converted)], "skipped": {}},
        "train_loss_curve": [[1, 5.0], [10, val_loss + 0.1]], "val_loss_curve": [[10, val_loss]],
    }


def test_gap_and_speed_are_relative_to_fp32():
    runs = [fake_run("fp32", 2.0, 1000.0, 0), fake_run("fp8-hybrid", 2.05, 1500.0, 5)]
    compare.add_comparisons(runs)
    assert runs[0]["val_loss_gap"] == 0 and runs[0]["speed_vs_fp32"] == 1
    assert runs[1]["val_loss_gap"] == pytest.approx(0.05)
    assert runs[1]["val_loss_gap_pct"] == pytest.approx(2.5)
    assert runs[1]["speed_vs_fp32"] == pytest.approx(1.5)
    table = compare.markdown_table(runs)
    assert "| fp8-hybrid | – | 2.0500 | +0.0500 (+2.50%) |" in table and "| 1.50x |" in table and "| 5 / 0 |" in table


def test_without_fp32_there_is_no_gap():
    runs = [fake_run("bf16-mixed", 2.0, 1000.0, 0)]
    compare.add_comparisons(runs)
    assert runs[0]["val_loss_gap"] is None and runs[0]["speed_vs_fp32"] is None


def test_bad_precision_name_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        compare.parse_args(["--precisions", "fp8 hybrid"])
    assert info.value.code == 2 and "invalid precision name" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_precision_comparison_writes_report_plot_and_results(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    out = tmp_path / "cmp"
    code = compare.main(["--precisions", "fp32", "fp8-hybrid", "--experiment", "smoke", "--out", str(out),
                         "trainer.max_steps=4", "trainer.val_check_interval=4"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["precision"] for r in results["runs"]] == ["fp32", "fp8-hybrid"]
    fp32, fp8 = results["runs"]
    assert fp8["val_loss_gap"] == pytest.approx(fp8["val_loss"] - fp32["val_loss"])
    report = (out / "report.md").read_text()
    assert "| fp32 |" in report and "| fp8-hybrid |" in report and "![loss curves](loss_curves.png)" in report
    assert "Command: `fp8-compare --precisions fp32 fp8-hybrid" in report
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "fp32" / "summary.json").is_file() and (out / "fp8_hybrid" / "stdout.log").is_file()


def test_unknown_precision_fails_before_any_run(tmp_path, capsys):
    code = compare.main(["--precisions", "fp32", "fp8_nope", "--out", str(tmp_path)])
    assert code == 2 and not (tmp_path / "fp32").exists()
    err = capsys.readouterr().err
    assert "unknown precision(s) ['fp8_nope']" in err and "fp8_mxfp8" in err

