"""Models trained by ``fp8-train``: ordinary LightningModules with no FP8 code inside."""

from fp8_lightning.models.gpt import GPT, check_gpt_dims
from fp8_lightning.models.schedules import warmup_cosine, warmup_cosine_factor

__all__ = ["GPT", "check_gpt_dims", "warmup_cosine", "warmup_cosine_factor"]
