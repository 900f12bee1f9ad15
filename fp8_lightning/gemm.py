"""The one place that picks how an FP8 GEMM is computed.

Every GEMM of :class:`~fp8_lightning.linear.FP8Linear` is written ``out = a @ b.T`` with both operands holding
the reduction dimension K last (an "NT" GEMM). That is exactly the layout ``torch._scaled_mm`` wants: ``a``
row-major and ``b.T`` column-major, with no transposes in here.

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.gemm``.
"""

from __future__ import annotations

import torch

from fp8_lightning.ops.dispatch import dequantize_operand, operand_f32
from fp8_lightning.kernels.availability import kernels_usable
from fp8_lightning.formats import FP8_MIN_CAPABILITY, NATIVE_MX_MIN_CAPABILITY, NATIVE_MX_MIN_CUDA
from fp8_lightning.ops.triton_ops import mx_gemm_supported, triton_mx_gemm
from fp8_lightning.quantize import LAYOUT_MULTIPLE, Quantized, pad_2d, pad_dim, scaled_mm_layout
from fp8_lightning.settings import settings

GEMM_ENV = "FP8_LIGHTNING_GEMM"
EMULATE_ENV = "FP8_LIGHTNING_EMULATE"

def emulation_requested() -> bool:
    return settings().emulate


def requested_backend() -> str:
    return settings().gemm


def fp8_gemm_support(device: torch.device | str) -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` can run per-tensor FP8 GEMMs on ``device``.

    Args:
        device: a torch device.

    Returns:
        ``(supported, reason)``: the reason says why not, or what makes it work.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return True, "CPU: torch._scaled_mm runs on oneDNN"
    if device.type != "cuda":
        return False, f"device type '{device.type}' has no FP8 GEMM; use CPU or an NVIDIA GPU with sm89+"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_MIN_CAPABILITY:
        return False, (
            f"CUDA device '{torch.cuda.get_device_name(device)}' has compute capability {major}.{minor}; FP8 GEMMs "
            f"need {'.'.join(map(str, FP8_MIN_CAPABILITY))}+ (Ada, Hopper, Blackwell)"
        )
    return True, f"compute capability {major}.{minor}"


def per_tensor_scaled_mm(device: torch.device | str, emulate: bool = False) -> bool:
    """Whether per-tensor GEMMs on ``device`` run on ``torch._scaled_mm``: on request
    (``FP8_LIGHTNING_GEMM=scaled_mm``), or by default on a device with FP8 GEMMs other than the CPU (which takes the
    float GEMM); never when emulating.
    The eager GEMM (:func:`fp8_mm`) and the traced step's plan (:func:`fp8_lightning.traced.make_plan`) both ask."""
    backend = "emulate" if emulate else requested_backend()
    if backend == "auto":
        return torch.device(device).type != "cpu" and fp8_gemm_support(device)[0]
    return backend == "scaled_mm"


def check_device(device: torch.device | str, emulate: bool = False) -> None:
    """Raise a clear error when ``device`` cannot run FP8 GEMMs and emulation was not requested."""
    ok, reason = fp8_gemm_support(device)
    if not ok and not (emulate or emulation_requested()):
        raise RuntimeError(
            f"FP8 training cannot run here: {reason}. Pass emulate=True (or set {EMULATE_ENV}=1) to emulate FP8 "
            "numerics in float32 on this device, or train in bf16/fp32."
        )


def scaled_mm(
    a: torch.Tensor, a_inverse: torch.Tensor, b: torch.Tensor, b_inverse: torch.Tensor, out_dtype: torch.dtype,
    bias: torch.Tensor | None = None, fast_accum: bool = False,
) -> torch.Tensor:
    """``torch._scaled_mm`` of per-tensor FP8 operands with K last (``a``: (M, K), ``b``: (N, K)) and their inverse
    scales, in the layout cuBLAS wants: ``a`` row-major, ``b.T`` column-major, K and N zero-padded to multiples of
    16. Plain tensor operations: the eager layer calls it and a compiled graph holds it as is (inductor then calls
    cuBLAS with no Python in between).

    ``bias`` rides in the GEMM's epilogue, in the output dtype, where cuBLAS takes it: with a bf16 or fp16 output
    (``_scaled_mm`` refuses a bias with float32 output and wants it in the output's dtype). The sum is then rounded
    once, where adding it afterwards rounds the product and the sum; with float32 output it is added afterwards.
    ``fast_accum``: Hopper's faster, less precise accumulation of FP8 products (``use_fast_accum``).
    """
    n = b.shape[0]
    a_data, b_data = scaled_mm_layout(a, b)
    mm_dtype = out_dtype if out_dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    fused = bias is not None and mm_dtype != torch.float32
    out = torch._scaled_mm(
        a_data,
        b_data.t(),
        scale_a=a_inverse,
        scale_b=b_inverse,
        bias=pad_dim(bias.to(mm_dtype), 0, LAYOUT_MULTIPLE) if fused else None,
        out_dtype=mm_dtype,
        use_fast_accum=fast_accum,
    )
    out = out[:, :n].to(out_dtype)
    return out if fused else _add_bias(out, bias)


def _float_matmul(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None, alpha: float = 1.0
) -> torch.Tensor:
    """The FP8 GEMM on CPU, one ``addmm`` of the operands' float32 forms (``dispatch.operand_f32``) that, in
    float32, also adds the bias. Per-tensor operands are the exact FP8 values and ``alpha`` applies both inverse
    scales (reading a CPU scalar costs nothing); MX operands are already dequantized (``alpha`` 1)."""
    fused_bias = bias is not None and bias.dtype == out_dtype == torch.float32
    start = bias if fused_bias else _ZERO
    out = torch.addmm(start, operand_f32(a), operand_f32(b).t(), beta=int(fused_bias), alpha=alpha)
    return out if fused_bias else _add_bias(out.to(out_dtype), bias)


_ZERO = torch.zeros(())  # addmm's ignored input (beta=0) when there is no bias


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias.to(out.dtype)


def native_mx_gemm_support(device: torch.device | str) -> tuple[bool, str]:
    """Whether cuBLAS runs MX (1x32 block-scaled) FP8 GEMMs natively on ``device`` (sm100+, with a torch built on
    CUDA 12.8+, whose cuBLAS has the MX scale mode), and why not."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "native MX GEMMs need a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < NATIVE_MX_MIN_CAPABILITY:
        need = ".".join(map(str, NATIVE_MX_MIN_CAPABILITY))
        return False, f"compute capability {major}.{minor} has no native MX GEMM (needs {need}+, Blackwell)"
    cuda = torch.version.cuda
    if not cuda or tuple(int(p) for p in cuda.split(".")[:2]) < NATIVE_MX_MIN_CUDA:
        need = ".".join(map(str, NATIVE_MX_MIN_CUDA))
        return False, f"torch's CUDA {cuda} has no cuBLAS MX GEMM (needs CUDA {need}+)"
    return True, f"compute capability {major}.{minor}, CUDA {cuda}"


def swizzle_mx_scales(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales of shape (rows, K // 32) in cuBLAS's 1D block-scaling layout, flattened.

    Rows are padded to 128 and scale columns to 4 (with zero bytes); each 128x4 tile becomes 32x16 with the scale
    of (row r, column c) at ``tile * 512 + (r % 32) * 16 + (r // 32) * 4 + c``, tiles in row-major order.
    """
    padded = pad_2d(scale.contiguous().view(torch.uint8), 128, 4)
    row_tiles, col_tiles = padded.shape[0] // 128, padded.shape[1] // 4
    tiles = padded.view(row_tiles, 128, col_tiles, 4).permute(0, 2, 1, 3)  # (tile_r, tile_c, 128, 4)
    swizzled = tiles.reshape(-1, 4, 32, 4).transpose(1, 2)  # row r = 32 * i + j goes to (j, i)
    return swizzled.reshape(-1).view(scale.dtype)


def swizzled_scales(q: Quantized) -> torch.Tensor:
    """``q``'s MX scales in cuBLAS's layout (:func:`swizzle_mx_scales`), made once per operand and kept on it."""
    cache = q.cache
    if cache.swizzled is None:
        cache.swizzled = swizzle_mx_scales(q.scale)
    return cache.swizzled


def _native_mx_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    mm_dtype = out_dtype if out_dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    out = torch._scaled_mm(
        a.data.contiguous(),
        b.data.contiguous().t(),
        scale_a=swizzled_scales(a),
        scale_b=swizzled_scales(b),
        out_dtype=mm_dtype,
    )
    return out.to(out_dtype)


def fp8_mm(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, emulate: bool = False, bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` for FP8 operands with K last: ``a`` is (M, K), ``b`` is (N, K); returns (M, N).
    ``fast_accum`` asks cuBLAS's per-tensor and rowwise GEMMs for fast accumulation (other backends accumulate in
    float32). The operands' kind runs the GEMM (:class:`~fp8_lightning.quantize.OperandKind`)."""
    if a.data.shape[-1] != b.data.shape[-1]:
        raise ValueError(f"fp8_mm: K differs: a is {tuple(a.data.shape)}, b is {tuple(b.data.shape)}.")
    if a.kind is not b.kind:
        raise ValueError(f"fp8_mm: cannot mix scaling kinds {str(a.kind)!r} and {str(b.kind)!r}.")
    return a.kind.gemm(a, b, out_dtype, emulate, bias, fast_accum)


