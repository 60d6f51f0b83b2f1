"""BAdam (use_badam, optim/badam.py) through the real CLI on one process (in-process, no launcher).

It trains a tiny model whose three decoder layers take turns (badam_switch_interval 2: layer 0 for the first step,
then two steps each), its losses differ from plain AdamW's, the saved model holds every layer's updates and the
checkpoint every layer's weights: a run
resumed from step 3 (layer 1 active, layer 0 already trained) logs the uninterrupted run's losses for steps 4-6.
"""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file

from tests.distributed.test_checkpoints import (
    assert_resumed_like_finished,
    crash_after_first_checkpoint,
    losses_by_step,
)
from tests.distributed.test_lf_optimizers import run_one_process

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
pytest.importorskip("badam", reason="use_badam needs the badam package (requirements.txt; pip install badam)")

BADAM = ("use_badam=true", "badam_switch_interval=2", "optim=adamw_torch", "badam_verbose=1")


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    from shardtune.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-3", layers=3)


@pytest.mark.matrix  # four CLI runs (about 30 s); tests/unit/test_badam.py checks the steps and resume in make test
def test_badam_trains_block_by_block_and_resumes_like_an_uninterrupted_run(three_layers, tmp_path):
    finished, crashed, plain = tmp_path / "finished", tmp_path / "crashed", tmp_path / "plain"
    result = run_one_process(three_layers, finished, *BADAM)
    switches = [line.split(": ", 1)[1] for line in result.stdout.splitlines() if "will be trainable" in line]
    assert switches == ["['model.layers.0.']", "['model.layers.1.']", "['model.layers.2.']", "['model.layers.0.']"]
    found = losses_by_step(finished)
    assert sorted(found) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(x) for x in found.values())
    run_one_process(three_layers, plain, "optim=adamw_torch")
    assert [found[s] for s in (2, 3, 4)] != pytest.approx([losses_by_step(plain)[s] for s in (2, 3, 4)], rel=1e-4)
    # At step 3 layer 1 was active; layer 0's (trained in step 1) and layer 2's weights must be saved too.
    saved = load_file(str(finished / "checkpoint-3" / "trainable.safetensors"))
    assert {n.split(".")[2] for n in saved if n.startswith("model.layers.")} == {"0", "1", "2"}
    assert "model.embed_tokens.weight" in saved and "lm_head.weight" in saved
    # The saved model holds every block's updates (and the untrained embeddings as loaded).
    base, final = load_file(str(three_layers / "model.safetensors")), load_file(str(finished / "model.safetensors"))
    moved = {n.split(".")[2] for n in final if n.startswith("model.layers.") and not final[n].equal(base[n])}
    assert moved == {"0", "1", "2"} and final["model.embed_tokens.weight"].equal(base["model.embed_tokens.weight"])
    crash_after_first_checkpoint(finished, crashed)
    assert "resuming from" in run_one_process(three_layers, crashed, *BADAM, overwrite=False).stdout
    assert_resumed_like_finished(finished, crashed, rel=1e-6)


def test_badam_under_a_launcher_is_refused_before_launch(three_layers, tmp_path):
    from tests.conftest import run_cli

    result = run_cli("train", "examples/tiny/sft_full.yaml", f"model_name_or_path={three_layers}",
                     f"output_dir={tmp_path}", *BADAM, FORCE_TORCHRUN="1", NPROC_PER_NODE="1")
    assert result.returncode == 2 and "use_badam (true) with FORCE_TORCHRUN (1)" in result.stderr
