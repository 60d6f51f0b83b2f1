"""Checkpoints for every engine family: resume continues the loss curve, across world sizes, after SIGKILL."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import cli_env, crash_after_checkpoint, overrides_merged, run_and_kill_a_worker, run_cli

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

RUN = ("examples/tiny/sft_full.yaml", "max_steps=6", "save_steps=3", "logging_steps=1", "do_eval=false",
       "eval_strategy=no", "val_size=0", "plot_loss=false", "max_samples=80", "gradient_accumulation_steps=2",
       "learning_rate=1e-3", "lr_scheduler_type=cosine", "warmup_steps=1")


def train(model: Path, out: Path, nproc: int, micro: int, *extra: str, overwrite: bool = True) -> None:
    env = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(nproc)}
    result = run_cli("train", *RUN, f"model_name_or_path={model}", f"output_dir={out}",
                     f"per_device_train_batch_size={micro}", f"overwrite_output_dir={str(overwrite).lower()}",
                     *extra, **env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def losses_by_step(out: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return {r["current_steps"]: r["loss"] for r in records if "loss" in r}


def crash_after_first_checkpoint(finished: Path, crashed: Path) -> None:
    """A copy of a finished run as it was when the process died right after checkpoint-3."""
    crash_after_checkpoint(finished, crashed, 3)


def assert_resumed_like_finished(finished: Path, crashed: Path, rel: float) -> None:
    """The resumed copy logged steps 1-6 and steps 4-6 (trained after the resume) match the uninterrupted run."""
    expected, resumed = losses_by_step(finished), losses_by_step(crashed)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(expected[step], rel=rel), (step, resumed, expected)


FAMILIES = {
    "ddp": (),
    "fsdp2-sharded": ("fsdp=full_shard auto_wrap",),
    "fsdp2-full_state_dict": ("fsdp=full_shard auto_wrap", "fsdp_config={'fsdp_state_dict_type': 'FULL_STATE_DICT'}"),
    "fsdp1-full_state_dict": ("fsdp=full_shard auto_wrap",
                              "fsdp_config={'fsdp_version': 1, 'fsdp_state_dict_type': 'FULL_STATE_DICT'}"),
    "deepspeed-z2": ("deepspeed=z2",),
    "deepspeed-z3": ("deepspeed=z3",),
    "fsdp2-lora": ("fsdp=full_shard auto_wrap", "finetuning_type=lora"),
    "deepspeed-z3-lora": ("deepspeed=z3", "finetuning_type=lora"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_resume_matches_uninterrupted_run(family, tiny_model_dir, tmp_path):
    finished, crashed = tmp_path / "finished", tmp_path / "crashed"
    train(tiny_model_dir, finished, 2, 2, *FAMILIES[family])
    assert (finished / "checkpoint-3" / "COMPLETE").is_file()
    crash_after_first_checkpoint(finished, crashed)
    result = train(tiny_model_dir, crashed, 2, 2, *FAMILIES[family], overwrite=False)
    assert "resuming from" in result.stdout
    assert_resumed_like_finished(finished, crashed, rel=1e-3)


RESHARDED = {**FAMILIES, "deepspeed-z2-lora": ("deepspeed=z2", "finetuning_type=lora")}


@pytest.mark.parametrize(("family", "writers", "readers"), [
    ("fsdp2-sharded", 2, 1), ("deepspeed-z2", 2, 1), ("deepspeed-z2", 1, 2), ("deepspeed-z2-lora", 2, 1),
    ("deepspeed-z3", 2, 1),
])
def test_resume_on_a_different_world_size(family, writers, readers, tiny_model_dir, tmp_path):
    """Written by N processes, resumed by M with the same global batch: the curve continues."""
    finished, crashed = tmp_path / "finished", tmp_path / "crashed"
    train(tiny_model_dir, finished, writers, 4 // writers, *RESHARDED[family])
    crash_after_first_checkpoint(finished, crashed)
    result = train(tiny_model_dir, crashed, readers, 4 // readers, *RESHARDED[family], overwrite=False)
    if family.startswith("deepspeed"):
        assert f"written by {writers} processes, resuming on {readers}" in result.stdout
    expected, resumed = losses_by_step(finished), losses_by_step(crashed)
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(expected[step], rel=2e-3), (step, resumed, expected)


def test_a_run_killed_while_saving_resumes_from_the_previous_checkpoint(tiny_model_dir, tmp_path):
    """The state a SIGKILL in the middle of writing checkpoint-6 leaves: shards half written, no COMPLETE."""
    finished, crashed = tmp_path / "finished", tmp_path / "crashed"
    train(tiny_model_dir, finished, 2, 2, *FAMILIES["deepspeed-z2"])
    crash_after_first_checkpoint(finished, crashed)
    partial = crashed / "checkpoint-6"
    shutil.copytree(crashed / "checkpoint-3", partial)
    (partial / "COMPLETE").unlink()
    for shard in (partial / "deepspeed").glob("*.pt"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = train(tiny_model_dir, crashed, 2, 2, *FAMILIES["deepspeed-z2"], overwrite=False)
    assert f"resuming from {crashed / 'checkpoint-3'}" in result.stdout
    expected, resumed = losses_by_step(finished), losses_by_step(crashed)
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-3), (step, resumed, expected)
    assert (partial / "COMPLETE").is_file(), "the half-written folder is replaced by a complete save"


def test_sigkill_of_a_rank_is_recovered_by_torchrun(tiny_model_dir, tmp_path):
    env = cli_env(NPROC_PER_NODE="2", MAX_RESTARTS="1", MASTER_PORT=str(_free_port()), GLOO_SOCKET_IFNAME="lo")
    argv = [sys.executable, "-m", "shardtune", "train", *overrides_merged([
        *RUN, f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path}", "max_steps=120", "save_steps=10",
        "per_device_train_batch_size=2"])]
    code, stdout, stderr = run_and_kill_a_worker(argv, env, tmp_path / "checkpoint-20", is_torchrun_worker,
                                                 finish_timeout=600, start_timeout=300)
    assert code == 0, stderr[-4000:]
    assert "resuming from" in stdout
    results = json.loads((tmp_path / "train_results.json").read_text())
    assert results["global_step"] == 120


def _free_port() -> int:
    from shardtune.launch.torchrun import find_free_port

    return find_free_port()


def is_torchrun_worker(cmdline: str) -> bool:
    """A training rank under the launcher (shardtune -> torchrun -> ranks), not torchrun itself."""
    return "shardtune.train" in cmdline and "torchrun_agent" not in cmdline


def test_zero3_without_gathering_on_save_writes_the_trained_model_and_resumes(tiny_model_dir, tmp_path):
    """stage3_gather_16bit_weights_on_model_save false: the final folder is still complete, written module by
    module, and holds the weights the ZeRO-3 shards of the last checkpoint hold."""
    from transformers import AutoModelForCausalLM

    from shardtune.engines.deepspeed_config import PRESET_DIR, PRESETS
    from shardtune.export.convert import read_checkpoint_state
    from tests.distributed.helpers import check_saved_model

    config = json.loads((PRESET_DIR / PRESETS["z3"]).read_text())
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    (tmp_path / "z3.json").write_text(json.dumps(config))
    finished, crashed = tmp_path / "finished", tmp_path / "crashed"
    result = train(tiny_model_dir, finished, 2, 2, f"deepspeed={tmp_path / 'z3.json'}")
    assert "writing the model one gathered module at a time" in result.stdout
    check_saved_model(finished, tiny_model_dir, "full")  # every weight present and trained
    saved = AutoModelForCausalLM.from_pretrained(finished)
    shards = read_checkpoint_state(saved, finished / "checkpoint-6", "deepspeed")  # the same step's fp32 weights
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(tensor, shards[name], rtol=0, atol=0)
    crash_after_first_checkpoint(finished, crashed)
    train(tiny_model_dir, crashed, 2, 2, f"deepspeed={tmp_path / 'z3.json'}", overwrite=False)
    expected, resumed = losses_by_step(finished), losses_by_step(crashed)
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-3), (step, resumed, expected)
