"""``micro_batch_tokens`` on 2 processes: the same losses and gradient norms as 1 process with the same global batch.

The token-budget micro-batches are formed for the whole job and dealt out (data/budget_batches.py), so a step of
2 ranks x 2 micro-batches trains the samples that 1 rank x 4 does; the loss is normalised by the step's tokens on
all ranks. 20 samples at 448 tokens make 7 padded micro-batches (5 padding-free): steps of 4 and 3 (4 and 1), so
each epoch's last step has an odd number, which 2 ranks even out by halving its fullest; the 4 steps span 2 epochs,
the second in another order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.distributed.helpers import ENGINE_KEYS, logged, losses, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

BUDGET = ("max_samples=10", "micro_batch_tokens=448", "include_num_input_tokens_seen=non_padding")
MODES = {"padding_free": ("padding_free=true",), "padded": ("padding_free=false",)}
# make test keeps one cell; the other engines and the padded rows are matrix cells.
CELLS = [pytest.param(engine, mode, id=f"{engine}-{mode}",
                      marks=() if (engine, mode) == ("ddp", "padding_free") else (pytest.mark.matrix,))
         for engine in ("ddp", "fsdp2", "zero2", "zero3", "fsdp1") for mode in MODES]


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory) -> Callable[[str], Path]:
    """The single-process run of a mode (4 micro-batches per step), trained once when a cell first asks."""
    runs: dict[str, Path] = {}

    def run(mode: str) -> Path:
        if mode not in runs:
            runs[mode] = tmp_path_factory.mktemp(f"budget-1-{mode}")
            train(tiny_model_dir, runs[mode], "full", 1, 4, *BUDGET, *MODES[mode], "gradient_accumulation_steps=4")
        return runs[mode]

    return run


@pytest.mark.parametrize(("engine", "mode"), CELLS)
def test_budget_batches_on_two_processes_match_one(engine, mode, one_process, tiny_model_dir, tmp_path):
    reference = one_process(mode)
    results = train(tiny_model_dir, tmp_path, "full", 2, 4, *BUDGET, *MODES[mode], "gradient_accumulation_steps=2",
                    *ENGINE_KEYS[engine])
    assert results["world_size"] == 2 and results["global_step"] == 4
    assert len(losses(tmp_path)) == 4
    assert losses(tmp_path) == pytest.approx(losses(reference), rel=2e-3)
    assert logged(tmp_path, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=2e-3)
    # The same samples in each step: as many non-padding input tokens seen after every step.
    assert logged(tmp_path, "num_input_tokens_seen") == logged(reference, "num_input_tokens_seen")
