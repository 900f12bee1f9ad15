"""Activation checkpointing of FP8 modules: a recompute runs exactly the FP8 forward the original forward ran.

Checkpointing (``torch.utils.checkpoint`` in both modes, Hugging Face ``gradient_checkpointing_enable()``, FSDP2's
per-block checkpoint) runs a region's forward a second time during backward. By then the ``fp8_autocast`` block of
the forward has usually closed, and on a GPU the backward runs on autograd's own thread, which never saw it. Left to
the per-thread setting, the recompute would run in high precision: non-reentrant checkpointing then finds other saved
tensors and raises, reentrant checkpointing silently takes gradients of another forward.

So each converted module keeps a :class:`ForwardLog` of the FP8 setting (``fp8_autocast`` state) its forwards ran
under. A forward run while autograd executes a backward, with grad enabled, is a recompute: that is how every
checkpoint implementation recomputes, and no other forward runs there. A recompute takes the logged setting and runs
as a *replay*: the same recipe and the scales in force, the step's cached FP8 weight, and nothing booked (no amax,
no scale advance, no statistic, no GEMM count, no observer call), so its casts are bit for bit those of the forward
and the gradients are those of the run without checkpointing.

Forwards with grad (what non-reentrant checkpointing recomputes) and training forwards without it (reentrant
checkpointing's, and no-grad rollouts) are logged apart; a recompute replays the first kind when there is one. A
backward that reaches the module (a recompute, the layer's own FP8 backward: :func:`close_forwards`, or the output
of a high-precision forward: :func:`close_on_backward`) closes both logs: the first forward after it starts them
afresh, so no forward of an earlier step is replayed, also where the weight never changes in place (a frozen
module), or when the weight changed in place (an optimizer step). A closed log still serves recomputes until then
(a second backward through a retained graph). A module that ran under two settings of one kind raises
:class:`FP8RecomputeError`. :func:`fp8_checkpoint_context`, passed as ``context_fn`` to non-reentrant
checkpointing, carries the setting of each checkpointed call instead and always works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref

import torch
import torch.nn as nn

from fp8_lightning.autocast import AutocastState, autocast_state, swap_autocast_state

_LOG_ATTR = "_fp8_forward_log"  # forwards with grad enabled (what non-reentrant checkpointing recomputes)
_NO_GRAD_LOG_ATTR = "_fp8_no_grad_forward_log"  # training forwards without grad (reentrant checkpointing's)


class FP8RecomputeError(RuntimeError):
    """A checkpoint recompute of an FP8 module whose forward setting cannot be told (see the module docstring)."""


def _describe(state: AutocastState) -> str:
    if not state.enabled:
        return "high precision (outside fp8_autocast)"
    return f"FP8 ({type(state.recipe).__name__ if state.recipe else 'the layer recipe'})"


class ForwardLog:
    """The FP8 setting of a module's forwards of one kind since the last backward that reached it or weight update.

    ``state``: the setting of the first such forward; ``other``: a different setting a later one ran under, or None;
    ``closed``: a backward reached the module since (its forwards are then done with: the next one starts afresh).
    """

    __slots__ = ("state", "other", "version", "closed")

    def __init__(self) -> None:
        self.state: AutocastState | None = None
        self.other: AutocastState | None = None
        self.version: int | None = None
        self.closed = False

    def record(self, state: AutocastState, version: int) -> None:
        if self.state is None or self.closed or version != self.version:
            self.state, self.other, self.version, self.closed = state, None, version, False
        elif state == self.state:  # the same setting from a new fp8_autocast block: keep the new object, which
            self.state = state  # the hot path compares by identity
        else:
            self.other = state

    def replay(self, module: nn.Module) -> AutocastState:
        if self.other is not None:
            raise FP8RecomputeError(
                f"{type(module).__name__} is recomputed by activation checkpointing, but since its last recompute it "
                f"ran under two FP8 settings ({_describe(self.state)} and {_describe(self.other)}), so the recompute "
                "cannot tell which forward it repeats. Checkpoint it with torch.utils.checkpoint.checkpoint(fn, *args, "
                "use_reentrant=False, context_fn=fp8_lightning.fp8_checkpoint_context), which records the setting of "
                "each call (Hugging Face: gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False, 'context_fn': fp8_checkpoint_context})), or run the module under one setting."
            )
        return self.state


def forward_setting(module: nn.Module, weight: torch.Tensor) -> tuple[AutocastState, bool]:
    """The FP8 setting ``module``'s forward runs under now, and whether this forward is a recompute (a replay).

    Args:
        module: the converted module being called.
        weight: its (first) weight, whose in-place version tells of an optimizer step (one starts the log afresh).

    Returns:
        (setting, replay): outside a recompute the ``fp8_autocast`` state in force (and logged); in a recompute the
        setting of the forward it repeats, with ``replay=True``.

    Raises:
        FP8RecomputeError: a recompute of a module that ran under two settings (see :class:`ForwardLog`).
    """
    state = autocast_state()
    if state.recompute:  # fp8_checkpoint_context's recompute: the setting travelled with the call
        return state, True
    if torch.compiler.is_compiling():
        return state, False  # a compiled step: the compiler plans its own recomputation
    if torch.is_grad_enabled():
        if torch._C._current_graph_task_id() != -1:  # a forward inside a backward: a recompute
            log = module.__dict__.get(_LOG_ATTR)  # non-reentrant: its forward ran with grad
            if log is None or log.state is None:  # else reentrant, whose forward ran without grad
                log = module.__dict__.get(_NO_GRAD_LOG_ATTR)
            if log is None or log.state is None:  # no forward of this module to repeat: an ordinary forward
                return state, False
            replayed = log.replay(module)
            close_forwards(module)
            return replayed, True
    elif not module.training or torch.is_inference_mode_enabled():
        return state, False  # evaluation: never recomputed
    grad = torch.is_grad_enabled()
    attr = _LOG_ATTR if grad else _NO_GRAD_LOG_ATTR  # a no-grad rollout never blurs a step's
    log = module.__dict__.get(attr)
    if log is None:
        log = module.__dict__[attr] = ForwardLog()
    elif state is log.state and not log.closed:  # the hot path: the same fp8_autocast block, nothing new
        return state, False
    version = -1 if weight.is_inference() else weight._version  # inference tensors have no version
    if log.state is None or log.closed:  # a new step: the other kind's forwards are done with if a backward closed
        done = module.__dict__.get(_NO_GRAD_LOG_ATTR if grad else _LOG_ATTR)  # them (no recompute may replay them)
        if done is not None and done.closed:
            done.state = None
    log.record(state, version)
    return state, False


def close_forwards(module: nn.Module) -> None:
    """Mark ``module``'s logged forwards as done with: a backward reached the module (its own backward calls this).

    The next forward then starts the logs afresh, so a later recompute never replays the setting of a forward whose
    backward already ran (a step without checkpointing before a step with it); until then a recompute still replays
    them (the module's forward used twice in one graph, or a second backward through a retained graph).
    """
    for attr in (_LOG_ATTR, _NO_GRAD_LOG_ATTR):
        log = module.__dict__.get(attr)
        if log is not None:
            log.closed = True


def close_on_backward(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """``out`` of a high-precision forward of ``module``, which closes its logs when a backward reaches it (an FP8
    backward calls :func:`close_forwards` itself): a later step's recompute then never replays this forward."""
    if out.requires_grad and not torch.compiler.is_compiling() and _LOG_ATTR in module.__dict__:
        out.register_hook(functools.partial(_close_if_alive, weakref.ref(module)))  # the graph keeps no module alive
    return out


def _close_if_alive(module_ref: weakref.ref, grad: torch.Tensor) -> None:
    module = module_ref()
    if module is not None:
        close_forwards(module)


def forget_forwards(module: nn.Module) -> None:
    """Drop the module's log (when its conversion is undone)."""
    module.__dict__.pop(_LOG_ATTR, None)
    module.__dict__.pop(_NO_GRAD_LOG_ATTR, None)


class _Replaying:
    """Puts a recorded setting in force, marked as a recompute, for as long as it is entered (re-enterable: a
    backward with ``retain_graph=True`` may recompute twice)."""

    __slots__ = ("state", "previous")

    def __init__(self, state: AutocastState):
        self.state, self.previous = state, []

    def __enter__(self) -> AutocastState:
        self.previous.append(swap_autocast_state(self.state))
        return self.state

    def __exit__(self, *exc) -> None:
        swap_autocast_state(self.previous.pop())


def fp8_checkpoint_context():
    """``context_fn`` for non-reentrant ``torch.utils.checkpoint``: the recompute replays the FP8 setting of the
    checkpointed call (needed only where one module runs under several settings between recomputes).

    Returns:
        (forward context, recompute context), as ``torch.utils.checkpoint.checkpoint(context_fn=...)`` expects.
    """
    return contextlib.nullcontext(), _Replaying(dataclasses.replace(autocast_state(), recompute=True))


__all__ = [
    "FP8RecomputeError", "ForwardLog", "close_forwards", "close_on_backward", "forget_forwards", "forward_setting",
    "fp8_checkpoint_context",
]
