"""OFT (finetuning_type: oft, peft's OFTConfig): what trains, what is saved, and what is refused before launch."""

from __future__ import annotations

import pytest
import torch

from shardtune.config.load import build_config
from shardtune.errors import ConfigError, ModelError
from shardtune.launch.validate import cross_key_problems, file_problems
from shardtune.model.adapter_files import save_lora_adapter
from shardtune.model.finetuning.apply import apply_finetuning, count_parameters
from shardtune.model.finetuning.oft import OftSettings, divisor_problems, size_problem
from shardtune.model.finetuning.settings import FinetuningSettings

BLOCK = 4  # divides the tiny model's widths (64 and its MLP's 172)
OFT = FinetuningSettings(finetuning_type="oft", oft=OftSettings(block_size=BLOCK))


def _base(tiny_model_dir):
    from shardtune.model.load import load_causal_lm

    return load_causal_lm(str(tiny_model_dir), attn_implementation="sdpa")


def _batch() -> torch.Tensor:
    return torch.randint(3, 2000, (2, 24), generator=torch.Generator().manual_seed(0))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _train(model, ids: torch.Tensor, steps: int = 8) -> list[float]:
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    """A tiny model with an OFT adapter, its frozen base weights before training, and its losses."""
    model = apply_finetuning(_base(tiny_model_dir), OFT)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    start = _logits(model, _batch())
    losses = _train(model, _batch())
    return model, frozen, start, losses


def test_only_the_rotations_train_and_a_new_adapter_changes_nothing(tiny_model_dir, trained):
    model, _, start, _ = trained
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".oft_R.default.weight" in n for n in names)
    # 2 layers x (6 Linear layers of 64 inputs + down_proj of 172), in x (b - 1) / 2 each
    assert count_parameters(model)[0] == 2 * (6 * 64 + 172) * (BLOCK - 1) // 2
    # The rotations start at the identity: the adapted model's output is the base model's.
    torch.testing.assert_close(start, _logits(_base(tiny_model_dir), _batch()))


def test_training_lowers_the_loss_and_leaves_the_base_weights(trained):
    model, frozen, start, losses = trained
    assert losses[-1] < losses[0] - 0.5, losses
    now = dict(model.named_parameters())
    assert all(torch.equal(now[name], before) for name, before in frozen.items())
    assert not torch.allclose(_logits(model, _batch()), start, atol=1e-3)


def test_the_saved_adapter_loads_with_plain_peft_and_gives_the_same_logits(tiny_model_dir, trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, _, _, _ = trained
    assert save_lora_adapter(model, model.state_dict(), tmp_path) == 14  # one rotation per adapted layer
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path)
    expected = _logits(model, _batch())
    torch.testing.assert_close(_logits(loaded, _batch()), expected)
    merged = loaded.merge_and_unload()  # what `shardtune export --merge-lora` writes
    torch.testing.assert_close(_logits(merged, _batch()), expected, rtol=1e-4, atol=1e-4)


def test_a_skeleton_holds_the_same_host_adapter_as_a_whole_load(tiny_model_dir):
    from shardtune.model.source import ModelSource

    source = ModelSource(str(tiny_model_dir), OFT, attn_implementation="sdpa")
    skeleton = source.build_skeleton()
    whole = dict(source.load_full().named_parameters())
    initial = skeleton.initial_values()
    assert sorted(initial) == sorted(n for n in whole if ".oft_R." in n)
    assert all(torch.equal(value, whole[name]) for name, value in initial.items())
    buffers = skeleton.non_persistent_buffers()
    indices = [name for name in buffers if name.endswith((".rows", ".cols"))]
    assert len(indices) == 2 * 14 and not any(buffers[name].is_meta for name in indices)


def test_resuming_an_adapter_of_another_method_is_refused(tiny_model_dir, trained, tmp_path):
    from shardtune.model.pretrained_adapters import adapter_method, resumed_adapter_config

    model, _, _, _ = trained
    save_lora_adapter(model, model.state_dict(), tmp_path)
    assert adapter_method(tmp_path) == "oft"
    assert resumed_adapter_config(str(tmp_path), "oft").oft_block_size == BLOCK
    with pytest.raises(ModelError, match="holds a oft adapter, but finetuning_type is lora"):
        resumed_adapter_config(str(tmp_path), "lora")


def test_an_oft_adapter_trains_on_from_adapter_name_or_path(tiny_model_dir, trained, tmp_path):
    model, _, _, _ = trained
    save_lora_adapter(model, model.state_dict(), tmp_path)
    resumed = apply_finetuning(_base(tiny_model_dir), FinetuningSettings(
        finetuning_type="oft", oft=OftSettings(block_size=BLOCK), resume_adapter=str(tmp_path)))
    torch.testing.assert_close(_logits(resumed, _batch()), _logits(model, _batch()))
    assert any(p.requires_grad for n, p in resumed.named_parameters() if ".oft_R." in n)


