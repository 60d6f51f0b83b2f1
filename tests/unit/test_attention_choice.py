"""Attention per model: `auto` picks a kernel the model's class supports, says why, and records it; a kernel the
model cannot run, or packing it cannot keep apart, is refused on the launching host."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardtune.config.load import build_config
from shardtune.errors import ModelError
from shardtune.launch.model_checks import attention_problems
from shardtune.launch.preflight import apply_attention_auto
from shardtune.model.attention import (
    AUTO,
    KernelSupport,
    choose_attention,
    kernel_problem,
    kernel_support,
    layer_windows,
    packing_problem,
)
from shardtune.train.loop import to_device
from shardtune.train.setup import with_attention_resolved

# model_type -> (auto without flash-attn, auto with flash-attn on a GPU); transformers 5.23's own class flags.
EXPECTED = {
    "llama": ("sdpa", "flash_attention_2"),
    "qwen3": ("sdpa", "flash_attention_2"),
    "mistral": ("sdpa", "flash_attention_2"),
    "gemma2": ("eager", "flash_attention_2"),  # softcapping: no sdpa
    "gemma3_text": ("sdpa", "flash_attention_2"),
    "gpt_oss": ("eager", "eager"),  # no sdpa, and flash-attn 2 drops its sinks
    "deepseek_v3": ("sdpa", "flash_attention_2"),
}


def support_of(model_type: str) -> KernelSupport:
    support = kernel_support({"model_type": model_type})
    assert support is not None
    return support


@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_auto_picks_flash_then_sdpa_then_eager_as_the_class_allows(model_type: str) -> None:
    without, with_flash = EXPECTED[model_type]
    support = support_of(model_type)
    assert choose_attention(AUTO, support, flash_usable=False, model="m").kernel == without
    chosen = choose_attention(AUTO, support, flash_usable=True, model="m")
    assert chosen.kernel == with_flash
    assert chosen.reason.startswith("auto: ") and support.model_class in chosen.reason


def test_the_class_is_found_from_model_type_or_architectures() -> None:
    assert support_of("gemma3_text").model_class == "Gemma3ForCausalLM"
    by_architecture = kernel_support({"model_type": "nope", "architectures": ["GptOssForCausalLM"]})
    assert by_architecture is not None and by_architecture.sinks and not by_architecture.sdpa
    assert kernel_support({"model_type": "my_remote_model", "architectures": ["MyModel"]}) is None


def test_a_class_unknown_before_loading_gets_eager_and_keeps_an_explicit_choice() -> None:
    assert choose_attention(AUTO, None, flash_usable=True, model="m").kernel == "eager"
    assert choose_attention("sdpa", None, flash_usable=False, model="m").kernel == "sdpa"


@pytest.mark.parametrize(("model_type", "kernel", "fragment"), [
    ("gemma2", "sdpa", "Gemma2ForCausalLM (m) does not support sdpa"),
    ("gpt_oss", "sdpa", "GptOssForCausalLM (m) does not support sdpa"),
    ("gpt_oss", "flash_attention_2", "has attention sinks, which the flash-attn 2 kernel does not take"),
])
def test_an_explicit_kernel_the_model_cannot_run_is_refused(model_type: str, kernel: str, fragment: str) -> None:
    problem = kernel_problem(kernel, support_of(model_type), "m")
    assert problem is not None and fragment in problem
    assert problem.startswith(f"attn_implementation ({kernel}; flash_attn: ") and "flash_attn: auto" in problem
    with pytest.raises(ModelError, match="attn_implementation"):
        choose_attention(kernel, support_of(model_type), flash_usable=True, model="m")


@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_eager_and_the_auto_choice_are_always_accepted(model_type: str) -> None:
    support = support_of(model_type)
    for flash_usable in (False, True):
        kernel = choose_attention(AUTO, support, flash_usable=flash_usable, model="m").kernel
        assert kernel_problem(kernel, support, "m") is None
    assert kernel_problem("eager", support, "m") is None


def test_layer_kinds_come_from_the_config() -> None:
    assert layer_windows({"model_type": "llama"}) == {"full_attention": None}
    assert layer_windows({"sliding_window": 4096}) == {"sliding_attention": 4096}
    assert layer_windows({"sliding_window": None, "layer_types": ["full_attention"] * 3}) == {"full_attention": None}
    hybrid = {"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]}
    assert layer_windows(hybrid) == {"sliding_attention": 512, "full_attention": None}
    assert layer_windows({"model_type": "gemma3", "text_config": hybrid}) == layer_windows(hybrid)


def test_packing_is_refused_where_no_mask_can_keep_samples_apart() -> None:
    chunked = {"layer_types": ["chunked_attention", "full_attention"], "sliding_window": 16}
    problem = packing_problem(chunked, None, "sdpa", "m")
    assert problem is not None and "chunked_attention layers" in problem and "packing: false" in problem
    assert packing_problem(chunked, None, "flash_attention_2", "m") is None  # varlen offsets bound every layer
    hybrid = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}
    one_mask = KernelSupport("SomeForCausalLM", flash=False, sdpa=True, sinks=False, mask_per_layer_type=False)
    problem = packing_problem(hybrid, one_mask, "sdpa", "m")
    assert problem is not None and "takes one mask for all of them" in problem
    for model_type in ("gemma2", "gemma3_text", "gpt_oss", "qwen2"):
        assert packing_problem(hybrid, support_of(model_type), "eager", "m") is None


def test_launching_host_resolves_auto_from_the_folder_and_says_why(tiny_model_dir: Path, capsys) -> None:
    config = build_config({"model_name_or_path": str(tiny_model_dir), "flash_attn": "auto"})
    assert config.attn_implementation == AUTO
    resolved = apply_attention_auto(config, has_cuda=False)
    assert resolved.attn_implementation == "sdpa"
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[shardtune] attention:")]
    assert lines == ["[shardtune] attention: sdpa (auto: LlamaForCausalLM supports sdpa; flash-attn is not usable "
                     "here (needs the package and a CUDA GPU))"]
    explicit = build_config({"model_name_or_path": str(tiny_model_dir), "flash_attn": "disabled"})
    assert apply_attention_auto(explicit, has_cuda=False).attn_implementation == "eager"
    assert "[shardtune] attention: eager (asked for" in capsys.readouterr().out
    apply_attention_auto(explicit, has_cuda=False, announce_choice=False)  # a rank: the launching host said it
    assert "attention" not in capsys.readouterr().out


def test_an_uncached_hub_id_is_decided_on_the_rank(capsys) -> None:
    config = build_config({"model_name_or_path": "no-such-org/no-such-model"})
    assert apply_attention_auto(config, has_cuda=False).attn_implementation == AUTO
    assert "decided on each rank" in capsys.readouterr().out


def test_a_rank_resolves_auto_left_open_from_the_loaded_config(arch_model_dir, capsys) -> None:
    config = build_config({"model_name_or_path": str(arch_model_dir("gemma2"))})
    assert with_attention_resolved(config, is_main=True).attn_implementation == "eager"
    assert "[shardtune] attention: eager (auto: Gemma2ForCausalLM does not support sdpa" in capsys.readouterr().out


def test_validation_checks_the_chosen_kernel_and_packing_under_it(arch_model_dir, tmp_path: Path) -> None:
    gpt_oss = str(arch_model_dir("gpt_oss"))
    assert attention_problems(build_config({"model_name_or_path": gpt_oss, "flash_attn": "sdpa"}))
    # Packed rows work under eager; the router's aux loss (on by default) cannot read their block mask.
    assert not attention_problems(build_config({"model_name_or_path": gpt_oss, "flash_attn": "disabled",
                                                "packing": True, "moe_aux_loss_coef": 0}))
    assert "moe_aux_loss_coef" in attention_problems(build_config({"model_name_or_path": gpt_oss,
                                                                   "flash_attn": "disabled", "packing": True}))[0]
    chunked = Path(shutil.copytree(arch_model_dir("gemma3"), tmp_path / "chunked"))
    make_layers_chunked(chunked)
    problems = attention_problems(build_config({"model_name_or_path": str(chunked), "flash_attn": "sdpa",
                                                "packing": True}))
    assert len(problems) == 1 and "chunked_attention layers" in problems[0]
    assert not attention_problems(build_config({"model_name_or_path": str(chunked), "flash_attn": "sdpa"}))


def make_layers_chunked(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["layer_types"] = ["chunked_attention", "full_attention"]
    (model / "config.json").write_text(json.dumps(config))


def test_per_layer_type_masks_reach_the_device() -> None:
    batch = {"attention_mask": {"full_attention": torch.zeros(1), "sliding_attention": torch.ones(1)}, "n": 3}
    moved = to_device(batch, torch.device("cpu"))
    assert set(moved["attention_mask"]) == {"full_attention", "sliding_attention"} and moved["n"] == 3


def test_models_that_build_their_own_mask_keep_rows_apart_by_padding():
    """GPT-1, XLNet, ProphetNet, CPM-Ant build their mask from a 2-D padding mask and BLOOM reads ALiBi positions
    from it: a packed row's 4-D block mask cannot reach them, so packing is refused and padding_free (on by default
    on the CPU) stays off (the registry matrix found them: each failed or mixed samples on one process)."""
    from shardtune.model.attention import kernel_support, packing_problem

    for model_type in ("bloom", "openai-gpt", "xlnet", "prophetnet", "cpmant"):
        support = kernel_support({"model_type": model_type})
        assert support is not None and not support.prepared_mask, model_type
        assert "builds its attention mask itself" in packing_problem({"model_type": model_type}, support, "sdpa", "m")
    for config in ({"model_type": "llama"}, {"model_type": "falcon", "alibi": False}, {"model_type": "fuyu"}):
        assert kernel_support(config).prepared_mask, config
