"""LLaMA-Factory's optimizer replacements (Muon, GaLore, APOLLO, Adam-mini), each through its own implementation.

Which engines may use them is decided on the launching host (``engines.spec.whole_weight_optimizer_problems``);
everything here sees whole, unsharded parameters (one process or DDP), but Muon, which also takes FSDP2's
DTensor shards (optim/sharded_muon.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardtune.errors import ConfigError
from shardtune.optim.settings import ExtraOptimizer
from shardtune.optim.sharded_muon import ShardedMuon


class ChainedOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped as one, for an engine that drives a single optimizer.

    ``param_groups`` is the children's own group dicts, so a learning-rate scheduler or a GradScaler acting on this
    object acts on every child; ``state_dict`` keeps each child's state apart, so resume restores them exactly."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        # torch's constructor checks the parameters and files them as one group of its own (kept apart, unused):
        # the children are set after it, since their groups hold the same parameters and would fail that check.
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})
        self.optimizers = optimizers

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The children's group dicts, read each time: torch's distributed state-dict loading calls each child's
        load_state_dict, which replaces its dicts; a list kept here would leave a scheduler setting stale ones."""
        if "optimizers" not in self.__dict__:
            return self.__dict__.setdefault("_constructor_groups", [])
        return [group for o in self.optimizers for group in o.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.__dict__["_constructor_groups"] = groups

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"optimizer state holds {len(saved)} optimizers, this run builds {len(self.optimizers)}")
        for optimizer, state in zip(self.optimizers, saved, strict=True):
            optimizer.load_state_dict(state)


