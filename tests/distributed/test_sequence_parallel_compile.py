"""torch_compile with sequence parallelism: a new packed layout must not compile the decoder layers again.

The split attention loops over the micro-batch's segment spans in Python; traced into a layer's graph, the graph was
guarded on the spans, so each new layout recompiled (allgather) or the layers fell back to eager (ulysses). Checked
on 2 CPU processes with torch's eager backend (the graphs dynamo captures, without code generation): five rows of
one length and five layouts, the graphs counted after each, and every loss equal to an uncompiled model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardtune.data.collator import DataCollator
from tests.distributed.helpers import spawn_cases

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

MODES = ("ulysses", "allgather")
LAYOUTS = [(9, 14, 6), (20, 9), (5, 5, 5, 5, 9), (3, 26), (12, 17)]  # 29 tokens each, padded to 30


def _packed_batch(lengths: tuple[int, ...], pad_token_id: int, vocab: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": [], "segment_ids": []}
    for number, length in enumerate(lengths, start=1):
        ids = torch.randint(5, vocab, (length,), generator=generator).tolist()
        row["input_ids"] += ids
        row["labels"] += [-100] + ids[1:]
        row["position_ids"] += list(range(length))
        row["segment_ids"] += [number] * length
    return DataCollator(pad_token_id, attn_implementation="sdpa", sequence_parallel=2)([row])


def _graphs_per_layout(rank: int, model_dir: str, mode: str) -> str:
    """The graph count after each layout, and the largest loss difference against the uncompiled model."""
    from transformers import AutoModelForCausalLM

    from shardtune.engines.sequence_parallel import SequenceParallel
    from shardtune.model.compile import apply_regional_compile, compiled_graphs
    from shardtune.train.loop import micro_batch_losses
    from shardtune.train.sequence_shards import sequence_shard

    torch._dynamo.reset()
    compiled, plain = (AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa") for _ in range(2))
    apply_regional_compile(compiled, None, "eager")
    split = SequenceParallel(2, rank, dist.group.WORLD, mode)
    split.attach(compiled)
    split.attach(plain)
    config = compiled.config
    graphs, worst = [], 0.0
    for seed, lengths in enumerate(LAYOUTS):
        shard = sequence_shard(_packed_batch(lengths, config.pad_token_id, config.vocab_size, seed), 2, rank)
        with split.scope(shard["segment_spans"]):
            loss, _ = micro_batch_losses(compiled, shard, 0, 0.0, False)
            loss.backward()
            expected, _ = micro_batch_losses(plain, shard, 0, 0.0, False)
        graphs.append(compiled_graphs())
        worst = max(worst, abs(float(loss) - float(expected)) / abs(float(expected)))
    return " ".join(map(str, [*graphs, worst]))


@pytest.fixture(scope="module")
def outcomes(tiny_model_dir, tmp_path_factory) -> Path:
    return spawn_cases(tmp_path_factory.mktemp("sp-compile"), tiny_model_dir, tuple(MODES), _graphs_per_layout)


@pytest.mark.parametrize("mode", MODES)
def test_a_new_packed_layout_compiles_nothing_again(mode, outcomes):
    for rank in range(2):
        text = Path(outcomes, f"{mode}.rank{rank}").read_text()
        assert not text.startswith("crash"), text
        *graphs, worst = text.split()
        assert int(graphs[0]) > 0 and len(set(graphs)) == 1, f"graphs after each layout: {graphs}"
        assert float(worst) < 1e-5, text
