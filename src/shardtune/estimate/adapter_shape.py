"""What each fine-tuning method trains, on a model shape: LoRA's and OFT's adapters, freeze's layers.

The same arithmetic as model/finetuning/ (targets.py, freeze.py, oft.py), on config.json's numbers instead of a built
model, so that the estimate and the launching host's checks see what the ranks will build.
"""

from __future__ import annotations

from shardtune.errors import ConfigError
from shardtune.estimate.shape import LINEAR_MODULES, ModelShape
from shardtune.model.finetuning.oft import OftSettings, trainable_params


def adapted_widths(shape: ModelShape, targets: tuple[str, ...] | list[str], index: int | None = None) -> dict[str, int]:
    """in_features of each targeted Linear layer of decoder layer ``index`` (the last by default), by name."""
    present = shape.layer_linear_shapes(index)
    return {name: present[name][0] for name in lora_target_modules(targets, shape) if name in present}


def all_adapted_widths(shape: ModelShape, targets: tuple[str, ...] | list[str]) -> dict[str, int]:
    """in_features of every targeted Linear layer name over the decoder layers (dense and MoE layers differ)."""
    found: dict[str, int] = {}
    for index in range(shape.num_layers):
        for name, width in adapted_widths(shape, targets, index).items():
            if found.setdefault(name, width) != width:
                found.setdefault(f"{name} (layer {index})", width)
    return found


def oft_params(shape: ModelShape, settings: OftSettings, targets: tuple[str, ...] | list[str]) -> int:
    """Trainable OFT parameters: in x (b - 1) / 2 per adapted Linear layer of in_features ``in`` and block size b."""
    return sum(trainable_params(width, settings) for index in range(shape.num_layers)
               for width in adapted_widths(shape, targets, index).values())


def lora_params(shape: ModelShape, rank: int, targets: tuple[str, ...] | list[str]) -> int:
    """Trainable LoRA parameters: r x (in + out) per adapted linear layer (A is r x in, B is out x r).

    Only nn.Linear layers are adapted: the fused experts and the router of an MoE layer are not.
    """
    modules = lora_target_modules(targets, shape)
    total = 0
    for i in range(shape.num_layers):
        shapes = shape.layer_linear_shapes(i)
        total += sum(rank * (shapes[m][0] + shapes[m][1]) for m in modules if m in shapes)
    return total


def lora_small_params(shape: ModelShape, rank: int, targets: tuple[str, ...] | list[str], below: int) -> int:
    """LoRA parameters in matrices of fewer than ``below`` elements (A: r x in, B: out x r): those ZeRO-3 keeps
    whole on every rank (stage3_param_persistence_threshold)."""
    modules = lora_target_modules(targets, shape)
    total = 0
    for i in range(shape.num_layers):
        shapes = shape.layer_linear_shapes(i)
        total += sum(rank * width for m in modules if m in shapes for width in shapes[m] if rank * width < below)
    return total


def lora_base_params(shape: ModelShape, targets: tuple[str, ...] | list[str]) -> int:
    """Weights of the decoder's Linear layers LoRA adapts (the frozen bases under its adapters)."""
    modules = lora_target_modules(targets, shape)
    total = 0
    for i in range(shape.num_layers):
        shapes = shape.layer_linear_shapes(i)
        total += sum(shapes[m][0] * shapes[m][1] for m in modules if m in shapes)
    return total


def lora_target_modules(targets: tuple[str, ...] | list[str], shape: ModelShape | None = None) -> tuple[str, ...]:
    """'all' means every linear layer of the decoder (never the output head), as peft's 'all-linear'."""
    known = shape.linear_module_names if shape is not None else LINEAR_MODULES
    names = [t.strip() for t in targets if t.strip()]
    if "all" in names:
        return known
    unknown = [t for t in names if t not in known]
    if unknown:
        raise ConfigError(f"lora_target ({','.join(unknown)}): the estimate knows this model's linear layers "
                          f"{','.join(known)}; use those or 'all'")
    return tuple(names)


def freeze_trainable_params(shape: ModelShape, layers: int, modules: tuple[str, ...] | list[str]) -> int:
    """Parameters of the |layers| trainable decoder layers (restricted to ``modules`` unless 'all').

    Positive counts train the last layers, negative the first (LLaMA-Factory's freeze_trainable_layers).
    """
    count = min(abs(layers), shape.num_layers)
    indices = range(shape.num_layers - count, shape.num_layers) if layers > 0 else range(count)
    names = [m.strip() for m in modules if m.strip()]
    if "all" in names:
        return shape.layers_params(indices)
    total = 0
    for index in indices:
        shapes = shape.layer_linear_shapes(index)
        attention = shape.attention_linear_shapes()
        for name in names:
            if name in shapes:
                total += shape.linear_params(name, index)
            elif name == "self_attn":
                total += sum(shape.linear_params(m, index) for m in attention)
            elif name == "mlp":
                total += sum(shape.linear_params(m, index) for m in shapes if m not in attention)
                total += shape.layer_expert_params(index)
            elif name in ("input_layernorm", "post_attention_layernorm"):
                total += shape.hidden_size
    return total
