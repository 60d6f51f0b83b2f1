"""LLaMA-Factory's optimizer replacements: Muon (torch.optim.Muon + AdamW in one ChainedOptimizer), GaLore
(galore-torch), APOLLO (apollo-torch) and Adam-mini (adam-mini). Each is checked against its own package called
directly on a copy of the model; the engine rules (one process and DDP only) and the refusals name their keys."""

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
from shardtune.optim.replacements import ChainedOptimizer, is_muon_matrix
from shardtune.optim.settings import ExtraOptimizer, OptimizerSettings, optimizer_settings
from shardtune.optim.sharded_muon import ShardedMuon

LR, WD = 1e-2, 0.01


@pytest.fixture(scope="module")
def full_model(tiny_model_dir) -> torch.nn.Module:
    torch.manual_seed(0)
    return ModelSource(str(tiny_model_dir), FinetuningSettings(finetuning_type="full")).load_full()


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _backward(model: torch.nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    model(**_batch()).loss.backward()


def _ours(model: torch.nn.Module, kind: str, **extra) -> torch.optim.Optimizer:
    settings = OptimizerSettings(learning_rate=LR, weight_decay=WD, extra=ExtraOptimizer(kind, **extra))
    return build_optimizer([p for p in model.parameters() if p.requires_grad], settings, None, model)


def _step_both(model, ours_of, reference_of, steps: int = 2) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Step a copy with our optimizer and another copy with the package's; return both."""
    mine, theirs = copy.deepcopy(model), copy.deepcopy(model)
    ours, reference = ours_of(mine), reference_of(theirs)
    for _ in range(steps):
        for m, optimizer in ((mine, ours), (theirs, reference)):
            _backward(m)
            optimizer.step()
    return mine, theirs


def _assert_same_and_moved(model, mine, theirs) -> None:
    for (name, a), b in zip(mine.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert all(not torch.equal(a, b) for a, b in zip(mine.parameters(), model.parameters(), strict=True))


# --- config ---

def test_keys_reach_the_settings_with_llamafactory_defaults():
    assert optimizer_settings(build_config({"use_muon": True})).extra.kind == "muon"
    assert optimizer_settings(build_config({"use_adam_mini": True})).extra.kind == "adam_mini"
    galore = optimizer_settings(build_config({"use_galore": True})).extra
    assert (galore.kind, galore.target, galore.rank, galore.update_interval, galore.scale, galore.proj_type) == (
        "galore", ("all",), 16, 200, 2.0, "std")
    apollo = optimizer_settings(build_config({"use_apollo": True, "apollo_target": "q_proj,v_proj"})).extra
    assert (apollo.kind, apollo.target, apollo.rank, apollo.scale, apollo.apollo_proj, apollo.apollo_scale_type) == (
        "apollo", ("q_proj", "v_proj"), 16, 32.0, "random", "channel")
    assert optimizer_settings(build_config({})).extra.kind is None


def test_cross_key_refusals_name_the_keys():
    problems = cross_key_problems(build_config({"use_muon": True, "use_galore": True}))
    assert any("use_muon and use_galore" in p for p in problems)
    problems = cross_key_problems(build_config({"use_galore": True, "optim": "sgd"}))
    assert any("use_galore (true) with optim (sgd)" in p for p in problems)
    # Off, as a copied LLaMA-Factory file has them: inert (layer-wise: tests/unit/test_layerwise_optimizers.py).
    assert not [p for p in cross_key_problems(build_config({"galore_layerwise": True, "galore_rank": 8}))
                if "galore" in p]


def test_a_missing_package_is_refused_before_launch(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "adam_mini" else real(name, *a))
    problems = cross_key_problems(build_config({"use_adam_mini": True}))
    assert any("pip install adam-mini" in p for p in problems)


FSDP1 = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 1}}


@pytest.mark.parametrize("key", ["use_muon", "use_galore", "use_apollo", "use_adam_mini"])
def test_sharding_engines_are_refused_and_ddp_is_not(key):
    refused = [(FSDP1, "with fsdp"), ({"deepspeed": "z2"}, "with deepspeed")]
    if key != "use_muon":  # Muon gathers FSDP2's row shards (optim/sharded_muon.py)
        refused.append(({"fsdp": "full_shard auto_wrap"}, "with fsdp"))
    for engine, label in refused:
        _, problems = plan_engine(build_config({key: True, **engine}), world_size=2, has_cuda=False)
        assert any(p.startswith(f"{key} (true) {label}") and "whole" in p for p in problems), problems
    plan, problems = plan_engine(build_config({key: True}), world_size=2, has_cuda=False)
    assert plan.kind == "ddp" and not problems


def test_muon_runs_under_fsdp2_and_fsdp1_says_what_to_use():
    plan, problems = plan_engine(build_config({"use_muon": True, "fsdp": "full_shard auto_wrap"}), world_size=2,
                                 has_cuda=False)
    assert plan.kind == "fsdp" and not problems
    _, problems = plan_engine(build_config({"use_muon": True, **FSDP1}), world_size=2, has_cuda=False)
    assert any("fsdp_version 1" in p and "train with fsdp_version: 2" in p for p in problems), problems


