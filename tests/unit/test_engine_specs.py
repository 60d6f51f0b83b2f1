"""Every engine's record (engines/spec.py) is complete: its class builds, its memory option is one the estimate
models, its checkpoint layouts are told apart, and the planner, the dry run and export reach it."""

from __future__ import annotations

import importlib

import pytest

from shardtune.engines.base import Engine
from shardtune.engines.engine_plan import EnginePlan
from shardtune.engines.fsdp_config import resolve_fsdp_settings
from shardtune.engines.plan import ENGINE_SPECS
from shardtune.estimate.options import OPTION_SPECS

PLANS = [EnginePlan("local"), EnginePlan("ddp"),
         *(EnginePlan("fsdp", fsdp=resolve_fsdp_settings(words, None)[0])
           for words in ("full_shard auto_wrap", "shard_grad_op auto_wrap", "no_shard", "full_shard offload",
                         "hybrid_shard auto_wrap")),
         *(EnginePlan("deepspeed", deepspeed_raw={"zero_optimization": zero}, deepspeed_source="test")
           for zero in ({"stage": 0}, {"stage": 1}, {"stage": 2}, {"stage": 3},
                        {"stage": 3, "offload_optimizer": {"device": "cpu"}}))]


@pytest.mark.parametrize("kind", list(ENGINE_SPECS))
def test_the_record_names_an_engine_class_that_builds_from_a_plan(kind):
    module, name = ENGINE_SPECS[kind].engine.split(":")
    engine_class = getattr(importlib.import_module(module), name)
    assert issubclass(engine_class, Engine) and callable(engine_class.from_plan)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.kind}-{p.fsdp or p.deepspeed_raw}")
def test_every_plan_maps_to_an_option_the_estimate_models_and_describes_itself(plan):
    spec = ENGINE_SPECS[plan.kind]
    assert spec.memory_layout(plan).option in {s.name for s in OPTION_SPECS}
    assert spec.describe(plan).startswith(plan.kind)


def test_checkpoint_layouts_are_told_apart():
    markers = [layout.marker for spec in ENGINE_SPECS.values() for layout in spec.checkpoints]
    names = {layout.name: layout.marker for spec in ENGINE_SPECS.values() for layout in spec.checkpoints}
    assert len(set(markers)) == len(names) == len(set(names.values()))
