"""One optimizer step of a preference stage (dpo, kto) on any engine, and where the reference comes from.

A micro-batch holds ``pairs`` chosen rows then the same number of rejected rows (dpo), or the answers then their
KL rows (kto), padded together (``data.collator.PairCollator``). The policy scores the rows in one forward; the
reference scores them first, without gradients:

* LoRA: the policy itself with its adapters switched off (peft's ``disable_adapter``), called through the
  engine's wrapper so that sharded weights are gathered as in training: no second copy of the model.
* full / freeze: a frozen model loaded from the same source as the policy and placed by the engine as it places
  the policy (``Engine.load_frozen``): a replica on every rank under one process, DDP and ZeRO-0/1/2; sharded
  under ZeRO-3 (a second, optimizer-less DeepSpeed engine) and FSDP (its own ``fully_shard`` / FSDP1 wrap), so no
  rank ever holds it whole where the policy is sharded.
* ``ref_model`` (LLaMA-Factory's key, with ``ref_model_adapters`` merged into it): that folder instead, loaded and
  placed the same way, for LoRA runs too.
* ORPO and SimPO: no reference at all.

The loss of each micro-batch is its summed per-pair loss over the number of pairs in the whole window across
ranks (times the engine's factor that undoes its gradient averaging), so accumulation and data parallelism give
the update of one big batch, as the SFT loop does with tokens. KTO's KL reference point is estimated once per
window over every rank's KL rows (TRL and LLaMA-Factory estimate it per micro-batch, the same when a window is one
micro-batch per rank of equal size), so the step does not depend on how the window is split.

Under sequence parallelism every rank of a sequence group holds the same pairs (the sampler deals batches over the
data-parallel groups), so a pair never leaves its group: each rank scores its slice of every row, policy and
reference alike (a frozen reference routes its attention through the split too), and a row's log-probability is
the sum of its slices' (``SequenceParallel.sum_over_group``). Every rank of the group then computes the same pair
losses, so the window's pair count is divided by the group size: the group contributes each pair once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from shardtune.config.adapter_method import is_adapter_type
from shardtune.data.images import image_inputs_of_rows
from shardtune.engines.base import Engine
from shardtune.errors import ModelError
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.pretrained_adapters import AdapterPlan
from shardtune.model.source import ModelSource
from shardtune.train.loop import MODEL_INPUTS, Batch, count_input_tokens, rank_rows, targets_of, to_device
from shardtune.train.preference import (
    LossOutput,
    PairLogps,
    PreferenceSettings,
    kto_losses,
    preference_loss,
    target_logps,
)
from shardtune.train.sequence_shards import spans_of

PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")
ORPO_METRICS = ("sft_loss", "odds_ratio_loss")
KTO_METRICS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl")


@dataclass
class Reference:
    """How reference log-probabilities are computed: ``adapters_off`` (LoRA), ``copy`` (a frozen replica),
    ``sharded`` (a frozen model the engine shards as the policy), ``policy`` (the policy as it is: only while
    precomputing, before the first step), ``precomputed`` (read from the batch's ``ref_logps``) or ``none`` (ORPO,
    SimPO)."""

    kind: str
    model: torch.nn.Module | None = None

    def logps(self, engine: Engine, inputs: dict[str, Any], targets: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's summed log-probability of ``targets`` (the shifted labels) and their count."""
        return row_logps(engine, self.logits(engine, inputs), targets)

    def logits(self, engine: Engine, inputs: dict[str, Any]) -> torch.Tensor:
        """The reference's logits for ``inputs``, without gradients (ASFT's anchor reads them whole)."""
        if self.kind == "copy":
            self._match_policy_dtype(engine)
        assert self.kind in ("adapters_off", "copy", "sharded", "policy"), self.kind
        with torch.no_grad(), self._switched(engine), engine.autocast():
            model = self.model if self.kind in ("copy", "sharded") else engine.model
            assert model is not None
            return model(**inputs, use_cache=False).logits

    def _match_policy_dtype(self, engine: Engine) -> None:
        """Engines may cast the policy after the copy was made (DeepSpeed bf16 holds bf16 weights): the copy follows,
        so that the reference computes what the untrained policy would."""
        assert self.model is not None
        policy = next((p for p in engine.unwrapped_model().parameters() if p.is_floating_point()), None)
        current = next((p for p in self.model.parameters() if p.is_floating_point()), None)
        if policy is not None and current is not None and policy.dtype != current.dtype:
            self.model.to(policy.dtype)

    def _switched(self, engine: Engine) -> contextlib.AbstractContextManager:
        if self.kind != "adapters_off":
            return contextlib.nullcontext()
        peft_model = engine.unwrapped_model()
        disable = getattr(peft_model, "disable_adapter", None)
        if disable is None:
            raise ModelError(f"the reference of a LoRA run is the model with its adapters off, but the engine's "
                             f"model ({type(peft_model).__name__}) has no disable_adapter(); use finetuning_type full")
        return disable()


