"""The preference step in-process: accumulation equivalence, the reference (adapters off, frozen copy, none), the
refusals before launch."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from shardtune.config.load import build_config
from shardtune.data.collator import DataCollator, PairCollator
from shardtune.engines.base import PrecisionSettings
from shardtune.engines.local import LocalEngine
from shardtune.engines.plan import plan_engine
from shardtune.launch.validate import preference_key_problems
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.source import ModelSource
from shardtune.optim.build import build_optimizer, build_scheduler
from shardtune.optim.settings import OptimizerSettings
from shardtune.train.preference import PreferenceSettings
from shardtune.train.preference_step import PreferenceObjective, build_reference


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> ModelSource:
    """tiny_llama() saved: the policy's source, from which a full-parameter run loads its frozen reference."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(folder)
    return ModelSource(str(folder), FinetuningSettings(finetuning_type="full"))


def features(n: int = 8, seed: int = 1, kto: bool = False) -> list[dict]:
    """Pairs sharing a prompt (labels -100 on it) with answers of different lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(1, 96, (3 + i % 3,), generator=g).tolist()
        first = torch.randint(1, 96, (2 + i % 4,), generator=g).tolist()
        second = torch.randint(1, 96, (4 + i % 2,), generator=g).tolist()
        if kto:
            out.append({"input_ids": prompt + first, "labels": [-100] * len(prompt) + first,
                        "kl_input_ids": prompt + second, "kl_labels": [-100] * len(prompt) + second,
                        "kto_tag": i % 3 != 0})
        else:
            out.append({"chosen_input_ids": prompt + first, "chosen_labels": [-100] * len(prompt) + first,
                        "rejected_input_ids": prompt + second, "rejected_labels": [-100] * len(prompt) + second})
    return out


def make_engine(model: torch.nn.Module) -> LocalEngine:
    engine = LocalEngine(PrecisionSettings(), torch.device("cpu"))
    engine.prepare(model, lambda p: build_optimizer(p, OptimizerSettings(optim="sgd", learning_rate=0.5)),
                   lambda o: build_scheduler(o, "constant", 10, 0))
    return engine


def run_steps(source: ModelSource, stage: str, settings: PreferenceSettings, micro: int, lora: bool,
              steps: int = 2) -> tuple[list[dict[str, float]], torch.nn.Module]:
    model = tiny_llama()
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    engine = make_engine(model)
    reference = build_reference(engine, source, "lora" if lora else "full", settings)
    objective = PreferenceObjective(stage, settings, reference)
    collate = PairCollator(DataCollator(0))
    rows = features(kto=stage == "kto")
    window = [collate(rows[i:i + micro]) for i in range(0, len(rows), micro)]
    return [objective.train_step(engine, window, 0.0) for _ in range(steps)], engine.unwrapped_model()


@pytest.mark.parametrize(("stage", "loss", "lora"), [("dpo", "sigmoid", True), ("dpo", "sigmoid", False),
                                                     ("dpo", "ipo", True), ("dpo", "orpo", False),
                                                     ("dpo", "simpo", True), ("kto", "sigmoid", True)])
def test_accumulating_micro_batches_equals_one_batch(source: ModelSource, stage: str, loss: str, lora: bool) -> None:
    settings = PreferenceSettings(loss=loss, beta=0.2, ftx=0.1 if stage == "dpo" else 0.0)
    whole, whole_model = run_steps(source, stage, settings, micro=8, lora=lora)
    split, split_model = run_steps(source, stage, settings, micro=3, lora=lora)  # 3 + 3 + 2 pairs in one window
    for a, b in zip(whole, split, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if key != "slots":  # padded widths differ with the split
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    for p, q in zip(whole_model.parameters(), split_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_the_reference_starts_equal_to_the_policy(source: ModelSource) -> None:
    # LoRA with adapters off (B initialised to zero as peft does) and a frozen copy both give zero rewards at first.
    for lora in (True, False):
        model = tiny_llama()
        if lora:
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        settings = PreferenceSettings()
        engine = make_engine(model)
        objective = PreferenceObjective("dpo", settings, build_reference(engine, source, "lora" if lora else "full",
                                                                          settings))
        metrics = objective.train_step(engine, [PairCollator(DataCollator(0))(features())], 0.0)
        assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert metrics["rewards/chosen"] == pytest.approx(0, abs=1e-6)
        second = objective.train_step(engine, [PairCollator(DataCollator(0))(features())], 0.0)
        assert second["rewards/margins"] != pytest.approx(0, abs=1e-6)  # the policy moved, the reference did not


def test_a_frozen_copy_does_not_follow_the_policy(source: ModelSource) -> None:
    engine = make_engine(tiny_llama())
    reference = build_reference(engine, source, "full", PreferenceSettings())
    assert reference.kind == "copy" and reference.model is not None
    before = copy.deepcopy(reference.model.state_dict())
    run = PreferenceObjective("dpo", PreferenceSettings(), reference)
    run.train_step(engine, [PairCollator(DataCollator(0))(features())], 0.0)
    assert all(torch.equal(before[k], v) for k, v in reference.model.state_dict().items())
    assert not any(p.requires_grad for p in reference.model.parameters())


def test_orpo_and_simpo_load_no_reference(source: ModelSource) -> None:
    engine = make_engine(tiny_llama())
    for loss in ("orpo", "simpo"):
        assert build_reference(engine, source, "full", PreferenceSettings(loss=loss)).kind == "none"


BASE = {"model_name_or_path": "m", "output_dir": "o", "dataset": ["demo_dpo"], "stage": "dpo"}


def problems_for(**values: object) -> list[str]:
    return preference_key_problems(build_config({**BASE, **values}))


def test_preference_keys_out_of_their_stage_are_refused() -> None:
    assert any("pref_loss (ipo) is read by stage dpo only" in p for p in problems_for(stage="sft", pref_loss="ipo"))
    assert any("kto_chosen_weight" in p for p in problems_for(kto_chosen_weight=2.0))
    assert any("simpo_gamma" in p for p in problems_for(simpo_gamma=1.0))
    assert any("dpo_label_smoothing" in p for p in problems_for(pref_loss="hinge", dpo_label_smoothing=0.1))
    assert problems_for(pref_loss="simpo", simpo_gamma=1.0, pref_beta=2.0) == []
    assert problems_for(dpo_label_smoothing=0.1) == []


def test_what_is_not_done_yet_is_refused_with_its_reason() -> None:
    for finetuning_type in ("full", "freeze", "lora"):  # the score layer trains (and saves) under every method
        assert problems_for(stage="rm", finetuning_type=finetuning_type) == []
    assert problems_for(engine="auto", stage="rm") == []  # the estimate models the score head
    assert any("save_only_model (true) with stage rm" in p for p in problems_for(stage="rm", save_only_model=True))


def test_a_reward_model_folder_is_refused_as_the_model_to_train(tmp_path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "architectures": ["LlamaForSequenceClassification"]}))
    for stage in ("rm", "dpo"):
        assert any("is a reward model" in p for p in problems_for(stage=stage, model_name_or_path=str(tmp_path)))
    for unreadable in ('{"model_type": "llama",\n}', "[1, 2]", '{"architectures": "x"}'):
        (tmp_path / "config.json").write_text(unreadable)  # the model-folder checks report it, not this one
        assert not any("is a reward model" in p for p in problems_for(model_name_or_path=str(tmp_path)))
    assert problems_for(engine="auto") == []  # the estimate counts the reference and the two rows
    assert any("label_smoothing_factor" in p for p in problems_for(label_smoothing_factor=0.1))
    assert any("train_on_prompt (true)" in p for p in problems_for(train_on_prompt=True))
    assert any("neftune_noise_alpha" in p for p in problems_for(neftune_noise_alpha=5.0))
    assert any("pissa_init (true)" in p for p in problems_for(pissa_init=True))
    assert any("precompute_ref_log_probs" in p for p in problems_for(precompute_ref_log_probs=True, pref_loss="orpo"))


@pytest.mark.parametrize("engine_keys", [{"deepspeed": "z3"}, {"fsdp": "full_shard auto_wrap"}])
def test_a_full_reference_is_planned_where_the_policy_is_sharded(engine_keys: dict) -> None:
    # The engine loads it sharded as the policy (Engine.load_frozen): no refusal left; nor for a full reward model
    # (its score layer is filled into the sharded model: tests/distributed/test_preference_engines.py).
    for allowed in ({"finetuning_type": "full"}, {"finetuning_type": "full", "stage": "kto", "dataset": ["demo_kto"]},
                    {"finetuning_type": "lora"}, {"finetuning_type": "full", "precompute_ref_log_probs": True},
                    {"finetuning_type": "full", "stage": "rm"}):
        _, problems = plan_engine(build_config({**BASE, **allowed, **engine_keys}), world_size=2, has_cuda=False)
        assert problems == [], problems


@pytest.mark.parametrize(("stage", "lora"), [("dpo", False), ("dpo", True), ("kto", True)])
def test_precomputed_reference_gives_the_live_losses(source: ModelSource, stage: str, lora: bool) -> None:
    from shardtune.train.preference_step import Reference, precomputed_reference_logps

    settings = PreferenceSettings(beta=0.2)
    live, live_model = run_steps(source, stage, settings, micro=3, lora=lora, steps=3)

    model = tiny_llama()
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    engine = make_engine(model)
    objective = PreferenceObjective(stage, settings, Reference("precomputed"))
    collate = PairCollator(DataCollator(0))
    rows = features(kto=stage == "kto")
    table = precomputed_reference_logps(engine, rows, collate, 3, "lora" if lora else "full")
    rows = [{**row, "ref_logps": values} for row, values in zip(rows, table, strict=True)]
    window = [collate(rows[i:i + 3]) for i in range(0, len(rows), 3)]
    precomputed = [objective.train_step(engine, window, 0.0) for _ in range(3)]
    for a, b in zip(live, precomputed, strict=True):
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    for p, q in zip(live_model.parameters(), engine.unwrapped_model().parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_pref_loss_values_llamafactory_once_had_are_refused_with_the_replacement() -> None:
    from shardtune.errors import ConfigError

    with pytest.raises(ConfigError, match="use stage: kto"):
        build_config({**BASE, "pref_loss": "kto_pair"})
    assert build_config({**BASE, "pref_loss": "ipo"}).pref_loss == "ipo"


def test_ref_model_is_checked_on_the_launching_host(tmp_path) -> None:
    import json

    policy, other, adapter = tmp_path / "policy", tmp_path / "other", tmp_path / "adapter"
    for folder, vocab in ((policy, 96), (other, 128)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab}))
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    same = {"model_name_or_path": str(policy), "ref_model": str(policy)}
    assert any("ref_model: " in p and "has no weights" in p for p in problems_for(**same))  # config.json only
    assert any("vocab_size 128 and model_name_or_path 96" in p
               for p in problems_for(model_name_or_path=str(policy), ref_model=str(other)))
    assert any("neither a model folder" in p for p in problems_for(ref_model=str(tmp_path / "missing")))
    assert any("ref_model_adapters: " in p and "not a peft adapter folder" in p
               for p in problems_for(**same, ref_model_adapters=f"{adapter},{tmp_path}"))
    assert not any("ref_model_adapters" in p for p in problems_for(**same, ref_model_adapters=str(adapter)))
    assert any("applies to ref_model, which is not set" in p for p in problems_for(ref_model_adapters=str(adapter)))
    assert any("ref_model" in p and "stage dpo" in p for p in problems_for(**same, pref_loss="simpo"))
    assert any("precompute_ref_log_probs (true) with ref_model" in p
               for p in problems_for(**same, precompute_ref_log_probs=True))


@pytest.mark.parametrize("engine_keys", [{"deepspeed": "z3"}, {"fsdp": "full_shard auto_wrap"}])
def test_a_ref_model_that_must_be_whole_is_refused_where_the_policy_is_sharded(engine_keys: dict) -> None:
    config = build_config({**BASE, "ref_model": "r", "ref_model_adapters": "a", "ref_model_quantization_bit": 4,
                           **engine_keys})
    _, problems = plan_engine(config, world_size=2, has_cuda=True)
    assert any("ref_model_adapters with" in p for p in problems)
    assert any("ref_model_quantization_bit (4) with" in p for p in problems)
    _, problems = plan_engine(build_config({**BASE, "ref_model": "r", "ref_model_quantization_bit": 4}),
                              world_size=2, has_cuda=False)
    assert any("ref_model_quantization_bit (4) loads ref_model through bitsandbytes" in p for p in problems)
    _, problems = plan_engine(build_config({**BASE, "ref_model": "r", "ref_model_quantization_bit": 4}),
                              world_size=2, has_cuda=True)
    assert problems == []  # DDP on a GPU: allowed where the policy's quantization is
