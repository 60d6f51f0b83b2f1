"""Layer-wise GaLore and APOLLO (optim/layerwise.py): one optimizer per weight, stepped from its gradient hook.

The layer-wise run takes the plain run's steps exactly (same weights after each step, the learning-rate schedule
included), frees each gradient as soon as its weight has stepped (a hook counts the gradients alive while the
backward runs), resumes exactly from its state dict, and the keys are refused where the steps cannot hold.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from shardtune.config.load import build_config
from shardtune.engines.plan import plan_engine
from shardtune.launch.validate import cross_key_problems
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.source import ModelSource
from shardtune.optim.build import build_optimizer, build_scheduler
from shardtune.optim.layerwise import LayerwiseOptimizer
from shardtune.optim.settings import ExtraOptimizer, OptimizerSettings, optimizer_settings

LR, WD = 1e-2, 0.01
# A projection refreshed every 2 steps, so that 4 steps cover a refresh; APOLLO's random projection besides.
KINDS = {"galore": {"target": ("q_proj", "up_proj"), "rank": 4, "update_interval": 2},
         "apollo": {"target": ("k_proj", "gate_proj"), "rank": 4, "update_interval": 2, "scale": 32.0}}


@pytest.fixture(scope="module")
def full_model(tiny_model_dir) -> torch.nn.Module:
    torch.manual_seed(0)
    return ModelSource(str(tiny_model_dir), FinetuningSettings(finetuning_type="full")).load_full()


def _batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def _build(model: torch.nn.Module, kind: str, layerwise: bool) -> torch.optim.Optimizer:
    extra = ExtraOptimizer(kind, layerwise=layerwise, **KINDS[kind])
    settings = OptimizerSettings(optim="adamw_torch", learning_rate=LR, weight_decay=WD, extra=extra)
    return build_optimizer([p for p in model.parameters() if p.requires_grad], settings, None, model)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    """The loop's order: backward (the layer-wise steps happen here), step, schedule, zero_grad."""
    scheduler = getattr(optimizer, "_test_scheduler", None)
    for step in steps:
        model(**_batch(step)).loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def _scheduled(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    optimizer._test_scheduler = build_scheduler(optimizer, "cosine", total_steps=4, warmup_steps=1)  # type: ignore
    return optimizer


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", list(KINDS))
def test_layerwise_steps_as_the_whole_optimizer(kind, full_model):
    plain, layered = copy.deepcopy(full_model), copy.deepcopy(full_model)
    whole = _scheduled(_build(plain, kind, layerwise=False))
    per_weight = _scheduled(_build(layered, kind, layerwise=True))
    assert isinstance(per_weight, LayerwiseOptimizer)
    assert len(per_weight.optimizers) == len(list(full_model.parameters()))
    _train(plain, whole, range(4))
    _train(layered, per_weight, range(4))
    _assert_same(plain, layered)
    assert all(not torch.equal(a, b) for a, b in zip(layered.parameters(), full_model.parameters(), strict=True))
    # The schedule reached every weight's optimizer (cosine after 4 of 4 steps: 0).
    assert {g["lr"] for g in per_weight.param_groups} == {g["lr"] for g in whole.param_groups} == {0.0}


def _most_gradients_alive(model: torch.nn.Module, build) -> int:
    """The most parameters holding a .grad at once during one backward, seen as each gradient completes (the
    counting hooks are registered first, so they run before the optimizer's own)."""
    params = list(model.parameters())
    seen: list[int] = []
    handles = [p.register_post_accumulate_grad_hook(lambda _: seen.append(sum(q.grad is not None for q in params)))
               for p in params]
    optimizer = build(model)
    model(**_batch(0)).loss.backward()
    for handle in handles:
        handle.remove()
    if isinstance(optimizer, LayerwiseOptimizer):
        optimizer.remove_hooks()
    return max(seen)


@pytest.mark.parametrize("kind", list(KINDS))
def test_layerwise_frees_each_gradient_after_its_step(kind, full_model):
    layered = copy.deepcopy(full_model)
    assert _most_gradients_alive(layered, lambda m: _build(m, kind, layerwise=True)) == 1
    assert all(p.grad is None for p in layered.parameters())
    plain = copy.deepcopy(full_model)
    assert _most_gradients_alive(plain, lambda m: _build(m, kind, layerwise=False)) == len(list(plain.parameters()))


@pytest.mark.parametrize("kind", list(KINDS))
def test_layerwise_state_round_trips_for_an_exact_resume(kind, full_model):
    straight, resumed = copy.deepcopy(full_model), copy.deepcopy(full_model)
    _train(straight, _build(straight, kind, layerwise=True), range(4))
    first = _build(resumed, kind, layerwise=True)
    _train(resumed, first, range(3))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as TorchEngine.save_state; read back weights_only as on resume
    buffer.seek(0)
    first.remove_hooks()  # the crashed run's optimizer is gone
    second = _build(resumed, kind, layerwise=True)
    second.load_state_dict(torch.load(buffer, weights_only=True))
    _train(resumed, second, range(3, 4))
    _assert_same(straight, resumed)


def test_layerwise_keys_reach_the_settings_and_are_inert_without_their_optimizer():
    assert optimizer_settings(build_config({"use_galore": True, "galore_layerwise": True})).extra.layerwise
    assert optimizer_settings(build_config({"use_apollo": True, "apollo_layerwise": True})).extra.layerwise
    assert not optimizer_settings(build_config({"use_galore": True, "apollo_layerwise": True})).extra.layerwise
    inert = build_config({"galore_layerwise": True, "gradient_accumulation_steps": 4})
    assert not [p for p in cross_key_problems(inert) if "layerwise" in p]


@pytest.mark.parametrize("kind", list(KINDS))
def test_layerwise_refusals_name_the_keys(kind):
    key = f"{kind}_layerwise"
    on = {f"use_{kind}": True, key: True, "optim": "adamw_torch"}
    problems = cross_key_problems(build_config({**on, "gradient_accumulation_steps": 8, "fp16": True}))
    assert any(p.startswith(f"{key} (true) with gradient_accumulation_steps (8)") for p in problems), problems
    assert any(p.startswith(f"{key} (true) with fp16 (true)") for p in problems), problems
    assert not [p for p in cross_key_problems(build_config(on)) if key in p]
    _, problems = plan_engine(build_config(on), world_size=2, has_cuda=False)
    assert any(p.startswith(f"{key} (true) with ddp") and "one process" in p for p in problems), problems
    plan, problems = plan_engine(build_config(on), world_size=1, has_cuda=False)
    assert plan.kind == "local" and not problems