def build_reference(engine: Engine, source: ModelSource, finetuning_type: str, settings: PreferenceSettings,
                    precompute: bool = False, separate: bool = False) -> Reference:
    """The reference of a run (see the module docstring); ``source`` is where it loads from (``reference_source``),
    ``separate`` when that is ``ref_model``, which a LoRA run then uses instead of its adapters-off policy."""
    if not settings.needs_reference:
        return Reference("none")
    if precompute:
        return Reference("precomputed")
    return live_reference(engine, source, finetuning_type, separate)


def live_reference(engine: Engine, source: ModelSource, finetuning_type: str, separate: bool = False) -> Reference:
    """A reference computed during training: the adapters-off policy of a LoRA/OFT run (unless ``separate``), else a
    frozen model from ``source`` that the engine places as it places the policy."""
    if is_adapter_type(finetuning_type) and not separate:
        return Reference("adapters_off")
    frozen = engine.load_frozen(source)
    if engine.sequence is not None:  # its forwards take this rank's slices, as the policy's
        engine.sequence.attach(frozen)
    return Reference("sharded" if engine.shards_weights else "copy", frozen)


def reference_source(policy: ModelSource, ref_model: str | None = None, ref_adapters: tuple[str, ...] = (),
                     ref_quantization_bit: int | None = None) -> ModelSource:
    """Where the frozen reference loads from: the policy's source (the same weights: earlier adapters merged,
    vocabulary grown), or ``ref_model`` with its own adapters merged and quantization; either way nothing set up
    for training (no LoRA, gradient checkpointing or NEFTune noise)."""
    frozen = FinetuningSettings(finetuning_type="frozen")
    if ref_model is None:
        return dataclasses.replace(policy, finetuning=frozen)
    return dataclasses.replace(policy, name_or_path=ref_model, finetuning=frozen,
                               adapters=AdapterPlan(to_merge=ref_adapters), quantization_bit=ref_quantization_bit,
                               vocab=None)


def rows(batch: Batch, start: int, stop: int) -> dict[str, Any]:
    """The model inputs of rows [start, stop) of a padded batch (with the pixel inputs of those rows' images)."""
    pixels = image_inputs_of_rows(batch, start, stop) if "pixel_values" in batch else {}
    return {**{k: v[start:stop] for k, v in batch.items()
               if k in MODEL_INPUTS and k not in pixels and isinstance(v, torch.Tensor)}, **pixels}


def rows_scope(engine: Engine, batch: Batch, start: int, stop: int) -> contextlib.AbstractContextManager:
    """Around a forward of rows [start, stop) and its backward under sequence parallelism: those rows' segment spans,
    which the split attention reads to know what each token attends to (nothing without a split)."""
    if engine.sequence is None:
        return contextlib.nullcontext()
    return engine.sequence.scope(spans_of(batch, start, stop))


