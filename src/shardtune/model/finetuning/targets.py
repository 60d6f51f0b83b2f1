"""Which layers an adapter (LoRA, OFT) wraps: ``lora_target`` / ``oft_target`` checked against the model, and the
targets refused by name (a router, a layer no adapter can wrap, a name the model lacks, fused experts under OFT)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardtune.config.adapter_method import METHOD_OF_TARGET_KEY
from shardtune.errors import ConfigError
from shardtune.model.finetuning.exclusions import refuse_unadaptable_targets, unadaptable_linears
from shardtune.model.finetuning.freeze import decoder_layer_prefixes, trainable_layer_ids
from shardtune.model.finetuning.image_text import excluded_modules
from shardtune.model.finetuning.settings import FinetuningSettings, FrozenParts
from shardtune.model.moe import fused_expert_parameters, router_module_names
from shardtune.model.reward_head import SCORE_LAYER


@dataclass(frozen=True)
class LoraTargets:
    """peft's ``target_modules`` (Linear layers) and ``target_parameters`` (fused expert weights, 3-D)."""

    modules: Any  # "all-linear" or a list of short module names
    parameters: list[str] | None = None  # like "experts.gate_up_proj"


def resolved_targets(model: Any, settings: FinetuningSettings) -> LoraTargets:
    """What the adapter wraps: ``lora_targets`` of the target key, checked against the model, LLaMA-Pro's blocks
    only when expanded; OFT wraps Linear layers only (no fused expert weights)."""
    key = settings.target_key
    available = linear_module_names(model, settings.frozen_parts)
    targets = lora_targets(model, settings.lora_target, settings.frozen_parts, key)
    if targets.modules != "all-linear":
        missing = [t for t in targets.modules if t not in available]
        if missing:
            raise ConfigError(f"{key}: {','.join(missing)} not found in the model; "
                              f"linear modules are: {','.join(available)}")
    if settings.finetuning_type == "oft" and targets.parameters:
        if "all" not in settings.lora_target:
            raise ConfigError(f"oft_target ({','.join(settings.lora_target)}): fused expert weights are no Linear "
                              "layers, which OFT rotates the input of; remove them (or use finetuning_type: lora)")
        print(f"[shardtune] oft_target (all): fused expert weights ({','.join(targets.parameters)}) are not "
              "adapted (OFT wraps Linear layers only)", flush=True)
        targets = replace(targets, parameters=None)
    if settings.llama_pro:
        targets = expanded_block_targets(model, targets, settings.freeze_trainable_layers)
    return targets


def lora_targets(model: Any, requested: tuple[str, ...], frozen: FrozenParts | None = None,
                 key: str = "lora_target") -> LoraTargets:
    """What ``lora_target`` adapts. A dense model's ``all`` is peft's "all-linear". On a mixture-of-experts model
    ``all`` is every Linear but the routers (attention, dense and shared-expert MLPs) plus the fused expert weights
    (3-D parameters, adapted with peft's ``target_parameters``), said in the run log; a router named explicitly is
    refused, a fused expert weight named explicitly (``gate_up_proj``, ``down_proj``) is adapted as a parameter.
    """
    routers = router_module_names(model)
    fused = sorted({name.rsplit(".", 1)[-1] for name in fused_expert_parameters(model)})
    linear = linear_module_names(model, frozen)
    unadaptable = unadaptable_linears(model, linear)
    if "all" not in requested:
        _refuse_router_targets(model, requested, routers, linear, key)
        refuse_unadaptable_targets(requested, unadaptable, key)
        chosen = [t for t in requested if t in linear or t not in fused]
        experts = [f"experts.{t}" for t in requested if t in fused and t not in linear]
        return LoraTargets(chosen, experts or None)
    if unadaptable:
        print(f"[shardtune] {key} (all): not adapted: "
              + "; ".join(f"{name} ({why})" for name, why in sorted(unadaptable.items())), flush=True)
    if not routers and not unadaptable:
        return LoraTargets("all-linear")
    if not routers:
        return LoraTargets([name for name in linear if name not in unadaptable])
    router_names = {name.rsplit(".", 1)[-1] for name in routers}
    chosen = [name for name in linear if name not in router_names and name not in unadaptable]
    print(f"[shardtune] {key} (all) on a mixture-of-experts model: Linear layers {','.join(chosen)}"
          + (f", fused expert weights {','.join(fused)}" if fused else "")
          + f"; routers ({','.join(sorted(router_names))}) are not adapted", flush=True)
    return LoraTargets(chosen, [f"experts.{name}" for name in fused] or None)


