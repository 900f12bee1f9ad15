"""benchmarks/kernels_gpu.py refuses clearly where it cannot measure, and then writes nothing."""

from __future__ import annotations

import torch

from benchmarks import kernels_gpu


def test_refuses_without_cuda_and_writes_no_numbers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "kernels_gpu.md"
    assert kernels_gpu.main(["--out", str(out)]) == 2
    assert "refusing to run: CUDA is not available" in capsys.readouterr().out
    assert not out.exists() and not out.with_suffix(".json").exists()
