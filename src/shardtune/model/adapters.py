"""Choose which parameters train: full, freeze (last N layers) or a peft adapter (LoRA, or OFT: model/oft.py)."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from shardtune.config.adapter_method import METHOD_OF_TARGET_KEY, target_key
from shardtune.errors import ConfigError
from shardtune.model.composite import FrozenParts, excluded_modules, freeze_parts, model_parts
from shardtune.model.lora_exclusions import refuse_unadaptable_targets, unadaptable_linears
from shardtune.model.moe import fused_expert_parameters, router_module_names
from shardtune.model.oft import OftSettings, build_oft_config, check_adapted_sizes, materialize_oft_weights
from shardtune.model.pretrained_adapters import load_adapter_weights, resumed_adapter_config
from shardtune.model.reward_head import SCORE_LAYER
from shardtune.model.vocab import embedding_module_names


@dataclass(frozen=True)
class FinetuningSettings:
    """The subset of the config that decides trainable parameters."""

    finetuning_type: str = "lora"
    lora_rank: int = 8
    lora_alpha: int | None = None
    lora_dropout: float = 0.0
    lora_target: tuple[str, ...] = ("all",)  # the adapter's targets: lora_target, or oft_target under OFT
    oft: OftSettings = OftSettings()
    freeze_trainable_layers: int = 2
    freeze_trainable_modules: tuple[str, ...] = ("all",)
    llama_pro: bool = False  # use_llama_pro: only the expanded blocks train (freeze) or get adapters (lora)
    gradient_checkpointing: bool = False
    checkpointing_kwargs: dict[str, Any] = field(default_factory=dict)  # torch.utils.checkpoint arguments
    is_quantized: bool = False
    resume_adapter: str | None = None  # a saved adapter that trains on (its own rank, alpha and targets)
    use_dora: bool = False
    use_rslora: bool = False
    pissa_init: bool = False
    pissa_iter: int = 16
    additional_target: tuple[str, ...] | None = None
    neftune_noise_alpha: float | None = None
    sequence_parallel: int = 1  # ranks sharing each row: the embedding sees 1/N of it, NEFTune's length is the row's
    train_embeddings: bool = False  # resize_vocab: LoRA trains and saves the embedding and output layer in full
    score_head: bool = False  # stage rm (set by ModelSource): the score layer trains in full under freeze and LoRA too
    frozen_parts: FrozenParts = FrozenParts()  # image-text models: the freeze_* keys (model/composite.py)

    @property
    def target_key(self) -> str:
        """The key that named the adapter's targets, for messages."""
        return target_key(self.finetuning_type)

    @property
    def init_lora_weights(self) -> bool | str:
        """peft's spelling of the initialisation: PiSSA with fast SVD (``pissa_niter_N``) or exact, else LoRA's."""
        if not self.pissa_init:
            return True
        return "pissa" if self.pissa_iter == -1 else f"pissa_niter_{self.pissa_iter}"


def checkpointing_kwargs(settings: FinetuningSettings) -> dict[str, Any]:
    """torch.utils.checkpoint's arguments: non-reentrant unless gradient_checkpointing_kwargs says otherwise."""
    return {"use_reentrant": False, **settings.checkpointing_kwargs}


def apply_finetuning(model: Any, settings: FinetuningSettings) -> Any:
    """Mark trainable parameters; for LoRA, return the peft-wrapped model."""
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(settings))
        model.config.use_cache = False
    if settings.finetuning_type == "full":
        model.requires_grad_(True)
    elif settings.finetuning_type == "frozen":  # a model that is never trained (a preference run's reference)
        model.requires_grad_(False)
    elif settings.finetuning_type == "freeze":
        apply_freeze(model, settings.freeze_trainable_layers, settings.freeze_trainable_modules, settings.llama_pro)
        if settings.score_head:
            model.get_submodule(SCORE_LAYER).requires_grad_(True)
        if settings.gradient_checkpointing:
            # Reentrant checkpointing drops the gradients of a block whose inputs need none (frozen layers before).
            model.enable_input_require_grads()
    else:
        model = apply_adapter(model, settings)
    _freeze_image_text_parts(model, settings.frozen_parts)
    if settings.neftune_noise_alpha is not None:
        # After peft: on the embedding the model really calls.
        apply_neftune(model, settings.neftune_noise_alpha, settings.sequence_parallel)
    return model


