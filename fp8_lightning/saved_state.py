"""The scaling state of a converted model in checkpoints: save it, check it, load it.

Histories, scales and fallback decisions live outside the model's ``state_dict``. :func:`fp8_state_dict` collects
them per converted layer and experts module; :func:`load_fp8_state_dict` checks all of a saved state before it
restores any of it (finite positive scales, finite non-negative amaxes, the shapes and expert counts this model
holds), so a bad checkpoint fails with the layer and the value named instead of corrupting training.
:func:`fp8_state_checksum` fingerprints a state for the plugin's checkpoint entry.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Iterator

import torch
import torch.nn as nn

from fp8_lightning.grouped.experts import FP8ExpertsMixin
from fp8_lightning.linear import FP8Linear
from fp8_lightning.recipes import recipe_from


ROUTER_MARK = "fp8_router"  # set on each router that a conversion keeps in high precision


def scaled_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module with FP8 scaling state (converted layers and experts), in module order."""
    for name, child in module.named_modules():
        if isinstance(child, (FP8Linear, FP8ExpertsMixin)):
            yield name, child


def fp8_state_dict(module: nn.Module) -> dict:
    """The scaling state of every converted layer and expert module, for checkpoints.

    Args:
        module: the model holding converted layers.

    Returns:
        ``{layer name: state}`` with CPU tensors; :func:`load_fp8_state_dict` restores it.
    """
    out = {}
    for name, layer in scaled_modules(module):
        out[name] = {
            "disabled_reason": layer.fp8_disabled_reason,
            "scalings": [s.state_dict() for _, s in layer.fp8_scalings()],
        }
    return out


def load_fp8_state_dict(module: nn.Module, state: dict, strict: bool = True, source: str | None = None) -> None:
    """Restore what :func:`fp8_state_dict` saved.

    The state is checked before anything is restored (:func:`check_fp8_state`): finite, positive scales, finite
    non-negative amaxes, tensors of the shapes this model's layers hold, and experts modules holding as many experts
    as the saved ones.

    Args:
        module: the model holding converted layers.
        state: what :func:`fp8_state_dict` returned.
        strict: refuse missing or unexpected layers.
        source: a checkpoint path, named in the errors.

    Returns:
        None; the layers' scaling states hold the restored values.

    Raises:
        KeyError: a missing or unexpected layer (with ``strict``).
        ValueError: a state that fails the checks above.
    """
    where = _where(source)
    layers = dict(scaled_modules(module))
    state = _without_router_state(module, state, layers, where)
    if strict and set(layers) != set(state):
        missing, unexpected = sorted(set(layers) - set(state)), sorted(set(state) - set(layers))
        raise KeyError(
            f"FP8 scaling state in {where} does not match the model: missing {missing}, unexpected {unexpected}. "
            "Convert the same layers as the run that saved it (the same recipe and layers= policy; NVFP4's default "
            "keeps the last 15% of blocks in high precision, their experts included: layers={'last': 0} converts "
            "them all), or load with strict=False."
        )
    check_fp8_state(state, source)
    restores = []
    for name, saved in state.items():
        layer = layers.get(name)
        if layer is None:
            continue
        for entry in saved["scalings"]:
            scaling = layer.fp8_scaling(recipe_from(entry["recipe"]))
            if isinstance(layer, FP8ExpertsMixin):
                scaling.check_experts(entry, f"layer {name!r} in {where}")
            _check_shapes(entry, scaling.state_dict(), f"layer {name!r}", where)
            restores.append((scaling, entry))
    for name, saved in state.items():  # everything checked: restore
        if name in layers:
            layers[name].fp8_disabled_reason = saved["disabled_reason"]
    for scaling, entry in restores:
        scaling.load_state_dict(entry)


def _without_router_state(module: nn.Module, state, layers: dict, where: str):
    """``state`` less what it holds for routers this model keeps in high precision (a run that converted them
    saved it), with a warning naming them."""
    if not isinstance(state, dict):
        return state  # check_fp8_state names what is wrong
    routers = sorted(name for name, child in module.named_modules()
                     if child.__dict__.get(ROUTER_MARK) and name in state and name not in layers)
    if routers:
        warnings.warn(f"The FP8 scaling state in {where} holds state for the router(s) {routers}, which this model "
                      "keeps in high precision (FP8 scores could change which experts run): that state is not used.")
    return {name: saved for name, saved in state.items() if name not in routers}


def restart_gradient_scales(module: nn.Module) -> list[str]:
    """Make the next training cast of every delayed-scaled output gradient pick its scale just in time, from the
    gradient it casts (as a fresh layer's first cast does); its amax history continues from there.

    For a run resumed with another number of data-parallel replicas: each replica's loss averages its own share of
    the batch, so the output gradients it sees are larger or smaller than the saved gradient histories by up to
    the ratio of the replica counts, and a saved scale could saturate them for a step. Activation and weight
    histories do not depend on the replicas and are left as they are.

    Args:
        module: the model holding converted layers.

    Returns:
        The names of the layers whose gradient scale restarts (in module order).
    """
    names = []
    for name, layer in scaled_modules(module):
        for _, scaling in layer.fp8_scalings():
            state = scaling.operands.get("grad_output")
            if getattr(state, "delayed", False) and state.initialized:
                state.initialized = False
                names.append(name)
    return list(dict.fromkeys(names))


