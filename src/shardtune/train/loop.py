"""The training loop: engine-agnostic, token-normalised gradient accumulation.

Each optimizer step consumes one *window* of ``gradient_accumulation_steps`` micro-batches. The loss of
every micro-batch is its summed token loss divided by the number of trainable tokens in the whole window
across all ranks, so accumulation gives exactly the update of one big batch (no average of averages).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from shardtune.engines.base import Engine
from shardtune.train.loss import DEFAULT_LOSS_CHUNK_SIZE, Anchor, TokenWeighting, causal_lm_loss_terms
from shardtune.train.sequence_shards import sequence_shard, spans_of

IGNORE_INDEX = -100
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                "max_length_k", "pixel_values", "image_grid_thw", "image_position_ids", "mm_token_type_ids",
                "token_type_ids")  # from pixel_values on: images (data/images.py)
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LoopSettings:
    total_steps: int
    steps_per_epoch: int
    gradient_accumulation_steps: int
    max_grad_norm: float = 1.0
    logging_steps: int = 10
    logging_first_step: bool = False
    save_steps: int | None = None
    save_each_epoch: bool = False
    eval_steps: int | None = None
    eval_each_epoch: bool = False
    loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE
    label_smoothing: float = 0.0
    token_weighting: TokenWeighting | None = None  # use_dft_loss / use_eaft_loss / use_asft_loss (train/loss.py)
    anchor: AnchorSource | None = None  # use_asft_loss: the frozen reference's KL term (train/anchor.py)
    router_aux_loss_coef: float | None = None  # MoE: add coef x the router's auxiliary loss (model/moe.py)
    # A preference stage's step (train/preference_step.py) in place of the token loss; None for sft and pt.
    objective: Objective | None = None


class Objective(Protocol):
    """A training objective other than the token loss: one window's step, and the eval metrics ("loss" and more)."""

    def train_step(self, engine: Engine, window: list[Batch], max_grad_norm: float) -> dict[str, float]: ...
    def evaluate(self, engine: Engine, batches: Iterable[Batch]) -> dict[str, float]: ...


@runtime_checkable
class KeepsCheckpointState(Protocol):
    """An objective with state of its own that a checkpoint carries beside the engine's (grpo: the rollouts of a
    window whose repeats are not all done): files by name for this rank, and their restore on resume."""

    def checkpoint_files(self, engine: Engine) -> dict[str, Any]: ...
    def restore_from(self, engine: Engine, checkpoint: Path) -> None: ...


class AnchorSource(Protocol):
    """ASFT's reference: its next-token distribution at a micro-batch's trainable positions (train/anchor.py)."""

    def anchor(self, engine: Engine, batch: Batch) -> Anchor: ...


@dataclass
class TrainState:
    """Progress that a checkpoint must restore (written as trainer_state.json)."""

    global_step: int = 0
    epoch: float = 0.0
    tokens_seen: int = 0  # non-padding input tokens, summed over ranks
    slots_seen: int = 0  # input token positions, padding included
    loss_history: list[dict[str, float]] = field(default_factory=list)
    interrupted: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def input_tokens_seen(self, which: str) -> int | None:
        """``include_num_input_tokens_seen``'s count: all positions, non-padding tokens, or None for no."""
        return {"all": self.slots_seen, "non_padding": self.tokens_seen}.get(which)


