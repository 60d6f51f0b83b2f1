"""Expert and sequence parallelism together, through the real CLI: each sequence split over ``sequence_parallel_size``
ranks (its attention by all-to-all) while each MoE layer's experts are split over ``expert_parallel_size`` ranks
(tokens to their experts by all-to-all), on 2 and 4 gloo processes, gives one process's losses and gradient norms on
the whole rows (fp32, Qwen3-MoE, packed rows that cross the slice boundary).

The two splits are independent: attention runs on a rank's slice of every row (heads exchanged within the sequence
group), then every token of the slice goes to its experts' ranks (the expert group), whichever sequence group they
belong to; expert gradients are summed over every rank that sent tokens, the dense ones over the sequence and data
groups, both divided by the world size. The router's load-balancing loss stays refused with sequence parallelism
(engines/sequence_parallel_plan.py: a slice is not the rows), hence ``moe_aux_loss_coef=0``.
"""

from __future__ import annotations

import pytest

from tests.distributed.helpers import logged, losses, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

ROWS = ("moe_aux_loss_coef=0", "packing=true", "cutoff_len=64")
ENGINES = {"fsdp2": ("fsdp=full_shard",), "zero2-autoep": ("deepspeed=z2",)}
LORA = ("lora_target=q_proj,k_proj,v_proj,o_proj", "learning_rate=1e-2")
# (engine, finetuning, processes, sequence_parallel_size, expert_parallel_size)
SLICE = [("fsdp2", "full", 2, 2, 2)]
MATRIX = [("fsdp2", "lora", 2, 2, 2), ("fsdp2", "full", 4, 2, 2), ("fsdp2", "full", 4, 2, 4),
          ("fsdp2", "full", 4, 4, 2), ("zero2-autoep", "full", 2, 2, 2), ("zero2-autoep", "full", 4, 2, 2)]
CELLS = [pytest.param(*cell, id="{}-{}-{}procs-sp{}-ep{}".format(*cell)) for cell in SLICE]
CELLS += [pytest.param(*cell, id="{}-{}-{}procs-sp{}-ep{}".format(*cell), marks=pytest.mark.matrix)
          for cell in MATRIX]


@pytest.fixture(scope="module")
def one_process(arch_model_dir, tmp_path_factory):
    """Losses and gradient norms of one process on whole rows (micro-batch 4), per finetuning type."""
    found: dict[str, tuple[list[float], list[float]]] = {}

    def reference(finetuning: str) -> tuple[list[float], list[float]]:
        if finetuning not in found:
            out = tmp_path_factory.mktemp(f"one-{finetuning}")
            train(arch_model_dir("qwen3_moe"), out, finetuning, 1, 4, *ROWS, *(LORA if finetuning == "lora" else ()))
            found[finetuning] = losses(out), logged(out, "grad_norm")
        return found[finetuning]

    return reference


@pytest.mark.parametrize("engine,finetuning,nproc,sp,ep", CELLS)
def test_split_experts_and_sequences_match_one_process(engine, finetuning, nproc, sp, ep, one_process,
                                                       arch_model_dir, tmp_path):
    expected_losses, expected_norms = one_process(finetuning)
    data_parallel = nproc // sp
    result = train(arch_model_dir("qwen3_moe"), tmp_path, finetuning, nproc, 4 // data_parallel, *ENGINES[engine],
                   *ROWS, *(LORA if finetuning == "lora" else ()), f"sequence_parallel_size={sp}",
                   f"expert_parallel_size={ep}")
    assert result["sequence_parallel"]["size"] == sp and result["sequence_parallel"]["data_parallel_size"] == \
        data_parallel
    split = result["expert_parallel"]
    assert split["size"] == ep and split["expert_data_parallel_size"] == nproc // ep
    assert all(rank["rows_received_per_step"] > 0 for rank in split["ranks"])  # tokens travelled to their experts
    assert losses(tmp_path) == pytest.approx(expected_losses, rel=1e-5)
    assert logged(tmp_path, "grad_norm") == pytest.approx(expected_norms, rel=1e-5)
