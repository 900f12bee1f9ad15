"""The GPU benchmark scripts without a GPU: kernels_gpu.py refuses clearly and writes nothing; the linear
suite's Llama-3-8B shapes and its printed targets."""

from __future__ import annotations

import torch

from benchmarks import bench_linear, kernels_gpu


def test_refuses_without_cuda_and_writes_no_numbers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "kernels_gpu.md"
    assert kernels_gpu.main(["--out", str(out)]) == 2
    assert "refusing to run: CUDA is not available" in capsys.readouterr().out
    assert not out.exists() and not out.with_suffix(".json").exists()


def test_linear_suite_shapes_and_targets():
    llama = bench_linear.suite_shapes("gpu", None, llama=True)
    # Llama-3-8B: hidden 4096, FFN 14336, 8 KV heads x 128 = 1024; 8192 tokens
    assert {(m, k, n) for _, m, k, n in llama} == {
        (8192, 4096, 4096), (8192, 4096, 1024), (8192, 4096, 14336), (8192, 14336, 4096)
    }  # fmt: skip
    assert [s[1:] for s in bench_linear.suite_shapes("gpu", None)][-1] == (8192, 8192, 8192)
    rows = [
        {"size": "8192", "config": "fp8 tensorwise", "speedup_vs_bf16": 1.7},
        {"size": "llama3-8b w2", "config": "fp8 mxfp8", "speedup_vs_bf16": 0.9},
        {"size": "llama3-8b w2", "config": "torchao tensorwise", "speedup_vs_bf16": 0.8},
    ]
    text = bench_linear.targets(rows)
    assert "1.70x, met." in text and "NOT met: fp8 mxfp8 at llama3-8b w2 (0.90x)" in text
    assert "torchao" not in text


def test_llama_stack_has_llama3_8b_layer_shapes_and_the_peer_target():
    import torch.nn as nn

    from benchmarks import bench_gpt
    from benchmarks.llama_stack import LLAMA3_8B, LlamaStack

    with torch.device("meta"):
        stack = LlamaStack(n_layer=1, **LLAMA3_8B)
    shapes = {name: tuple(m.weight.shape) for name, m in stack.layers[0].named_modules() if isinstance(m, nn.Linear)}
    assert shapes == {"wq": (4096, 4096), "wk": (1024, 4096), "wv": (1024, 4096), "wo": (4096, 4096),
                      "w1": (14336, 4096), "w3": (14336, 4096), "w2": (4096, 14336)}  # fmt: skip
    # 32 such layers and the untied 128256 x 4096 embedding and head: Llama-3-8B's published 8.03B parameters
    assert abs(32 * stack.num_parameters() + 2 * 128256 * 4096 + 4096 - 8.03e9) < 0.01e9
    rows = [{"model": "m", "precision": "torchao tensorwise", "step_ms": 10.0},
            {"model": "m", "precision": "fp8 tensorwise", "step_ms": 8.0}]  # fmt: skip
    assert bench_gpt.versus_torchao(rows) == " m fp8 tensorwise: 1.25x torchao.float8 speed (target >= 1)."