def _freeze_image_text_parts(model: Any, frozen: FrozenParts) -> None:
    named = freeze_parts(model, frozen)
    if named:
        print(f"[shardtune] image-text model: not trained: {', '.join(named)}", flush=True)


def modules_to_save(model: Any, settings: FinetuningSettings) -> list[str] | None:
    """Layers LoRA trains in full and saves with the adapter: ``additional_target``, else the embedding and output
    layer when the vocabulary grows (LLaMA-Factory's precedence), else none."""
    if settings.additional_target:
        return list(settings.additional_target)
    return embedding_module_names(model) if settings.train_embeddings else None


def apply_neftune(model: Any, alpha: float, slices: int = 1) -> Any:
    """NEFTune (as the Hugging Face Trainer adds it): while the model trains, add uniform noise of magnitude
    ``alpha / sqrt(seq_len * hidden)`` to the input embeddings; eval and inference see them unchanged. ``slices``:
    under sequence parallelism each rank embeds 1/N of every row, and ``seq_len`` is the whole row's (N x the slice),
    so every token gets the noise one process gives it.

    A forward hook on the embedding module itself, so it survives every engine's wrapping (FSDP and ZeRO keep the
    module and run its hooks) and keys on the module's own ``training`` flag. Returns the hook's handle.
    """
    import torch

    def add_noise(module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        magnitude = alpha / (slices * output.size(1) * output.size(2)) ** 0.5
        return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)

    return model.get_input_embeddings().register_forward_hook(add_noise)


def decoder_layer_prefixes(model: Any) -> list[str]:
    """Names like ``model.layers.3`` of each decoder layer, in order (an image-text model's language model only:
    its vision tower has layers too)."""
    pattern = re.compile(r"^(.*\.layers\.\d+)\.")
    parts = model_parts(model)
    seen: dict[str, None] = {}
    for name, _ in model.named_parameters():
        match = pattern.match(name)
        if match and (parts is None or parts.part_of(match.group(1)) == "language"):
            seen.setdefault(match.group(1), None)
    return list(seen)


def trainable_layer_ids(num_layers: int, trainable_layers: int, llama_pro: bool = False) -> list[int]:
    """The decoder layers freeze tuning trains: the last ``trainable_layers`` (the first ``-n`` when negative); with
    LLaMA-Pro the blocks its expansion inserted, the last of every ``num_layers / trainable_layers`` (LLaMA-Factory's
    rule). A ConfigError when the numbers do not fit the model."""
    problem = layer_count_problem(num_layers, trainable_layers, llama_pro)
    if problem:
        raise ConfigError(problem)
    if llama_pro:
        stride = num_layers // trainable_layers
        return list(range(stride - 1, num_layers, stride))
    count = abs(trainable_layers)
    return list(range(num_layers - count, num_layers)) if trainable_layers > 0 else list(range(count))


def layer_count_problem(num_layers: int, trainable_layers: int, llama_pro: bool) -> str | None:
    """What is wrong with ``freeze_trainable_layers`` for a model of ``num_layers`` decoder layers (also checked on
    the launching host from config.json)."""
    if llama_pro:
        if trainable_layers <= 0 or num_layers % trainable_layers:
            return (f"use_llama_pro: freeze_trainable_layers ({trainable_layers}) must be the number of blocks the "
                    f"expansion added, which divides the model's {num_layers} layers; `shardtune expand-model` "
                    "writes such a model")
        return None
    count = abs(trainable_layers)
    if count == 0 or count > num_layers:
        return (f"freeze_trainable_layers ({trainable_layers}): the model has {num_layers} layers; use "
                f"1..{num_layers} (or a negative number for the first layers)")
    return None


def apply_freeze(model: Any, trainable_layers: int, modules: tuple[str, ...], llama_pro: bool = False) -> None:
    """Train only the decoder layers ``trainable_layer_ids`` chooses, and in them ``modules`` (or all)."""
    layers = decoder_layer_prefixes(model)
    chosen = [layers[i] for i in trainable_layer_ids(len(layers), trainable_layers, llama_pro)]
    wanted = set(modules)
    matched = False
    for name, param in model.named_parameters():
        in_layer = any(name.startswith(prefix + ".") for prefix in chosen)
        in_module = "all" in wanted or any(f".{m}." in name for m in wanted)
        param.requires_grad_(in_layer and in_module)
        matched |= in_layer and in_module
    if not matched:
        raise ConfigError(f"freeze_trainable_modules ({','.join(modules)}): no parameter of the chosen layers "
                          "matches; use 'all' or names such as mlp, self_attn")


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


