"""``enable_liger_kernel``: Liger's Triton kernels in place of the model's RMSNorm, RoPE and gated MLP.

Liger (``liger-kernel``) patches a loaded model of a family it knows (``apply_liger_kernel_to_<family>`` through
its ``_apply_liger_kernel_to_instance``, the entry transformers' Trainer uses too): the norms and MLPs of the
instance get Liger's forward, and the family's module-level RoPE function is replaced. What stays: the loss.
shardtune computes it itself, chunk by chunk inside the output layer's call (train/loss.py), and never passes labels
to the model; Liger's fused linear cross-entropy replaces the model's whole forward to compute the loss there, so
it is switched off (as is its plain cross-entropy, which only the model's own loss would call): the model's
forward computes no loss, once or twice.

Where it runs: Liger's kernels are Triton GPU kernels, so a rank without a CUDA GPU, or without liger-kernel (and
the triton it pulls), refuses with one line. The launching host checks nothing: the ranks may run elsewhere.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from shardtune.errors import ModelError

INSTALL = "pip install liger-kernel (it needs triton and a CUDA GPU)"
# The loss switches shardtune keeps off (see the module docstring); every other switch keeps Liger's default.
LOSS_SWITCHES = {"cross_entropy": False, "fused_linear_cross_entropy": False}


def liger_device_problem(has_cuda: bool, has_liger: bool) -> str | None:
    """Why this rank cannot run Liger's kernels (one line), or None."""
    if not has_cuda:
        return ("enable_liger_kernel (true) needs a CUDA GPU (Liger's kernels are Triton GPU kernels); none is "
                "visible here. Remove enable_liger_kernel")
    if not has_liger:
        return f"enable_liger_kernel (true) needs the liger-kernel package: {INSTALL}"
    return None


def check_liger_device() -> None:
    """Raise the one-line refusal where Liger cannot run on this rank, before any weight loads."""
    problem = liger_device_problem(torch.cuda.is_available(), liger_importable())
    if problem:
        raise ModelError(problem)


def liger_importable() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401  (imports triton)
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class LigerReport:
    model_type: str
    kernels: tuple[str, ...]  # the switches of Liger's patch that were on: rope, rms_norm, swiglu, ...

    def line(self) -> str:
        return (f"[shardtune] enable_liger_kernel: Liger's kernels replaced {', '.join(self.kernels)} of "
                f"{self.model_type}; the loss stays shardtune's (Liger's fused linear cross-entropy is off)")


def kernels_switched_on(apply_fn: object) -> tuple[str, ...]:
    """The kernel switches of a Liger ``apply_liger_kernel_to_<family>`` that are on by default, the loss ones
    excepted: what the patch replaces."""
    parameters = inspect.signature(apply_fn).parameters.values()  # type: ignore[arg-type]
    return tuple(p.name for p in parameters
                 if p.default is True and p.name not in LOSS_SWITCHES)


def apply_liger_kernels(model: torch.nn.Module) -> LigerReport:
    """Patch ``model`` (a transformers model, or peft's wrapper of one) with Liger's kernels for its family."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        raise ModelError(f"enable_liger_kernel (true) needs the liger-kernel package: {INSTALL}") from None
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if get_base_model is not None else model
    model_type = str(getattr(getattr(base, "config", None), "model_type", None))
    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply_fn is None:
        raise ModelError(f"enable_liger_kernel (true): Liger has no kernels for model type '{model_type}'; "
                         "remove enable_liger_kernel")
    accepted = inspect.signature(apply_fn).parameters
    _apply_liger_kernel_to_instance(base, **{k: v for k, v in LOSS_SWITCHES.items() if k in accepted})
    return LigerReport(model_type, kernels_switched_on(apply_fn))
