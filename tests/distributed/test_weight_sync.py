"""The weight sync proven (issue 44, "Sync, proven"): 2 gloo ranks under ZeRO-3 and FSDP2 (and DDP), full and LoRA,
train a tiny LLaMA with the real engines and stream its weights after every optimizer step into a generator process
that keeps its own copy (tests/distributed/weight_sync_worker.py). After every step the generator's tensors are
bitwise the trained weights gathered whole (LoRA: merged by peft's own merge_and_unload), the sync held at most one
layer and one bucket (below twice the largest layer; the model holds four times its bytes), and ranks that sent the
generator different numbers of prompts (each rank none in one step) finished within the timeout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.helpers import ENGINE_KEYS, logged, run_under_torchrun
from tests.distributed.test_grpo_engines import COMPARED, KINDS, one_process, train  # noqa: F401 - a fixture

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

CASES = ("zero3-full", "zero3-lora", "fsdp2-full", "fsdp2-lora", "ddp-lora")
WORKER = Path(__file__).with_name("weight_sync_worker.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from shardtune.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("sync") / "m", hidden=128, layers=2, intermediate=512)


def run_worker(model_dir: Path, out: Path, case: str) -> dict:
    # A rank left waiting in a gather would hang here: the timeout turns that into a failure.
    run_under_torchrun(WORKER, 2, "--model", str(model_dir), "--out", str(out), "--case", case, timeout=420)
    return json.loads((out / f"{case}.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_the_generator_holds_the_trained_weights_bit_for_bit_after_every_step(case, model_dir, tmp_path):
    result = run_worker(model_dir, tmp_path, case)
    steps = result["steps"]
    assert result["world_size"] == 2 and len(steps) == 4  # the start, then 3 optimizer steps
    for i, step in enumerate(steps):
        check, sync = step["check"], step["sync"]
        assert check["generator_names"] == check["names"], i  # the checkpoint's names, nothing more or less
        assert check["equal"] == check["names"], (i, sorted(set(check["names"]) - set(check["equal"]))[:3])
        assert sorted(sync["names"]) == check["names"]  # every tensor sent once
        if i:
            previous = steps[i - 1]["check"]["digests"]
            assert any(check["digests"][k] != previous[k] for k in previous), i  # the step moved the weights
        largest = check["largest_layer_bytes"]
        assert sync["largest_unit_bytes"] == largest and check["model_bytes"] > 3 * largest
        assert largest <= sync["peak_bytes"] < 2 * largest, (i, sync["peak_bytes"], largest)
        assert sync["buckets"] > 2
    tokens = result["rollout_tokens_by_rank"]  # per rank, per step (None before the first)
    assert [t[1:] for t in tokens] != [tokens[0][1:]] * 2 and 0 in tokens[0][1:] and 0 in tokens[1][1:]


@pytest.mark.parametrize(("engine", "kind"), [("zero3", "lora"), ("fsdp2", "full")], ids=["zero3-lora", "fsdp2-full"])
def test_a_cli_run_with_the_protocol_generator_logs_the_one_process_run(engine, kind, one_process,  # noqa: F811
                                                                        tiny_model_dir, tmp_path):
    """Through the real CLI: 2 ranks whose completions come from the generator process (rollout_backend
    vllm_protocol_cpu, synced after every step) log the one-process run where the policy generates itself."""
    results = train(tiny_model_dir, tmp_path / "two", 2, 4, *KINDS[kind], *ENGINE_KEYS[engine],
                    "rollout_backend=vllm_protocol_cpu")
    assert results["world_size"] == 2
    for key in COMPARED:
        assert logged(tmp_path / "two", key) == pytest.approx(logged(one_process(kind), key), rel=2e-3, abs=1e-5), key
    assert len(logged(tmp_path / "two", "weight_sync_seconds")) == 3
