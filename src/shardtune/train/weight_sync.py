"""The streamed weight sync of a generator that keeps its own copy of the weights (the vLLM back-end's protocol).

After each optimizer step every rank walks the same sync units in the same order (``sync_units``: each module that
owns parameters, a LoRA layer with its base and adapters as one), and the engine hands each unit's whole tensors
(``Engine.gathered_weights``: a per-unit collective under ZeRO-3 and FSDP2, the weights as they are otherwise).
Rank 0 turns them into the checkpoint's tensors, under the names ``save_pretrained`` writes (peft's, FSDP's and
activation checkpointing's prefixes stripped), cast to the generator's dtype, and streams them in buckets of at most
``bucket_bytes`` (full tensor bytes) to a ``WeightReceiver``; the other ranks only take part in the gathers. A
tensor as large as a bucket goes alone, straight from the gathered storage (no copy), before its gather ends. So
the sync holds at most one unit's gathered tensors and one bucket: below twice the largest unit once
``bucket_bytes`` is below it (a LoRA layer adds its merged weight: see below).

LoRA sends the merged weight of each adapted layer (base + scaling x B @ A, peft's merge, computed from the
gathered unit): the generator holds a plain model under the base checkpoint's names and needs no LoRA support.
The merge needs one weight-sized tensor beside the gathered layer, so an adapted layer's peak is its unit plus its
merged weight (the adapters' bytes above twice the layer; the largest layer, the embedding or output layer, is
rarely adapted).

A real vLLM client implements ``WeightReceiver`` as TRL's ``VLLMClient`` does: ``load_weights`` is one
``update_named_params`` (the (name, dtype, shape) list first, then the tensors over the NCCL weight-update group;
colocated: ``model_runner.model.load_weights(list of (name, tensor))`` through ``collective_rpc``) and
``finish_weight_update`` is ``reset_prefix_cache``. train/protocol_generator.py is a CPU process that speaks it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shardtune.engines.base import Engine

DEFAULT_BUCKET_BYTES = 256 * 2**20  # vLLM's load_weights takes any count; a bucket bounds the bytes in flight

# Wrapper prefixes that save_pretrained never writes.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


class WeightReceiver(Protocol):
    """The generator's side of the sync (vLLM: see the module docstring)."""

    dtype: torch.dtype

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of whole tensors under the checkpoint's names."""

    def finish_weight_update(self) -> None:
        """Every bucket of this sync was sent: the generator may generate with the new weights."""


@dataclass
class SyncUnit:
    """Parameters gathered and sent together: one module's own, or a LoRA layer's base and adapters."""

    name: str
    params: list[tuple[str, torch.nn.Parameter]]  # names relative to the model
    lora: torch.nn.Module | None = None


@dataclass
class SyncReport:
    """What one sync did; ``peak_bytes``: the most bytes of tensors the sync held at once (a gathered unit, the
    tensors made from it, the bucket), measured on rank 0 from the tensors themselves."""

    tensors: int = 0
    buckets: int = 0
    bytes_sent: int = 0
    peak_bytes: int = 0
    largest_unit_bytes: int = 0
    seconds: float = 0.0
    names: list[str] = field(default_factory=list)


def is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def sync_units(model: torch.nn.Module) -> list[SyncUnit]:
    """The model's parameters in sync units, in module order (the same on every rank); tied weights once."""
    units: list[SyncUnit] = []
    seen: set[int] = set()
    claimed: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if claimed and name.startswith(claimed):
            continue
        if is_lora_layer(module):
            claimed += (f"{name}.",)
            params = [(f"{name}.{n}", p) for n, p in module.named_parameters()]
        else:
            params = [(f"{name}.{n}" if name else n, p) for n, p in module.named_parameters(recurse=False)]
        params = [(n, p) for n, p in params if id(p) not in seen]
        seen.update(id(p) for _, p in params)
        if params:
            units.append(SyncUnit(name, params, module if is_lora_layer(module) else None))
    return units


def checkpoint_name(name: str) -> str | None:
    """The name ``save_pretrained`` of the plain (merged) model writes for parameter ``name``; None for a tensor it
    does not write (a LoRA adapter, merged instead; peft's untrained copy of a module it trains whole)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    name = name.removeprefix("module.").removeprefix("base_model.model.")
    if ".lora_" in name or ".original_module." in name:
        return None
    name = name.replace(".base_layer.", ".")
    parts = name.split(".")
    if "modules_to_save" in parts:  # peft's trained copy: <module>.modules_to_save.<adapter>.<param>
        at = parts.index("modules_to_save")
        parts = parts[:at] + parts[at + 2:]
    return ".".join(parts)


def merged_lora_weight(layer: Any, base: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """``base`` plus each active adapter's scaling x B @ A, as peft's ``merge`` computes it (bit for bit: its delta
    is ``(B @ A) * scaling`` and IEEE addition commutes), from the unit's gathered tensors; a new tensor."""
    if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):  # off, or in base already
        return base.clone()
    merged: torch.Tensor | None = None
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if layer.use_dora.get(adapter) or layer.lora_bias.get(adapter) or base.dim() != 2:
            raise RuntimeError(f"weight sync: {type(layer).__name__} with DoRA, a LoRA bias or a weight of "
                               f"{base.dim()} dimensions has no merge here; use plain LoRA on linear layers")
        a, b = tensors[f"lora_A.{adapter}.weight"], tensors[f"lora_B.{adapter}.weight"]
        delta = (b @ a).mul_(layer.scaling[adapter])
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T.contiguous()
        merged = delta.add_(base) if merged is None else merged.add_(delta)
    return base.clone() if merged is None else merged


