"""The pure pieces of sequence parallelism for the preference stages (the 2-process parity is
tests/distributed/test_sequence_parallel_preference.py): a row's log-probability as the sum of its slices', the slice
that holds a reward model's scored token, and one attention mode for the policy and its frozen reference."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardtune.engines.sequence_parallel import SequenceParallel
from shardtune.errors import ConfigError
from shardtune.train.preference import sequence_logps, target_logps
from shardtune.train.reward import scored_slice
from shardtune.train.sequence_shards import sequence_shard

PAD = 0


def test_slices_log_probabilities_sum_to_the_whole_rows():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 11, generator=generator)
    labels = torch.randint(1, 11, (2, 8), generator=generator)
    labels[0, :3] = labels[1, :5] = labels[1, 7:] = -100  # prompts and padding; row 1's answer ends in slice 2
    whole, lengths = sequence_logps(logits, labels)
    batch = {"input_ids": labels.clamp(min=0), "labels": labels, "position_ids": torch.arange(8).expand(2, 8),
             "segment_ids": torch.ones(2, 8, dtype=torch.long)}
    parts = [target_logps(logits[:, index * 4:(index + 1) * 4], sequence_shard(batch, 2, index)["shift_labels"])
             for index in range(2)]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole)
    assert torch.equal(parts[0][1] + parts[1][1], lengths)


def test_the_scored_token_is_found_on_the_whole_row():
    rows = torch.tensor([[5, 6, 7, 8, 9, PAD, PAD, PAD],  # last real token at 4: slice 1 of 2
                         [5, 6, 7, PAD, PAD, PAD, PAD, PAD],  # at 2: slice 0
                         [5, 6, 7, 8, 9, 10, 11, 12],  # no padding: the last slice
                         [5, PAD, 7, PAD, PAD, PAD, PAD, PAD],  # a padding id inside the row: the rightmost other
                         [PAD] * 8])  # padding only: position 0, as transformers' pooling takes
    assert scored_slice(rows, PAD, 2).tolist() == [1, 0, 1, 0, 0]
    assert scored_slice(rows, PAD, 4).tolist() == [2, 1, 3, 1, 0]


def test_the_scored_slices_own_pooling_picks_the_whole_rows_token():
    """transformers' pooling (rightmost token that is not padding) on the owner's slice alone is the whole row's."""
    rows = torch.tensor([[5, 6, PAD, 8, 9, PAD, PAD, PAD], [5, 6, 7, 8, 9, 10, 11, PAD]])

    def pooled(ids: torch.Tensor) -> torch.Tensor:
        return (torch.arange(ids.shape[1]) * (ids != PAD)).argmax(-1)

    owners = scored_slice(rows, PAD, 4)
    for row, owner in enumerate(owners.tolist()):
        local = pooled(rows[row:row + 1, owner * 2:(owner + 1) * 2])
        assert int(local) + owner * 2 == int(pooled(rows[row:row + 1])), row


def tiny(heads: int, kv_heads: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=32, hidden_size=8 * heads, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv_heads)
    return LlamaForCausalLM(config)


def test_the_policy_and_its_reference_share_one_mode():
    split = SequenceParallel(2, 0, None)
    assert split.attach(tiny(4, 2)) == "ulysses"
    assert split.attach(tiny(3, 3)) == "allgather"  # auto: the mode both can run
    assert split.attach(tiny(4, 2)) == "allgather"
    reference_first = SequenceParallel(2, 0, None)
    assert reference_first.attach(tiny(3, 3)) == "allgather" and reference_first.attach(tiny(4, 2)) == "allgather"
    forced = SequenceParallel(2, 0, None, "ulysses")
    assert forced.attach(tiny(4, 2)) == "ulysses"
    with pytest.raises(ConfigError, match="must divide by sequence_parallel_size"):
        forced.attach(tiny(3, 3))
