"""DeepSpeed JSON translation: presets, "auto" resolution and the checks, all without processes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from shardtune.engines.deepspeed_checks import build_deepspeed_config, deepspeed_problems
from shardtune.engines.deepspeed_config import (
    AUTO,
    DEEPSPEED_TOP_LEVEL_KEYS,
    IGNORED_FOREIGN_KEYS,
    PRESET_DIR,
    PRESETS,
    REMOVED_TOP_LEVEL_KEYS,
    DeepSpeedInputs,
    gathers_weights_on_save,
    load_deepspeed_setting,
    resolve_deepspeed_config,
    zero_stage,
)
from shardtune.errors import ConfigError
from shardtune.optim.settings import OptimizerSettings
from shardtune.world import WorldLayout

REPO = Path(__file__).resolve().parents[2]
INPUTS = DeepSpeedInputs(layout=WorldLayout(1, 2, micro_batch=2, grad_accum=4), max_grad_norm=1.0,
                         bf16=True, fp16=False, hidden_size=64, total_steps=100, warmup_steps=10)
SOURCE = "ds.json"


def autos(node, path=""):
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in autos(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in autos(v, f"{path}.{i}")]
    return [path] if node == AUTO else []


def problems_for(raw: dict, inputs: DeepSpeedInputs = INPUTS) -> list[str]:
    return deepspeed_problems(raw, inputs, SOURCE)


def z2(**top) -> dict:
    raw, _ = load_deepspeed_setting("z2")
    raw.update(top)
    return raw


# --- presets ---

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_resolves_with_no_auto_left(name):
    raw, source = load_deepspeed_setting(name)
    before = json.dumps(raw)
    assert deepspeed_problems(raw, INPUTS, source) == []
    resolved = resolve_deepspeed_config(raw, INPUTS)
    assert autos(resolved) == []
    assert json.dumps(raw) == before, "resolution must not modify its input"
    assert json.dumps(resolved) == json.dumps(resolve_deepspeed_config(raw, INPUTS)), "must be deterministic"
    assert resolved["train_micro_batch_size_per_gpu"] == 2
    assert resolved["gradient_accumulation_steps"] == 4
    assert resolved["train_batch_size"] == 2 * 4 * 2
    assert resolved["gradient_clipping"] == 1.0
    assert resolved["bf16"]["enabled"] is True and resolved["fp16"]["enabled"] is False
    assert zero_stage(resolved) == int(name[1])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_example_files_are_byte_identical_to_presets(name):
    example = REPO / "examples" / "deepspeed" / PRESETS[name]
    assert example.read_bytes() == (PRESET_DIR / PRESETS[name]).read_bytes()


def test_examples_folder_holds_exactly_the_presets():
    assert sorted(p.name for p in (REPO / "examples" / "deepspeed").glob("*.json")) == sorted(PRESETS.values())


def test_offload_presets_offload_to_cpu():
    z2o, _ = load_deepspeed_setting("z2_offload")
    z3o, _ = load_deepspeed_setting("z3_offload")
    assert z2o["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in z2o["zero_optimization"]
    assert z3o["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert z3o["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


# --- bucket sizes ---

def test_zero3_bucket_sizes_follow_hidden_size_above_deepspeed_floors():
    raw, _ = load_deepspeed_setting("z3")
    zero = resolve_deepspeed_config(raw, replace(INPUTS, hidden_size=32768))["zero_optimization"]
    assert zero["reduce_bucket_size"] == 32768 * 32768
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 32768 * 32768)
    assert zero["stage3_param_persistence_threshold"] == 10 * 32768


def test_small_models_get_deepspeed_buckets_and_keep_adapters_and_norms_whole():
    """hidden 896 (Qwen2.5-0.5B): hidden^2 buckets would be smaller than one MLP weight (896 x 4864)."""
    raw, _ = load_deepspeed_setting("z3")
    zero = resolve_deepspeed_config(raw, replace(INPUTS, hidden_size=896))["zero_optimization"]
    assert zero["reduce_bucket_size"] == 500_000_000 > 896 * 4864
    assert zero["stage3_prefetch_bucket_size"] == 50_000_000
    persistence = zero["stage3_param_persistence_threshold"]
    assert persistence == 100_000 > 896 * 64 and persistence < 896 * 896  # a rank-64 adapter whole, no weight
    tiny = resolve_deepspeed_config(raw, replace(INPUTS, hidden_size=64))["zero_optimization"]
    assert tiny["stage3_param_persistence_threshold"] == 64 * 64 // 4  # the tiny test model's weights stay sharded


def test_explicit_sizes_win_over_auto():
    raw, _ = load_deepspeed_setting("z3")
    raw = {**raw, "zero_optimization": {**raw["zero_optimization"], "reduce_bucket_size": 1234,
                                        "stage3_param_persistence_threshold": 10}}
    zero = resolve_deepspeed_config(raw, replace(INPUTS, hidden_size=896))["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_param_persistence_threshold"]) == (1234, 10)


def test_bucket_sizes_fall_back_to_deepspeed_defaults_without_hidden_size():
    raw, _ = load_deepspeed_setting("z3_offload")
    zero = resolve_deepspeed_config(raw, replace(INPUTS, hidden_size=None))["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (500_000_000, 50_000_000, 100_000)


# --- contradictions: each names both keys and both values ---

@pytest.mark.parametrize(("change", "expected"), [
    ({"train_micro_batch_size_per_gpu": 4},
     "train_micro_batch_size_per_gpu (4) in ds.json contradicts per_device_train_batch_size (2)"),
    ({"gradient_accumulation_steps": 3},
     "gradient_accumulation_steps (3) in ds.json contradicts gradient_accumulation_steps (4)"),
    ({"train_batch_size": 32},
     "train_batch_size (32) in ds.json contradicts per_device_train_batch_size (2) x gradient_accumulation_steps "
     "(4) x world size (2) = 16"),
    ({"gradient_clipping": 0.5}, "gradient_clipping (0.5) in ds.json contradicts max_grad_norm (1.0)"),
    ({"fp16": {"enabled": True}}, "fp16.enabled (true) in ds.json contradicts fp16 (false)"),
    ({"bf16": {"enabled": False}}, "bf16.enabled (false) in ds.json contradicts bf16 (true)"),
])
def test_explicit_value_contradicting_a_training_key(change, expected):
    problems = problems_for(z2(**change))
    assert any(p.startswith(expected) for p in problems), problems


def test_explicit_values_that_agree_are_fine():
    raw = z2(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4, train_batch_size=16,
             gradient_clipping=1.0, bf16={"enabled": True}, fp16={"enabled": False})
    assert problems_for(raw) == []


def test_fp16_and_bf16_both_enabled():
    raw = z2(fp16={"enabled": True}, bf16={"enabled": True})
    problems = problems_for(raw, replace(INPUTS, fp16=True))
    assert any("fp16 and bf16 are both enabled" in p for p in problems), problems


def test_non_numeric_batch_value():
    assert any("train_micro_batch_size_per_gpu in ds.json: must be a number" in p
               for p in problems_for(z2(train_micro_batch_size_per_gpu="2")))


# --- ZeRO rules ---

def with_zero(preset: str, **zero) -> dict:
    raw, _ = load_deepspeed_setting(preset)
    raw["zero_optimization"].update(zero)
    return raw


@pytest.mark.parametrize("stage", [4, -1, "3", True])
def test_stage_must_be_0_to_3(stage):
    problems = problems_for(with_zero("z2", stage=stage))
    assert problems == [f"zero_optimization.stage ({json.dumps(stage)}) in ds.json: must be 0, 1, 2 or 3"]


def test_offload_param_needs_stage_3():
    problems = problems_for(with_zero("z2_offload", offload_param={"device": "cpu"}))
    assert any("offload_param in ds.json needs stage 3, but stage is 2" in p for p in problems), problems


def test_offload_param_device_none_is_no_offload():
    assert problems_for(with_zero("z2", offload_param={"device": "none"})) == []


def test_offload_optimizer_needs_a_zero_stage():
    problems = problems_for(with_zero("z0", offload_optimizer={"device": "cpu"}))
    assert any("offload_optimizer in ds.json needs stage 1, 2 or 3, but stage is 0" in p for p in problems)


@pytest.mark.parametrize("gather", [False, None])
def test_zero3_without_gathered_save_is_accepted(gather):
    """The final save then gathers one module at a time (engines/deepspeed_save.py) instead of refusing."""
    raw = with_zero("z3")
    if gather is None:
        del raw["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    else:
        raw["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
    assert problems_for(raw) == []
    assert not gathers_weights_on_save(raw)


def test_zero3_accepts_the_unprefixed_gather_key():
    raw = with_zero("z3")
    del raw["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    raw["zero_optimization"]["gather_16bit_weights_on_model_save"] = True
    assert problems_for(raw) == []
    assert gathers_weights_on_save(raw)


# --- optimizers ---

def test_json_optimizer_without_cpu_version_cannot_be_offloaded():
    raw = with_zero("z2_offload")
    raw["optimizer"] = {"type": "Lamb", "params": {"lr": AUTO}}
    problems = problems_for(raw)
    assert any('optimizer.type ("Lamb") in ds.json has no CPU implementation' in p for p in problems), problems


def test_json_adamw_with_offload_is_fine_and_its_autos_resolve():
    raw = with_zero("z2_offload")
    raw["optimizer"] = {"type": "AdamW", "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}}
    raw["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
                                                            "warmup_num_steps": AUTO, "total_num_steps": AUTO}}
    assert problems_for(raw) == []
    inputs = replace(INPUTS, optimizer=OptimizerSettings(learning_rate=2e-4, weight_decay=0.1))
    resolved = resolve_deepspeed_config(raw, inputs)
    assert resolved["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}
    assert resolved["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-4,
                                               "warmup_num_steps": 10, "total_num_steps": 100}


def test_scheduler_total_steps_auto_needs_the_step_count():
    raw = z2(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": AUTO}})
    problems = problems_for(raw, replace(INPUTS, total_steps=None))
    assert any(p.startswith("scheduler.params.total_num_steps in ds.json") for p in problems), problems


def test_client_optimizer_offload_needs_adam():
    problems = problems_for(with_zero("z2_offload"), replace(INPUTS, optimizer=OptimizerSettings(optim="sgd")))
    assert any("runs DeepSpeedCPUAdam, which optim (sgd) cannot become" in p for p in problems), problems
    relaxed = with_zero("z2_offload")
    relaxed["zero_force_ds_cpu_optimizer"] = False
    assert problems_for(relaxed, replace(INPUTS, optimizer=OptimizerSettings(optim="sgd"))) == []


def test_untested_optimizer_under_zero_needs_the_opt_in():
    raw = z2()
    del raw["zero_allow_untested_optimizer"]
    problems = problems_for(raw, replace(INPUTS, optimizer=OptimizerSettings(optim="adafactor")))
    assert any("optim (adafactor) is not one DeepSpeed ZeRO tested" in p for p in problems), problems
    assert problems_for(raw) == []  # adamw_torch is tested


# --- other rules ---

def test_unknown_top_level_key_suggests_the_real_one():
    problems = problems_for(z2(zero_optimisation={"stage": 2}))
    assert problems == ["zero_optimisation in ds.json: not a DeepSpeed 0.19.8 key (DeepSpeed would ignore it); "
                        "did you mean zero_optimization?"]


def test_removed_deepspeed_feature_is_named():
    [problem] = problems_for(z2(elasticity={"enabled": True}))
    assert problem.startswith("elasticity in ds.json: DeepSpeed 0.19.8 removed")


def test_llama_factory_no_op_blocks_are_accepted_and_dropped():
    raw = z2(comms_config={"verbose": False}, monitor_config={"enabled": True})
    assert problems_for(raw) == []
    assert IGNORED_FOREIGN_KEYS.isdisjoint(resolve_deepspeed_config(raw, INPUTS))


def test_auto_where_shardtune_has_no_value():
    problems = problems_for(with_zero("z2", overlap_comm=AUTO))
    assert problems == ['zero_optimization.overlap_comm in ds.json: shardtune has no value for "auto" here; '
                        "set it explicitly"]


def test_deepspeed_native_auto_is_left_to_deepspeed():
    raw = z2(data_types={"keep_in_fp32_modules": AUTO})
    assert problems_for(raw) == []
    assert resolve_deepspeed_config(raw, INPUTS)["data_types"] == {}


def test_training_keys_missing_from_the_json_are_filled():
    resolved = resolve_deepspeed_config({"zero_optimization": {"stage": 1}}, INPUTS)
    assert (resolved["train_batch_size"], resolved["train_micro_batch_size_per_gpu"],
            resolved["gradient_accumulation_steps"], resolved["gradient_clipping"]) == (16, 2, 4, 1.0)
    assert resolved["bf16"] == {"enabled": True} and resolved["fp16"] == {"enabled": False}


def test_gradient_sum_and_unmanaged_accumulation():
    problems = problems_for(z2(gradient_allreduce_op="max", managed_gradient_accumulation=False))
    assert any(p.startswith('gradient_allreduce_op ("max")') for p in problems)
    assert any(p.startswith("managed_gradient_accumulation (false)") for p in problems)
    assert any("not support it with stage 3" in p for p in problems_for(with_zero("z3") | {
        "gradient_allreduce_op": "sum"}))


# --- loading ---

def test_preset_name_resolves_to_the_shipped_file():
    raw, source = load_deepspeed_setting("z3_offload")
    assert source == "preset z3_offload (ds_z3_offload_config.json)"
    assert raw == json.loads((PRESET_DIR / "ds_z3_offload_config.json").read_text())


def test_path_and_inline_mapping(tmp_path):
    path = tmp_path / "my_ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    raw, source = load_deepspeed_setting(str(path))
    assert raw == {"zero_optimization": {"stage": 2}} and source == str(path)
    inline = {"zero_optimization": {"stage": 1}}
    raw, source = load_deepspeed_setting(inline)
    raw["zero_optimization"]["stage"] = 3
    assert inline["zero_optimization"]["stage"] == 1, "the caller's mapping must not be shared"
    assert source == "the inline deepspeed mapping"


def test_unknown_preset_or_missing_file_lists_the_presets():
    with pytest.raises(ConfigError) as err:
        load_deepspeed_setting("z4")
    assert str(err.value) == ("deepspeed (z4): no such preset or file; presets are: "
                              "z0, z1, z2, z2_offload, z3, z3_offload")


def test_invalid_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "train_batch_size": "auto",\n  "zero_optimization": {"stage": 2,}\n}\n')
    with pytest.raises(ConfigError) as err:
        load_deepspeed_setting(str(path))
    assert str(err.value).startswith(f"deepspeed: {path} is not valid JSON: ")
    assert str(err.value).endswith("at line 3, column 36")


def test_duplicate_key_and_non_object(tmp_path):
    dup = tmp_path / "dup.json"
    dup.write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    with pytest.raises(ConfigError, match="has the key 'stage' twice"):
        load_deepspeed_setting(str(dup))
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object, not list"):
        load_deepspeed_setting(str(listing))


def test_build_raises_every_problem_at_once():
    raw = z2(train_micro_batch_size_per_gpu=8, gradient_clipping=0.0, zero_optimisation={})
    with pytest.raises(ConfigError) as err:
        build_deepspeed_config(raw, INPUTS)
    assert len(err.value.problems) == 3


def test_known_keys_cover_what_deepspeed_reads():
    """Guard for DeepSpeed upgrades: every top-level key its config parser reads is in our list."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    read: set[str] = set()

    class Recording(dict):
        def get(self, key, default=None):
            read.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            read.add(key)
            return super().__contains__(key)

        def __copy__(self):
            return Recording(self)

    DeepSpeedConfig(Recording({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}))
    assert read, "the recording dict saw no key: DeepSpeedConfig changed how it reads its input"
    assert read - DEEPSPEED_TOP_LEVEL_KEYS - REMOVED_TOP_LEVEL_KEYS == set()


