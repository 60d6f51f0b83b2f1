"""``fp8``: float8 training of the model's Linear layers with torchao (``torchao.float8``).

What changes: each chosen ``nn.Linear`` becomes torchao's ``Float8Linear``, which casts its input, weight and
output gradient to float8 with one dynamic scale per tensor and runs the three matmuls of forward and backward as
float8 matmuls; the weights, gradients and optimizer states keep their dtype (fp32 masters under bf16 autocast),
so saved models and checkpoints are the same as a bf16 run's. Which layers stay in high precision, as torchao
recommends: the output head (its logits feed the loss directly and suffer most from rounding; LLaMA-Factory and
torchtitan keep it too), MoE routers (a rounding flips which expert a token goes to) and any layer whose input or
output size is not a multiple of 16 (the float8 matmul kernels need 16-aligned sizes).

``fp8_enable_fsdp_float8_all_gather`` also wraps each converted weight so that FSDP2 all-gathers it already cast to
float8 (half of bf16's bytes); the FSDP engine then computes every weight's scale in one pass after each optimizer
step (engines/fsdp.py), as torchao documents. The conversion keeps each weight's Parameter (only the module
around it changes; the all-gather wrap keeps its name), so it runs on the engines' meta skeletons before the
weights are loaded and leaves state-dict names alone.

Where it runs: the float8 matmuls pay off only on GPUs with float8 tensor cores (compute capability 8.9+: H100,
L4, RTX 4090); a rank without one refuses with one line. The launching host checks only the keys: the ranks may
run elsewhere. torchao is an optional extra (``pip install 'shardtune[fp8]'``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardtune.errors import ModelError

if TYPE_CHECKING:  # torch only where a rank needs it: the launching host's checks import this module
    import torch

    from shardtune.config.schema import TrainConfig

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
ALIGNMENT = 16  # torch._scaled_mm needs both sizes of each matmul operand to be multiples of 16
INSTALL = "pip install 'shardtune[fp8]' (torchao)"


def float8_wanted(c: TrainConfig) -> bool:
    """fp8, or the all-gather switch that implies it (LLaMA-Factory turns fp8 on for it, with a warning)."""
    return c.fp8 or c.fp8_enable_fsdp_float8_all_gather


def float8_key_problems(c: TrainConfig) -> list[str]:
    """The keys fp8 cannot go with, checked on the launching host (the device is checked on each rank)."""
    if not float8_wanted(c):
        return []
    on = "fp8 (true)" if c.fp8 else "fp8_enable_fsdp_float8_all_gather (true, which turns fp8 on)"
    problems = []
    if c.fp8_backend in ("te", "msamp"):
        problems.append(f"fp8_backend ({c.fp8_backend}): shardtune's float8 training is torchao's; Transformer "
                        "Engine and MS-AMP are not used: set fp8_backend: torchao (or auto)")
    if not c.bf16 or c.fp16:
        problems.append(f"{on} with bf16 ({str(c.bf16).lower()}) / fp16 ({str(c.fp16).lower()}): the layers fp8 "
                        "leaves in high precision (output head, norms, unaligned layers) compute in bf16; set bf16: "
                        "true (and fp16: false)")
    if c.quantization_bit is not None:
        problems.append(f"{on} with quantization_bit ({c.quantization_bit}): float8 training and quantized weights "
                        "exclude each other (as in LLaMA-Factory); remove one of them")
    if c.finetuning_type not in ("full", "freeze"):
        problems.append(f"{on} with finetuning_type ({c.finetuning_type}): float8 layers are wired for the "
                        "model's own weights (full or freeze); an adapter's small matmuls gain nothing from float8")
    return problems


def float8_device_problem(has_cuda: bool, capability: tuple[int, int] | None, has_torchao: bool) -> str | None:
    """Why this rank cannot train in float8 (one line), or None."""
    needs = (f"a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ (H100, L4, RTX 4090; "
             "float8 tensor cores)")
    if not has_cuda:
        return f"fp8 (true) needs {needs}; none is visible here. Remove fp8 to train in bf16"
    if capability is not None and capability < MIN_CAPABILITY:
        return (f"fp8 (true) needs {needs}; this GPU has compute capability {capability[0]}.{capability[1]}. "
                "Remove fp8 to train in bf16")
    if not has_torchao:
        return f"fp8 (true) needs torchao: {INSTALL}"
    return None


def check_float8_device() -> None:
    """Raise the one-line refusal where this rank's device cannot run float8 matmuls, before any weight loads."""
    import importlib.util

    import torch

    has_cuda = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability() if has_cuda else None
    problem = float8_device_problem(has_cuda, capability, importlib.util.find_spec("torchao") is not None)
    if problem:
        raise ModelError(problem)


@dataclass(frozen=True)
class Float8Report:
    """What the conversion did, for the rank-0 log line."""

    converted: int
    kept: tuple[tuple[str, str], ...]  # (name, reason) of each Linear layer left in high precision
    fsdp_all_gather: bool

    def line(self) -> str:
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.kept:
            by_reason.setdefault(reason, []).append(name)
        kept = "; ".join(f"{names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''} ({reason})"
                         for reason, names in by_reason.items())
        gather = " (float8 all-gather under FSDP2)" if self.fsdp_all_gather else ""
        return (f"[shardtune] fp8: {self.converted} Linear layers train in float8 (torchao){gather}"
                f"{f'; kept in bf16: {kept}' if kept else ''}")


def high_precision_reason(name: str, module: torch.nn.Linear, head: torch.nn.Module | None) -> str | None:
    """Why the Linear layer ``name`` stays in high precision, or None when it trains in float8."""
    if module is head:
        return "output head"
    leaf = name.rsplit(".", 1)[-1]
    if "router" in name or leaf == "gate":  # MoE routers (a dense MLP's projection is gate_proj, converted)
        return "MoE router"
    if "lora_" in name:
        return "adapter"
    if module.in_features % ALIGNMENT or module.out_features % ALIGNMENT:
        return f"sizes not multiples of {ALIGNMENT}"
    return None


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    get_base_model = getattr(model, "get_base_model", None)  # peft's wrapper: the head is its base model's
    base = get_base_model() if get_base_model is not None else model
    get_output_embeddings = getattr(base, "get_output_embeddings", None)
    return get_output_embeddings() if get_output_embeddings is not None else None


def apply_float8_training(model: torch.nn.Module, fsdp_all_gather: bool = False) -> Float8Report:
    """Swap the model's eligible ``nn.Linear`` layers for torchao's ``Float8Linear`` in place (tensorwise dynamic
    scaling, torchao's default recipe and the one FSDP2's float8 all-gather takes)."""
    import torch

    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ModelError(f"fp8 (true) needs torchao: {INSTALL}") from None
    head = output_head(model)
    kept: list[tuple[str, str]] = []

    def converts(module: torch.nn.Module, name: str) -> bool:
        if type(module) is not torch.nn.Linear:  # torchao asks about every module; only plain Linears swap
            return False
        reason = high_precision_reason(name, module, head)
        if reason:
            kept.append((name, reason))
        return reason is None

    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather),
                               module_filter_fn=converts)
    return Float8Report(len(float8_layers(model)), tuple(kept), fsdp_all_gather)


def float8_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's torchao ``Float8Linear`` layers (none where torchao is not installed)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def float8_all_gathers(model: torch.nn.Module) -> bool:
    """Whether the model's float8 layers all-gather their weights in float8 (their scales then need computing after
    each optimizer step)."""
    return any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False)
               for m in float8_layers(model))

