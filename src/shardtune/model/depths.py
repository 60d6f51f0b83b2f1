"""Mixture of depths (Raposo et al., 2024; LLaMA-Factory's ``mixture_of_depths: convert | load``): in every second
decoder layer a router scores each token, and only the top ``capacity`` share of a row's tokens (12.5%) run through
the layer; the others pass by on the residual stream. The layer's update of a chosen token is scaled by its router
weight, which is how the router learns which tokens need the layer.

The router weight is ``2 * sigmoid(score)``: 1 for a router that scores 0, so a converted checkpoint computes what it
did for the tokens its layers still see. A router is one ``Linear(hidden, 1)`` per routed layer, stored as
``<layer>.mod_router.weight`` beside the layer's own weights, and the config records the routed layers
(``mixture_of_depths`` in config.json): ``mixture_of_depths: load`` routes again. transformers itself loads the saved
folder as its own class, drops the routers and runs every layer on every token.

Choosing the top tokens of a whole row needs the whole row (the choice of an early token depends on later ones):
with a KV cache (generation) every layer runs on every token, as the paper notes for routing without a predictor.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from shardtune.errors import ConfigError
from shardtune.model.depth_checks import depth_problem

CAPACITY = 0.125  # the paper's best setting: 12.5% of a row's tokens through each routed layer
ROUTER = "mod_router"


def routed_layer_ids(num_layers: int) -> list[int]:
    """Every second layer, from the second on (the paper's interleaving: full layers and routed ones alternate)."""
    return list(range(1, num_layers, 2))


def apply_mixture_of_depths(model: Any, mode: str, folder: str) -> list[int]:
    """Give the model's routed layers their routers (new for convert, read from ``folder`` for load) and route
    their forward; returns the routed layer indices."""
    from shardtune.model.finetuning.freeze import decoder_layer_prefixes

    config = model.config
    problem = depth_problem(mode, config.to_dict())
    if problem:
        raise ConfigError(problem)
    layers = [model.get_submodule(prefix) for prefix in decoder_layer_prefixes(model)]
    routed = config.mixture_of_depths["layers"] if mode == "load" else routed_layer_ids(len(layers))
    capacity = config.mixture_of_depths["capacity"] if mode == "load" else CAPACITY
    std = float(getattr(config, "initializer_range", 0.02))
    for index in routed:
        layer = layers[index]
        weight = next(layer.parameters())
        router = torch.nn.Linear(config.hidden_size, 1, bias=False, device=weight.device, dtype=weight.dtype)
        torch.nn.init.normal_(router.weight, std=std)
        layer.add_module(ROUTER, router)
        layer.forward = functools.partial(routed_forward, layer.forward, router, capacity)
    config.mixture_of_depths = {"capacity": capacity, "layers": routed}
    if mode == "load":
        _read_routers(model, folder)
    return routed


def _read_routers(model: Any, folder: str) -> None:
    from shardtune.model.weights import open_weights

    weights = open_weights(folder)
    wanted = {name: p for name, p in model.named_parameters() if name.endswith(f".{ROUTER}.weight")}
    missing = sorted(name for name in wanted if weights is None or name not in weights)
    if missing:
        raise ConfigError(f"mixture_of_depths (load): {Path(folder)} lacks the router weights {missing[:2]}; was it "
                          "saved from a routed run?")
    with torch.no_grad():
        for name, parameter in wanted.items():
            parameter.copy_(weights.read(name))  # type: ignore[union-attr]  # None is refused above


def routed_forward(layer_forward: Any, router: torch.nn.Linear, capacity: float, hidden_states: torch.Tensor,
                   *args: Any, **kwargs: Any) -> torch.Tensor:
    """The layer on the top-scored tokens of each row; the rest pass by unchanged.

    A row's budget is its share of its own tokens (padding excluded), so a row is routed the same in any batch:
    two processes compute what one does. Rows of one batch take as many tokens as the largest budget; a row's
    tokens beyond its own budget are carried along but change nothing and are hidden from the others' attention."""
    batch, length, width = hidden_states.shape
    real = _real_tokens(kwargs.get("attention_mask"), hidden_states)
    budgets = (real.sum(dim=1) * capacity).floor().clamp(min=1).long()
    keep = int(budgets.max())
    if args or kwargs.get("past_key_values") is not None or keep >= length:
        return layer_forward(hidden_states, *args, **kwargs)  # generation, or a row too short to route
    scores = router(hidden_states).squeeze(-1)
    best = scores.masked_fill(~real, float("-inf")).topk(keep, dim=1).indices
    within = torch.arange(keep, device=best.device).unsqueeze(0) < budgets.unsqueeze(1)
    chosen, order = best.sort(dim=1)  # in position order: attention among the chosen stays causal
    routed = within.gather(1, order)
    rows = chosen.unsqueeze(-1).expand(-1, -1, width)
    picked = hidden_states.gather(1, rows)
    out = layer_forward(picked, **_chosen_inputs(kwargs, chosen, routed, batch))
    out = out[0] if isinstance(out, tuple) else out
    weight = 2 * torch.sigmoid(scores.gather(1, chosen)).unsqueeze(-1).to(out.dtype)
    update = torch.where(routed.unsqueeze(-1), (out - picked) * weight, torch.zeros_like(out))
    return hidden_states.scatter(1, rows, picked + update)


def _real_tokens(mask: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """(batch, length) True for the tokens some query may attend to: padding is False."""
    batch, length = hidden_states.shape[:2]
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:  # (batch, heads, queries, keys)
        allowed = mask if mask.dtype == torch.bool else mask == 0
        return allowed[:, 0].any(dim=1).expand(batch, length)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.bool().expand(batch, length)
    return torch.ones(batch, length, dtype=torch.bool, device=hidden_states.device)


def _chosen_inputs(kwargs: dict[str, Any], chosen: torch.Tensor, routed: torch.Tensor,
                   batch: int) -> dict[str, Any]:
    """The layer's keyword inputs for the chosen tokens: their positions, rotary angles and mask rows/columns
    (a token beyond its row's budget is no key for the others; it still sees itself, so no row is empty)."""
    inputs = dict(kwargs)
    if isinstance(inputs.get("position_ids"), torch.Tensor):
        inputs["position_ids"] = inputs["position_ids"].expand(batch, -1).gather(1, chosen)
    if inputs.get("position_embeddings") is not None:
        inputs["position_embeddings"] = tuple(_take_tokens(angle, chosen, 1) for angle in inputs["position_embeddings"])
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:  # (batch, heads, queries, keys)
        mask = _take_tokens(_take_tokens(mask, chosen, 2), chosen, 3)
        eye = torch.eye(chosen.shape[1], dtype=torch.bool, device=mask.device)
        visible = routed[:, None, None, :] | eye
        inputs["attention_mask"] = mask & visible if mask.dtype == torch.bool else \
            mask.masked_fill(~visible, torch.finfo(mask.dtype).min)
    elif isinstance(mask, torch.Tensor) and mask.dim() == 2:  # (batch, keys): a padding mask
        inputs["attention_mask"] = mask.gather(1, chosen) * routed.to(mask.dtype)
    inputs.pop("cache_position", None)  # no cache on this path
    return inputs


def _take_tokens(tensor: torch.Tensor, chosen: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor`` indexed along its token dimension ``dim`` by each row's chosen tokens (a broadcast batch of one
    is expanded first)."""
    shape = list(tensor.shape)
    shape[0] = chosen.shape[0]
    tensor = tensor.expand(shape)
    index_shape = [1] * tensor.dim()
    index_shape[0], index_shape[dim] = chosen.shape[0], chosen.shape[1]
    index = chosen.view(index_shape).expand(*[chosen.shape[1] if d == dim else s for d, s in enumerate(shape)])
    return tensor.gather(dim, index)