def linear_module_names(model: Any, frozen: FrozenParts | None = None) -> list[str]:
    """Short names of the Linear layers LoRA can adapt (the output head or a reward model's score excluded; with
    ``frozen``, those of an image-text model's frozen parts too)."""
    import torch

    left_out = set(excluded_modules(model, frozen)) if frozen is not None else set()
    names = {short_module_name(name) for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and "lm_head" not in name and name != SCORE_LAYER
             and name not in left_out}
    return sorted(names)


def short_module_name(name: str) -> str:
    """The name peft matches a target against: the last part, with its list's name where that part is an index
    (Gemma 3n's ``altup_projections.0``; a bare ``0`` would match every first decoder layer too)."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def _refuse_router_targets(model: Any, requested: tuple[str, ...], routers: set[str], linear: list[str],
                           key: str) -> None:
    """A router named in ``lora_target`` that is not a Linear layer cannot be adapted: say so, by name."""
    router_names = {name.rsplit(".", 1)[-1] for name in routers}
    for target in requested:
        if target in router_names and target not in linear:
            raise ConfigError(f"{key} ({target}): it is the mixture-of-experts router, a "
                              f"{_module_class(model, routers, target)} rather than a Linear layer, which "
                              f"{METHOD_OF_TARGET_KEY[key]} cannot adapt; remove it (routers train with "
                              "finetuning_type: full)")


def _module_class(model: Any, names: set[str], short: str) -> str:
    modules = dict(model.named_modules())
    return next(type(modules[n]).__name__ for n in sorted(names) if n.rsplit(".", 1)[-1] == short)


def expanded_block_targets(model: Any, targets: LoraTargets, trainable_layers: int) -> LoraTargets:
    """LLaMA-Pro under LoRA: the targeted Linear layers of the expanded blocks only, by their full names."""
    import torch

    layers = decoder_layer_prefixes(model)
    blocks = tuple(layers[i] + "." for i in trainable_layer_ids(len(layers), trainable_layers, llama_pro=True))
    wanted = None if targets.modules == "all-linear" else set(targets.modules)
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
             and name.startswith(blocks) and (wanted is None or name.rsplit(".", 1)[-1] in wanted)]
    return replace(targets, modules=names)


def frozen_targets(model: Any, targets: LoraTargets, frozen: FrozenParts) -> list[str]:
    """The targeted Linear layers of an image-text model's frozen parts (its vision tower), which keep no adapter
    (as LLaMA-Factory leaves them out of every lora_target)."""
    return [name for name in excluded_modules(model, frozen)
            if targets.modules == "all-linear" or name.rsplit(".", 1)[-1] in targets.modules]


def report_unadapted_linears(model: Any, requested: LoraTargets, left_out: list[str]) -> None:
    """peft 0.21 rewrites the names of transformers v4's per-expert layers (``gate_proj``, ``up_proj``,
    ``down_proj``, ``w1``...) into the fused experts of MoE families it knows, so Linear layers of those names
    outside the experts (DeepSeek-V3's dense first layer and shared experts) lose their adapter: say which."""
    if requested.modules == "all-linear" or not requested.parameters:
        return
    import torch

    wanted, frozen = set(requested.modules), tuple(left_out)  # frozen: full names, under peft's prefix now
    # an adapted layer is a peft module, not a Linear
    missed = sorted({name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
                     and name.rsplit(".", 1)[-1] in wanted and not name.endswith(frozen)})
    if missed:
        print(f"[shardtune] lora_target: peft maps {','.join(sorted({n.rsplit('.', 1)[-1] for n in missed}))} to "
              f"the fused experts of this model type; {len(missed)} Linear layers of those names are not adapted "
              f"(e.g. {missed[0]})", flush=True)
