"""LLaMA-Factory's optimizer replacements through the real CLI: one process, 2-process DDP and (Muon) FSDP2 on CPU.

Each replacement changes the loss curve against plain AdamW, and DDP (2 x 2 samples) follows the one-process run
(4 samples) because every rank steps the same whole weights with the averaged gradient; Muon under FSDP2 too, since
each rank orthogonalises the gathered whole update of every sharded matrix. Resume from a checkpoint restores each
child of Muon's ChainedOptimizer (and GaLore's projectors) exactly, also from FSDP2's sharded checkpoint. Layer-wise
GaLore/APOLLO (one process) takes the plain run's steps and resumes exactly.
"""

from __future__ import annotations

import math

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import logged, losses, train
from tests.distributed.test_checkpoints import RUN as CHECKPOINTED_RUN
from tests.distributed.test_checkpoints import assert_resumed_like_finished, crash_after_first_checkpoint
from tests.distributed.test_checkpoints import train as train_with_checkpoints

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

REPLACEMENTS = {
    "muon": ("use_muon=true",),
    "galore": ("use_galore=true", "galore_rank=8"),
    "apollo": ("use_apollo=true", "apollo_rank=8"),
    "adam_mini": ("use_adam_mini=true",),
}


@pytest.fixture(scope="module")
def adamw_losses(tiny_model_dir, tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("adamw")
    train(tiny_model_dir, out, "full", 1, 4)
    return losses(out)


@pytest.mark.parametrize("name", list(REPLACEMENTS))
def test_replacement_trains_and_ddp_matches_one_process(name, adamw_losses, tiny_model_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "ddp"
    train(tiny_model_dir, one, "full", 1, 4, *REPLACEMENTS[name])
    single = losses(one)
    assert all(math.isfinite(x) for x in single)
    assert single[1:] != pytest.approx(adamw_losses[1:], rel=1e-3)  # the first loss precedes any step
    train(tiny_model_dir, two, "full", 2, 2, *REPLACEMENTS[name])
    assert losses(two) == pytest.approx(single, rel=2e-3)


FSDP2 = ("fsdp=full_shard auto_wrap",)


def test_muon_under_fsdp2_matches_one_process(tiny_model_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "fsdp2"
    train(tiny_model_dir, one, "full", 1, 4, *REPLACEMENTS["muon"])
    train(tiny_model_dir, two, "full", 2, 2, *REPLACEMENTS["muon"], *FSDP2)
    assert losses(two) == pytest.approx(losses(one), rel=2e-3)


@pytest.mark.parametrize("name", ["muon", "galore", "muon-fsdp2"])
def test_resume_matches_uninterrupted_run(name, tiny_model_dir, tmp_path):
    finished, crashed = tmp_path / "finished", tmp_path / "crashed"
    keys = (*REPLACEMENTS["muon"], *FSDP2) if name == "muon-fsdp2" else REPLACEMENTS[name]
    train_with_checkpoints(tiny_model_dir, finished, 2, 2, *keys)
    crash_after_first_checkpoint(finished, crashed)
    result = train_with_checkpoints(tiny_model_dir, crashed, 2, 2, *keys, overwrite=False)
    assert "resuming from" in result.stdout
    assert_resumed_like_finished(finished, crashed, rel=1e-4)


def test_lora_with_muon_trains_under_ddp(tiny_model_dir, tmp_path):
    train(tiny_model_dir, tmp_path, "lora", 2, 2, "use_muon=true", "max_steps=6")
    found = losses(tmp_path)
    assert all(math.isfinite(x) for x in found) and found[-1] < found[0]


# Layer-wise GaLore/APOLLO run on one process (in-process, no launcher), without accumulation; max_grad_norm=0 in
# both runs, since a layer-wise step cannot clip (the plain run would).
LAYERWISE = ("gradient_accumulation_steps=1", "optim=adamw_torch", "max_grad_norm=0", "galore_update_interval=2")


def test_layerwise_galore_takes_the_plain_runs_steps_on_one_process(tiny_model_dir, tmp_path):
    plain, layered = tmp_path / "plain", tmp_path / "layerwise"
    train(tiny_model_dir, plain, "full", 1, 4, *REPLACEMENTS["galore"], *LAYERWISE)
    train(tiny_model_dir, layered, "full", 1, 4, *REPLACEMENTS["galore"], *LAYERWISE, "galore_layerwise=true")
    assert losses(layered) == pytest.approx(losses(plain), rel=1e-6)
    assert logged(layered, "grad_norm") == [0.0] * len(losses(layered))  # no global norm: nothing clipped


def test_layerwise_apollo_resumes_like_an_uninterrupted_run(tiny_model_dir, tmp_path):
    finished, crashed = tmp_path / "finished", tmp_path / "crashed"
    keys = (*REPLACEMENTS["apollo"], *LAYERWISE, "apollo_layerwise=true")
    run_one_process(tiny_model_dir, finished, *keys)
    crash_after_first_checkpoint(finished, crashed)
    assert "resuming from" in run_one_process(tiny_model_dir, crashed, *keys, overwrite=False).stdout
    assert_resumed_like_finished(finished, crashed, rel=1e-6)


def run_one_process(model, out, *extra: str, overwrite: bool = True):
    result = run_cli("train", *CHECKPOINTED_RUN, f"model_name_or_path={model}", f"output_dir={out}",
                     "per_device_train_batch_size=4", f"overwrite_output_dir={str(overwrite).lower()}", *extra)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result
