"""The FP8 linear layer's one autograd Function: ``y = x @ W.T + b`` with its three GEMMs on FP8 operands.

With ``x`` (M, K), ``W`` (N, K) and the output gradient ``g`` (M, N)::

    fprop   y  = x @ W.T        reduction over K
    dgrad   dx = g @ W          W.T's operand (K, N), reduction over N
    wgrad   dW = g.T @ x        g.T's and x.T's operands, reduction over M

Every GEMM is ``a @ b.T`` with K last in both operands. The Function fixes which operands each GEMM multiplies,
what is saved for backward and how the bias gradient is formed, once. A *step* object supplies the rest:

* ``forward_operands(tensors)``: the operands of x, x.T, W and W.T (cast before the Function, outside autograd),
  and the output gradient's scaling-state tensors;
* ``gemm(a, b, out_dtype, bias, fast_accum)``: one FP8 GEMM;
* ``pack(x_t, w_t)`` / ``unpack(meta, saved)``: the saved operands as tensors for ``save_for_backward`` plus
  what else backward needs, and back (with the output gradient's state tensors, saved after them);
* ``grad_operands(g, grad_state, columnwise)``: the output gradient's operands (g and, for wgrad, g.T).

The eager step (:class:`fp8_lightning.linear.EagerStep`) hands over the casts' operand objects with their caches;
the traced step (:class:`fp8_lightning.traced.TracedPlan`, a frozen constant to the compiler) takes the casts'
tensors, which enter the graph as the Function's inputs.

The backward refuses ``create_graph=True``: its gradients would carry no graph (a silent zero second derivative).
``torch.compile`` traces it with grad disabled, where the check is a no-op (``docs/guides/core.md``).
"""

from __future__ import annotations

import torch

DOUBLE_BACKWARD_REFUSED = (
    "An FP8 linear layer was asked for a differentiable gradient (a backward with create_graph=True: double backward, "
    "a gradient penalty, a Hessian-vector product). FP8 has no second derivative: the layer's backward GEMMs run on "
    "FP8 copies made outside autograd, so its gradients would carry no graph and the second derivative would "
    "silently be zero. Run the forward of that computation with the layer in high precision: inside "
    "fp8_lightning.fp8_autocast(enabled=False), or keep the layer out of FP8 with the layer policy "
    "(convert_to_fp8(model, layers={'<layer name>': None}) or module_filter_fn)."
)


class FP8LinearFunction(torch.autograd.Function):
    """``y = x2d @ weight.T + bias`` from operands a step cast; ``x2d`` and ``weight`` come in for their gradient
    edges. The bias rides in the fprop GEMM and its gradient is the output gradient summed over tokens."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, step, *tensors):
        x, x_t, w, w_t, grad_state = step.forward_operands(tensors)
        # ------------------------------------------------ fprop ------------------------------------------------
        y = step.gemm(x, w, step.out_dtype, bias, step.fprop_fast_accum)
        saved, ctx.meta = step.pack(x_t, w_t)  # x.T for wgrad, W.T for dgrad
        ctx.save_for_backward(*saved, *grad_state)
        ctx.step, ctx.inputs = step, len(tensors)
        ctx.dtypes = (x2d.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        if torch.is_grad_enabled():  # create_graph=True: the gradients would silently carry no graph
            raise RuntimeError(DOUBLE_BACKWARD_REFUSED)
        step, (x_dtype, w_dtype, bias_dtype) = ctx.step, ctx.dtypes
        needs_x, needs_w, needs_bias = ctx.needs_input_grad[:3]
        x_t, w_t, grad_state = step.unpack(ctx.meta, ctx.saved_tensors)
        g = grad_y.contiguous()
        g_row, g_t = step.grad_operands(g, grad_state, needs_w)
        grad_x = grad_w = grad_bias = None
        # ------------------------------------------------ dgrad ------------------------------------------------
        if needs_x:
            grad_x = step.gemm(g_row, w_t, x_dtype, None, step.grad_fast_accum)  # (M, N) @ (K, N).T
        # ------------------------------------------------ wgrad ------------------------------------------------
        if needs_w:
            grad_w = step.gemm(g_t, x_t, w_dtype, None, step.grad_fast_accum)  # (N, M) @ (K, M).T
        if needs_bias:
            grad_bias = g.sum(0, dtype=bias_dtype)  # one reduction, accumulated in the bias dtype or wider
        return (grad_x, grad_w, grad_bias, None) + (None,) * ctx.inputs