def optimizer_parts(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers torch's distributed state-dict functions should see: a ChainedOptimizer's children (their
    state is keyed by parameter name one by one, and merged), any other optimizer itself."""
    return list(optimizer.optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def is_muon_matrix(name: str, param: torch.nn.Parameter) -> bool:
    """LLaMA-Factory's split: hidden 2-D weights go to Muon; embeddings, the output head and 1-D weights to AdamW."""
    return param.ndim == 2 and "embed" not in name and "lm_head" not in name


def build_muon(named: list[tuple[str, torch.nn.Parameter]], lr: float, weight_decay: float,
               betas: tuple[float, float], eps: float) -> ChainedOptimizer:
    """torch.optim.Muon for the hidden matrices, AdamW for the rest; both decay every weight, as LLaMA-Factory's
    Muon does. ``match_rms_adamw`` scales Muon's step by 0.2 x sqrt(max(rows, cols)) so one learning rate suits
    both halves (LLaMA-Factory's rule). FSDP2's sharded matrices (DTensors) go to ShardedMuon, which orthogonalises
    each gathered whole."""
    matrices = [p for name, p in named if is_muon_matrix(name, p)]
    others = [p for name, p in named if not is_muon_matrix(name, p)]
    optimizers: list[torch.optim.Optimizer] = []
    if matrices:
        muon = ShardedMuon if any(isinstance(p, DTensor) for p in matrices) else torch.optim.Muon
        optimizers.append(muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"))
    if others:
        optimizers.append(torch.optim.AdamW(others, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
    return ChainedOptimizer(optimizers)


def projected_names(named: list[tuple[str, torch.nn.Parameter]], model: torch.nn.Module,
                    target: tuple[str, ...], all_linear: Iterable[str]) -> set[str]:
    """Parameters GaLore/APOLLO project, as LLaMA-Factory picks them: the 2-D weights of Linear modules whose name
    contains a target; 'all' is every Linear layer's short name but the output head's (``all_linear``)."""
    targets = tuple(all_linear) if target == ("all",) else target
    linear = {f"{name}.weight" for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and any(t in name for t in targets)}
    return {name for name, p in named if p.ndim == 2 and name in linear}


def projection_groups(named: list[tuple[str, torch.nn.Parameter]], projected: set[str], weight_decay: float,
                      settings: dict[str, Any]) -> list[dict[str, Any]]:
    """LLaMA-Factory's three groups: 1-D weights without decay, other weights with it, projected ones with the
    projection settings (and decay)."""
    nodecay = [p for n, p in named if n not in projected and p.ndim < 2]
    decay = [p for n, p in named if n not in projected and p.ndim >= 2]
    groups = [{"params": nodecay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay},
              {"params": [p for n, p in named if n in projected], "weight_decay": weight_decay, **settings}]
    return [g for g in groups if g["params"]]


def build_galore(groups: list[dict[str, Any]], optim: str, lr: float, betas: tuple[float, float],
                 eps: float) -> torch.optim.Optimizer:
    """galore-torch's optimizer for ``optim``, as LLaMA-Factory picks it."""
    galore = _import("galore_torch", "use_galore", "galore-torch")
    if optim in ("adamw_torch", "adamw_torch_fused"):
        return galore.GaLoreAdamW(groups, lr=lr, betas=betas, eps=eps, no_deprecation_warning=True)
    if optim == "adamw_8bit":
        return galore.GaLoreAdamW8bit(groups, lr=lr, betas=betas, eps=eps)
    if optim == "adafactor":
        return galore.GaLoreAdafactor(groups, lr=lr, scale_parameter=False, relative_step=False)
    raise ConfigError(f"use_galore (true) with optim ({optim}): GaLore has adamw_torch, adamw_8bit and adafactor")


def build_apollo(groups: list[dict[str, Any]], lr: float, betas: tuple[float, float],
                 eps: float) -> torch.optim.Optimizer:
    apollo = _import("apollo_torch", "use_apollo", "apollo-torch")
    return apollo.APOLLOAdamW(groups, lr=lr, betas=betas, eps=eps)


def galore_settings(extra: ExtraOptimizer) -> dict[str, Any]:
    return {"rank": extra.rank, "update_proj_gap": extra.update_interval, "scale": extra.scale,
            "proj_type": extra.proj_type}


def apollo_settings(extra: ExtraOptimizer) -> dict[str, Any]:
    return {**galore_settings(extra), "proj": extra.apollo_proj, "scale_type": extra.apollo_scale_type,
            "scale_front": extra.apollo_scale_front}


def build_adam_mini(named: list[tuple[str, torch.nn.Parameter]], model_config: Any, lr: float,
                    weight_decay: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """adam-mini's optimizer over the named parameters (it groups them into blocks by name and head count)."""
    adam_mini = _import("adam_mini", "use_adam_mini", "adam-mini")
    dim = getattr(model_config, "hidden_size", None)
    n_heads = getattr(model_config, "num_attention_heads", None)
    if dim is None or n_heads is None:
        raise ConfigError("use_adam_mini (true): the model config has no hidden_size/num_attention_heads, which "
                          "Adam-mini needs to split attention weights into heads; use optim: adamw_torch")
    return adam_mini.Adam_mini(named_parameters=named, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                               dim=dim, n_heads=n_heads, n_kv_heads=getattr(model_config, "num_key_value_heads", None),
                               verbose=False)


def register_safe_state_types() -> None:
    """GaLore and APOLLO keep a projector object in each projected weight's state; allow exactly those classes
    when a checkpoint's optimizer state is read with ``weights_only=True``."""
    for module_name, class_names in (("galore_torch.galore_projector", ("GaLoreProjector",)),
                                     ("apollo_torch.random_projector", ("GradientProjector",)),
                                     ("apollo_torch.svd_projector", ("GaLoreProjector",))):
        try:
            module = __import__(module_name, fromlist=list(class_names))
        except ImportError:
            continue
        torch.serialization.add_safe_globals([getattr(module, c) for c in class_names if hasattr(module, c)])


def _import(module: str, key: str, package: str) -> Any:
    try:
        return __import__(module)
    except ImportError as err:
        raise ConfigError(f"{key} (true) needs the {package} package ({err}): pip install {package}") from None
