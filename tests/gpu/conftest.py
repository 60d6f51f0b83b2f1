"""GPU tier: every test here is marked `gpu` and skipped without CUDA (the marks are set in each module)."""

from __future__ import annotations

import pytest

from tests.gpu.helpers import GPUS, MICRO, Run, train


@pytest.fixture(scope="session")
def bf16_reference(tiny_model_dir, tmp_path_factory) -> dict[str, Run]:
    """One plain process (local engine) per finetuning type, bf16, with the global batch of the sharded runs."""
    return {finetuning: train(tiny_model_dir, tmp_path_factory.mktemp(f"gpu-ref-{finetuning}"), finetuning,
                              micro=MICRO * max(GPUS, 1))
            for finetuning in ("full", "lora")}