def row_logps(engine: Engine, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of ``targets`` (shifted labels, -100 for none) and their count; under
    sequence parallelism the sums over the group's slices, the same on each of its ranks."""
    summed, lengths = target_logps(logits, targets)
    if engine.sequence is None:
        return summed, lengths
    return engine.sequence.sum_over_group(summed), engine.sequence.sum_over_group(lengths)


def global_pairs(engine: Engine, window: list[Batch]) -> torch.Tensor:
    """The pairs (kto: answers) of the window over all ranks, each counted once: the ranks of a sequence group hold
    the same pairs."""
    summed = engine.all_reduce_sum(torch.tensor(float(sum(b["pairs"] for b in window)), device=engine.device))
    return summed / engine.sequence.size if engine.sequence is not None else summed


@dataclass
class PreferenceObjective:
    """The dpo or kto objective the loop calls instead of the token loss."""

    stage: str
    settings: PreferenceSettings
    reference: Reference

    @property
    def metric_keys(self) -> tuple[str, ...]:
        if self.stage == "kto":
            return KTO_METRICS
        return PAIR_METRICS + (ORPO_METRICS if self.settings.loss == "orpo" else ())

    def train_step(self, engine: Engine, window: list[Batch], max_grad_norm: float) -> dict[str, float]:
        """Forward/backward every micro-batch of one window, one optimizer step; metrics averaged over all pairs."""
        window = [to_device(rank_rows(engine, b), engine.device) for b in window]
        pairs = global_pairs(engine, window)
        denominator = torch.clamp(pairs, min=1.0)
        kl = self.window_kl(engine, window) if self.stage == "kto" else None
        totals = MetricTotals(self.metric_keys, engine.device)
        for i, batch in enumerate(window):
            with rows_scope(engine, batch, 0, self.scored_rows(batch)):
                reference = self.reference_logps(engine, batch)
                with engine.accumulation_context(is_last_micro_batch=i == len(window) - 1), engine.autocast():
                    out = self.batch_losses(engine, batch, reference, kl)
                engine.backward(out.losses.sum() * engine.loss_scale_for_mean_reduction / denominator)
            totals.add(out)
        grad_norm = engine.step(max_grad_norm)
        found = totals.reduced(engine)
        counts = engine.all_reduce_sum(torch.tensor(
            [float(sum(count_input_tokens(b) for b in window)), float(sum(b["input_ids"].numel() for b in window))],
            device=engine.device))
        return {**found, "grad_norm": grad_norm, "tokens": float(counts[0]),
                "slots": float(counts[1]), "trainable_tokens": float(pairs)}

    @torch.no_grad()
    def evaluate(self, engine: Engine, batches: Iterable[Batch]) -> dict[str, float]:
        """Mean per-pair loss and metrics over the eval data, over all ranks."""
        engine.model.eval()
        totals = MetricTotals(self.metric_keys, engine.device)
        for batch in batches:
            batch = to_device(rank_rows(engine, batch), engine.device)
            kl = self.window_kl(engine, [batch]) if self.stage == "kto" else None
            with rows_scope(engine, batch, 0, self.scored_rows(batch)), engine.autocast():
                totals.add(self.batch_losses(engine, batch, self.reference_logps(engine, batch), kl))
        engine.model.train()
        return totals.reduced(engine)

    def reference_logps(self, engine: Engine, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Reference log-probabilities of the rows the loss compares (dpo: all; kto: the answers)."""
        if self.reference.kind == "none":
            return None
        if self.reference.kind == "precomputed":
            table = batch["ref_logps"].to(torch.float32)
            summed = table[:, 0] if self.stage == "kto" else torch.cat([table[:, 0], table[:, 1]])
            return summed, summed.new_zeros(summed.shape)  # lengths: the policy's are the same rows'
        stop = self.scored_rows(batch)
        return self.reference.logps(engine, rows(batch, 0, stop), targets_of(batch)[:stop])

    def scored_rows(self, batch: Batch) -> int:
        """How many rows, from the first, the loss compares: both rows of each pair (dpo), the answers (kto)."""
        return int(batch["pairs"]) * (1 if self.stage == "kto" else 2)

    def batch_losses(self, engine: Engine, batch: Batch, reference: tuple[torch.Tensor, torch.Tensor] | None,
                     kl: torch.Tensor | None) -> LossOutput:
        n = int(batch["pairs"])  # the collator's count of pairs (an int in the batch dict)
        stop = self.scored_rows(batch)
        logits = engine.model(**rows(batch, 0, stop), use_cache=False).logits
        summed, lengths = row_logps(engine, logits, targets_of(batch)[:stop])
        if self.stage == "kto":
            assert reference is not None and kl is not None
            return kto_losses(self.settings, summed, reference[0], batch["kto_tag"], kl)
        policy = PairLogps(summed[:n], summed[n:], lengths[:n], lengths[n:])
        ref = None if reference is None else PairLogps(reference[0][:n], reference[0][n:], lengths[:n], lengths[n:])
        return preference_loss(self.settings, policy, ref)

    def window_kl(self, engine: Engine, window: list[Batch]) -> torch.Tensor:
        """KTO's reference point: the mean log-ratio of every rank's KL rows in the window, clamped at 0 (under
        sequence parallelism each rank of a group adds the whole rows' values and their count: the mean is the
        same)."""
        total = torch.zeros(2, device=engine.device, dtype=torch.float64)
        for batch in window:
            n, end = int(batch["pairs"]), batch["input_ids"].shape[0]
            inputs, targets = rows(batch, n, end), targets_of(batch)[n:end]
            with torch.no_grad(), rows_scope(engine, batch, n, end):
                with engine.autocast():
                    policy, _ = row_logps(engine, engine.model(**inputs, use_cache=False).logits, targets)
                if self.reference.kind == "precomputed":
                    reference = batch["ref_logps"][:, 1].to(policy.dtype)
                else:
                    reference, _ = self.reference.logps(engine, inputs, targets)
            total += torch.stack([(policy - reference).sum().double(), torch.tensor(float(n), device=engine.device,
                                                                                    dtype=torch.float64)])
        total = engine.all_reduce_sum(total)
        return (total[0] / torch.clamp(total[1], min=1.0)).clamp(min=0).float()


class MetricTotals:
    """Sums and counts of the loss and each metric over a window, reduced over ranks in one call."""

    def __init__(self, keys: tuple[str, ...], device: torch.device) -> None:
        self.keys = ("loss", *keys)
        self.sums = torch.zeros(2 * len(self.keys), device=device, dtype=torch.float64)

    def add(self, out: LossOutput) -> None:
        values = {"loss": out.losses.detach(), **out.metrics}
        for i, key in enumerate(self.keys):
            value = values[key].detach().double().reshape(-1)
            self.sums[2 * i] += value.sum()
            self.sums[2 * i + 1] += value.numel()

    def reduced(self, engine: Engine) -> dict[str, float]:
        summed = engine.all_reduce_sum(self.sums).tolist()
        return {key: summed[2 * i] / max(summed[2 * i + 1], 1.0) for i, key in enumerate(self.keys)}


def precomputed_reference_logps(engine: Engine, dataset: Any, collate: Any,
                                batch_size: int, finetuning_type: str) -> list[list[float]]:
    """The reference's log-probabilities of both rows of every sample of ``dataset`` ([chosen, rejected], kto:
    [answer, KL row]), scored by the policy before its first step (LoRA: with its adapters off).

    Data-parallel group g scores samples g, g + groups, ... (the ranks of a sequence group each their slice of the
    same rows, the first of them writing the sums); every rank runs the same number of forwards (a sharding engine
    gathers weights collectively), the last ones on a repeated sample whose result is dropped; one reduction
    gives every rank the whole table.
    """
    scorer = Reference("adapters_off" if is_adapter_type(finetuning_type) else "policy")
    size, groups = len(dataset), engine.data_parallel_size
    mine = list(range(engine.data_parallel_rank, size, groups))
    per_rank = -(-size // groups)
    writes = engine.sequence is None or engine.sequence.index == 0
    table = torch.zeros(size, 2, dtype=torch.float64, device=engine.device)
    engine.model.eval()
    for start in range(0, per_rank, batch_size):
        chunk = mine[start:start + batch_size]
        real = len(chunk)
        chunk = chunk + [0] * (min(batch_size, per_rank - start) - real)  # same number of rows on every rank
        batch = to_device(rank_rows(engine, collate([dataset[i] for i in chunk])), engine.device)
        end = batch["input_ids"].shape[0]
        with rows_scope(engine, batch, 0, end):
            summed, _ = scorer.logps(engine, rows(batch, 0, end), targets_of(batch))
        n = batch["pairs"]
        pairs = torch.stack([summed[:n], summed[n:2 * n]], dim=1).double()
        if real and writes:
            table[torch.tensor(chunk[:real], device=engine.device)] = pairs[:real]
    engine.model.train()
    return engine.all_reduce_sum(table).tolist()
