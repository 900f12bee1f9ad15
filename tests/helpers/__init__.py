"""Helpers only the tests use (what the benchmarks share with the tests is in ``fp8_lightning.testing``)."""
