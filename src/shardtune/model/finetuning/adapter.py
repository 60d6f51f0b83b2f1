"""What LoRA and OFT share: choose the targets (targets.py), leave a frozen part's layers alone, wrap the model with
peft, give the new adapter host values, and train on a saved adapter. Each method's own part: lora.py, oft.py."""

from __future__ import annotations

import warnings
from typing import Any

from shardtune.errors import ConfigError
from shardtune.model.finetuning.lora import build_lora_config, initialize_adapter_weights
from shardtune.model.finetuning.oft import build_oft_config, check_adapted_sizes, materialize_oft_weights
from shardtune.model.finetuning.settings import FinetuningSettings, checkpointing_kwargs
from shardtune.model.finetuning.targets import LoraTargets, frozen_targets, report_unadapted_linears, resolved_targets
from shardtune.model.pretrained_adapters import load_adapter_weights, resumed_adapter_config


def apply_adapter(model: Any, settings: FinetuningSettings) -> Any:
    """Wrap with a peft adapter (LoRA or OFT); an unknown target is an error listing the real module names."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    targets = resolved_targets(model, settings)
    left_out = frozen_targets(model, targets, settings.frozen_parts)
    if settings.is_quantized:
        # peft enables checkpointing again: with our arguments, not with its own (it would drop use_reentrant: false
        # and the user's gradient_checkpointing_kwargs).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=settings.gradient_checkpointing,
                                                gradient_checkpointing_kwargs=checkpointing_kwargs(settings))
    config = new_adapter_config(model, settings, targets, left_out)
    if settings.resume_adapter:  # the saved adapter's own rank, alpha and targets
        config = resumed_adapter_config(settings.resume_adapter, settings.finetuning_type)
    check_additional_target(model, settings.additional_target)
    with warnings.catch_warnings():  # peft 0.21 reads transformers' deprecated alias: noise in every LoRA run's log
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = get_peft_model(model, config)
    report_unadapted_linears(model, targets, left_out)
    initialize_new_adapter(model, settings)
    if settings.resume_adapter:
        load_adapter_weights(model, settings.resume_adapter)
    if settings.gradient_checkpointing:
        # Frozen embeddings give inputs without grad; checkpointed blocks then see no grad path.
        model.enable_input_require_grads()
    return model


def new_adapter_config(model: Any, settings: FinetuningSettings, targets: LoraTargets, left_out: list[str]) -> Any:
    """peft's config of a new adapter; SEQ_CLS (stage rm) makes peft train and save the score layer in full beside
    the adapter (modules_to_save)."""
    task_type = "SEQ_CLS" if settings.score_head else "CAUSAL_LM"
    in_full = modules_to_save(model, settings)
    if settings.finetuning_type == "oft":
        return build_oft_config(settings.oft, targets.modules, exclude=left_out or None, modules_to_save=in_full,
                                task_type=task_type)
    return build_lora_config(settings, targets, exclude=left_out or None, modules_to_save=in_full,
                             task_type=task_type)


def initialize_new_adapter(model: Any, settings: FinetuningSettings) -> None:
    """Host values for the new adapter, the same whether the base was loaded whole or left empty."""
    if settings.finetuning_type == "oft":
        check_adapted_sizes(model, settings.oft)
        materialize_oft_weights(model)
    elif not settings.pissa_init:  # PiSSA's matrices come from the base weights' SVD: keep them
        initialize_adapter_weights(model)


def modules_to_save(model: Any, settings: FinetuningSettings) -> list[str] | None:
    """Layers the adapter trains in full and saves with it: ``additional_target``, else the embedding and output
    layer when the vocabulary grows (LLaMA-Factory's precedence), else none."""
    if settings.additional_target:
        return list(settings.additional_target)
    return embedding_module_names(model) if settings.train_embeddings else None


def embedding_module_names(model: Any) -> list[str]:
    """Short names of the input embedding and output layer (``embed_tokens``, ``lm_head``) for peft's
    ``modules_to_save``, as LLaMA-Factory picks them when the vocabulary is resized (model/vocab.py)."""
    wanted = [model.get_input_embeddings(), model.get_output_embeddings()]
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if any(module is w for w in wanted if w is not None)})


def check_additional_target(model: Any, names: tuple[str, ...] | None) -> None:
    """peft matches ``modules_to_save`` by the last part of a module's name; an unknown name would train nothing."""
    if not names:
        return
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigError(f"additional_target: {','.join(missing)} not found in the model; use module names such "
                          "as embed_tokens, lm_head, norm")