def unit_tensors(unit: SyncUnit, whole: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's names of one gathered unit's tensors, each with the tensor it is made from (a LoRA layer's
    base weight: merged with its adapters by ``checkpoint_tensor``)."""
    out: list[tuple[str, torch.Tensor]] = []
    for (param_name, _), tensor in zip(unit.params, whole, strict=True):
        name = checkpoint_name(param_name)
        if name is not None:
            out.append((name, tensor))
    return out


def checkpoint_tensor(unit: SyncUnit, whole: list[torch.Tensor], name: str, tensor: torch.Tensor,
                      dtype: torch.dtype, copy: bool) -> torch.Tensor:
    """The checkpoint's ``name`` as ``dtype``: ``tensor`` itself when it has that dtype and ``copy`` is off, else a
    new tensor; a LoRA layer's merged weight is always new (one tensor of its size; cast to another dtype, its
    merge too for the moment of the cast)."""
    if unit.lora is None or checkpoint_name(f"{unit.name}.base_layer.weight") != name:
        return tensor.to(dtype, copy=copy)
    prefix = f"{unit.name}."
    by_name = {n.removeprefix(prefix): t for (n, _), t in zip(unit.params, whole, strict=True)}
    merged = merged_lora_weight(unit.lora, tensor, by_name)
    return merged if merged.dtype == dtype else merged.to(dtype)


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.nelement() * t.element_size() for t in tensors)


class Bucket:
    """Tensors waiting to be sent; sent when the next one would pass ``limit`` bytes (a bigger one alone)."""

    def __init__(self, receiver: WeightReceiver, limit: int, report: SyncReport) -> None:
        self.receiver, self.limit, self.report = receiver, limit, report
        self.items: list[tuple[str, torch.Tensor]] = []
        self.bytes = 0

    def make_room(self, size: int) -> None:
        """Send what is waiting if ``size`` more bytes would pass the limit (before the next tensor is made)."""
        if self.items and self.bytes + size > self.limit:
            self.flush()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = nbytes([tensor])
        self.make_room(size)
        self.items.append((name, tensor))
        self.bytes += size
        self.report.names.append(name)

    def flush(self) -> None:
        if not self.items:
            return
        self.receiver.load_weights(self.items)
        self.report.buckets += 1
        self.report.tensors += len(self.items)
        self.report.bytes_sent += self.bytes
        self.items, self.bytes = [], 0


def sync_weights(engine: Engine, receiver: WeightReceiver | None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
                 ) -> SyncReport:
    """Stream the trained weights to ``receiver`` (rank 0's; None on the other ranks, which only join the gathers).
    A collective: every rank calls it after the same optimizer step, whatever it generated."""
    started = time.perf_counter()
    report = SyncReport()
    bucket = Bucket(receiver, bucket_bytes, report) if receiver is not None else None
    for unit in sync_units(engine.unwrapped_model()):
        with engine.gathered_weights([p for _, p in unit.params]) as whole:
            held = nbytes(whole)
            report.largest_unit_bytes = max(report.largest_unit_bytes, held)
            if bucket is None or receiver is None:
                continue
            for name, tensor in unit_tensors(unit, whole):
                size = tensor.nelement() * receiver.dtype.itemsize
                bucket.make_room(size)
                # A tensor that fills a bucket alone is sent from the gathered storage itself, before the gather
                # ends: a copy of the largest layer beside it would double the peak.
                sent = checkpoint_tensor(unit, whole, name, tensor, receiver.dtype, copy=size < bucket.limit)
                made = 0 if sent is tensor else nbytes([sent])
                report.peak_bytes = max(report.peak_bytes, held + bucket.bytes + made)
                bucket.add(name, sent)
                if bucket.bytes >= bucket.limit:
                    bucket.flush()
        if bucket is not None:
            report.peak_bytes = max(report.peak_bytes, bucket.bytes)
    if bucket is not None and receiver is not None:
        bucket.flush()
        receiver.finish_weight_update()
    engine.barrier()  # no rank generates before rank 0's generator holds the new weights
    report.seconds = time.perf_counter() - started
    return report


@dataclass
class WeightSync:
    """A run's sync: before its first rollout (the generator then holds the policy as loaded or resumed) and after
    every optimizer step. ``receiver``: rank 0's, None on the other ranks."""

    receiver: WeightReceiver | None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    started: bool = False
    keep: object = None  # what must live as long as the run (rank 0's generator process)

    def before_rollouts(self, engine: Engine) -> float:
        if self.started:
            return 0.0
        self.started = True
        return sync_weights(engine, self.receiver, self.bucket_bytes).seconds

    def after_step(self, engine: Engine) -> float:
        return sync_weights(engine, self.receiver, self.bucket_bytes).seconds
