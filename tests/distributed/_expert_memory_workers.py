"""Process body of the 2-process test of what an FSDP2-sharded MoE holds between its forward and its backward.

The bytes counted are those of the storages the autograd graph reaches (a custom Function's ``ctx`` attributes and
saved tensors, a built-in node's saved tensors, an AccumulateGrad node's variable, the inner tensors of a tensor
subclass) that the model does not hold anyway (its sharded parameters and the FP8 scaling state of its modules),
grouped by the graph node that reaches them. A storage FSDP2 freed on reshard (``resize_(0)``) counts zero bytes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from fp8_lightning import convert_to_fp8, fp8_autocast, recipe_from, sync_scales
from fp8_lightning.grouped.experts import GroupedExperts
from fp8_lightning.testing import end_worker, init_gloo

DIM, HIDDEN, EXPERTS, TOKENS, BLOCKS, STEPS = 64, 128, 4, 32, 3, 3
OFFS = (4, 4, 20, 32)  # an empty expert, uneven groups
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4", "nvfp4_1x16")
SPECS = {"nvfp4_1x16": {"name": "nvfp4", "fp4_2d_weights": False}}


class Block(nn.Module):
    """Fused SwiGLU experts and a linear layer, with residuals: one FSDP2 unit."""

    def __init__(self):
        super().__init__()
        self.experts = GroupedExperts(DIM, HIDDEN, EXPERTS)
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        x = x + self.experts(x, torch.tensor(OFFS, dtype=torch.int32))
        return x + self.proj(x)


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _tensors(obj, seen: dict, out: list) -> None:
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
                _tensors(getattr(obj, name), seen, out)
        for value in getattr(obj, "__dict__", {}).values():
            _tensors(value, seen, out)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for item in obj:
            _tensors(item, seen, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, seen, out)
    elif type(obj).__module__.startswith(("fp8_lightning", "tests")) or dataclasses.is_dataclass(obj):
        for item in getattr(obj, "__dict__", {}).values():
            _tensors(item, seen, out)
        for slot in getattr(type(obj), "__slots__", ()):
            _tensors(getattr(obj, slot, None), seen, out)
        if isinstance(obj, tuple):
            for item in obj:
                _tensors(item, seen, out)


def _storages(tensors) -> dict[int, int]:
    """Each real storage (a tensor subclass's outer wrapper has none: its inner tensors count) and its bytes now."""
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors
            if t.device.type != "meta" and (type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"))}


def _node_tensors(node) -> list:
    found, seen = [], {}
    if hasattr(node, "saved_tensors"):  # a custom Function's node is its ctx
        _tensors({k: v for k, v in vars(node).items() if k != "step"}, seen, found)
        _tensors(node.saved_tensors, seen, found)
    else:
        for name in dir(node):
            if name.startswith("_saved_") or name == "variable":
                _tensors(getattr(node, name), seen, found)
    return found


def model_storages(model: nn.Module) -> dict[int, int]:
    """What the model holds anyway: its (sharded) parameters and buffers and its modules' FP8 state."""
    found, seen = [], {}
    for p in model.parameters():
        _tensors(p, seen, found)
    for b in model.buffers():
        _tensors(b, seen, found)
    for module in model.modules():
        _tensors({k: v for k, v in vars(module).items() if k.startswith(("_fp8", "fp8"))}, seen, found)
    return _storages(found)


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
        for key, nbytes in _storages(_node_tensors(node)).items():
            if key not in persistent and key not in counted:
                counted.add(key)
                held[kind] = held.get(kind, 0) + nbytes
        stack.extend(fn for fn, _ in node.next_functions)
    return held


def _model(recipe) -> MoENet:
    torch.manual_seed(0)
    model = MoENet()
    convert_to_fp8(model, recipe_from(SPECS.get(recipe, recipe)), layers={"last": 0})
    return model


def unsharded_held(recipe) -> dict[str, int]:
    """What the graph holds after a forward of the model in one process, unsharded (the weights' casts are then the
    step's cache, which the modules hold anyway): the reference of activation bytes."""
    model = _model(recipe)
    with fp8_autocast():
        loss = (model(torch.randn(TOKENS, DIM)) ** 2).mean()
    return graph_held(loss, model)


def memory_run(recipe, rank: int, world: int, fp8_all_gather: bool) -> dict:
    """Train ``STEPS`` steps of :class:`MoENet` under FSDP2 (every block its own unit, resharded after forward); after
    each forward, count what the graph holds. Returns the counts of the last step, the losses, the last gradients and
    the bytes of the sharded expert weights (each rank's) and of their gathered buffers after the forward."""
    from fp8_lightning.distributed import enable_fp8_all_gather, shard_model
    from fp8_lightning.privates import local_shard

    model = _model(recipe)
    if fp8_all_gather:
        enable_fp8_all_gather(model, world)
    shard_model(model, reshard_after_forward=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    losses, run = [], {}
    for _ in range(STEPS):
        x = torch.randn(world, TOKENS, DIM, generator=g)[rank]
        with fp8_autocast():
            loss = (model(x) ** 2).mean()
        run["held"] = graph_held(loss, model)
        experts = [getattr(block.experts, w) for block in model.blocks for w in ("w1", "w2", "w3")]
        run["shard_bytes"] = sum(_storages(_walk(local_shard(w))).get(_key(local_shard(w)), 0) for w in experts)
        loss.backward()
        run["grads"] = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        sync_scales(model)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return {**run, "losses": losses}


def _walk(t: torch.Tensor) -> list:
    found: list = []
    _tensors(t, {}, found)
    return found


def _key(t: torch.Tensor) -> int:
    """The storage of a sharded expert weight's high-precision shard."""
    return getattr(t, "_hp", t).untyped_storage()._cdata


def memory_worker(rank: int, world: int, port: int, out: dict, recipes=RECIPES) -> None:
    init_gloo(rank, world, port)
    results = {r: {"fp8": memory_run(r, rank, world, True), "hp": memory_run(r, rank, world, False),
                   "unsharded": unsharded_held(r)} for r in recipes}  # fmt: skip
    if rank == 0:
        out.update(results)
    end_worker()
