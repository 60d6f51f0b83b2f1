"""Packing and the collator: row limits, every sample once, padding, and no attention across samples."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardtune.data import DataCollator, DataSettings, build_datasets
from shardtune.data.packing import pack_row, plan_rows
from shardtune.model.varlen import register_varlen
from tests.unit.conftest_data import DATA_DIR, build_test_tokenizer

CUTOFF = 160
M = -100


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_test_tokenizer()


@pytest.fixture(scope="module")
def unpacked_and_packed(tokenizer: Any) -> tuple[Any, Any]:
    base = {"dataset": ("demo", "demo_sharegpt"), "dataset_dir": str(DATA_DIR), "template": "chatml",
            "cutoff_len": CUTOFF, "max_samples": 60}
    unpacked, _ = build_datasets(tokenizer, DataSettings(**base))
    packed, _ = build_datasets(tokenizer, DataSettings(packing=True, **base))
    return unpacked, packed


def split_row(row: dict[str, list[int]]) -> list[tuple[list[int], list[int], list[int]]]:
    """(input_ids, labels, position_ids) of each sample in a packed row, by segment id."""
    samples: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for token, label, position, segment in zip(row["input_ids"], row["labels"], row["position_ids"],
                                               row["segment_ids"], strict=True):
        ids, labels, positions = samples.setdefault(segment, ([], [], []))
        ids.append(token)
        labels.append(label)
        positions.append(position)
    assert list(samples) == list(range(1, len(samples) + 1)), "segments are numbered 1.. in order"
    return list(samples.values())


def test_plan_rows_respects_capacity_and_uses_every_index_once() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    rows = plan_rows(lengths, 100)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 100 for row in rows)
    assert len(rows) <= 1.1 * sum(lengths) / 100 + 1  # best-fit decreasing is close to the lower bound
    assert plan_rows([6, 4, 5, 5], 10) == [[0, 1], [2, 3]]


def test_pack_row_restarts_positions_and_masks_each_first_label() -> None:
    row = pack_row([[1, 2, 3], [4, 5]], [[1, 2, 3], [M, 5]])
    assert row == {"input_ids": [1, 2, 3, 4, 5], "labels": [M, 2, 3, M, 5], "position_ids": [0, 1, 2, 0, 1],
                   "segment_ids": [1, 1, 1, 2, 2]}


def test_packed_rows_fit_and_hold_every_sample_exactly_once(unpacked_and_packed: tuple[Any, Any]) -> None:
    unpacked, packed = unpacked_and_packed
    assert len(packed) < len(unpacked)
    assert all(len(ids) <= CUTOFF for ids in packed["input_ids"])
    found: Counter[tuple[int, ...]] = Counter()
    for row in packed:
        for ids, labels, positions in split_row(row):
            assert positions == list(range(len(ids)))
            assert labels[0] == M
            found[tuple(ids)] += 1
    assert found == Counter(tuple(ids) for ids in unpacked["input_ids"])
    # Apart from the first label (a prompt token here anyway), labels are untouched.
    expected = {tuple(s["input_ids"]): s["labels"][1:] for s in unpacked}
    assert all(expected[tuple(ids)] == labels[1:] for row in packed for ids, labels, _ in split_row(row))


def test_collator_pads_plain_rows() -> None:
    collator = DataCollator(pad_token_id=9, pad_to_multiple_of=4)
    batch = collator([{"input_ids": [1, 2, 3], "labels": [M, 2, 3]}, {"input_ids": [4], "labels": [4]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 9], [4, 9, 9, 9]]
    assert batch["labels"].tolist() == [[M, 2, 3, M], [4, M, M, M]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 0, 1, 2]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_rows_without_padding_get_no_mask_and_the_same_loss_and_gradients() -> None:
    """An all-ones mask is left out (transformers would check it every forward); the model then computes exactly
    what it computes with the mask."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = [{"input_ids": [1, 2, 3, 4], "labels": [M, 2, 3, 4]}, {"input_ids": [5, 6, 7, 8], "labels": [5, 6, M, 8]}]
    batch = DataCollator(pad_token_id=0, attn_implementation="sdpa")(rows)
    assert "attention_mask" not in batch and int(batch["num_tokens"]) == 8
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa"))
    found = []
    for mask in (None, torch.ones_like(batch["input_ids"])):
        model.zero_grad()
        extra = {} if mask is None else {"attention_mask": mask}
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], **extra)
        out.loss.backward()
        found.append((out.loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(found[0][0], found[1][0])
    assert all(torch.equal(a, b) for a, b in zip(found[0][1], found[1][1], strict=True))


def test_collator_builds_a_block_diagonal_mask_for_packed_rows() -> None:
    feature = {"input_ids": [5, 6, 7], "labels": [M, 6, M], "position_ids": [0, 1, 0], "segment_ids": [1, 1, 2]}
    as_bool = DataCollator(0, pad_to_multiple_of=4, attn_implementation="sdpa")([feature])["attention_mask"]
    assert as_bool.dtype == torch.bool and as_bool.shape == (1, 1, 4, 4)
    assert as_bool[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    additive = DataCollator(0, pad_to_multiple_of=4, attn_implementation="eager")([feature])["attention_mask"]
    assert additive.dtype == torch.float32
    assert torch.equal(additive == 0, as_bool)
    assert torch.equal(DataCollator(0, pad_to_multiple_of=4)([feature])["attention_mask"], additive)
    assert DataCollator(0, attn_implementation="flex_attention")([feature])["attention_mask"].dtype == torch.float32


def test_collator_gives_flash_attention_varlen_offsets_over_the_flattened_batch() -> None:
    rows = [{"input_ids": [5, 6, 7], "labels": [M, 6, M], "position_ids": [0, 1, 0], "segment_ids": [1, 1, 2]},
            {"input_ids": [8, 9, 10, 11, 12], "labels": [M] * 5, "position_ids": [0, 1, 2, 3, 4],
             "segment_ids": [1] * 5}]
    batch = DataCollator(0, attn_implementation="flash_attention_2")(rows)
    assert "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[0, 1, 0, 0, 1], [0, 1, 2, 3, 4]]
    # row 0: sample(2) sample(1) padding(2); row 1: sample(5)
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 2, 3, 5, 10]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 5


def tiny_llama(vocab_size: int, attn_implementation: str) -> LlamaForCausalLM:
    register_varlen()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CUTOFF)
    config._attn_implementation = attn_implementation
    return LlamaForCausalLM(config).eval()


def two_packed_rows(packed: Any) -> list[dict[str, list[int]]]:
    """The two rows holding the most samples, the second cut short so the batch needs padding."""
    rows = sorted(packed, key=lambda row: max(row["segment_ids"]), reverse=True)[:2]
    rows[1] = {key: values[: len(values) * 2 // 3] for key, values in rows[1].items()}
    return rows


def assert_each_sample_matches(logits: torch.Tensor, rows: list[dict[str, list[int]]],
                               reference: LlamaForCausalLM) -> None:
    """Every sample's logits in the packed batch equal ``reference`` run on that sample alone."""
    for row_index, row in enumerate(rows):
        start = 0
        for ids, _, _ in split_row(row):
            alone = reference(input_ids=torch.tensor([ids])).logits[0]
            torch.testing.assert_close(logits[row_index, start : start + len(ids)], alone, atol=1e-5, rtol=0)
            start += len(ids)


@pytest.mark.parametrize(("model_attention", "collator_attention"), [
    ("sdpa", "sdpa"), ("eager", "eager"), ("sdpa", None), ("eager", None), ("varlen", "varlen"),
])
def test_packed_logits_equal_logits_of_each_sample_alone(tokenizer: Any, unpacked_and_packed: tuple[Any, Any],
                                                         model_attention: str, collator_attention: str | None) -> None:
    model = tiny_llama(len(tokenizer), model_attention)
    rows = two_packed_rows(unpacked_and_packed[1])
    batch = DataCollator(tokenizer.pad_token_id, attn_implementation=collator_attention)(rows)
    with torch.no_grad():
        assert_each_sample_matches(model(**batch).logits, rows, model)
    assert max(rows[0]["segment_ids"]) >= 3 and max(rows[1]["segment_ids"]) >= 2


def varlen_reference_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                               cu_seq_lens_q: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """What flash-attn's varlen kernel computes, in plain torch: causal attention within each sequence of the
    flattened batch, the sequences given by ``cu_seq_lens_q`` (the kwargs our collator builds for flash)."""
    batch, heads, length, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    out = torch.empty_like(q)
    offsets = cu_seq_lens_q.tolist()
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        piece = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
            is_causal=True, scale=scaling, enable_gqa=True)
        out[start:end] = piece.transpose(0, 1)
    return out.reshape(batch, length, heads, dim), None


def test_flash_varlen_kwargs_give_each_sample_its_own_attention(tokenizer: Any,
                                                                unpacked_and_packed: tuple[Any, Any]) -> None:
    """Position-id/offset based flattening (the flash-attention path) runs here through a reference varlen
    kernel registered with transformers: the kwargs must reach attention and the offsets must be right."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register("varlen_reference", varlen_reference_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("varlen_reference", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    model = tiny_llama(len(tokenizer), "varlen_reference")
    rows = two_packed_rows(unpacked_and_packed[1])
    batch = DataCollator(tokenizer.pad_token_id, attn_implementation="flash_attention_2")(rows)
    with torch.no_grad():
        assert_each_sample_matches(model(**batch, use_cache=False).logits, rows, tiny_llama(len(tokenizer), "sdpa"))


@pytest.mark.parametrize("finetuning", ["full", "lora"])
@pytest.mark.parametrize("attn", ["sdpa", "eager", "varlen"])
def test_padding_free_rows_give_the_padded_loss_and_gradients(finetuning, attn) -> None:
    """padding_free puts a micro-batch's samples into fewer packed rows: every parameter's gradient and the loss
    are those of the padded batch (up to float summation order). Under varlen the padded rows carry no mask (right
    padding, causal) and the padding-free rows carry offsets."""
    import copy

    from shardtune.train.loop import token_loss_sum
    from tests.unit.test_chunked_loss import finetuned, tiny_llama

    g = torch.Generator().manual_seed(3)
    rows = []
    for length in (30, 6, 9, 14, 5):
        ids = torch.randint(0, 101, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [M] * 2 + ids[2:]})
    padded = DataCollator(0, attn_implementation=attn)(rows)
    free = DataCollator(0, attn_implementation=attn, padding_free=True)(rows)
    assert free["input_ids"].shape == (3, 30) and padded["input_ids"].shape == (5, 30)
    assert int(free["num_tokens"]) == int(padded["num_tokens"]) == 64
    model = finetuned(tiny_llama(), finetuning)
    register_varlen()
    model.config._attn_implementation = attn
    found = []
    for batch in (padded, free):
        copy_ = copy.deepcopy(model)
        loss, count = token_loss_sum(copy_, batch, 8)
        loss.backward()
        found.append((float(loss), int(count), {n: p.grad for n, p in copy_.named_parameters() if p.requires_grad}))
    assert found[0][1] == found[1][1]
    assert found[1][0] == pytest.approx(found[0][0], rel=1e-5)
    # Relative to each gradient's norm: an element near zero differs by fp32 summation order alone (2e-6 here on
    # a gradient whose largest element is 7.6; the kernels' order depends on the CPU's vector width).
    for name, grad in found[0][2].items():
        difference = float((found[1][2][name] - grad).norm() / grad.norm().clamp(min=1e-30))
        assert difference < 1e-5, f"{name}: relative difference {difference:.2e}"


def test_padding_free_keeps_rows_that_cannot_share() -> None:
    rows = [{"input_ids": [1] * 5, "labels": [1] * 5}, {"input_ids": [2] * 4, "labels": [2] * 4}]
    batch = DataCollator(0, padding_free=True)(rows)  # 4 + 5 > 5: nothing to gain, the padded batch as before
    assert batch["attention_mask"].tolist() == [[1] * 5, [1] * 4 + [0]]
