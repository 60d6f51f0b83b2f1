"""``torch_compile``: regional compilation, one ``torch.compile`` per decoder layer.

Why per layer and not the whole model: the model's own code around the layers (the causal-mask builder, the
embedding, the loss head shardtune replaces for the chunked loss) branches on Python values and would break the
graph or recompile; a decoder layer is the same code for every layer and every step, so its graphs compile once
and are reused (as torchtitan and accelerate's regional compilation do). ``Module.compile`` compiles in place:
the layer keeps its name and parameters, so state dicts, checkpoints and the engines' wrapping see the same model,
and FSDP2's hooks (which torch keeps out of the graph) run around the compiled code. The engines wrap afterwards
(FSDP2: compile, then ``fully_shard``). Compilation is lazy: the first steps pay it, and ``CompileReport`` says
how long it took and whether anything compiled again after step 2. What the layers receive keeps one form from
step to step: sizes are symbolic, and right-padded rows come without a padding mask where that computes the same
loss (data/collator.py's ``unmasked_padding``), so a batch with a padded row does not bring a mask that the
batches before it lacked (transformers' sdpa path branches on ``attention_mask is None``). Under sequence
parallelism the split attention runs outside the graphs (engines/sequence_parallel.py ``split_attention``): its
loop follows each micro-batch's packed layout, which a graph would be compiled again for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# Graphs are compiled by the end of the second step; any compiled later is counted (CompileReport) as a recompile.
SETTLED_AFTER_STEP = 2


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: modules of the classes in ``_no_split_modules`` (what FSDP wraps)."""
    get_base_model = getattr(model, "get_base_model", None)  # peft's wrapper: the class list is on its base
    base = get_base_model() if get_base_model is not None else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_regional_compile(model: torch.nn.Module, mode: str | None, backend: str) -> int:
    """Compile every decoder layer in place; returns how many. A model without known layers is refused."""
    layers = decoder_layers(model)
    if not layers:
        from shardtune.errors import ModelError

        raise ModelError("torch_compile: the model names no decoder-layer class (_no_split_modules), so shardtune "
                         "cannot compile it layer by layer; set torch_compile: false")
    for layer in layers:
        # Symbolic sizes from the first compile: micro-batches differ in length (unpacked rows) and the epoch's last
        # holds fewer rows; torch's automatic dynamic shapes would compile again at each new kind of change (one
        # more graph when the last micro-batch first comes, long after the first steps). One graph serves them all.
        layer.compile(mode=mode, backend=backend, dynamic=True)
    return len(layers)


def compiled_graphs() -> int:
    """Graphs torch.compile has produced in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_seconds() -> float:
    """Seconds spent compiling in this process so far (tracing, AOT autograd and code generation)."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))


@dataclass
class CompileReport:
    """What ``torch_compile`` cost: layers compiled, graphs, seconds, and graphs compiled after the shapes settled."""

    layers: int
    mode: str | None
    backend: str
    graphs_at_settle: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def on_step(self, step: int) -> None:
        if step == SETTLED_AFTER_STEP:
            self.graphs_at_settle = compiled_graphs()

    def summary(self) -> dict[str, Any]:
        graphs = compiled_graphs()
        settled = self.graphs_at_settle
        return {"layers": self.layers, "mode": self.mode or "default", "backend": self.backend, "graphs": graphs,
                "compile_seconds": round(compile_seconds(), 2),
                "recompiles_after_step_2": None if settled is None else graphs - settled}

    def line(self) -> str:
        s = self.summary()
        after = "" if s["recompiles_after_step_2"] is None else f", {s['recompiles_after_step_2']} after step 2"
        return (f"[shardtune] torch_compile: {s['layers']} decoder layers compiled ({s['backend']}, mode "
                f"{s['mode']}): {s['graphs']} graphs in {s['compile_seconds']:.1f} s{after}")
