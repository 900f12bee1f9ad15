"""What an autograd graph holds between forward and backward, in bytes: the storages its nodes reach (a custom
Function's ``ctx`` attributes and saved tensors, a built-in node's saved tensors, an AccumulateGrad node's variable, the
inner tensors of a tensor subclass) that the model does not hold anyway (its parameters, buffers and the FP8 scaling
state of its modules), grouped by the graph node that reaches them. A storage FSDP2 freed on reshard (``resize_(0)``)
counts zero bytes. The FSDP2 memory tests of experts and of linear layers count with it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn


def reached_tensors(obj, seen: dict, out: list) -> None:
    """Every tensor ``obj`` reaches through containers, plain objects and tensor subclasses' inner tensors (``seen``
    keeps what it visited alive, so that no id is reused meanwhile)."""
    if id(obj) in seen or obj is None or isinstance(obj, (str, int, float, bool, type, torch.dtype, torch.device)):
        return
    seen[id(obj)] = obj
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        if type(obj) is not torch.Tensor and type(obj) is not nn.Parameter and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            for name in names:
                reached_tensors(getattr(obj, name), seen, out)
        for value in getattr(obj, "__dict__", {}).values():
            reached_tensors(value, seen, out)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for item in obj:
            reached_tensors(item, seen, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            reached_tensors(item, seen, out)
    elif type(obj).__module__.startswith(("fp8_lightning", "tests")) or dataclasses.is_dataclass(obj):
        for item in getattr(obj, "__dict__", {}).values():
            reached_tensors(item, seen, out)
        for slot in getattr(type(obj), "__slots__", ()):
            reached_tensors(getattr(obj, slot, None), seen, out)
        if isinstance(obj, tuple):
            for item in obj:
                reached_tensors(item, seen, out)


def storage_bytes(tensors) -> dict[int, int]:
    """Each real storage (a tensor subclass's outer wrapper has none: its inner tensors count) and its bytes now."""
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors
            if t.device.type != "meta" and (type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"))}


def walk(t: torch.Tensor) -> list:
    """Every tensor ``t`` reaches (itself, a subclass's inner tensors)."""
    found: list = []
    reached_tensors(t, {}, found)
    return found


def _node_tensors(node) -> list:
    found, seen = [], {}
    if hasattr(node, "saved_tensors"):  # a custom Function's node is its ctx
        reached_tensors({k: v for k, v in vars(node).items() if k != "step"}, seen, found)
        reached_tensors(node.saved_tensors, seen, found)
    else:
        for name in dir(node):
            if name.startswith("_saved_") or name == "variable":
                reached_tensors(getattr(node, name), seen, found)
    return found


def model_storages(model: nn.Module) -> dict[int, int]:
    """What the model holds anyway: its (sharded) parameters and buffers and its modules' FP8 state."""
    found, seen = [], {}
    for p in model.parameters():
        reached_tensors(p, seen, found)
    for b in model.buffers():
        reached_tensors(b, seen, found)
    for module in model.modules():
        reached_tensors({k: v for k, v in vars(module).items() if k.startswith(("_fp8", "fp8"))}, seen, found)
    return storage_bytes(found)


def graph_held(loss: torch.Tensor, model: nn.Module) -> dict[str, int]:
    """Bytes of the storages the graph of ``loss`` holds beyond the model's own, by kind of graph node (each storage
    counted once, for the first node found to reach it)."""
    persistent, counted, held = model_storages(model), set(), {}
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kind = type(node).__name__
        if kind == "AccumulateGrad":  # the leaf it feeds: an unsharded parameter, by type
            kind = f"AccumulateGrad[{type(node.variable).__name__}]"
        for key, nbytes in storage_bytes(_node_tensors(node)).items():
            if key not in persistent and key not in counted:
                counted.add(key)
                held[kind] = held.get(kind, 0) + nbytes
        stack.extend(fn for fn, _ in node.next_functions)
    return held
