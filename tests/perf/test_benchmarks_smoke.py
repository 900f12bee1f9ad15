"""CPU smoke runs of each benchmark suite through its front door (``python -m benchmarks <suite>``): they run and
write their JSON, markdown and plot (no timing asserted)."""

import json
from pathlib import Path

import pytest

from tests.helpers.front_door import run_suite


def _check_folder(folder: Path, plot: str) -> dict:
    record = json.loads((folder / "results.json").read_text())
    assert {"command", "device", "date", "torch", "rows"} <= set(record)
    assert record["command"].startswith("python -m benchmarks ")
    assert (folder / "results.md").read_text().count("|") > 10
    assert (folder / plot).stat().st_size > 1000
    return record


def _peer(record: dict) -> set[str]:
    """The torchao.float8 row, present exactly when torchao imports (the dev install has it)."""
    assert record["torchao"] in ("not installed", "installed") or record["torchao"].startswith("unusable")
    return {"torchao tensorwise"} if record["torchao"] == "installed" else set()


def test_linear_suite_reports_every_configuration(tmp_path):
    run_suite("linear", "--suite", "cpu", "--sizes", "32", "--rounds", "1", "--warmup", "1", "--out", str(tmp_path))
    record = _check_folder(tmp_path, "linear.png")
    rows = record["rows"]
    fp8 = {f"fp8 {name}" for name in ("delayed", "tensorwise", "mxfp8", "rowwise", "blockwise")}
    assert {r["config"] for r in rows} == {"fp32", "bf16"} | fp8 | _peer(record)
    assert all(r["ms"] > 0 for r in rows)


def test_gpt_suite_reports_tokens_per_second(tmp_path):
    run_suite("gpt", "--suite", "cpu", "--models", "dim64", "--rounds", "1", "--warmup", "1", "--out", str(tmp_path))
    record = _check_folder(tmp_path, "gpt.png")
    rows = record["rows"]
    assert {r["precision"] for r in rows} == {"fp32", "bf16", "fp8 delayed", "fp8 tensorwise", "fp8 mxfp8"} | _peer(record)
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert next(r for r in rows if r["precision"] == "fp32")["ratio"] == pytest.approx(1.0)


@pytest.mark.timeout(300)
def test_memory_suite_counts_saved_bytes_optimizer_and_allgather(tmp_path):
    run_suite("memory", "--suite", "cpu", "--n-embd", "32", "--allgather-width", "32", "--allgather-depth", "1",
              "--out", str(tmp_path), timeout=290)  # fmt: skip
    rows = _check_folder(tmp_path, "memory.png")["rows"]
    saved = {r["precision"]: r["MiB"] for r in rows["saved_activations"]}
    assert all(saved[p] < saved["fp32"] for p in saved if p.startswith("fp8"))  # 1-byte copies replace fp32 ones
    assert rows["optimizer"] and rows["allgather"]
    assert (tmp_path / "allgather_bytes.md").exists()


def test_launch_count_reports_both_per_tensor_recipes(tmp_path):
    """Runs in its own process: it turns on Triton's interpreter, which must happen before triton is imported."""
    out = tmp_path / "launches.md"
    run_suite("launch-count", "--out", str(out), "--experts", "4", env={"TRITON_INTERPRET": None})
    rows = [line for line in out.read_text().splitlines()
            if line.startswith(("| delayed", "| tensorwise")) and "experts" not in line]  # fmt: skip
    assert len(rows) == 4 and all("_scaled_mm 3" in row for row in rows)
    bf16 = [row for row in rows if "bf16 autocast" in row]
    assert len(bf16) == 2 and all("| add " not in row and ", add " not in row for row in bf16)  # bias in the GEMM
    fine = [line for line in out.read_text().splitlines() if "Triton casts" in line]  # one launch per copy
    assert fine[:2] == ["| rowwise, Triton casts | 6 | fine_cast 6 |", "| blockwise, Triton casts | 5 | fine_cast 5 |"]
    # MXFP8: three casts (each both copies), then per operand one pad of its scales and one swizzling copy
    assert fine[2] == "| mxfp8, Triton casts | 15 | constant_pad_nd 6, clone 6, mx_quantize 3 |"
    # a mixture-of-experts step: each per-tensor grouped GEMM is one Triton launch (two 2-D x 3-D, one 2-D x 2-D)
    moe = [line for line in out.read_text().splitlines() if line.startswith(("| tensorwise, 4", "| delayed, 4"))]
    assert len(moe) == 2 and all("grouped_mm_2d3d 2" in row and "grouped_mm_2d2d 1" in row for row in moe)


