"""Read a checkpoint's tensors under the names, and in the layout, of the model transformers builds for it.

transformers 5 converts many checkpoints while loading: regex renames (``block_sparse_moe.input_linear`` ->
``experts.gate_up_proj``), prefixes (an image-text checkpoint's ``language_model.*`` under ``model.``), experts
stacked into fused 3-D weights, projections concatenated (Kimi-Linear's q/k/v short convolutions) or split
(HRM's ``gqkv_proj``). ``from_pretrained`` does it for the replicating engines. The sharding engines (FSDP, ZeRO-3)
never load the model whole: they fill an empty skeleton tensor by tensor (model/source.py), so they read the files
through this reader, which applies the same conversion: transformers' own transforms for the model
(``get_model_conversion_mapping``), matched to the stored names by its own ``rename_source_key``, each converter
run by its own ``convert`` on the tensors it collects. Nothing of the table is re-implemented here.

A converted tensor is built from all of its sources, except where the converter's first operation stacks a list
along dim 0 (experts): a rank's block of experts is then built from those experts' tensors only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from shardtune.model.weights import WeightsReader


@dataclass
class Converted:
    """One converter applied to the stored tensors it matched: the model tensors it produces."""

    converter: Any  # transformers' WeightConverter (a template: each run uses a copy)
    layer_name: str  # the first target's full name, as transformers passes it to ``convert``
    sources: list[tuple[str, str]] = field(default_factory=list)  # (source pattern, stored name), in load order


@dataclass
class ConvertedReader(WeightsReader):
    """A ``WeightsReader`` that answers for the model's tensor names: renamed ones read from their stored name,
    converted ones built by their converter."""

    renamed: dict[str, str] = field(default_factory=dict)  # model name -> stored name
    converted: dict[str, Converted] = field(default_factory=dict)  # model name -> its converter run
    model: Any = None  # the empty model (converters may read its config)
    # The last run's outputs: a converter that splits one stored tensor in several (HRM's fused q/k/v) is read
    # once for all of them, as the engines read a layer's tensors one after the other.
    _last: tuple[int, tuple[int, int] | None, dict[str, torch.Tensor]] | None = field(default=None, repr=False)

    def __contains__(self, name: str) -> bool:
        return name in self.renamed or name in self.converted or name in self.files

    def read(self, name: str) -> torch.Tensor:
        if name in self.converted:
            return self._convert(self.converted[name], None)[name]
        return super().read(self.renamed.get(name, name))

    def read_slice(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.converted:
            return super().read_slice(self.renamed.get(name, name), offsets, shape)
        run = self.converted[name]
        stacked = bool(offsets) and _stacks_along_dim0(run.converter)
        block = self._convert(run, (offsets[0], shape[0]) if stacked else None)[name]
        for dim in range(1 if stacked else 0, len(offsets)):
            block = block.narrow(dim, offsets[dim], shape[dim])
        return block

    def _convert(self, run: Converted, rows: tuple[int, int] | None) -> dict[str, torch.Tensor]:
        """Run a copy of the converter on its sources (only list items ``rows`` = (first, count) when given)."""
        if self._last is not None and self._last[:2] == (id(run), rows):
            return self._last[2]
        converter = copy.deepcopy(run.converter)
        position: dict[str, int] = {}
        for pattern, stored in run.sources:
            index = position[pattern] = position.get(pattern, -1) + 1
            if rows is None or rows[0] <= index < rows[0] + rows[1]:
                converter.add_tensor(run.layer_name, stored, pattern, _reading(super().read, stored))
        config = getattr(self.model, "config", None)
        produced = converter.convert(run.layer_name, model=self.model, config=config)
        self._last = (id(run), rows, produced)
        return produced


def _reading(read: Any, stored: str) -> Any:
    return lambda: read(stored)


def _stacks_along_dim0(converter: Any) -> bool:
    """Whether the converter's first operation stacks its list of tensors along dim 0 (merges experts)."""
    operations = getattr(converter, "operations", [])
    return bool(operations) and type(operations[0]).__name__ == "MergeModulelist" and \
        getattr(operations[0], "dim", None) == 0


def converted_weights(weights: WeightsReader, model: Any) -> WeightsReader:
    """``weights`` answering with the names of ``model`` (an empty transformers model), converted as
    ``from_pretrained`` converts; unchanged when transformers has no conversion that touches these files."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [rule for rule in mapping if isinstance(rule, WeightRenaming)]
    converters = [rule for rule in mapping if isinstance(rule, WeightConverter)]
    by_pattern = {pattern: rule for rule in converters for pattern in rule.source_patterns}
    expected = model.state_dict()
    prefix: str = model.base_model_prefix
    renamed: dict[str, str] = {}
    runs: dict[str, Converted] = {}
    for stored in sorted(weights.files, key=dot_natural_key):
        name, pattern = rename_source_key(stored, renamings, converters, prefix, expected)
        if name not in expected and stored in expected:  # as transformers: the stored name was right after all
            name, pattern = rename_source_key(stored, [], [], prefix, expected)
        if name not in expected:
            continue
        if pattern is None:
            if name != stored:
                renamed[name] = stored
            continue
        run = runs.setdefault(name, Converted(by_pattern[pattern], name))
        run.sources.append((pattern, stored))
    if not renamed and not runs:
        return weights
    converted = {target: run for run in runs.values() for target in _targets(run)}
    return ConvertedReader(weights.folder, weights.files, weights.bytes_read, renamed, converted, model)


def _targets(run: Converted) -> list[str]:
    """The full names a converter run produces: the layer name with each target pattern in place of the first
    (as ``WeightConverter.convert`` names its outputs)."""
    patterns = list(run.converter.target_patterns)
    first = next((p for p in patterns if p in run.layer_name), None)
    if first is None:
        return [run.layer_name]
    before, _, after = run.layer_name.partition(first)
    return [before + pattern + after for pattern in patterns]