@pytest.mark.parametrize(("rank", "block", "expected"), [
    (0, 0, "oft_rank (0) and oft_block_size (0): OFT needs one of them"),
    (8, 32, "oft_rank (8) and oft_block_size (32) are both set"),
    (8, 0, None), (0, 32, None)])
def test_exactly_one_of_rank_and_block_size(rank, block, expected):
    problem = size_problem(rank, block)
    assert (problem is None) if expected is None else (expected in problem)
    config = build_config({"finetuning_type": "oft", "oft_rank": rank, "oft_block_size": block})
    found = [p for p in cross_key_problems(config) if p.startswith("oft_")]
    assert found == ([] if expected is None else [problem])


def test_a_block_size_must_divide_every_adapted_layer():
    assert divisor_problems({"q_proj": 4096, "down_proj": 14336}, OftSettings(block_size=32)) == []
    problems = divisor_problems({"down_proj": 172}, OftSettings(block_size=32))
    assert problems == ["oft_block_size (32) does not divide down_proj's in_features (172); use a divisor such as 43, "
                        "or leave down_proj out of oft_target"]
    assert divisor_problems({"q_proj": 64}, OftSettings(rank=3, block_size=0))[0].startswith("oft_rank (3) does not")


def test_the_launching_host_refuses_a_block_size_the_model_does_not_fit(tiny_model_dir, tmp_path):
    values = {"model_name_or_path": str(tiny_model_dir), "output_dir": str(tmp_path / "out"),
              "finetuning_type": "oft", "dataset": ["demo"]}
    problems = file_problems(build_config({**values, "oft_block_size": 32}))
    assert [p for p in problems if "oft_block_size" in p] == [
        "oft_block_size (32) does not divide down_proj's in_features (172); use a divisor such as 43, or leave "
        "down_proj out of oft_target"]
    narrower = build_config({**values, "oft_block_size": 32, "oft_target": ["q_proj", "v_proj"]})
    assert not [p for p in file_problems(narrower) if "oft_" in p]
    typo = build_config({**values, "oft_block_size": 4, "oft_target": ["q_prj"]})
    assert "oft_target: q_prj not found in the model (did you mean 'q_proj'?)" in file_problems(typo)


def test_oft_keys_are_refused_for_other_methods_and_lora_keys_for_oft():
    config = build_config({"finetuning_type": "lora", "oft_rank": 4, "module_dropout": 0.1})
    problems = cross_key_problems(config)
    assert "oft_rank (4) is only valid with finetuning_type: oft (got 'lora')" in problems
    assert "module_dropout (0.1) is only valid with finetuning_type: oft (got 'lora')" in problems
    oft = cross_key_problems(build_config({"finetuning_type": "oft", "use_dora": True,
                                           "additional_target": ["embed_tokens"]}))
    assert "use_dora (True) is only valid with finetuning_type: lora (got 'oft')" in oft
    assert not [p for p in oft if p.startswith("additional_target")]


def test_the_estimate_counts_what_peft_builds(tiny_model_dir, trained):
    from shardtune.estimate.config import workload_from_config
    from shardtune.estimate.shape import load_model_shape
    from shardtune.estimate.workload import trainable_params

    config = build_config({"model_name_or_path": str(tiny_model_dir), "finetuning_type": "oft",
                           "oft_block_size": BLOCK})
    built = count_parameters(trained[0])[0]
    assert trainable_params(load_model_shape(str(tiny_model_dir)), workload_from_config(config)) == built
    by_rank = build_config({"model_name_or_path": str(tiny_model_dir), "finetuning_type": "oft", "oft_rank": 2,
                            "oft_block_size": 0, "oft_target": ["q_proj"]})
    # q_proj: 2 blocks of 32 -> 2 x 32 x 31 / 2 per layer
    assert trainable_params(load_model_shape(str(tiny_model_dir)), workload_from_config(by_rank)) == 2 * 2 * 496


def test_oft_is_no_longer_refused():
    config = build_config({"finetuning_type": "oft", "oft_block_size": 16, "oft_target": "q_proj,v_proj",
                           "module_dropout": 0.1})
    assert (config.oft_block_size, config.oft_target, config.module_dropout) == (16, ["q_proj", "v_proj"], 0.1)
    with pytest.raises(ConfigError, match="oft_block_size"):
        build_config({"finetuning_type": "oft", "oft_block_size": -1})
