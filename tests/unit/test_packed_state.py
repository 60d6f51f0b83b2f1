"""Packed rows through layers with a state (model/packed_state.py): each sample's loss and gradients in a packed row
equal that sample trained alone (fp32), for every family of the installed transformers whose config names layers
with a recurrent state or a short convolution; what stays refused says why (model/attention.py packing_problem).

The families come from transformers' own causal-LM table (model/registry.py), filtered by the config's layer kinds:
no names written here but the slice `make test` runs; `make test-matrix` runs them all.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from shardtune.data.collator import DataCollator
from shardtune.data.packing import pack_row
from shardtune.data.settings import IGNORE_INDEX
from shardtune.errors import ModelError
from shardtune.model.attention import (
    kernel_support,
    layer_windows,
    packing_problem,
    recurrent_kinds,
    stateful_layer_kinds,
)
from shardtune.model.packed_state import apply_sample_boundaries, sample_segments, stateful_blocks
from shardtune.model.registry import decoder_families, tiny_registry_config

SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
SLICE = ("qwen3_next", "nemotron_h")  # gated delta net + full attention; Mamba-2 + attention + MLP blocks
TOLERANCE = 1e-5  # fp32, relative to the reference's size (at least 1)
A, B, C = [5, 17, 99, 3, 240, 31, 8], [44, 61, 7, 300, 12, 19, 77, 150, 9], [400, 22, 6, 91, 13]


def tiny_model(family: str, fixed: bool = True) -> tuple[Any, DataCollator]:
    """The family's tiny model in fp32 (eval: no dropout), its packed rows made exact when ``fixed``, and the
    collator training would give it."""
    from transformers import AutoModelForCausalLM

    config = tiny_registry_config(family, 512, SPECIAL_IDS)
    support = kernel_support(config.to_dict())
    kernel = "sdpa" if support is not None and support.sdpa else "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=kernel).float().eval()
    if fixed:
        apply_sample_boundaries(model, stateful_layer_kinds(config))
    windows = layer_windows(config)
    return model, DataCollator(0, attn_implementation=kernel, window_by_layer_type=windows,
                               recurrent_kinds=recurrent_kinds(windows))


def token_losses(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Each label's loss ``[B, L - 1]`` (0 where ignored)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   attention_mask=batch.get("attention_mask"), use_cache=False).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)


def loss_and_grads(model: Any, batch: dict[str, Any], row: int, span: slice) -> tuple[float, list[torch.Tensor]]:
    """The mean loss of one sample's labels (``span`` of row ``row``) and its gradients."""
    model.zero_grad()
    loss = token_losses(model, batch)[row, span].sum() / (span.stop - span.start)
    loss.backward()
    return loss.item(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def packed_batch(collator: DataCollator, first: list[int]) -> dict[str, Any]:
    """Two rows: ``first`` and B packed, and C alone (padded to the longer row: padding is a segment too)."""
    return collator([pack_row([first, B], [first, B]), pack_row([C], [C])])


def sample_spans(first: list[int]) -> list[tuple[int, slice, list[int]]]:
    """(row, labels of the sample in the shifted row, the sample) for each sample of ``packed_batch``."""
    n = len(first)
    return [(0, slice(0, n - 1), first), (0, slice(n, n + len(B) - 1), B), (1, slice(0, len(C) - 1), C)]


def worst_difference(family: str, fixed: bool = True) -> float:
    """The largest relative difference, over the samples of a packed batch, between a sample's loss and gradients
    in the batch and the same sample trained alone."""
    model, collator = tiny_model(family, fixed)
    packed = packed_batch(collator, A)
    worst = 0.0
    for row, span, sample in sample_spans(A):
        loss, grads = loss_and_grads(model, packed, row, span)
        alone = collator([pack_row([sample], [sample])])
        ref_loss, ref_grads = loss_and_grads(model, alone, 0, slice(0, len(sample) - 1))
        worst = max(worst, abs(loss - ref_loss) / max(1.0, abs(ref_loss)))
        for got, want in zip(grads, ref_grads, strict=True):
            worst = max(worst, (got - want).abs().max().item() / max(1.0, want.abs().max().item()))
    return worst


def stateful_registry_families() -> list[str]:
    """The installed transformers' causal-LM families whose tiny config names layers with a state."""
    found = []
    for family in decoder_families():
        try:
            config = tiny_registry_config(family, 512, SPECIAL_IDS)
        except Exception:  # noqa: BLE001 - families that do not build: test_registry_families.py's NOT_BUILT
            continue
        if stateful_layer_kinds(config.to_dict()):
            found.append(family)
    return found


def packing_refusal(family: str) -> str | None:
    config = tiny_registry_config(family, 512, SPECIAL_IDS).to_dict()
    return packing_problem(config, kernel_support(config), "sdpa", family)


@pytest.mark.parametrize("family", SLICE)
def test_packed_samples_equal_each_sample_trained_alone(family):
    assert packing_refusal(family) is None
    assert worst_difference(family) <= TOLERANCE


def test_a_samples_state_does_not_leak_into_the_next():
    """Change sample A's tokens: B's loss and gradients in the same packed row stay as they were, and they do change
    with the per-sample runs left out (the test can fail)."""
    changed = [t + 1 for t in A]
    for fixed in (True, False):
        model, collator = tiny_model("qwen3_next", fixed)
        row, span, _ = sample_spans(A)[1]
        loss, grads = loss_and_grads(model, packed_batch(collator, A), row, span)
        other_loss, other_grads = loss_and_grads(model, packed_batch(collator, changed), row, span)
        moved = max([abs(loss - other_loss)]
                    + [(g - h).abs().max().item() for g, h in zip(grads, other_grads, strict=True)])
        assert (moved <= TOLERANCE) is fixed, f"fixed={fixed}: B moved by {moved:.2e}"


def test_sample_segments_start_where_positions_start_again():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert sample_segments(positions) == (((0, 3), (3, 5), (5, 6)), ((0, 6),))


def test_stateful_blocks_are_the_outermost_stateful_children_of_decoder_layers():
    model, _ = tiny_model("nemotron_h", fixed=False)
    blocks = stateful_blocks(model)
    assert blocks and all(name.endswith(".mixer") and "Mamba" in type(block).__name__ for name, block in blocks)
    assert not any(name.startswith(other + ".") for name, _ in blocks for other, _ in blocks)


def test_a_model_whose_stateful_layers_are_not_found_is_refused():
    model, _ = tiny_model("llama", fixed=False)
    with pytest.raises(ModelError, match=r"packing: .* found no block of them to run once per packed sample"):
        apply_sample_boundaries(model, ["linear_attention"])


def test_packing_now_passes_the_launch_check_for_stateful_families():
    for family in SLICE:
        config = tiny_registry_config(family, 512, SPECIAL_IDS).to_dict()
        for kernel in ("sdpa", "eager", "flash_attention_2"):
            assert packing_problem(config, None, kernel, family) is None, (family, kernel)


@pytest.mark.matrix
@pytest.mark.timeout(900)
def test_every_stateful_registry_family_packs_exactly_or_is_refused_with_the_reason():
    families = stateful_registry_families()
    assert {"qwen3_next", "nemotron_h", "bamba", "falcon_h1", "jamba", "granitemoehybrid", "qwen3_5",
            "kimi_linear", "lfm2", "zamba2"} <= set(families)
    failures, report = [], []
    for family in families:
        started = time.monotonic()
        refusal = packing_refusal(family)
        if refusal is not None:
            report.append(f"{family}: refused ({refusal})")
            if "packing" not in refusal or "set packing: false" not in refusal:
                failures.append(f"{family}: refusal without the reason or the fix: {refusal}")
            continue
        try:
            fixed, leaked = worst_difference(family), worst_difference(family, fixed=False)
        except Exception as error:  # noqa: BLE001 - every family's outcome in one report
            failures.append(f"{family}: {type(error).__name__}: {error}")
            continue
        report.append(f"{family}: {fixed:.1e} (without the fix {leaked:.1e}) {time.monotonic() - started:.1f}s")
        if fixed > TOLERANCE:
            failures.append(f"{family}: packed samples differ from alone by {fixed:.2e}")
    print("\n".join(report))
    assert not failures, failures


@pytest.mark.parametrize("keys", [{"packing": True}, {}], ids=["packing", "padding-free-by-default"])
def test_rows_that_hold_several_samples_run_the_stateful_blocks_per_sample(keys, arch_model_dir, tmp_path):
    """sft with packing, and sft with padding_free left unset (on by default on the CPU, where the block mask costs
    nothing): both put several samples in a row, and both wrap the blocks; unpacked rows with padding_free off not."""
    from shardtune.config.schema import TrainConfig
    from shardtune.model.packed_state import runs_per_sample
    from shardtune.train.kernels import apply_kernels

    folder = arch_model_dir("nemotron_h")
    for fields, wrapped in ((keys, True), ({"padding_free": False}, False)):
        model, _ = tiny_model("nemotron_h", fixed=False)
        config = TrainConfig(model_name_or_path=str(folder), stage="sft", dataset="demo", output_dir=str(tmp_path),
                             **fields)
        apply_kernels(model, config, is_main=False)
        assert any(runs_per_sample(module) for module in model.modules()) is wrapped, fields


def test_a_stateful_block_returns_the_same_outputs_whether_rows_hold_one_sample_or_several():
    """ZeRO-3 hooks every tensor a module returns, and its ranks must fetch the same modules in every micro-batch:
    MiniMax's lightning attention returned its final state only when no row held two samples, its backward fetch
    then fired twice on that rank, and the ranks of a packed ZeRO-3 run hung at the third step. Its run there
    equals one process (tests/distributed/test_packed_state_engines.py's registry cells)."""
    model, collator = tiny_model("minimax")
    (name, block), *_ = stateful_blocks(model)
    returned: list[tuple] = []
    block.register_forward_hook(lambda _, __, output: returned.append(
        tuple(type(item).__name__ for item in (output if isinstance(output, tuple) else (output,)))))
    with torch.no_grad():
        for batch in (packed_batch(collator, A), collator([pack_row([A], [A]), pack_row([A[::-1]], [A[::-1]])])):
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    several, one_each = returned
    assert several == one_each == ("Tensor", "NoneType"), (name, returned)
