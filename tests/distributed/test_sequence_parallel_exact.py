"""The split attention and the slicing of a packed row, checked at one forward and backward on 2 CPU processes,
with negative controls: each pitfall of sequence parallelism, put back on purpose, must break the match.

The row packs three samples and the middle one crosses the boundary between the two slices, with padding at the
end. Reference: the summed token loss and the parameter gradients of one process on the whole row (the same
collator, mask and loss code as a one-process run). Split: each rank's slice through the split attention, the
gradients summed over the two ranks as the engines sum them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardtune.data.collator import DataCollator
from shardtune.engines.sequence_parallel import SequenceParallel
from shardtune.train.loop import micro_batch_losses
from shardtune.train.sequence_shards import segment_spans, sequence_shard
from tests.distributed.helpers import spawn_cases

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

# What each case changes; "exact" is the shipped path.
CASES = {
    "exact": "the shipped split",
    "shift-after-slicing": "labels shifted inside each slice (the slice's last token loses its target)",
    "local-positions": "position ids restarting at each slice (RoPE sees the wrong positions)",
    "slice-local-mask": "attention within the slice only (the model's own kernel on the slice)",
    "unsplit-segments": "one segment per row (packed samples attend to each other across the boundary)",
}


def _packed_batch(pad_token_id: int, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(5, vocab, (n,), generator=generator).tolist() for n in (9, 14, 6)]
    row = {"input_ids": [], "labels": [], "position_ids": [], "segment_ids": []}
    for number, ids in enumerate(samples, start=1):
        row["input_ids"] += ids
        row["labels"] += [-100] + ids[1:]
        row["position_ids"] += list(range(len(ids)))
        row["segment_ids"] += [number] * len(ids)
    # 29 tokens padded to 30 (a multiple of 2); the second sample spans tokens 9..22, across the boundary at 15.
    return DataCollator(pad_token_id, attn_implementation="sdpa", sequence_parallel=2)([row])


def _variant(batch: dict, case: str, index: int) -> dict:
    shard = sequence_shard(batch, 2, index)
    if case == "shift-after-slicing":
        local = batch["labels"][:, index * 15:(index + 1) * 15]
        shard["shift_labels"] = torch.cat([local[:, 1:], torch.full_like(local[:, :1], -100)], dim=1)
    if case == "local-positions":
        shard["position_ids"] = torch.arange(15)[None]
    if case == "unsplit-segments":
        shard["segment_spans"] = [segment_spans(row) for row in (batch["segment_ids"] > 0).long()]
    return shard


def _compare(rank: int, model_dir: str, case: str) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    batch = _packed_batch(model.config.pad_token_id, model.config.vocab_size)
    whole = DataCollator(model.config.pad_token_id, attn_implementation="sdpa")  # the one-process batch
    reference_batch = {**batch, "attention_mask": whole.packed_masks(batch["segment_ids"])}
    reference_batch = {k: v for k, v in reference_batch.items() if k != "segment_ids"}
    loss, _ = micro_batch_losses(model, reference_batch, 0, 0.0, False)
    loss.backward()
    expected_loss = float(loss)
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    split = SequenceParallel(2, rank, dist.group.WORLD, "ulysses" if "allgather" not in case else "allgather")
    if case != "slice-local-mask":
        split.attach(model)
    shard = _variant(batch, case.removesuffix("+allgather"), rank)
    with split.scope(shard["segment_spans"]):
        loss, _ = micro_batch_losses(model, shard, 0, 0.0, False)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad)
    loss_ok = abs(float(total) - expected_loss) <= 1e-4 * abs(expected_loss)
    # Per tensor, the largest difference against the tensor's largest entry: fp32 rounding of the per-segment
    # attention is about 1e-6 of it; each pitfall is off by more than 1e-2.
    worst = max(float((grads[n] - expected[n]).abs().max() / expected[n].abs().max().clamp(min=1e-12))
                for n in expected)
    grads_ok = worst < 1e-5
    return f"{loss_ok} {grads_ok} {float(total)} {expected_loss} {worst}"


ALL_CASES = ["exact+allgather", *CASES]


@pytest.fixture(scope="module")
def outcomes(tiny_model_dir, tmp_path_factory) -> Path:
    """Every case on the same two processes (one start-up for all)."""
    return spawn_cases(tmp_path_factory.mktemp("sp-exact"), tiny_model_dir, tuple(ALL_CASES), _compare)


def _matched(results: Path, case: str) -> tuple[bool, bool]:
    found = [Path(results, f"{case}.rank{rank}").read_text() for rank in range(2)]
    for text in found:
        assert not text.startswith("crash"), text
    loss_ok, grads_ok = found[0].split()[:2]
    return loss_ok == "True", grads_ok == "True"


@pytest.mark.parametrize("case", ["exact", "exact+allgather"])
def test_split_row_gives_the_whole_rows_loss_and_gradients(case, outcomes):
    assert _matched(outcomes, case) == (True, True), Path(outcomes, f"{case}.rank0").read_text()


@pytest.mark.parametrize("case", [c for c in CASES if c != "exact"])
def test_each_pitfall_breaks_the_match(case, outcomes):
    loss_ok, grads_ok = _matched(outcomes, case)
    assert not (loss_ok and grads_ok), f"{CASES[case]}: still matched the whole row, so the test could not see it"
