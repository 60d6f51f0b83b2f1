"""Read a mixture-of-experts checkpoint saved one expert at a time into transformers' fused expert weights.

transformers 5 builds Qwen3-MoE, Mixtral, DeepSeek-V3 (and others) with each sparse block's experts as two 3-D
parameters (``experts.gate_up_proj`` ``[experts, 2 x inter, hidden]``, ``experts.down_proj``), but checkpoints,
the hub's and those transformers' own ``save_pretrained`` writes, keep one Linear per expert
(``experts.3.gate_proj.weight``...). ``from_pretrained`` converts while loading; the sharding engines fill an
empty model tensor by tensor from the files (model/weights.py), so they need the same conversion: each fused tensor
is composed from its experts' tensors when it is read. The rules come from transformers' own conversion table
for the model type (``get_checkpoint_conversion_mapping``), not from a copy of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from shardtune.model.weights import WeightsReader


@dataclass
class FusedExpertsReader(WeightsReader):
    """A ``WeightsReader`` that also answers for fused expert tensors and renamed modules of the model."""

    # model name -> per expert (in order), the stored names concatenated along dim 0 (gate then up)
    composed: dict[str, list[list[str]]] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)  # model name -> stored name

    def __contains__(self, name: str) -> bool:
        return name in self.files or name in self.composed or name in self.renamed

    def read(self, name: str) -> torch.Tensor:
        if name in self.composed:
            experts = [torch.cat([super(FusedExpertsReader, self).read(part) for part in parts], dim=0)
                       for parts in self.composed[name]]
            return torch.stack(experts)
        return super().read(self.renamed.get(name, name))

    def read_slice(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.composed:
            return super().read_slice(self.renamed.get(name, name), offsets, shape)
        # Only the experts in the block are read (a rank's shard of the expert dimension), then narrowed.
        first, count = (offsets[0], shape[0]) if offsets else (0, len(self.composed[name]))
        experts = [torch.cat([super(FusedExpertsReader, self).read(part) for part in parts], dim=0)
                   for parts in self.composed[name][first:first + count]]
        block = torch.stack(experts)
        for dim in range(1, len(offsets)):
            block = block.narrow(dim, offsets[dim], shape[dim])
        return block


def with_fused_experts(weights: WeightsReader, model_type: str) -> WeightsReader:
    """``weights`` able to read the fused expert tensors of ``model_type`` from per-expert files; unchanged when
    transformers has no conversion for that type or the files already hold the fused layout."""
    rules = _conversion_rules(model_type)
    if not rules:
        return weights
    renames, converters = rules
    composed: dict[str, dict[int, dict[int, str]]] = {}
    renamed: dict[str, str] = {}
    for stored in weights.files:
        name = stored
        for source, target in renames:
            name = name.replace(source, target)
        if name != stored:
            renamed[name] = stored
        for patterns, target in converters:
            for index, pattern in enumerate(patterns):
                match = pattern.search(name)
                if match:
                    fused = name[:match.start()] + target + name[match.end():]
                    composed.setdefault(fused, {}).setdefault(int(match.group(1)), {})[index] = stored
    if not composed and not renamed:
        return weights
    ordered = {name: [[parts[i] for i in sorted(parts)] for _, parts in sorted(experts.items())]
               for name, experts in composed.items()}
    return FusedExpertsReader(weights.folder, weights.files, weights.bytes_read, ordered, renamed)


def _conversion_rules(model_type: str) -> tuple[list[tuple[str, str]], list[tuple[list[re.Pattern], str]]] | None:
    """transformers' renamings (substring -> substring) and expert-merging converters (source patterns with ``*``
    for the expert index -> fused target) for ``model_type``."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    mapping = get_checkpoint_conversion_mapping(model_type)
    if not mapping:
        return None
    renames, converters = [], []
    for rule in mapping:
        sources, targets = list(rule.source_patterns), list(rule.target_patterns)
        if type(rule).__name__ == "WeightRenaming" and len(sources) == len(targets) == 1:
            renames.append((sources[0], targets[0]))
        elif type(rule).__name__ == "WeightConverter" and len(targets) == 1 and all("*" in s for s in sources) \
                and _stacks_experts(rule):
            converters.append(([re.compile(re.escape(s).replace(r"\*", r"(\d+)")) for s in sources], targets[0]))
    return renames, converters


def _stacks_experts(rule: object) -> bool:
    """The converter stacks the experts (dim 0) and, for several sources, concatenates them after (dim 1): the
    composition ``read`` does. Another operation is left alone (its tensors are then missing, and said so)."""
    operations = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(rule, "operations", [])]
    return operations in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])