def test_host_time_reports_every_layer_eagerly(tmp_path):
    out = tmp_path / "host.md"
    run_suite("host-time", "--rounds", "2", "--features", "32", "--modes", "eager", "--out", str(out))
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    recipes = ("delayed", "tensorwise", "mxfp8", "rowwise", "blockwise")
    assert {f"ours {name}" for name in recipes} <= {r["layer"] for r in rows}
    assert all(r["eager_us"] > 0 for r in rows) and rows[0]["eager_x"] == 1.0
    assert "eager / nn.Linear" in out.read_text()


def test_host_time_of_the_cuda_branch_reports_every_layer(tmp_path):
    """In its own process: the probe replaces the kernels and CPU torch._scaled_mm with their fakes for good."""
    out = tmp_path / "host.md"
    run_suite("host-time", "--cuda-branch", "--rounds", "2", "--features", "32", "--modes", "eager", "--out", str(out))
    text = out.read_text()
    assert "CUDA branch with stubbed kernels" in text
    assert all(f"| ours {name} |" in text for name in ("delayed", "tensorwise", "mxfp8"))


def test_grouped_suite_reports_fp8_bf16_and_the_per_expert_loop(tmp_path):
    run_suite("grouped", "--suite", "cpu", "--models", "qwen3-30b-a3b", "--shrink", "8", "--experts", "8",
              "--tokens", "32", "--rounds", "1", "--warmup", "0", "--out", str(tmp_path))  # fmt: skip
    rows = _check_folder(tmp_path, "grouped.png")["rows"]
    fp8 = {f"fp8 {name}" for name in ("delayed", "tensorwise", "mxfp8", "rowwise", "blockwise")}
    assert {r["config"] for r in rows} == {"bf16 grouped", "fp32 grouped", "bf16 per-expert loop"} | fp8
    assert {r["shape"] for r in rows} == {"qwen3-30b-a3b gate_up", "qwen3-30b-a3b down"}
    assert all(r["ms"] > 0 and r["empty_experts"] >= 1 for r in rows)


def test_grouped_suite_sweeps_tokens_with_micro_batches_and_prints_the_roofline(tmp_path):
    run_suite("grouped", "--suite", "cpu", "--models", "qwen3-30b-a3b", "--shrink", "8", "--experts", "8",
              "--tokens", "16", "32", "--microbatches", "2", "--recipes", "tensorwise", "--baselines", "--rounds",
              "1", "--warmup", "0", "--out", str(tmp_path))  # fmt: skip
    rows = _check_folder(tmp_path, "grouped.png")["rows"]
    assert {r["shape"] for r in rows} == {f"qwen3-30b-a3b {p} {t} tokens" for p in ("gate_up", "down") for t in (16, 32)}
    assert {r["rows"] for r in rows} == {16 * 8, 32 * 8}  # top-8 routing
    assert all(r["modelled"] == "-" for r in rows)  # the ceiling is a CUDA device's
    table = run_suite("grouped", "--roofline", "H100", "--recipes", "rowwise", "--tokens", "128", "8192").stdout
    # DeepSeek-V3 gate/up on an H100: the weight casts cap FP8 far below bf16 at 128 tokens per expert
    line = next(row for row in table.splitlines() if "deepseek-v3 gate_up" in row)
    first, second = (float(cell.strip().rstrip("x")) for cell in line.split("|")[6:8])
    assert first < 0.6 < 1.0 < second
