"""Entry point of ``make train``: a short real FP8 training run (replaced by the Hydra app ``fp8-train``)."""

import torch
import torch.nn as nn

from fp8_lightning import DelayedScaling, convert_to_fp8, fp8_autocast


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))
    teacher = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    print(convert_to_fp8(model, DelayedScaling()))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(200):
        x = torch.randn(128, 64)
        with torch.no_grad():
            target = teacher(x)
        with fp8_autocast():
            loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == 199:
            print(f"step {step:4d}  loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
