"""Preference stages through the real CLI on the tiny model, one process: a LLaMA-Factory-style DPO YAML learns the
bundled pairs (reward accuracy above chance), full fine-tuning keeps a frozen reference, KTO, ORPO and SimPO train,
metrics reach trainer_log.jsonl, and a resumed DPO run continues the same curve."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import crash_after_checkpoint, run_cli
from tests.e2e.test_train_cli import read_log, train, train_losses

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

DPO = "examples/tiny/dpo_lora.yaml"
QUICK = ("save_strategy=no", "plot_loss=false")


def logged(out, key: str) -> list[float]:
    return [r[key] for r in read_log(out) if key in r and "loss" in r]


def test_lora_dpo_example_learns_the_preferred_answers(tiny_model_dir, tmp_path):
    out = tmp_path / "dpo"
    train(DPO, tiny_model_dir, out, "logging_steps=1", "plot_loss=true")
    records = [r for r in read_log(out) if "loss" in r]
    # At step 1 the policy is the reference (LoRA B = 0): every reward is 0 and the loss is log 2.
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert records[0]["rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert sum(r["rewards/accuracies"] for r in records[-4:]) / 4 > 0.5
    assert records[-1]["rewards/margins"] > 0 and records[-1]["loss"] < math.log(2)
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert key in records[-1]
    assert (out / "adapter_model.safetensors").is_file() and (out / "training_loss.png").is_file()
    results = json.loads((out / "train_results.json").read_text())
    assert results["final_loss"] < math.log(2)


def test_full_dpo_keeps_a_frozen_reference(tiny_model_dir, tmp_path):
    out = tmp_path / "full"
    result = run_cli("train", DPO, f"model_name_or_path={tiny_model_dir}", f"output_dir={out}", *QUICK,
                     "finetuning_type=full", "learning_rate=1e-3", "logging_steps=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reference model: a frozen copy of the model, whole on every rank" in result.stdout
    assert logged(out, "loss")[0] == pytest.approx(math.log(2), abs=1e-5)
    assert logged(out, "rewards/accuracies")[-1] > 0.5
    assert (out / "model.safetensors").is_file()


def test_ref_model_is_the_reference_of_a_lora_run(tiny_model_dir, tmp_path):
    """ref_model = the base model gives the adapters-off run's losses; another folder (a DPO-trained copy) moves
    the rewards from the first step on."""
    common = (f"model_name_or_path={tiny_model_dir}", *QUICK, "max_steps=3", "logging_steps=1")
    trained = tmp_path / "dpo-full"
    assert run_cli("train", DPO, *common, f"output_dir={trained}", "finetuning_type=full",
                   "learning_rate=1e-3").returncode == 0
    runs = {}
    for name, extra in {"adapters-off": (), "base": (f"ref_model={tiny_model_dir}",),
                        "trained": (f"ref_model={trained}",)}.items():
        result = run_cli("train", DPO, *common, f"output_dir={tmp_path / name}", *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = tmp_path / name
        if extra:
            assert f"reference model: ref_model {extra[0].split('=', 1)[1]} (frozen), whole on every rank" \
                in result.stdout
    for key in ("loss", "rewards/chosen", "rewards/margins", "grad_norm"):
        assert logged(runs["base"], key) == pytest.approx(logged(runs["adapters-off"], key), rel=1e-5, abs=1e-6)
    assert logged(runs["trained"], "rewards/margins")[0] != pytest.approx(0, abs=1e-4)
    assert logged(runs["trained"], "loss")[0] != pytest.approx(math.log(2), abs=1e-4)


def test_precomputed_reference_equals_the_live_one(tiny_model_dir, tmp_path):
    runs = {}
    for name, extra in {"live": (), "precomputed": ("precompute_ref_log_probs=true",)}.items():
        out = tmp_path / name
        result = run_cli("train", DPO, f"model_name_or_path={tiny_model_dir}", f"output_dir={out}", *QUICK,
                         "finetuning_type=full", "learning_rate=1e-3", "max_steps=6", "logging_steps=1",
                         "val_size=4", "do_eval=true", "eval_strategy=steps", "eval_steps=3", *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = out
    assert "precompute_ref_log_probs: 48 samples scored" in result.stdout
    for key in ("loss", "grad_norm", "rewards/margins", "rewards/accuracies"):
        assert logged(runs["precomputed"], key) == pytest.approx(logged(runs["live"], key), rel=1e-4, abs=1e-6), key
    evals = {name: [r["eval_loss"] for r in read_log(out) if "eval_loss" in r] for name, out in runs.items()}
    assert evals["precomputed"] == pytest.approx(evals["live"], rel=1e-4)


@pytest.mark.parametrize("loss", ["orpo", "simpo", "ipo", "hinge"])
def test_other_pref_losses_train(tiny_model_dir, tmp_path, loss):
    out = tmp_path / loss
    result = run_cli("train", DPO, f"model_name_or_path={tiny_model_dir}", f"output_dir={out}", *QUICK,
                     f"pref_loss={loss}", "max_steps=6", "logging_steps=1",
                     *(["pref_beta=2.0"] if loss == "simpo" else []))
    assert result.returncode == 0, result.stderr[-3000:]
    if loss in ("orpo", "simpo"):
        assert "reference model: none" in result.stdout
    losses = logged(out, "loss")
    assert losses[-1] < losses[0]
    if loss == "orpo":
        assert "odds_ratio_loss" in read_log(out)[-1]


def test_kto_trains_and_logs_its_kl_estimate(tiny_model_dir, tmp_path):
    out = tmp_path / "kto"
    result = run_cli("train", DPO, f"model_name_or_path={tiny_model_dir}", f"output_dir={out}", *QUICK,
                     "stage=kto", "dataset=demo_kto", "max_steps=8", "logging_steps=1", "kto_rejected_weight=1.5")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [r for r in read_log(out) if "loss" in r]
    assert all("kl" in r and r["kl"] >= 0 for r in records)
    assert records[0]["kl"] == pytest.approx(0, abs=1e-6)  # policy = reference at the start
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[-1]["rewards/chosen"] > records[-1]["rewards/rejected"]


def test_dpo_resume_continues_the_loss_curve(tiny_model_dir, tmp_path):
    common = ("max_steps=6", "save_steps=3", "logging_steps=1", "plot_loss=false", "finetuning_type=full",
              "learning_rate=1e-3", "per_device_train_batch_size=2", "gradient_accumulation_steps=2")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    train(DPO, tiny_model_dir, straight, *common)
    crash_after_checkpoint(straight, crashed, 3)
    result = run_cli("train", DPO, f"model_name_or_path={tiny_model_dir}", f"output_dir={crashed}", *common,
                     "overwrite_output_dir=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout
    expected, resumed = train_losses(straight), train_losses(crashed)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):  # the reference is the original model again, the policy the checkpoint's
        assert resumed[step] == pytest.approx(expected[step], rel=1e-4), (step, resumed, expected)
    assert logged(crashed, "rewards/margins")[-1] == pytest.approx(logged(straight, "rewards/margins")[-1], rel=1e-3)


def test_a_preference_dataset_for_sft_is_refused_and_dpo_is_estimated(tiny_model_dir, tmp_path):
    result = run_cli("train", DPO, f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path / 'y'}",
                     "dataset=demo")
    assert result.returncode == 2 and "not a ranking dataset" in result.stdout + result.stderr
    found = {}
    for label, extra in (("lora", ()), ("full", ("finetuning_type=full",))):
        result = run_cli("estimate", DPO, f"model_name_or_path={tiny_model_dir}", *extra, "--gpu-memory", "80GiB",
                         "--json")
        assert result.returncode == 0, result.stderr[-2000:]
        found[label] = {o["name"]: o["device_bytes"] for o in json.loads(result.stdout)["options"]}
    assert found["lora"]["DDP"]["reference"] == 0  # LoRA's reference is the policy with its adapters off
    assert found["full"]["DDP"]["reference"] == found["full"]["DDP"]["parameters"] > 0
    assert found["full"]["ZeRO-3"]["reference"] == found["full"]["ZeRO-3"]["parameters"]
    result = run_cli("estimate", DPO, f"model_name_or_path={tiny_model_dir}", "stage=rm", "finetuning_type=full",
                     "--gpu-memory", "80GiB", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    reward = {o["name"]: o["device_bytes"] for o in json.loads(result.stdout)["options"]}
    assert reward["DDP"]["reference"] == 0  # nothing beside the reward model; and its output matrix is one row
    assert 0 < reward["DDP"]["parameters"] < found["full"]["DDP"]["parameters"]


def test_sharegpt_pairs_with_an_eval_split(tiny_model_dir, tmp_path):
    out = tmp_path / "eval"
    train(DPO, tiny_model_dir, out, "dataset=demo_dpo_sharegpt", "val_size=4", "do_eval=true",
          "eval_strategy=steps", "eval_steps=3", "max_steps=6", *QUICK)
    evals = [r["eval_loss"] for r in read_log(out) if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] < math.log(2)  # log 2: the untrained policy
    assert json.loads((out / "train_results.json").read_text())["eval_loss"] == pytest.approx(evals[-1], rel=1e-5)


def test_reward_model_trains_and_loads_as_sequence_classification(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "rm"
    train(DPO, tiny_model_dir, out, "stage=rm", "finetuning_type=full", "learning_rate=1e-3", "val_size=8",
          "do_eval=true", "eval_strategy=steps", "eval_steps=6", "max_steps=12", *QUICK)
    evals = [r for r in read_log(out) if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1]["eval_rewards/accuracies"] > 0.5 and evals[-1]["eval_loss"] < math.log(2)
    assert json.loads((out / "train_results.json").read_text())["eval_rewards/accuracies"] > 0.5

    model, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == "LlamaForSequenceClassification" and not info["missing_keys"]
    scores = reward_scores(model, AutoTokenizer.from_pretrained(out), pairs=16)
    assert float((scores[:16] > scores[16:]).float().mean()) > 0.5


def reward_scores(model, tokenizer, pairs: int | None = None) -> torch.Tensor:
    """Scores of the first ``pairs`` bundled pairs' (all: None) chosen (first half) and rejected (second half)
    answers."""
    from shardtune.data import DataCollator, DataSettings, build_datasets
    from shardtune.data.collator import PairCollator
    from tests.conftest import DATA_DIR

    data, _ = build_datasets(tokenizer, DataSettings(dataset=("demo_dpo",), dataset_dir=str(DATA_DIR),
                                                     template="chatml", stage="rm", cutoff_len=256))
    batch = PairCollator(DataCollator(tokenizer.pad_token_id))([data[i] for i in range(pairs or len(data))])
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)


def pairwise_loss(scores: torch.Tensor) -> float:
    chosen, rejected = scores.chunk(2)
    return float(-torch.nn.functional.logsigmoid(chosen - rejected).mean())


def test_lora_reward_model_saves_its_score_layer_with_the_adapter_and_exports_merged(tiny_model_dir, tmp_path):
    """LLaMA-Factory's usual reward model: LoRA on the body, the score layer trained in full beside it. The adapter
    folder (peft's SEQ_CLS task) holds the score; on the base loaded with num_labels=1 it gives the scores the run
    evaluated with (its last eval_loss), and `shardtune export --merge-lora` writes a plain sequence-classification
    folder with the same scores."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "rm-lora"
    train(DPO, tiny_model_dir, out, "stage=rm", "learning_rate=1e-3", "eval_dataset=demo_dpo", "do_eval=true",
          "eval_strategy=steps", "eval_steps=12", "max_steps=12", "per_device_eval_batch_size=48", *QUICK)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and "score" in config["modules_to_save"]
    evals = [r for r in read_log(out) if "eval_loss" in r]
    assert evals[-1]["eval_rewards/accuracies"] > 0.5 and evals[-1]["eval_loss"] < math.log(2)

    tokenizer = AutoTokenizer.from_pretrained(out)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1,
                                                              pad_token_id=tokenizer.pad_token_id)
    adapted = PeftModel.from_pretrained(base, out).eval()
    scores = reward_scores(adapted, tokenizer)
    assert pairwise_loss(scores) == pytest.approx(evals[-1]["eval_loss"], rel=1e-4)

    merged_dir = tmp_path / "merged"
    result = run_cli("export", str(out), "--out", str(merged_dir), "--merge-lora")
    assert result.returncode == 0, result.stderr[-2000:]
    merged = AutoModelForSequenceClassification.from_pretrained(merged_dir).eval()
    assert type(merged).__name__ == "LlamaForSequenceClassification" and merged.config.num_labels == 1
    assert reward_scores(merged, tokenizer) == pytest.approx(scores, abs=1e-5)


def test_freeze_reward_model_trains_the_chosen_layers_and_the_score(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "rm-freeze"
    train(DPO, tiny_model_dir, out, "stage=rm", "finetuning_type=freeze", "freeze_trainable_layers=1",
          "learning_rate=1e-3", "max_steps=6", *QUICK)
    trained = AutoModelForSequenceClassification.from_pretrained(out)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, tensor in trained.state_dict().items():
        if name.startswith("model.layers.0.") or name == "model.embed_tokens.weight":
            assert torch.equal(tensor, base[name]), name  # frozen
    assert not torch.equal(trained.state_dict()["model.layers.1.mlp.down_proj.weight"],
                           base["model.layers.1.mlp.down_proj.weight"])
    from shardtune.model.load import load_causal_lm
    from shardtune.model.reward_head import RewardHead, to_reward_model

    untrained = to_reward_model(load_causal_lm(str(tiny_model_dir)), RewardHead(trained.config.pad_token_id, 42))
    assert not torch.equal(trained.score.weight, untrained.score.weight)  # drawn with the run's seed, then trained