@dataclass(frozen=True)
class LoraTargets:
    """peft's ``target_modules`` (Linear layers) and ``target_parameters`` (fused expert weights, 3-D)."""

    modules: Any  # "all-linear" or a list of short module names
    parameters: list[str] | None = None  # like "experts.gate_up_proj"


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


def parametrized_lora_weights(model: Any) -> list[str]:
    """Full names of the weights LoRA adapts through a parametrization (fused expert weights, peft's
    ``target_parameters``) instead of by wrapping a Linear layer: peft registers it anew on every forward."""
    from peft.tuners.lora.layer import ParamWrapper

    return [f"{name}.{module.parameter_name}" for name, module in model.named_modules()
            if isinstance(module, ParamWrapper)]


def _module_class(model: Any, names: set[str], short: str) -> str:
    modules = dict(model.named_modules())
    return next(type(modules[n]).__name__ for n in sorted(names) if n.rsplit(".", 1)[-1] == short)


def apply_adapter(model: Any, settings: FinetuningSettings) -> Any:
    """Wrap with a peft adapter (LoRA or OFT); an unknown target is an error listing the real module names."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    targets = resolved_targets(model, settings)
    left_out = _frozen_targets(model, targets, settings.frozen_parts)
    if settings.is_quantized:
        # peft enables checkpointing again: with our arguments, not with its own (it would drop use_reentrant: false
        # and the user's gradient_checkpointing_kwargs).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=settings.gradient_checkpointing,
                                                gradient_checkpointing_kwargs=checkpointing_kwargs(settings))
    config = _adapter_config(model, settings, targets, left_out)
    if settings.resume_adapter:
        config = resumed_adapter_config(settings.resume_adapter, settings.finetuning_type)
    _check_additional_target(model, settings.additional_target)
    with warnings.catch_warnings():  # peft 0.21 reads transformers' deprecated alias: noise in every LoRA run's log
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = get_peft_model(model, config)
    report_unadapted_linears(model, targets, left_out)
    _initialize_new_adapter(model, settings)
    if settings.resume_adapter:
        load_adapter_weights(model, settings.resume_adapter)
    if settings.gradient_checkpointing:
        # Frozen embeddings give inputs without grad; checkpointed blocks then see no grad path.
        model.enable_input_require_grads()
    return model


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


def _adapter_config(model: Any, settings: FinetuningSettings, targets: LoraTargets, left_out: list[str]) -> Any:
    """peft's config of a new adapter; SEQ_CLS (stage rm) makes peft train and save the score layer in full beside
    the adapter (modules_to_save)."""
    task_type = "SEQ_CLS" if settings.score_head else "CAUSAL_LM"
    if settings.finetuning_type == "oft":
        return build_oft_config(settings.oft, targets.modules, exclude=left_out or None,
                                modules_to_save=modules_to_save(model, settings), task_type=task_type)
    from peft import LoraConfig

    return LoraConfig(
        task_type=task_type,
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha or 2 * settings.lora_rank,
        lora_dropout=settings.lora_dropout,
        target_modules=targets.modules,
        target_parameters=targets.parameters,
        exclude_modules=left_out or None,
        use_dora=settings.use_dora,
        use_rslora=settings.use_rslora,
        modules_to_save=modules_to_save(model, settings),
        # peft's Literal cannot spell "pissa_niter_<N>", which it accepts (built by the init_lora_weights property).
        init_lora_weights=settings.init_lora_weights,  # type: ignore[arg-type]
    )


def _initialize_new_adapter(model: Any, settings: FinetuningSettings) -> None:
    """Host values for the new adapter, the same whether the base was loaded whole or left empty."""
    if settings.finetuning_type == "oft":
        check_adapted_sizes(model, settings.oft)
        materialize_oft_weights(model)
    elif not settings.pissa_init:  # PiSSA's matrices come from the base weights' SVD: keep them
        initialize_adapter_weights(model)


def expanded_block_targets(model: Any, targets: LoraTargets, trainable_layers: int) -> LoraTargets:
    """LLaMA-Pro under LoRA: the targeted Linear layers of the expanded blocks only, by their full names."""
    import torch

    layers = decoder_layer_prefixes(model)
    blocks = tuple(layers[i] + "." for i in trainable_layer_ids(len(layers), trainable_layers, llama_pro=True))
    wanted = None if targets.modules == "all-linear" else set(targets.modules)
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
             and name.startswith(blocks) and (wanted is None or name.rsplit(".", 1)[-1] in wanted)]
    return replace(targets, modules=names)


def _frozen_targets(model: Any, targets: LoraTargets, frozen: FrozenParts) -> list[str]:
    """The targeted Linear layers of an image-text model's frozen parts (its vision tower), which keep no adapter
    (as LLaMA-Factory leaves them out of every lora_target)."""
    return [name for name in excluded_modules(model, frozen)
            if targets.modules == "all-linear" or name.rsplit(".", 1)[-1] in targets.modules]


def _check_additional_target(model: Any, names: tuple[str, ...] | None) -> None:
    """peft matches ``modules_to_save`` by the last part of a module's name; an unknown name would train nothing."""
    if not names:
        return
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigError(f"additional_target: {','.join(missing)} not found in the model; use module names such "
                          "as embed_tokens, lm_head, norm")