# --- Muon ---

def test_muon_takes_hidden_matrices_and_adamw_the_rest(full_model):
    optimizer = _ours(full_model, "muon")
    assert isinstance(optimizer, ChainedOptimizer)
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in full_model.named_parameters()}
    muon_names = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    adamw_names = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert muon_names == {n for n, p in full_model.named_parameters() if is_muon_matrix(n, p)}
    assert any("q_proj" in n for n in muon_names) and not any("embed" in n or "lm_head" in n for n in muon_names)
    assert any("embed_tokens" in n for n in adamw_names) and any("norm" in n for n in adamw_names)
    assert muon_names | adamw_names == set(names.values()) and not muon_names & adamw_names


def _torch_muon(model: torch.nn.Module) -> ChainedOptimizer:
    named = list(model.named_parameters())
    return ChainedOptimizer([
        torch.optim.Muon([p for n, p in named if p.ndim == 2 and "embed" not in n and "lm_head" not in n], lr=LR,
                         weight_decay=WD, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW([p for n, p in named if not (p.ndim == 2 and "embed" not in n and "lm_head" not in n)],
                          lr=LR, weight_decay=WD)])


def test_muon_steps_as_torch_muon_and_adamw_do(full_model):
    mine, theirs = _step_both(full_model, lambda m: _ours(m, "muon"), _torch_muon)
    _assert_same_and_moved(full_model, mine, theirs)


def test_sharded_muon_steps_whole_weights_as_torch_muon(full_model):
    """ShardedMuon's own step loop (torch's functions, the gather between them) on plain tensors is torch's Muon;
    tests/distributed/test_sharded_muon.py checks the same on FSDP2 shards."""
    def sharded(model: torch.nn.Module) -> ChainedOptimizer:
        reference = _torch_muon(model)
        muon, adamw = reference.optimizers
        return ChainedOptimizer([ShardedMuon(muon.param_groups[0]["params"], lr=LR, weight_decay=WD,
                                             adjust_lr_fn="match_rms_adamw"), adamw])

    mine, theirs = _step_both(full_model, sharded, _torch_muon, steps=3)
    _assert_same_and_moved(full_model, mine, theirs)


def test_a_scheduler_drives_both_halves_of_muon_also_after_loading(full_model):
    optimizer = _ours(copy.deepcopy(full_model), "muon")
    scheduler = build_scheduler(optimizer, "linear", total_steps=10, warmup_steps=0)
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for o in optimizer.optimizers for g in o.param_groups] == [pytest.approx(LR * 0.9)] * len(
        optimizer.param_groups)
    optimizer.load_state_dict(optimizer.state_dict())  # as resume does: the children get new group dicts
    scheduler.step()
    assert [g["lr"] for o in optimizer.optimizers for g in o.param_groups] == [pytest.approx(LR * 0.8)] * len(
        optimizer.param_groups)
    for child in optimizer.optimizers:  # as FSDP's resume does (torch's set_state_dict loads each child)
        child.load_state_dict(child.state_dict())
    scheduler.step()
    assert [g["lr"] for o in optimizer.optimizers for g in o.param_groups] == [pytest.approx(LR * 0.7)] * len(
        optimizer.param_groups)


