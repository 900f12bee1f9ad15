"""``FP8Optimizer``: keeps a torch optimizer's states (and master weights) in low precision between steps.

Design, in the order a step meets it:

* **Wrap, don't replace.** The user builds ``torch.optim.AdamW(...)`` (or Adam, or SGD) as usual and wraps it.
  The wrapper *shares* the inner optimizer's ``param_groups`` list (the same dicts), so learning-rate schedulers,
  Lightning's ``LightningOptimizer``, gradient clipping and ``optimizer.param_groups[0]["lr"] = ...`` all keep
  working on either object. The wrapper is a ``torch.optim.Optimizer`` subclass so that schedulers accept it.
* **Own the math.** The inner optimizer's ``step`` is never called (its states would be float32): the wrapper
  runs the same update rule (``update_rules.py``, operation for operation like ``torch.optim``) on decoded
  float32 copies. Only Adam, AdamW and SGD are supported; anything else is refused with an error naming them,
  because a generic path would have to hold every state in float32 at once, which defeats the purpose.
* **One parameter at a time.** For each parameter: decode its states to float32, update, encode, write back.
  The float32 working set is one parameter's worth, never the model's.
* **Sharded parameters.** A DTensor parameter (FSDP2) is updated through its local shard: states are created,
  quantized and stored per local shard, so each rank holds 1/world of them.
* **Fused on CUDA.** When Triton and a GPU are there, ``kernels/fp8_adam.py`` does decode + AdamW + encode in one
  pass per block (the block of the state scales); the torch code below is its reference.
* **Checkpoints.** ``state_dict`` holds the stored tensors unchanged (FP8 bytes, scales, remainders), so saving
  and loading is exact (a sharded parameter's states as DTensors, so a distributed checkpoint saves every rank's,
  ``checkpoint.py``); ``load_state_dict`` also accepts a plain ``torch.optim`` state dict and quantizes it.
  ``to_plain_state_dict`` (``checkpoint.py``) goes the other way for users who leave FP8.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any, Callable

import torch

from fp8_lightning.kernels.availability import kernels_usable
from fp8_lightning.optim import master_weights as mw
from fp8_lightning.optim.config import FP8OptimizerConfig, config_from
from fp8_lightning.optim.checkpoint import local_state, shard_state_dict
from fp8_lightning.optim.state_formats import StateFormat, decode_state, encode_state
from fp8_lightning.optim.update_rules import adam_update, sgd_update
from fp8_lightning.privates import mark_optimizer_stepped

FULL_PRECISION = StateFormat("float32")
_RULES = {torch.optim.Adam: "adam", torch.optim.AdamW: "adam", torch.optim.SGD: "sgd"}
SUPPORTED_OPTIMIZERS = tuple(cls.__name__ for cls in _RULES)


def update_rule_for(optimizer: torch.optim.Optimizer) -> str:
    """``"adam"`` or ``"sgd"`` for a supported optimizer; a ``TypeError`` naming the supported ones otherwise."""
    rule = _RULES.get(type(optimizer))
    if rule is None:
        raise TypeError(
            f"FP8Optimizer cannot wrap {type(optimizer).__name__}: supported optimizers are "
            f"{', '.join(SUPPORTED_OPTIMIZERS)} (torch.optim, exact classes). Other optimizers would need all their "
            "states in float32 during the step; keep them unwrapped, or build one of the supported ones."
        )
    for index, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "differentiable", "capturable"):
            if group.get(flag):
                raise ValueError(
                    f"FP8Optimizer does not support {flag}=True (param group {index} of "
                    f"{type(optimizer).__name__}); build the optimizer with {flag}=False."
                )
    return rule


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, else the tensor itself (detached, same storage)."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if callable(to_local) else tensor).detach()


class FP8Optimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` (Adam, AdamW or SGD) and stores its states as ``preset``/``overrides`` say.

    ``preset``: ``"default"`` (loss parity), ``"max_savings"``, ``"fp32"``, an :class:`FP8OptimizerConfig` or a
    dict; ``overrides``: fields of :class:`FP8OptimizerConfig` (``exp_avg``, ``exp_avg_sq``, ``master_weights``,
    ``min_quantize_numel``, ``use_triton``) or ``block_size``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, preset: Any = "default", **overrides: Any) -> None:
        if isinstance(optimizer, FP8Optimizer):
            raise TypeError("This optimizer is already an FP8Optimizer; wrap the torch optimizer only once.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"FP8Optimizer wraps a torch.optim.Optimizer; got {type(optimizer).__name__}.")
        self.rule = update_rule_for(optimizer)
        self.config: FP8OptimizerConfig = config_from(preset, **overrides)
        self.optimizer = optimizer
        # torch's own set-up (hooks, state, step patching) over the wrapped optimizer's groups ...
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # ... then the very list: schedulers and Lightning see one
        self._backward_hooks: list = []
        self._import_inner_state()

    def __repr__(self) -> str:
        return f"FP8Optimizer({type(self.optimizer).__name__}, {self.config})"

    def __getstate__(self) -> dict:
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def release_gradients_in_backward(self) -> None:
        """Step each parameter as soon as backward has accumulated its gradient, then free that gradient.

        The gradients of the whole model then never exist at the same time (at most the few that autograd is
        accumulating), which removes their 2 or 4 bytes per parameter from the peak; ``step()`` afterwards finds
        no gradients left and only runs the closure. The update is the same as a regular ``step()`` (a test
        checks it bit for bit). Not compatible with anything that needs all gradients before the step: gradient
        clipping by norm, gradient accumulation over micro-batches, or data-parallel gradient reduction (DDP and
        FSDP reduce after the hook would have run); refused when torch.distributed runs with more than one rank.
        """
        if torch.distributed.is_available() and torch.distributed.is_initialized() and (
            torch.distributed.get_world_size() > 1
        ):
            raise RuntimeError(
                "release_gradients_in_backward needs the final gradient when backward reaches a parameter, but with "
                f"{torch.distributed.get_world_size()} ranks gradients are reduced later; use the regular step()."
            )
        if self._backward_hooks:
            return
        for group in self.param_groups:
            for param in group["params"]:
                hook = functools.partial(self._step_in_backward, group=group)
                self._backward_hooks.append(param.register_post_accumulate_grad_hook(hook))

    def _step_in_backward(self, param: torch.Tensor, group: dict) -> None:
        with torch.no_grad():
            self._step_parameter(param, group)
        param.grad = None

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups is self.optimizer.param_groups:
            self.optimizer.add_param_group(param_group)  # appends to the shared list
        else:  # torch's __init__ filling its own list with the wrapped optimizer's groups
            super().add_param_group(param_group)

    # -------------------------------------------------------------------------------------------------------
    # Formats of one parameter's states
    # -------------------------------------------------------------------------------------------------------

    def state_formats(self, local: torch.Tensor) -> dict[str, StateFormat]:
        """The storage format of each state of a parameter whose local tensor is ``local``."""
        quantize = local.numel() >= self.config.min_quantize_numel
        exp_avg = self.config.exp_avg if quantize else FULL_PRECISION
        if self.rule == "sgd":
            return {"momentum_buffer": exp_avg}
        return {"exp_avg": exp_avg, "exp_avg_sq": self.config.exp_avg_sq if quantize else FULL_PRECISION}

    def master_kind(self, local: torch.Tensor) -> str:
        return mw.resolve_master_kind(self.config.master_weights, local.dtype)

    def _init_state(self, local: torch.Tensor, group: dict) -> dict:
        state: dict[str, torch.Tensor] = {"step": torch.tensor(0.0), "shape": torch.tensor(list(local.shape))}
        if self.rule == "adam" or group.get("momentum", 0) != 0:
            for name, fmt in self.state_formats(local).items():
                self._store(state, name, fmt, torch.zeros_like(local, dtype=torch.float32))
        state.update(mw.init_master(local, self.master_kind(local)))
        return state

    @staticmethod
    def _store(state: dict, name: str, fmt: StateFormat, value: torch.Tensor) -> None:
        data, scale = encode_state(value, fmt)
        for key, new in ((name, data), (f"{name}_scale", scale)):
            if new is None:
                continue
            if key in state and state[key].shape == new.shape and state[key].dtype == new.dtype:
                state[key].copy_(new)  # same storage across steps: no reallocation, stable references
            else:
                state[key] = new

    @staticmethod
    def _load(state: dict, name: str, fmt: StateFormat, shape: torch.Size) -> torch.Tensor:
        if fmt.is_full_precision:
            return state[name]  # updated in place
        return decode_state(state[name], state.get(f"{name}_scale"), fmt, shape)

    # -------------------------------------------------------------------------------------------------------
    # Step
    # -------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        mark_optimizer_stepped(self.optimizer)  # schedulers built on the inner optimizer check for a step
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_parameter(param, group)
        return loss

    def _step_parameter(self, param: torch.Tensor, group: dict) -> None:
        local, grad = local_tensor(param), local_tensor(param.grad)
        if grad.is_sparse:
            raise RuntimeError("FP8Optimizer does not support sparse gradients; use a dense optimizer.")
        state = self.state[param]
        if not state:
            state.update(self._init_state(local, group))
        state["step"] += 1
        step = int(state["step"].item())
        formats, kind = self.state_formats(local), self.master_kind(local)
        if self.rule == "adam" and self._try_fused(local, grad, state, formats, kind, group, step):
            return
        master = mw.load_master(local, state, kind)
        grad32 = grad.float()
        if self.rule == "adam":
            exp_avg = self._load(state, "exp_avg", formats["exp_avg"], local.shape)
            exp_avg_sq = self._load(state, "exp_avg_sq", formats["exp_avg_sq"], local.shape)
            beta1, beta2 = group["betas"]
            adam_update(
                master, grad32, exp_avg, exp_avg_sq, step, lr=_scalar(group["lr"]), beta1=_scalar(beta1),
                beta2=_scalar(beta2), eps=group["eps"], weight_decay=group["weight_decay"],
                decoupled_weight_decay=_decoupled(self.optimizer, group), maximize=group.get("maximize", False),
            )
            self._store_back(state, formats, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})
        else:
            has_buffer = group["momentum"] != 0
            buffer = self._load(state, "momentum_buffer", formats["momentum_buffer"], local.shape) if (
                has_buffer and step > 1) else None
            buffer = sgd_update(
                master, grad32, buffer, lr=_scalar(group["lr"]), momentum=group["momentum"],
                dampening=group["dampening"], nesterov=group["nesterov"], weight_decay=group["weight_decay"],
                maximize=group.get("maximize", False),
            )
            if has_buffer:
                self._store_back(state, formats, {"momentum_buffer": buffer})
        mw.store_master(local, state, kind, master)

    def _store_back(self, state: dict, formats: dict, values: dict) -> None:
        for name, value in values.items():
            fmt = formats[name]
            if not fmt.is_full_precision:
                self._store(state, name, fmt, value)
            elif value.data_ptr() != state[name].data_ptr():
                state[name].copy_(value)

    def _try_fused(self, local, grad, state, formats, kind, group, step) -> bool:
        if not (self.config.use_triton and local.is_cuda):
            return False
        if not kernels_usable(local):  # no Triton, no FP8-capable GPU, or FP8_LIGHTNING_DISABLE_TRITON=1
            return False
        # imports Triton, an optional dependency: only once the kernels are known to run
        from fp8_lightning.kernels.fp8_adam import fused_adam_step, fused_adam_supported

        if not fused_adam_supported(local, formats["exp_avg"], formats["exp_avg_sq"], kind)[0]:
            return False
        beta1, beta2 = group["betas"]
        fused_adam_step(
            local, grad, state, formats["exp_avg"], formats["exp_avg_sq"], kind, step=step,
            lr=_scalar(group["lr"]), beta1=_scalar(beta1), beta2=_scalar(beta2), eps=group["eps"],
            weight_decay=group["weight_decay"], decoupled_weight_decay=_decoupled(self.optimizer, group),
            maximize=group.get("maximize", False),
        )
        return True

    # -------------------------------------------------------------------------------------------------------
    # State dicts
    # -------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state_dict = shard_state_dict(super().state_dict(), self.param_groups)  # per-shard states of DTensors
        state_dict["fp8_optimizer"] = {"config": self.config.to_dict(), "rule": self.rule}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by an FP8Optimizer (exactly), or a plain torch one (quantized on load)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                "The optimizer state dict does not match this optimizer's parameter groups: saved sizes "
                f"{[len(s['params']) for s in saved_groups]}, current {[len(g['params']) for g in self.param_groups]}."
            )
        meta = state_dict.get("fp8_optimizer")
        if meta is not None and meta["config"] != self.config.to_dict():
            raise ValueError(
                f"The checkpoint was saved with FP8 optimizer config {meta['config']}, this optimizer uses "
                f"{self.config.to_dict()}. Build the optimizer with the same preset/options to resume, or convert "
                "the checkpoint with fp8_lightning.optim.to_plain_state_dict and load that."
            )
        by_index = {
            index: param
            for saved, group in zip(saved_groups, self.param_groups)
            for index, param in zip(saved["params"], group["params"])
        }
        self.state = defaultdict(dict)
        for index, saved_state in state_dict["state"].items():
            # torch keys the state by parameter index; torch.distributed.checkpoint by the parameter's name (FQN)
            param = by_index[index] if index in by_index else by_index[int(index)]
            local = local_tensor(param)
            # torch.distributed.checkpoint drops the "fp8_optimizer" entry: FP8 states are known by their scales
            if meta is not None or any(key.endswith("_scale") for key in saved_state):
                self.state[param] = {
                    key: value if key in ("step", "shape") else local_state(value).to(local.device)
                    for key, value in saved_state.items()
                }
            else:
                self.state[param] = self._quantize_plain_state(param, saved_state, self._group_of(param))
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({key: value for key, value in saved.items() if key != "params"})

    def _group_of(self, param: torch.Tensor) -> dict:
        return next(g for g in self.param_groups if any(p is param for p in g["params"]))

    def _quantize_plain_state(self, param: torch.Tensor, plain: dict, group: dict) -> dict:
        """Build this wrapper's state for ``param`` from a torch optimizer's float state (``plain``)."""
        local = local_tensor(param)
        state = self._init_state(local, group)
        if "step" in plain:
            state["step"] = torch.tensor(float(plain["step"]))
        elif plain.get("momentum_buffer") is not None:
            state["step"] = torch.tensor(1.0)  # SGD keeps no step count; a buffer means it has stepped
        for name, fmt in self.state_formats(local).items():
            if plain.get(name) is not None:
                self._store(state, name, fmt, local_tensor(plain[name]).to(local.device).float())
        return state

    def _import_inner_state(self) -> None:
        """Quantize (and release) any state the inner optimizer already holds, e.g. when wrapping mid-training."""
        for group in self.param_groups:
            for param in group["params"]:
                plain = self.optimizer.state.pop(param, None)
                if plain:
                    self.state[param] = self._quantize_plain_state(param, plain, group)


def _scalar(value: Any) -> float:
    return float(value.item()) if torch.is_tensor(value) else float(value)


def _decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
