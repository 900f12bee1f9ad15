"""Process body of the 2-process tests of the experts' FP8 all-gather (importable by spawned children): the same
model trained under FSDP2 with the fused expert weights gathered in FP8 and in high precision, for every recipe."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from fp8_lightning import convert_to_fp8, fp8_autocast, recipe_from
from fp8_lightning.grouped.experts import GroupedExperts
from fp8_lightning.testing import CollectiveCounter, end_worker, init_gloo
from tests.helpers.distributed_steps import finish_step

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8", "nvfp4", "nvfp4_1x16")
SPECS = {"nvfp4_1x16": {"name": "nvfp4", "fp4_2d_weights": False}}  # the others are recipe names
MIXED = ("delayed", {"blocks.1": "mxfp8"})  # a layer policy: block 0's experts delayed, block 1's MXFP8
DIM, HIDDEN, EXPERTS, TOKENS, STEPS = 64, 128, 4, 40, 4
OFFS = (5, 5, 25, 40)  # an empty expert, uneven groups


class ExpertsNet(nn.Module):
    """Two residual blocks of :class:`GroupedExperts` (each sharded on its own) and a high-precision head."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([GroupedExperts(DIM, HIDDEN, EXPERTS) for _ in range(2)])
        self.head = nn.Linear(DIM, 8, bias=False)

    def forward(self, x):
        offs = torch.tensor(OFFS, dtype=torch.int32)
        for block in self.blocks:
            x = x + block(x, offs)
        return self.head(x)


def _train(model: nn.Module, batches, rank: int, world: int, loss_fn) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        with fp8_autocast():
            loss = loss_fn(model, batch[rank])
        loss.backward()
        losses.append(finish_step(model, opt, loss))
    return losses


def _fsdp(model: nn.Module, recipe, world: int, fp8_all_gather: bool, batches, rank: int, loss_fn,
          layers=None) -> dict:
    from fp8_lightning.distributed import enable_fp8_all_gather, shard_model, weight_amax_reductions
    from fp8_lightning.linear import FP8Linear

    convert_to_fp8(model, recipe_from(recipe), layers=layers)
    report = enable_fp8_all_gather(model, world) if fp8_all_gather else None
    for layer in model.modules():  # the linear layers gather in high precision: the runs differ by the experts only
        if isinstance(layer, FP8Linear) and hasattr(layer.weight, "_hp"):
            layer.weight = nn.Parameter(layer.weight._hp.detach())
    shard_model(model)
    with CollectiveCounter() as counter:
        losses = _train(model, batches, rank, world, loss_fn)
    run = {
        "losses": losses,
        "allgather_bytes": counter.bytes["all_gather"],
        "allgather_calls": counter.calls["all_gather"],
        "amax_reductions": weight_amax_reductions(model),
        "fp8": sorted(report.fp8) if report else [],
        "high_precision": dict(report.high_precision) if report else {},
    }
    if fp8_all_gather and "nvfp4" in str(recipe):  # after the counts: it gathers the weights once more
        run["cast_bits_equal"] = _gathered_casts_equal(model, world)
    return run


def _gathered_casts_equal(model: nn.Module, world: int) -> dict:
    """Per expert weight: whether the FP8-gathered operands of every expert, (W_e, W_e.T), have the bits of the
    experts' own casts of the whole weight gathered in high precision (``grouped_weight_operands``)."""
    from fp8_lightning.distributed.expert_weight import FP8GatheredExperts
    from fp8_lightning.privates import local_shard

    equal = {}
    for name, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        for param in module.fp8_weights:
            hp = local_shard(getattr(module, param))._hp.detach().contiguous()
            shards = [torch.empty_like(hp) for _ in range(world)]
            dist.all_gather(shards, hp)
            scaling = module.fp8_scaling().parts[param]
            want = scaling.recipe.grouped_weight_operands(torch.cat(shards), scaling.forward_dtype,
                                                          scaling.expert_states, False)  # fmt: skip
            module.unshard()
            gathered = local_shard(getattr(module, param))
            got = gathered.fp8_expert_operands(scaling, False) if isinstance(gathered, FP8GatheredExperts) else []
            module.reshard()
            equal[f"{name}.{param}"] = [
                all(torch.equal(g[i].data, w[i].data) and torch.equal(g[i].scale, w[i].scale) for g, w in zip(got, want))
                and len(got) == len(want) for i in (0, 1)
            ]  # [fprop copies equal, dgrad copies equal]
    return equal


