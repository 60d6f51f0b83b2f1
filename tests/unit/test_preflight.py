"""The launching host's preflight: every problem in one round, a plan the ranks trust, the engine `check` estimates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from shardtune.cli import main
from shardtune.launch import preflight as preflight_module
from shardtune.launch import worker
from shardtune.launch.preflight import RunPlan, plan_run, read_run_plan, write_run_plan
from shardtune.world import RankEnv

REPO = Path(__file__).resolve().parents[2]
LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_PORT", "FORCE_TORCHRUN", "RANK", "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def no_launch_variables(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def write_config(tmp_path: Path, model: Path, **values) -> Path:
    config = {"model_name_or_path": str(model), "dataset": "demo", "dataset_dir": str(REPO / "data"),
              "template": "chatml", "output_dir": str(tmp_path / "run"), "max_steps": 2, "cutoff_len": 64,
              **values}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_type_cross_key_and_engine_errors_arrive_in_one_round(tiny_model_dir, tmp_path, capsys):
    path = write_config(tmp_path, tiny_model_dir,
                        learning_rate="fast",  # a type error
                        bf16=True, fp16=True,  # a cross-key error
                        deepspeed="z3", fsdp="full_shard auto_wrap")  # an engine error
    assert main(["check", str(path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardtune: error:")]
    joined = "\n".join(errors)
    assert "learning_rate" in joined and "'fast'" in joined
    assert "bf16 (true) and fp16 (true) are both set" in joined
    assert "are both set; choose one engine" in joined


def test_a_rule_about_a_key_with_an_unusable_value_is_left_out(tiny_model_dir, tmp_path, capsys):
    """max_steps: soon cannot be read; the default standing in must not be judged (with epochs 0 it would be)."""
    path = write_config(tmp_path, tiny_model_dir, max_steps="soon", num_train_epochs=0)
    assert main(["check", str(path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardtune: error:")]
    assert len(errors) == 1 and "max_steps" in errors[0] and "soon" in errors[0]


def test_ranks_trust_the_plan_and_do_not_validate_again(tiny_model_dir, tmp_path, monkeypatch):
    plan = plan_run([str(write_config(tmp_path, tiny_model_dir, deepspeed="z2"))])
    path = write_run_plan(plan)
    data = json.loads(path.read_text())
    data["config"]["dataset"] = ["no_such_dataset"]  # would fail any validation
    path.write_text(json.dumps(data))

    def validating(*args, **kwargs):
        raise AssertionError("a rank started by shardtune ran the preflight again")

    monkeypatch.setattr(worker, "preflight", validating)
    ranked = worker.rank_plan([str(path)], RankEnv(rank=1, world_size=2, local_world_size=2))
    assert ranked.config.dataset == ["no_such_dataset"]
    assert ranked.engine == plan.engine and ranked.engine.kind == "deepspeed"
    assert (ranked.layout.world_size, ranked.layout.global_batch) == (2, 2 * plan.layout.global_batch)


def test_a_users_own_launcher_gets_the_whole_preflight_on_each_rank(tiny_model_dir, tmp_path, monkeypatch):
    config = write_config(tmp_path, tiny_model_dir)
    assert read_run_plan(str(config)) is None  # a YAML is never mistaken for a plan
    seen = []
    real = preflight_module.preflight

    def counting(*args, **kwargs) -> RunPlan:
        seen.append(args[1:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(worker, "preflight", counting)
    ranked = worker.rank_plan([str(config)], RankEnv(rank=0, world_size=4, local_world_size=2))
    assert seen == [(2, 2)] and ranked.layout.world_size == 4


def test_plan_file_keeps_the_engine_plan(tiny_model_dir, tmp_path):
    plan = plan_run([str(write_config(tmp_path, tiny_model_dir, fsdp="shard_grad_op offload auto_wrap",
                                      fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap":
                                                   ["LlamaDecoderLayer"]}))])
    config, engine = read_run_plan(str(write_run_plan(plan)))
    assert engine == plan.engine and engine.fsdp.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer",)
    assert config == plan.config


@pytest.mark.parametrize(("strategy", "offload", "option"), [("SHARD_GRAD_OP", False, "FSDP SHARD_GRAD_OP"),
                                                             ("FULL_SHARD", True, "FSDP offload")])
def test_check_estimates_the_engine_an_accelerate_fsdp_file_asks_for(strategy, offload, option, tmp_path):
    """`fsdp_config: accelerate.yaml` (an accelerate config file): the estimate follows its sharding strategy and
    offload, not FULL_SHARD."""
    from shardtune.estimate.config import configured_option, fit_warning, hardware_for
    from shardtune.estimate.hardware import parse_size

    accelerate = tmp_path / "accelerate.yaml"
    accelerate.write_text(yaml.safe_dump({
        "distributed_type": "FSDP", "num_processes": 8, "mixed_precision": "bf16",
        "fsdp_config": {"fsdp_version": 1, "fsdp_sharding_strategy": strategy, "fsdp_offload_params": offload,
                        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}))
    from shardtune.config.args import load_config

    config, _ = load_config([str(REPO / "examples" / "train_full" / "llama3_full_sft.yaml"),
                             f"fsdp_config={accelerate}"])
    hardware = hardware_for(8, 8, parse_size("80GiB", "gpu"), parse_size("1024GiB", "cpu"))
    assert configured_option(config, hardware).name == option
    # what `check` says: 24 GiB is too little for the file's engine; the warning names that engine
    warning = fit_warning(config, 8, 8, parse_size("24GiB", "gpu"), parse_size("1024GiB", "cpu"))
    assert warning is None or warning.startswith(f"memory: {option} is estimated")


@pytest.mark.parametrize(("values", "expected"), [
    ({"finetuning_type": "lora", "fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 1}},
     "fsdp_config (fsdp_version: 1) with finetuning_type: lora on fused expert weights (gate_up_proj and down_proj "
     "of 4 experts per MoE layer, chosen by lora_target all)"),
    ({"packing": True, "attn_implementation": "sdpa"},
     "moe_aux_loss_coef: transformers computes the router aux loss with a 2-D padding mask"),
    ({"stage": "dpo", "dataset": "demo_dpo", "finetuning_type": "lora", "moe_aux_loss_coef": 0.01},
     "moe_aux_loss_coef (0.01): stage dpo does not add the router auxiliary loss yet"),
], ids=["fsdp1-lora-fused-experts", "packed-aux-loss", "preference-aux-loss"])
def test_mixture_of_experts_limits_are_refused_before_launch(arch_model_dir, tmp_path, capsys, values, expected):
    """Read from config.json on the launching host: no rank is started to find out (they check again)."""
    config = json.loads((arch_model_dir("qwen3_moe") / "config.json").read_text())
    assert config.get("router_aux_loss_coef"), "the tiny Qwen3-MoE must have an aux loss for these rules to apply"
    path = write_config(tmp_path, arch_model_dir("qwen3_moe"), template="qwen3", **values)
    assert main(["check", str(path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardtune: error:")]
    assert len(errors) == 1 and expected in errors[0], errors


def test_the_same_moe_model_passes_where_its_limits_do_not_apply(arch_model_dir, tmp_path):
    """FSDP1 LoRA on the attention projections, packing without the aux loss, DPO with moe_aux_loss_coef: 0."""
    model = arch_model_dir("qwen3_moe")
    for values in ({"finetuning_type": "lora", "lora_target": "q_proj,v_proj", "fsdp": "full_shard auto_wrap",
                    "fsdp_config": {"fsdp_version": 1}},
                   {"packing": True, "attn_implementation": "sdpa", "moe_aux_loss_coef": 0},
                   {"stage": "dpo", "dataset": "demo_dpo", "finetuning_type": "lora", "moe_aux_loss_coef": 0}):
        assert main(["check", str(write_config(tmp_path, model, template="qwen3", **values))]) == 0, values


@pytest.mark.parametrize(("overrides", "needed"), [
    ([], False),
    (["optim=adamw_8bit"], True),
    (["quantization_bit=4"], True),
    (["use_galore=true"], True),
])
def test_a_rank_leaves_bitsandbytes_out_unless_the_run_uses_it(overrides, needed):
    """peft imports bitsandbytes (and with it torch's inductor) whenever it is installed; a rank that never calls
    it marks it absent, so that import is skipped."""
    import importlib.util
    import sys

    from shardtune.config.args import load_config

    config, _ = load_config([str(REPO / "examples" / "tiny" / "sft_lora.yaml"), *overrides])
    assert worker.needs_bitsandbytes(config) is needed
    before = sys.modules.pop("bitsandbytes", None)
    try:
        worker.leave_out_bitsandbytes(config)
        if needed:
            assert "bitsandbytes" not in sys.modules
        else:
            assert sys.modules["bitsandbytes"] is None and importlib.util.find_spec("bitsandbytes") is None
            with pytest.raises(ImportError):
                import bitsandbytes  # noqa: F401
    finally:  # the rest of this session imports it as usual
        sys.modules.pop("bitsandbytes", None)
        if before is not None:
            sys.modules["bitsandbytes"] = before


def test_helper_processes_a_node_cannot_hold_are_refused_before_launch(tiny_model_dir, tmp_path) -> None:
    """A data loader count meant for another machine forked this 2-CPU machine out of memory (1,020 workers,
    found by the schema fuzzer): refused at check, naming the key; LLaMA-Factory's 16 tokenisers still run."""
    from shardtune.cli import main

    base = ["check", "examples/tiny/sft_lora.yaml", f"model_name_or_path={tiny_model_dir}",
            f"output_dir={tmp_path / 'out'}"]
    assert main([*base, "preprocessing_num_workers=16", "dataloader_num_workers=4"]) == 0
    assert main([*base, "dataloader_num_workers=100000"]) == 2
    assert main([*base, "preprocessing_num_workers=100000"]) == 2


def test_check_says_what_train_on_this_machine_would_refuse(tiny_model_dir, tmp_path, capsys) -> None:
    """check passes a config meant for another machine's ranks, and warns of what train would refuse here."""
    from shardtune.cli import main

    code = main(["check", "examples/tiny/sft_lora.yaml", f"model_name_or_path={tiny_model_dir}",
                 f"output_dir={tmp_path / 'out'}", "enable_liger_kernel=true"])
    err = capsys.readouterr().err
    assert code == 0 and "shardtune: warning: on this machine, train would refuse: enable_liger_kernel" in err


@pytest.mark.parametrize("key, value", [("lora_target", "demo demo_sharegpt"), ("additional_target", "zzzz")])
def test_module_names_the_model_lacks_are_refused_by_check(key, value, tiny_model_dir, tmp_path, capsys) -> None:
    """Found by the schema fuzzer: names absent from the model with no close one passed check, and train refused."""
    from shardtune.cli import main

    code = main(["check", "examples/tiny/sft_lora.yaml", f"model_name_or_path={tiny_model_dir}",
                 f"output_dir={tmp_path / 'out'}", f"{key}={value}"])
    assert code == 2 and f"shardtune: error: {key}: {value} not found in the model" in capsys.readouterr().err
