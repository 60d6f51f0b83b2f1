"""Generation-based evaluation on 2 processes: under DDP, ZeRO-3 and FSDP each rank generates its share of the
prompts (the sharded engines gathering the weights for every forward, ranks kept in step), and the greedy answers
and scores equal one process's, sample for sample, in the data's order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import ENGINE_KEYS
from tests.e2e.test_after_training import PAIRS, parrot_args, parrot_data

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

# Greedy, short, one prompt per batch: the same computation per sample on every engine and process count.
PREDICT = ("do_sample=false", "max_new_tokens=12", "per_device_eval_batch_size=1")
NO_PREDICT = ("do_predict=false", "predict_with_generate=false")


@pytest.fixture(scope="module")
def half_trained(tiny_model_dir, tmp_path_factory) -> Path:
    """A model that learned some answers partly: answers stop at different lengths, some run to max_new_tokens.
    Its eval data has 5 samples, so 2 ranks get uneven shares (the sampler repeats one)."""
    root = tmp_path_factory.mktemp("half")
    data = parrot_data(root / "data")
    rows = json.loads((data / "parrot_eval.json").read_text())
    (data / "parrot_eval.json").write_text(json.dumps(rows + [{"instruction": "Name a color.", "input": "",
                                                               "output": "Green."}]))
    out = root / "out"
    result = run_cli(*parrot_args(tiny_model_dir, data, out, "max_steps=12", *NO_PREDICT))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def one_process(half_trained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("predict") / "one"
    result = run_cli("eval", str(half_trained), f"output_dir={out}", *PREDICT)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def predictions(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]


def scores(out: Path) -> dict:
    results = json.loads((out / "predict_results.json").read_text())
    return {k: v for k, v in results.items() if "runtime" not in k and "per_second" not in k}


@pytest.mark.parametrize("engine", [pytest.param("ddp", marks=pytest.mark.matrix), "zero3", "fsdp2",
                                    pytest.param("fsdp1", marks=pytest.mark.matrix)])
def test_two_ranks_generate_what_one_process_generates(engine, half_trained, one_process, tmp_path):
    reference = predictions(one_process)
    assert [r["label"] for r in reference] == [a for _, a in PAIRS] + ["Green."]
    assert len({len(r["predict"]) for r in reference}) > 1, "answers of one length test nothing about stopping"
    out = tmp_path / engine
    result = run_cli("eval", str(half_trained), f"output_dir={out}", *PREDICT, *ENGINE_KEYS[engine],
                     FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "world size 2" in result.stdout
    assert predictions(out) == reference
    assert scores(out) == scores(one_process)


@pytest.mark.matrix
def test_do_predict_after_training_under_fsdp2(tiny_model_dir, tmp_path):
    """Train and then predict in the same run of 2 ranks: the prediction files come out once, complete, in order."""
    data = parrot_data(tmp_path / "data")
    out = tmp_path / "run"
    result = run_cli(*parrot_args(tiny_model_dir, data, out, "per_device_train_batch_size=2", "max_steps=2",
                                  "max_new_tokens=6", *ENGINE_KEYS["fsdp2"]), FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stderr[-4000:]
    assert [r["label"] for r in predictions(out)] == [a for _, a in PAIRS]
    assert (out / "model.safetensors").is_file() and scores(out)["predict_samples"] == 4


@pytest.mark.matrix
def test_lora_adapter_predictions_under_zero3_equal_one_process(tiny_model_dir, tmp_path):
    """A LoRA output evaluated on its base: the peft model generates under ZeRO-3 as on one process."""
    data = parrot_data(tmp_path / "data")
    adapter = tmp_path / "lora"
    result = run_cli(*parrot_args(tiny_model_dir, data, adapter, "finetuning_type=lora", "max_steps=10",
                                  *NO_PREDICT))
    assert result.returncode == 0, result.stderr[-3000:]
    outs = {}
    for name, env, extra in (("one", {}, ()), ("zero3", {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"},
                                                   ENGINE_KEYS["zero3"])):
        outs[name] = tmp_path / name
        result = run_cli("eval", str(adapter), f"output_dir={outs[name]}", *PREDICT, *extra, **env)
        assert result.returncode == 0, result.stderr[-4000:]
    assert predictions(outs["zero3"]) == predictions(outs["one"])
