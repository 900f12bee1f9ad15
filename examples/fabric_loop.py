"""FP8 training in a hand-written loop with Lightning Fabric.

Fabric gives full control of the loop; FP8 comes from the precision plugin, exactly as with the Trainer:
``Fabric(precision="fp8-hybrid")`` (or ``plugins=[fp8_lightning.FP8FabricPrecision(recipe=...)]``) converts the
model's ``nn.Linear`` layers in ``fabric.setup`` and runs the once-per-step amax reduction and scale update in
``optimizer.step()``. The FP8 scaling state (amax histories, scales) is not part of the model's ``state_dict``:
save the plugin next to the model and optimizer, as below, to resume with the same scales.

    python examples/fabric_loop.py                       # tiny GPT on synthetic tokens, CPU, ~1 minute
    python examples/fabric_loop.py --precision fp8-tensorwise --steps 100
"""

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

import fp8_lightning  # noqa: F401  (registers the fp8-* precision strings, Fabric's included)
from fp8_lightning.data import SyntheticDataModule
from fp8_lightning.models import GPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", default="fp8-hybrid")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint", type=Path, default=Path("outputs/fabric_loop/last.ckpt"))
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=1, precision=args.precision)
    fabric.seed_everything(0)
    data = SyntheticDataModule(block_size=64, batch_size=16)
    data.setup()
    model = GPT(block_size=64, n_layer=2, n_head=4, n_embd=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)  # nn.Linear -> FP8Linear happens here
    train_loader = fabric.setup_dataloaders(data.train_dataloader())

    model.train()
    for step, (x, y) in enumerate(train_loader, start=1):
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()  # FP8 amaxes reduced and scales updated here, once per step
        if step % 20 == 0 or step == 1:
            fabric.print(f"step {step:4d}  loss {loss.item():.4f}")
        if step == args.steps:
            break

    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) for x, y in data.val_dataloader()]
    val_loss = torch.stack(losses).mean().item()
    fabric.print(f"val loss {val_loss:.4f} (floor of this data: {data.entropy_floor:.4f}, uniform guess: "
                 f"{math.log(256):.4f})")
    fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "fp8": fabric.strategy.precision})
    fabric.print(f"saved {args.checkpoint} (model, optimizer and FP8 scaling state)")


if __name__ == "__main__":
    main()