def _experts_loss(model, x):
    return (model(x) ** 2).mean()


def experts_net_run(recipe, rank: int, world: int, fp8_all_gather: bool, steps: int = STEPS, layers=None) -> dict:
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(world, TOKENS, DIM, generator=g) for _ in range(steps)]
    torch.manual_seed(0)
    return _fsdp(ExpertsNet(), SPECS.get(recipe, recipe), world, fp8_all_gather, batches, rank, _experts_loss, layers)


def _lm_loss(model, seq):
    return model(input_ids=seq, labels=seq).loss


def transformers_run(recipe, rank: int, world: int, fp8_all_gather: bool) -> dict:
    """gpt-oss: experts stored transposed, (E, K, N), with biases."""
    from tests.helpers.moe import VOCAB, tiny_moe

    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(3, VOCAB, (world, 4, 16), generator=g) for _ in range(3)]
    return _fsdp(tiny_moe("gpt_oss"), recipe, world, fp8_all_gather, batches, rank, _lm_loss)


def full_state_dict_check(world: int) -> bool:
    """The full state dict of a model whose expert weights gather in FP8 holds plain tensors equal to its weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fp8_lightning.distributed import enable_fp8_all_gather, shard_model

    torch.manual_seed(0)
    model = ExpertsNet()
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    convert_to_fp8(model, recipe_from("tensorwise"))
    enable_fp8_all_gather(model, world)
    shard_model(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sorted(full) == sorted(plain) and all(
        type(v) is torch.Tensor and torch.equal(v, plain[k]) for k, v in full.items()
    )


def nvfp4_resume_run(rank: int, world: int, tmpdir: str, steps: int = 4) -> dict:
    """NVFP4 experts gathered as FP4: an uninterrupted run, and one saved after half its steps (a sharded
    torch.distributed.checkpoint of the model, each rank's FP8 state) and resumed in a fresh model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from fp8_lightning.saved_state import fp8_state_dict, load_fp8_state_dict
    from fp8_lightning.distributed import enable_fp8_all_gather, shard_model

    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(world, TOKENS, DIM, generator=g) for _ in range(steps)]

    def build():
        torch.manual_seed(0)
        model = ExpertsNet()
        convert_to_fp8(model, recipe_from("nvfp4"), layers={"last": 0})  # every block in NVFP4, no bf16 tail
        gathered = enable_fp8_all_gather(model, world).fp8
        shard_model(model)
        return model, gathered

    model, gathered = build()
    whole = _train(model, batches, rank, world, _experts_loss)
    model, _ = build()
    first = _train(model, batches[: steps // 2], rank, world, _experts_loss)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=tmpdir)
    fp8_state = fp8_state_dict(model)
    resumed, _ = build()
    state = {"model": get_model_state_dict(resumed)}
    dcp.load(state, checkpoint_id=tmpdir)
    set_model_state_dict(resumed, state["model"])
    load_fp8_state_dict(resumed, fp8_state)
    second = _train(resumed, batches[steps // 2 :], rank, world, _experts_loss)
    return {"whole": whole, "resumed": first + second, "fp8": sorted(gathered)}


def experts_gather_worker(rank: int, world: int, port: int, out: dict, tmpdir: str) -> None:
    init_gloo(rank, world, port)
    results = {"full_state_dict": full_state_dict_check(world), "nvfp4_resume": nvfp4_resume_run(rank, world, tmpdir)}
    every_block = {"last": 0}  # both blocks' experts in the recipe (NVFP4's default keeps the last one in bf16)
    for recipe in RECIPES:
        results[recipe] = {
            "fp8": experts_net_run(recipe, rank, world, True, layers=every_block),
            "hp": experts_net_run(recipe, rank, world, False, layers=every_block),
        }
    results["mixed"] = {
        "fp8": experts_net_run(MIXED[0], rank, world, True, layers=MIXED[1]),
        "hp": experts_net_run(MIXED[0], rank, world, False, layers=MIXED[1]),
    }
    for recipe in ("tensorwise", "mxfp8"):
        results[f"gpt_oss/{recipe}"] = {
            "fp8": transformers_run(recipe, rank, world, True),
            "hp": transformers_run(recipe, rank, world, False),
        }
    if rank == 0:
        out.update(results)
    end_worker()