def per_tensor_mm(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, emulate: bool = False, bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """The GEMM of two per-tensor operands: the CPU float GEMM, ``torch._scaled_mm`` (CUDA, sm89+), or the
    dequantized operands multiplied in float32 (``emulate``)."""
    backend = "emulate" if emulate else requested_backend()
    if backend == "auto" and a.data.is_cpu:
        return _float_matmul(a, b, out_dtype, bias, 1.0 / (a.scale.item() * b.scale.item()))
    if not per_tensor_scaled_mm(a.data.device, emulate):
        return _add_bias((dequantize_operand(a) @ dequantize_operand(b).t()).to(out_dtype), bias)
    return scaled_mm(a.data, a.inverse_scale(), b.data, b.inverse_scale(), out_dtype, bias, fast_accum)


def mx_mm(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, emulate: bool = False, bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """The GEMM of two MX operands: the CPU float GEMM, cuBLAS's native MX GEMM (sm100+, blocks of 32), the Triton
    MX GEMM, or the dequantized operands multiplied in float32 (kept on the operands for their other GEMMs)."""
    backend = "emulate" if emulate else requested_backend()
    if backend == "auto" and a.data.is_cpu:
        return _float_matmul(a, b, out_dtype, bias)
    if backend != "emulate":
        block_32 = a.data.shape[-1] == 32 * a.scale.shape[-1]
        if block_32 and native_mx_gemm_support(a.data.device)[0]:
            return _add_bias(_native_mx_mm(a, b, out_dtype), bias)
        if kernels_usable(a.data) and mx_gemm_supported(a, b, out_dtype)[0]:
            return _add_bias(triton_mx_gemm(a, b, out_dtype), bias)
    return _add_bias((operand_f32(a) @ operand_f32(b).t()).to(out_dtype), bias)