class LoopHooks(Protocol):
    """What the loop reports to; implemented by the workflow (logging, checkpoints, eval)."""

    def on_step(self, state: TrainState, metrics: dict[str, float]) -> None: ...
    def on_log(self, state: TrainState, metrics: dict[str, float]) -> None: ...
    def on_save(self, state: TrainState) -> None: ...
    def on_evaluate(self, state: TrainState) -> None: ...
    def should_stop(self) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it at the same step)."""

    def stop_requested(self) -> bool:
        """Whether this rank was asked to stop (no collective; the token loss's step reduces it with its numbers)."""


def token_loss_sum(model: torch.nn.Module, batch: Batch, chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
                   label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross entropy over trainable positions, and how many there were.

    ``chunk_size`` > 0 never builds the full logits (shardtune.train.loss); 0 computes them whole.
    """
    loss, _ = micro_batch_losses(model, batch, chunk_size, label_smoothing, False)
    return loss, (targets_of(batch) != IGNORE_INDEX).sum()


def targets_of(batch: Batch) -> torch.Tensor:
    """Each position's next token: the labels shifted, or a sequence-parallel slice's ``shift_labels`` (shifted
    over the whole row before slicing)."""
    return batch["shift_labels"] if "shift_labels" in batch else batch["labels"][:, 1:]


def count_trainable_tokens(batch: Batch) -> int:
    return int((targets_of(batch) != IGNORE_INDEX).sum())


def count_input_tokens(batch: Batch) -> int:
    """Non-padding tokens in a batch (the collator counts them; packed rows have no 2-D mask)."""
    if "num_tokens" in batch:
        return int(batch["num_tokens"])
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return int(mask.sum())
    return batch["input_ids"].numel()


def rank_rows(engine: Engine, batch: Batch) -> Batch:
    """The micro-batch as this rank computes it: its slice of every row under sequence parallelism."""
    if engine.sequence is None:
        return batch
    return sequence_shard(batch, engine.sequence.size, engine.sequence.index)


def sequence_scope(engine: Engine, batch: Batch) -> contextlib.AbstractContextManager:
    """Around one micro-batch's forward and backward: the whole rows' segment spans for the split attention."""
    if engine.sequence is None:
        return contextlib.nullcontext()
    return engine.sequence.scope(spans_of(batch))


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Tensors to the device; plain values (flash-attention lengths) stay as they are."""
    return {k: _to_device(v, device) for k, v in batch.items()}


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, dict):  # packed rows of models with local and global layers: one mask per layer type
        return {k: _to_device(v, device) for k, v in value.items()}
    return value.to(device) if isinstance(value, torch.Tensor) else value


def accumulation_windows(batches: Iterable[Batch], size: int) -> Iterator[list[Batch]]:
    window: list[Batch] = []
    for batch in batches:
        window.append(batch)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def train_step(engine: Engine, window: list[Batch], max_grad_norm: float,
               loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE, label_smoothing: float = 0.0,
               router_aux_loss_coef: float | None = None, stop_requested: bool = False,
               token_weighting: TokenWeighting | None = None, anchor: AnchorSource | None = None
               ) -> dict[str, float]:
    """Forward/backward every micro-batch of one window, then one optimizer step; ``anchor``: ASFT's reference
    scores each micro-batch before the policy's forward.

    Two collectives besides the engine's own: the window's trainable-token count before the first backward, and
    one reduction after the step of everything the step reports, with whether any rank was asked to stop
    (``stop`` in the result). The numbers are read from the device once, at the end.
    """
    window = [rank_rows(engine, b) for b in window]
    local_tokens = sum(count_trainable_tokens(b) for b in window)
    arrived = time.perf_counter()
    global_tokens = engine.all_reduce_sum(torch.tensor(float(local_tokens), device=engine.device))
    # On the CPU the reduction blocks until every rank arrived: the wait for slower ranks (the rank log's wait_s).
    sync_seconds = time.perf_counter() - arrived
    # max(…, 1): a window whose samples are all masked must not divide by zero.
    denominator = torch.clamp(global_tokens, min=1.0)
    # The router's auxiliary loss is a mean over one micro-batch's tokens (transformers adds coef x it to each
    # micro-batch's mean loss): the step's term is its mean over every micro-batch of every rank.
    aux_share = 1.0 / (len(window) * engine.world_size)
    loss_total = torch.zeros((), device=engine.device)
    aux_total = torch.zeros((), device=engine.device)
    for i, batch in enumerate(window):
        batch = to_device(batch, engine.device)
        with sequence_scope(engine, batch):
            anchored = anchor.anchor(engine, batch) if anchor is not None else None
            with engine.accumulation_context(is_last_micro_batch=i == len(window) - 1), engine.autocast():
                loss_sum, aux = micro_batch_losses(engine.model, batch, loss_chunk_size, label_smoothing,
                                                   router_aux_loss_coef is not None, token_weighting, anchored)
            loss = loss_sum * engine.loss_scale_for_mean_reduction / denominator
            if aux is not None and router_aux_loss_coef is not None:
                loss = loss + aux * (router_aux_loss_coef * aux_share * engine.loss_scale_for_mean_reduction)
                aux_total += aux.detach() * aux_share
            engine.backward(loss)
        loss_total += loss_sum.detach()
        # The graph, the loss head's gradient buffers and the anchor go before the next forward.
        del loss, loss_sum, aux, anchored
    grad_norm = engine.step_on_device(max_grad_norm)
    # The loss, non-padding tokens and computed token slots (rows x padded length) and the stop flags, summed over
    # ranks in one call; then everything read from the device at once.
    local_input_tokens = float(sum(count_input_tokens(b) for b in window))
    counts = torch.tensor([local_input_tokens, float(sum(b["input_ids"].numel() for b in window)),
                           float(stop_requested)], device=engine.device)
    summed = engine.all_reduce_sum(torch.cat([torch.stack([loss_total.float(), aux_total.float()]), counts]))
    loss_sum_all, aux_loss, tokens, slots, stops, trainable, norm = torch.cat(
        [summed, global_tokens.reshape(1).float(), grad_norm.to(summed.device).reshape(1)]).tolist()
    metrics = {"loss": loss_sum_all / max(trainable, 1.0), "grad_norm": norm, "tokens": tokens, "slots": slots,
               "trainable_tokens": trainable, "local_tokens": local_input_tokens, "sync_seconds": sync_seconds,
               "stop": stops}
    if router_aux_loss_coef is not None:
        metrics.update(loss=metrics["loss"] + router_aux_loss_coef * aux_loss, aux_loss=aux_loss)
    return metrics


def micro_batch_losses(model: torch.nn.Module, batch: Batch, chunk_size: int, label_smoothing: float,
                       router_aux: bool, weighting: TokenWeighting | None = None, anchor: Anchor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The summed token loss of one micro-batch and, for an MoE model, its router auxiliary loss."""
    inputs = {k: v for k, v in batch.items() if k in MODEL_INPUTS}
    shifted = "shift_labels" in batch
    labels = batch["shift_labels"] if shifted else batch["labels"]
    return causal_lm_loss_terms(model, inputs, labels, chunk_size, label_smoothing, router_aux, shifted, weighting,
                                anchor)


@torch.no_grad()
def evaluate(engine: Engine, batches: Iterable[Batch], loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
             label_smoothing: float = 0.0) -> float:
    """Mean token loss over the eval data, summed over ranks (smoothed as in training, as the HF Trainer does)."""
    engine.model.eval()
    total = torch.zeros((), device=engine.device)
    tokens = torch.zeros((), device=engine.device)
    for batch in batches:
        batch = to_device(rank_rows(engine, batch), engine.device)
        with sequence_scope(engine, batch), engine.autocast():
            loss_sum, n = token_loss_sum(engine.model, batch, loss_chunk_size, label_smoothing)
        total += loss_sum.float()
        tokens += n
    engine.model.train()
    total, tokens = engine.all_reduce_sum(total), engine.all_reduce_sum(tokens.float())
    return float(total / torch.clamp(tokens, min=1.0))


def run_loop(engine: Engine, epoch_batches: Callable[[int, int], Iterable[Batch]], s: LoopSettings,
             state: TrainState, hooks: LoopHooks) -> TrainState:
    """Train until ``s.total_steps``. ``epoch_batches(epoch, skip)``: that epoch's micro-batches from number
    ``skip`` on; a run resumed mid-epoch asks for the ones after the windows already done (every window but an
    epoch's last holds gradient_accumulation_steps micro-batches)."""
    engine.model.train()
    interval: list[dict[str, float]] = []
    while state.global_step < s.total_steps:
        epoch = state.global_step // s.steps_per_epoch
        done_in_epoch = state.global_step - epoch * s.steps_per_epoch
        batches = epoch_batches(epoch, done_in_epoch * s.gradient_accumulation_steps)
        windows = accumulation_windows(batches, s.gradient_accumulation_steps)
        fetch_started = time.perf_counter()
        for index, window in enumerate(windows, start=done_in_epoch):
            data_seconds = time.perf_counter() - fetch_started
            if s.objective is not None:
                metrics = s.objective.train_step(engine, window, s.max_grad_norm)
                stop = hooks.should_stop()
            else:
                metrics = train_step(engine, window, s.max_grad_norm, s.loss_chunk_size, s.label_smoothing,
                                     s.router_aux_loss_coef, hooks.stop_requested(), s.token_weighting, s.anchor)
                stop = metrics.pop("stop") > 0
            metrics["data_seconds"] = data_seconds  # waiting for this window's batches
            state.global_step += 1
            state.epoch = epoch + (index + 1) / s.steps_per_epoch
            state.tokens_seen += int(metrics["tokens"])
            state.slots_seen += int(metrics["slots"])
            interval.append(metrics)
            hooks.on_step(state, metrics)
            end_of_epoch = index + 1 == s.steps_per_epoch
            saved = _after_step(state, s, hooks, interval, end_of_epoch)
            if state.global_step >= s.total_steps:
                break
            if stop:
                state.interrupted = True
                if (s.save_steps or s.save_each_epoch) and not saved:
                    hooks.on_save(state)  # a stop (Ctrl-C, preemption) always leaves this step's checkpoint
                return state
            fetch_started = time.perf_counter()
    return state


def _after_step(state: TrainState, s: LoopSettings, hooks: LoopHooks, interval: list[dict[str, float]],
                end_of_epoch: bool) -> bool:
    """Log, evaluate and save as due after this step; whether it saved a checkpoint."""
    step, last = state.global_step, state.global_step >= s.total_steps
    if step % s.logging_steps == 0 or last or (step == 1 and s.logging_first_step):
        hooks.on_log(state, _interval_metrics(interval))
        interval.clear()
    if (s.eval_steps and step % s.eval_steps == 0) or (s.eval_each_epoch and end_of_epoch):
        hooks.on_evaluate(state)
    if (s.save_steps and step % s.save_steps == 0) or (s.save_each_epoch and end_of_epoch):
        hooks.on_save(state)
        return True
    return False


def _interval_metrics(interval: list[dict[str, float]]) -> dict[str, float]:
    trainable = sum(m["trainable_tokens"] for m in interval)
    loss = sum(m["loss"] * m["trainable_tokens"] for m in interval) / max(trainable, 1.0)
    found = {"loss": loss, "grad_norm": interval[-1]["grad_norm"], "tokens": sum(m["tokens"] for m in interval)}
    if "aux_loss" in interval[-1]:
        found["aux_loss"] = sum(m["aux_loss"] for m in interval) / len(interval)
    for key in interval[-1]:  # a preference objective's metrics (rewards/..., logps/..., kl), weighted as the loss
        if key not in STEP_METRICS:
            found[key] = sum(m[key] * m["trainable_tokens"] for m in interval) / max(trainable, 1.0)
    return found


# What every step reports; anything else comes from an objective and is averaged into the logged metrics.
STEP_METRICS = ("loss", "grad_norm", "tokens", "slots", "trainable_tokens", "aux_loss", "local_tokens",
                "sync_seconds", "data_seconds")


def steps_per_epoch(num_micro_batches: int, gradient_accumulation_steps: int) -> int:
    return max(1, math.ceil(num_micro_batches / gradient_accumulation_steps))


def total_training_steps(per_epoch: int, num_train_epochs: float, max_steps: int) -> int:
    return max_steps if max_steps > 0 else max(1, math.ceil(per_epoch * num_train_epochs))