# --- the save check every engine and export use (model/saved.py) ---

def test_save_check_catches_empty_and_missing_weights(tmp_path):
    import torch
    from safetensors.torch import save_file

    from shardtune.model.saved import expected_saved_parameters, saved_weights_problem

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model.register_buffer("persistent", torch.zeros(2))
    model.register_buffer("recomputed", torch.zeros(5), persistent=False)
    expected = expected_saved_parameters(model)
    assert expected == 4 * 3 + 3 + 3 + 3 + 2
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    assert saved_weights_problem(tmp_path, expected) is None
    save_file({"0.weight": torch.empty(0)}, str(tmp_path / "model.safetensors"))
    message = saved_weights_problem(tmp_path, expected)
    assert message is not None and "empty tensors: ['0.weight']" in message
    assert "no .safetensors file" in saved_weights_problem(tmp_path / "nothing", expected)


@pytest.mark.parametrize(("op", "factor"), [("mean", 2.0), ("sum", 1.0)])
def test_loss_factor_undoes_deepspeed_rank_averaging(op, factor):
    import torch

    from shardtune.engines.base import PrecisionSettings
    from shardtune.engines.deepspeed import DeepSpeedEngine
    from shardtune.engines.distributed import DistContext

    ctx = DistContext(rank=0, local_rank=0, world_size=2, local_world_size=2, device=torch.device("cpu"),
                      backend="gloo")
    engine = DeepSpeedEngine({"gradient_allreduce_op": op, "zero_optimization": {"stage": 2}}, PrecisionSettings(),
                             ctx)
    assert engine.loss_scale_for_mean_reduction == factor
    assert engine.zero_stage == 2 and engine.name == "deepspeed"


def test_resume_on_another_world_size_is_refused_only_for_optimizer_state_on_nvme(tmp_path):
    from shardtune.engines.deepspeed_config import resume_problems

    shards = tmp_path / "checkpoint-3" / "deepspeed"
    shards.mkdir(parents=True)
    for rank in (0, 1):
        (shards / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    zero2 = {"zero_optimization": {"stage": 2}}
    nvme = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}}
    assert resume_problems(zero2, tmp_path / "checkpoint-3", world_size=1) == []
    assert resume_problems(nvme, tmp_path / "checkpoint-3", world_size=2) == []
    [problem] = resume_problems(nvme, tmp_path / "checkpoint-3", world_size=1)
    assert "2 processes" in problem and "NVMe" in problem and "shardtune export" in problem
