"""CPU smoke runs of each benchmark suite: they run and write their JSON, markdown and plot (no timing asserted)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_gpt  # noqa: E402
import bench_linear  # noqa: E402
import bench_memory  # noqa: E402
import host_time  # noqa: E402


def _check_folder(folder: Path, plot: str) -> dict:
    record = json.loads((folder / "results.json").read_text())
    assert {"command", "device", "date", "torch", "rows"} <= set(record)
    assert record["command"].startswith("python benchmarks/bench_")
    assert (folder / "results.md").read_text().count("|") > 10
    assert (folder / plot).stat().st_size > 1000
    return record


def _peer(record: dict) -> set[str]:
    """The torchao.float8 row, present exactly when torchao imports (the dev install has it)."""
    assert record["torchao"] in ("not installed", "installed") or record["torchao"].startswith("unusable")
    return {"torchao tensorwise"} if record["torchao"] == "installed" else set()


def test_linear_suite_reports_every_configuration(tmp_path):
    rows = bench_linear.main(["--suite", "cpu", "--sizes", "32", "--rounds", "1", "--warmup", "1", "--out", str(tmp_path)])
    record = _check_folder(tmp_path, "linear.png")
    fp8 = {f"fp8 {name}" for name in ("delayed", "tensorwise", "mxfp8", "rowwise", "blockwise")}
    assert {r["config"] for r in rows} == {"fp32", "bf16"} | fp8 | _peer(record)
    assert all(r["ms"] > 0 for r in rows)


def test_gpt_suite_reports_tokens_per_second(tmp_path):
    rows = bench_gpt.main(["--suite", "cpu", "--models", "dim64", "--rounds", "1", "--warmup", "1", "--out", str(tmp_path)])
    record = _check_folder(tmp_path, "gpt.png")
    assert {r["precision"] for r in rows} == {"fp32", "bf16", "fp8 delayed", "fp8 tensorwise", "fp8 mxfp8"} | _peer(record)
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert next(r for r in rows if r["precision"] == "fp32")["ratio"] == pytest.approx(1.0)


@pytest.mark.timeout(300)
def test_memory_suite_counts_saved_bytes_optimizer_and_allgather(tmp_path):
    rows = bench_memory.main(["--suite", "cpu", "--n-embd", "32", "--allgather-width", "32", "--allgather-depth", "1",
                              "--out", str(tmp_path)])  # fmt: skip
    _check_folder(tmp_path, "memory.png")
    saved = {r["precision"]: r["MiB"] for r in rows["saved_activations"]}
    assert all(saved[p] < saved["fp32"] for p in saved if p.startswith("fp8"))  # 1-byte copies replace fp32 ones
    assert rows["optimizer"] and rows["allgather"]
    assert (tmp_path / "allgather_bytes.md").exists()


def test_launch_count_reports_both_per_tensor_recipes(tmp_path):
    """Runs in its own process: it turns on Triton's interpreter, which must happen before triton is imported."""
    import os
    import subprocess

    out = tmp_path / "launches.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "benchmarks/launch_count.py", "--out", str(out)], check=True, env=env,
                   cwd=Path(__file__).resolve().parents[2], capture_output=True, timeout=300)  # fmt: skip
    rows = [line for line in out.read_text().splitlines() if line.startswith(("| delayed", "| tensorwise"))]
    assert len(rows) == 4 and all("_scaled_mm 3" in row for row in rows)
    bf16 = [row for row in rows if "bf16 autocast" in row]
    assert len(bf16) == 2 and all("| add " not in row and ", add " not in row for row in bf16)  # bias in the GEMM
    fine = [line for line in out.read_text().splitlines() if "Triton casts" in line]  # one launch per copy
    assert fine[:2] == ["| rowwise, Triton casts | 6 | fine_cast 6 |", "| blockwise, Triton casts | 5 | fine_cast 5 |"]
    # MXFP8: three casts (each both copies), then per operand one pad of its scales and one swizzling copy
    assert fine[2] == "| mxfp8, Triton casts | 15 | constant_pad_nd 6, clone 6, mx_quantize 3 |"


def test_host_time_reports_every_layer_eagerly(tmp_path):
    out = tmp_path / "host.md"
    rows = host_time.main(["--rounds", "2", "--features", "32", "--modes", "eager", "--out", str(out)])
    recipes = ("delayed", "tensorwise", "mxfp8", "rowwise", "blockwise")
    assert {f"ours {name}" for name in recipes} <= {r["layer"] for r in rows}
    assert all(r["eager_us"] > 0 for r in rows) and rows[0]["eager_x"] == 1.0
    assert "eager / nn.Linear" in out.read_text()


def test_host_time_of_the_cuda_branch_reports_every_layer(tmp_path):
    """In its own process: the probe replaces the kernels and CPU torch._scaled_mm with their fakes for good."""
    import subprocess

    out = tmp_path / "host.md"
    subprocess.run([sys.executable, "benchmarks/host_time.py", "--cuda-branch", "--rounds", "2", "--features", "32",
                    "--modes", "eager", "--out", str(out)], check=True, cwd=Path(__file__).resolve().parents[2],
                   capture_output=True, timeout=300)  # fmt: skip
    text = out.read_text()
    assert "CUDA branch with stubbed kernels" in text
    assert all(f"| ours {name} |" in text for name in ("delayed", "tensorwise", "mxfp8"))
