"""Mixtures of experts in FP8: the grouped FP8 GEMM (:mod:`~fp8_lightning.grouped.gemm`) and the in-place conversion of
fused 3-D expert modules (:mod:`~fp8_lightning.grouped.experts`)."""

from fp8_lightning.grouped.experts import FP8GroupedExperts, GroupedExperts, convert_experts
from fp8_lightning.grouped.gemm import GroupedScaling, fp8_grouped_mm

__all__ = ["FP8GroupedExperts", "GroupedExperts", "GroupedScaling", "convert_experts", "fp8_grouped_mm"]
