"""LoRA's own part of the adapter path (adapter.py holds what LoRA and OFT share): its peft config, drawing its
matrices on the host, the weights it adapts through a parametrization, and its casts under autocast."""

from __future__ import annotations

from typing import Any

from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.finetuning.targets import LoraTargets


def build_lora_config(settings: FinetuningSettings, targets: LoraTargets, *, exclude: list[str] | None,
                      modules_to_save: list[str] | None, task_type: str) -> Any:
    """peft's LoraConfig for a new adapter on ``targets``."""
    from peft import LoraConfig

    return LoraConfig(
        task_type=task_type,
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha or 2 * settings.lora_rank,
        lora_dropout=settings.lora_dropout,
        target_modules=targets.modules,
        target_parameters=targets.parameters,
        exclude_modules=exclude,
        use_dora=settings.use_dora,
        use_rslora=settings.use_rslora,
        modules_to_save=modules_to_save,
        # peft's Literal cannot spell "pissa_niter_<N>", which it accepts (built by the init_lora_weights property).
        init_lora_weights=settings.init_lora_weights,  # type: ignore[arg-type]
    )


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


def parametrized_lora_weights(model: Any) -> list[str]:
    """Full names of the weights LoRA adapts through a parametrization (fused expert weights, peft's
    ``target_parameters``) instead of by wrapping a Linear layer: peft registers it anew on every forward."""
    from peft.tuners.lora.layer import ParamWrapper

    return [f"{name}.{module.parameter_name}" for name, module in model.named_modules()
            if isinstance(module, ParamWrapper)]


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