def test_muon_steps_through_a_grad_scaler_as_without_it(full_model):
    """fp16 runs unscale and step through torch's GradScaler, which reads param_groups: both children unscale."""
    plain, scaled = copy.deepcopy(full_model), copy.deepcopy(full_model)
    _backward(plain)
    _ours(plain, "muon").step()
    optimizer, scaler = _ours(scaled, "muon"), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaled.zero_grad(set_to_none=True)
    scaler.scale(scaled(**_batch()).loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    for (name, a), b in zip(plain.named_parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_muon_and_galore_on_lora_take_the_adapter_matrices(tiny_model_dir):
    torch.manual_seed(0)
    lora = ModelSource(str(tiny_model_dir), FinetuningSettings(lora_target=("q_proj", "v_proj"))).load_full()
    names = {id(p): n for n, p in lora.named_parameters()}
    muon, *rest = _ours(lora, "muon").optimizers
    muon_names = [names[id(p)] for g in muon.param_groups for p in g["params"]]
    assert not rest and len(muon_names) == 4 * lora.config.num_hidden_layers
    assert all("lora_A" in n or "lora_B" in n for n in muon_names)
    galore = _ours(lora, "galore", target=("q_proj",), rank=2)
    projected = [names[id(p)] for g in galore.param_groups if "rank" in g for p in g["params"]]
    assert len(projected) == 2 * lora.config.num_hidden_layers and all("q_proj.lora_" in n for n in projected)


def _resumes_exactly(model: torch.nn.Module, build) -> None:
    """Two steps, save the optimizer (loaded as a checkpoint is, weights_only), one more step on a fresh
    optimizer loaded from it: the same weights as three uninterrupted steps."""
    straight, resumed = copy.deepcopy(model), copy.deepcopy(model)
    optimizer = build(straight)
    for _ in range(3):
        _backward(straight)
        optimizer.step()
    first = build(resumed)
    for _ in range(2):
        _backward(resumed)
        first.step()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = build(resumed)
    second.load_state_dict(torch.load(buffer, weights_only=True))
    _backward(resumed)
    second.step()
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_muon_state_round_trips_for_an_exact_resume(full_model):
    _resumes_exactly(full_model, lambda m: _ours(m, "muon"))


# --- GaLore and APOLLO ---

def test_galore_projects_the_targeted_linear_weights(full_model):
    import galore_torch

    optimizer = _ours(full_model, "galore", target=("q_proj", "down_proj"), rank=4)
    assert type(optimizer) is galore_torch.GaLoreAdamW
    names = {id(p): n for n, p in full_model.named_parameters()}
    projected = [g for g in optimizer.param_groups if "rank" in g]
    assert len(projected) == 1 and projected[0]["rank"] == 4 and projected[0]["update_proj_gap"] == 200
    assert {names[id(p)].rsplit(".", 2)[-2] for p in projected[0]["params"]} == {"q_proj", "down_proj"}
    everything = _ours(full_model, "galore")
    projected_all = {names[id(p)] for g in everything.param_groups if "rank" in g for p in g["params"]}
    assert not any("lm_head" in n or "embed" in n for n in projected_all)
    assert len(projected_all) == 7 * full_model.config.num_hidden_layers  # q, k, v, o, gate, up, down


def _reference_groups(model, targets: tuple[str, ...], settings: dict) -> list[dict]:
    named = list(model.named_parameters())
    projected = [p for n, p in named if n.endswith(".weight") and any(t in n for t in targets)]
    ids = {id(p) for p in projected}
    return [{"params": [p for n, p in named if id(p) not in ids and p.ndim < 2], "weight_decay": 0.0},
            {"params": [p for n, p in named if id(p) not in ids and p.ndim >= 2], "weight_decay": WD},
            {"params": projected, "weight_decay": WD, **settings}]


def test_galore_steps_as_galore_torch_does(full_model):
    import galore_torch

    settings = {"rank": 4, "update_proj_gap": 200, "scale": 2.0, "proj_type": "std"}
    mine, theirs = _step_both(full_model, lambda m: _ours(m, "galore", target=("q_proj", "up_proj"), rank=4),
                              lambda m: galore_torch.GaLoreAdamW(_reference_groups(m, ("q_proj", "up_proj"),
                                                                                   settings), lr=LR, eps=1e-8))
    _assert_same_and_moved(full_model, mine, theirs)


def test_galore_state_round_trips_for_an_exact_resume(full_model):
    _resumes_exactly(full_model, lambda m: _ours(m, "galore", rank=4))


def test_apollo_steps_as_apollo_torch_does(full_model):
    import apollo_torch

    settings = {"rank": 4, "update_proj_gap": 200, "scale": 32.0, "proj_type": "std", "proj": "random",
                "scale_type": "channel", "scale_front": False}
    targets = ("k_proj", "gate_proj")
    mine, theirs = _step_both(full_model, lambda m: _ours(m, "apollo", target=targets, rank=4, scale=32.0),
                              lambda m: apollo_torch.APOLLOAdamW(_reference_groups(m, targets, settings), lr=LR,
                                                                 eps=1e-8))
    _assert_same_and_moved(full_model, mine, theirs)


def test_apollo_state_round_trips_for_an_exact_resume(full_model):
    _resumes_exactly(full_model, lambda m: _ours(m, "apollo", rank=4, scale=32.0))


# --- Adam-mini ---

def test_adam_mini_steps_as_the_package_does(full_model):
    from adam_mini import Adam_mini

    config = full_model.config
    mine, theirs = _step_both(
        full_model, lambda m: _ours(m, "adam_mini"),
        lambda m: Adam_mini(named_parameters=m.named_parameters(), lr=LR, weight_decay=WD, eps=1e-8,
                            dim=config.hidden_size, n_heads=config.num_attention_heads,
                            n_kv_heads=config.num_key_value_heads, verbose=False))
    assert type(_ours(full_model, "adam_mini")) is Adam_mini
    _assert_same_and_moved(full_model, mine, theirs)


def test_adam_mini_state_round_trips_for_an_exact_resume(full_model):
    _resumes_exactly(full_model, lambda m: _ours(m, "adam_mini"))


@pytest.mark.parametrize("finetuning_type", ["lora", "oft"])
def test_adam_mini_with_an_adapter_is_refused_before_launch(finetuning_type):
    """Found by the schema fuzzer: Adam-mini's step failed on a LoRA model (it splits q_proj/k_proj... by heads)."""
    problems = cross_key_problems(build_config({"use_adam_mini": True, "finetuning_type": finetuning_type}))
    assert any(p.startswith(f"use_adam_mini (true) with finetuning_type ({finetuning_type})") for p in problems)
    assert not any("use_adam_mini" in p for p in cross_key_problems(build_config({"use_adam_mini": True,
                                                                                  "finetuning_type": "freeze"})))