def initialize_adapter_weights(model: Any) -> None:
    """(Re)draw every LoRA matrix on the host with peft's own initialisation, layer by layer in model order.

    peft places new adapter weights on their base layer's device; on a model built without its base weights (the
    meta device) their values would be lost. Drawing them again here, on the host, gives the same values whether
    the base model was loaded whole or left empty for a sharding engine to fill.
    """
    import torch
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter in [*module.lora_A.keys(), *module.lora_embedding_A.keys()]:
            for container in (module.lora_A, module.lora_B, module.lora_embedding_A, module.lora_embedding_B):
                part = container[adapter] if adapter in container else None
                if isinstance(part, torch.nn.Module) and any(p.is_meta for p in part.parameters()):
                    part.to_empty(device="cpu")
                elif isinstance(part, torch.nn.Parameter) and part.is_meta \
                        and isinstance(container, torch.nn.ParameterDict):  # where Parameters live
                    container[adapter] = torch.nn.Parameter(torch.empty_like(part, device="cpu"))
            module.reset_lora_parameters(adapter, init_lora_weights=True)


def count_parameters(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = total = 0
    for param in model.parameters():
        n = param.numel()
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total


def leave_adapter_inputs_to_autocast(model: Any) -> int:
    """Under autocast, switch off peft's cast of each LoRA layer's input to the adapter weights' dtype; returns the
    layers switched.

    peft copies a bf16 input (attention output into o_proj, the MLP's product into down_proj) to fp32 to match the
    fp32 adapter weights, and autocast at once copies it back to bf16 for the matmul: two activation-sized copies
    per layer and their two in the backward, for results that are bit for bit the same without them
    (tests/unit/test_adapter_casts.py). Plain LoRA without dropout only: other variants compute more with the
    input, and dropout draws a different mask on a bf16 input than on an fp32 one.
    """
    import torch

    switched = 0
    for module in model.modules():
        if not hasattr(module, "lora_A") or getattr(module, "lora_variant", None):
            continue
        if all(isinstance(dropout, torch.nn.Identity) for dropout in module.lora_dropout.values()):
            module.cast_input_dtype_enabled = False
            switched += 1
    return switched


def store_frozen_bases_in(model: Any, dtype: Any) -> int:
    """Under autocast to ``dtype``, keep each plain LoRA layer's frozen base weight (and bias) in ``dtype``; returns
    the layers changed.

    Autocast keeps the casts of trainable weights only, so it casts every frozen fp32 base weight to bf16 again at each
    call (forward, and a checkpointed layer's recompute), and without checkpointing the backward keeps that bf16
    copy beside the fp32 weight. The matmul sees the same bf16 values either way: the loss and gradients are bit for
    bit the same (tests/unit/test_adapter_casts.py). Only the base layers of plain LoRA layers, which peft calls as a
    whole inside autocast, and only torch's own Linear: DoRA and the other variants read the base weight themselves,
    quantized layers keep their own storage, and every layer without an adapter (embeddings, norms, the output
    layer, a router a model may run in fp32 itself) keeps fp32. Call it after any forward that runs outside autocast
    (DDP's probe for unused parameters).
    """
    import torch

    changed = 0
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if not hasattr(module, "lora_A") or getattr(module, "lora_variant", None) or type(base) is not torch.nn.Linear:
            continue
        params = [p for p in base.parameters() if not p.requires_grad and p.dtype == torch.float32]
        for param in params:
            param.data = param.data.to(dtype)
        changed += bool(params)
    return changed
