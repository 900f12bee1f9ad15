"""The CUDA contract: every GEMM the library issues, checked against torch's CUDA rules on a simulated device.

* :mod:`.rules` and :mod:`.rules_v2`: torch's CUDA-side rules for ``torch._scaled_mm`` and
  ``torch.nn.functional.scaled_mm`` (ScaledBlas.cpp) as pure functions, with torch's messages;
* :mod:`.simulate`: a layer's training step on fake CUDA tensors with a simulated capability, CUDA and torch
  version, every GEMM call recorded;
* :mod:`.check`: the verdict on each GEMM (native, fallback, violation) over recipes, architectures and shapes;
* ``python -m fp8_lightning.cuda_contract``: the same from the command line (exit status 1 on a violation).
"""

from fp8_lightning.cuda_contract.check import FALLBACK, NATIVE, VIOLATION, Verdict, check_layer, judge
from fp8_lightning.cuda_contract.rules import Facts, Outcome, Target, scaled_mm_v1
from fp8_lightning.cuda_contract.rules_v2 import scaled_mm_v2
from fp8_lightning.cuda_contract.simulate import GemmRecord, run_layer

__all__ = [
    "FALLBACK", "NATIVE", "VIOLATION", "Facts", "GemmRecord", "Outcome", "Target", "Verdict", "check_layer", "judge",
    "run_layer", "scaled_mm_v1", "scaled_mm_v2",
]