# --------------------------------------------------------------------------------------------------------
# Checking saved scaling state
# --------------------------------------------------------------------------------------------------------

_POSITIVE = ("scale",)  # a scale divides and multiplies every value: 0, negative, NaN or inf corrupts training
_NON_NEGATIVE = ("amax_history", "pending_amax")  # amaxes that feed future scales (NaN/inf never enter them)


def _where(source: str | None) -> str:
    return f"checkpoint {source}" if source else "the checkpoint being loaded"


def check_fp8_state(state: dict, source: str | None = None) -> None:
    """Raise ``ValueError`` when the saved scaling state of :func:`fp8_state_dict` is malformed or holds a scale
    that is not finite and positive, or an amax history that is not finite and non-negative: values training
    never writes, so the checkpoint is corrupted (or was edited). ``source`` (a checkpoint path) is named."""
    where = _where(source)
    fix = (
        "Resume from an earlier checkpoint, or remove the FP8 scaling state from this one to restart FP8 scaling "
        "from scratch (the model weights are not affected)."
    )
    if not isinstance(state, dict):
        raise ValueError(f"The FP8 scaling state in {where} is a {type(state).__name__}, not a dict of layers. {fix}")
    for name, saved in state.items():
        if not isinstance(saved, dict) or not isinstance(saved.get("scalings"), list) or "disabled_reason" not in saved:
            raise ValueError(
                f"The FP8 scaling state of layer {name!r} in {where} is malformed (expected a dict with "
                f"'disabled_reason' and a list 'scalings'; got {_describe(saved)}). {fix}"
            )
        for entry in saved["scalings"]:
            if not isinstance(entry, dict) or "recipe" not in entry:
                raise ValueError(
                    f"The FP8 scaling state of layer {name!r} in {where} holds a scaling entry without its recipe "
                    f"({_describe(entry)}). {fix}"
                )
            for path, key, value in _tensors(entry, f"layer {name!r}"):
                bad = _bad_value(key, value)
                if bad:
                    raise ValueError(f"The FP8 scaling state in {where} is corrupted: {path} {bad}. {fix}")


def _describe(value) -> str:
    if isinstance(value, dict):
        return f"{type(value).__name__} with keys {sorted(map(str, value))}"
    return type(value).__name__


def _tensors(value, path: str):
    """(path, key, tensor) for every tensor in nested dicts."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "recipe":
                continue
            if torch.is_tensor(item):
                yield f"{path}, {key!r}", key, item
            else:
                yield from _tensors(item, f"{path}, {key!r}")


def _bad_value(key: str, value: torch.Tensor) -> str | None:
    if key not in _POSITIVE + _NON_NEGATIVE or value.numel() == 0:
        return None
    if not value.is_floating_point():
        return f"has dtype {value.dtype}; a floating-point tensor is expected"
    values = value.detach().float()
    if not bool(torch.isfinite(values).all()):
        return f"= {_show(values)} is not finite; scales and amaxes must be finite"
    if key in _POSITIVE and not bool((values > 0).all()):
        return f"= {_show(values)}; scales must be positive"
    if key in _NON_NEGATIVE and not bool((values >= 0).all()):
        return f"= {_show(values)}; amaxes must be non-negative"
    return None


def _show(values: torch.Tensor) -> str:
    if values.numel() == 1:
        return str(values.item())
    return f"{values.flatten()[:8].tolist()} (shape {tuple(values.shape)})"


def _check_shapes(saved: dict, current: dict, path: str, where: str) -> None:
    """Refuse a saved tensor whose shape differs from the one this layer holds (the recipe's amax_history_len, or
    the layer's size, changed since it was saved)."""
    for key, value in saved.items():
        here = current.get(key) if isinstance(current, dict) else None
        if isinstance(value, dict) and isinstance(here, dict):
            _check_shapes(value, here, f"{path}, {key!r}", where)
        elif torch.is_tensor(value) and torch.is_tensor(here) and value.shape != here.shape:
            raise ValueError(
                f"The FP8 scaling state in {where} does not fit this model: {path}, {key!r} has shape "
                f"{tuple(value.shape)} there but {tuple(here.shape)} here "
                "(was amax_history_len or the layer changed?). "
                "Resume with the recipe the checkpoint was saved with, or remove its FP8 scaling state to restart "
                "FP8 scaling from scratch."
            )


def fp8_state_checksum(state) -> str:
    """sha256 of a (nested) scaling state: every tensor's dtype, shape and bytes, and every other value's repr,
    in key order. Saved with the state and compared on load, so that a changed byte is refused."""
    digest = hashlib.sha256()
    _feed(digest, state)
    return digest.hexdigest()


def _feed(digest, value) -> None:
    if isinstance(value, dict):
        digest.update(b"{")
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode() + b":")
            _feed(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    elif torch.is_tensor(value):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"<{flat.dtype} {tuple(value.shape)}>".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    else:
        digest.update(repr(value).encode())
