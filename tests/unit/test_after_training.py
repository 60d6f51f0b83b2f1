"""The pieces that make a trained model usable: the saved chat template renders the token ids training used, the
stop token becomes eos, export destinations are checked, answers are scored, generation keys are validated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.config.load import build_config
from shardtune.data.processing import SftOptions, encode_sft_batch
from shardtune.data.templates import TEMPLATES, get_template
from shardtune.errors import ConfigError
from shardtune.export.destination import EXPORT_MARKER, destination_problem, staged_folder
from shardtune.export.serving import ServingSettings, save_serving_tokenizer
from shardtune.infer.generation import GenerationSettings, answer_ids
from shardtune.infer.metrics import WordTokenizer, answer_scores
from shardtune.launch.validate import cross_key_problems

NAMED = [name for name in TEMPLATES if name != "auto"]
CHAT = [{"role": "user", "content": " What is 2+2? "}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6."}]


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny tokenizer with every special token a template writes (as make-tiny-model gives each family)."""
    from shardtune.model.tiny import build_tiny_tokenizer, bundled_corpus

    specials = sorted(set().union(*(TEMPLATES[name].literal_special_tokens() for name in NAMED)))
    return build_tiny_tokenizer(bundled_corpus(), extra_special=specials)


def trained_ids(tokenizer, template, system: str, messages) -> list[int]:
    batch = {"_system": [system], "_messages": [messages], "tools": [""]}
    return encode_sft_batch(batch, tokenizer, template, SftOptions(cutoff_len=4096))["input_ids"][0]


def saved_tokenizer(tokenizer, tmp_path: Path, name: str, enable_thinking: bool = True):
    from transformers import AutoTokenizer

    settings = ServingSettings(name, base_model=str(tmp_path / "no-base"), enable_thinking=enable_thinking)
    save_serving_tokenizer(tokenizer, settings, tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("system", ["", "Be brief."], ids=["no-system", "system"])
def test_saved_chat_template_gives_the_token_ids_training_used(name, system, tokenizer, tmp_path):
    import copy

    for thinking in (True, False) if TEMPLATES[name].thinking else (True,):
        template = get_template(name, enable_thinking=thinking)
        expected = trained_ids(tokenizer, template, system, CHAT)
        saved = saved_tokenizer(copy.deepcopy(tokenizer), tmp_path / f"{name}-{thinking}", name, thinking)
        head = [{"role": "system", "content": system}] if system else []
        got = saved.apply_chat_template(head + CHAT, tokenize=True, return_dict=False)
        assert list(got) == expected, (name, thinking, saved.decode(got), tokenizer.decode(expected))
        prompt = trained_ids(tokenizer, template, system, CHAT[:3] + [{"role": "assistant", "content": "x"}])
        prompt = prompt[:len(prompt) - len(tokenizer("x", add_special_tokens=False)["input_ids"])]
        asked = saved.apply_chat_template(head + CHAT[:3], tokenize=True, add_generation_prompt=True,
                                          return_dict=False)
        assert prompt[:len(asked)] == list(asked)


@pytest.mark.parametrize("name", NAMED)
def test_stop_token_becomes_eos_and_pad_stays(name, tokenizer, tmp_path):
    import copy

    saved = saved_tokenizer(copy.deepcopy(tokenizer), tmp_path, name)
    stop = get_template(name).stop_token(tokenizer)
    # A stop token the tokenizer would split (the tiny tokenizer lacks Gemma's <end_of_turn>) cannot be eos.
    assert saved.eos_token == (stop if stop in tokenizer.get_vocab() else tokenizer.eos_token)
    assert saved.pad_token == tokenizer.pad_token != stop


def test_saved_template_refuses_tools(tokenizer, tmp_path):
    import copy

    from jinja2.exceptions import TemplateError

    saved = saved_tokenizer(copy.deepcopy(tokenizer), tmp_path, "qwen")
    with pytest.raises(TemplateError, match="tools, tool calls and tool results are not part of it"):
        saved.apply_chat_template(CHAT[:1], tools=[{"type": "function", "function": {"name": "f"}}], tokenize=False)
    with pytest.raises(TemplateError, match="not part of it"):
        saved.apply_chat_template([*CHAT[:1], {"role": "tool", "content": "6"}], tokenize=False)


def test_replace_eos_false_keeps_the_base_eos(tokenizer, tmp_path):
    import copy

    from transformers import AutoTokenizer

    save_serving_tokenizer(copy.deepcopy(tokenizer), ServingSettings("chatml", "x", replace_eos=False), tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).eos_token == tokenizer.eos_token


def test_weights_recast_and_resharded(tiny_model_dir, tmp_path):
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.export.serving import cast_saved_weights

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    before = AutoModelForCausalLM.from_pretrained(folder)
    assert cast_saved_weights(folder, "bfloat16", max_shard_bytes=200_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (folder / "model.safetensors").exists()
    after = AutoModelForCausalLM.from_pretrained(folder)
    assert after.dtype == torch.bfloat16
    for (name, old), (_, new) in zip(before.state_dict().items(), after.state_dict().items(), strict=True):
        torch.testing.assert_close(new, old.to(torch.bfloat16), msg=name)
    assert not cast_saved_weights(folder, "bfloat16")  # nothing left to change


# --- export destinations ---

def test_destination_rules(tmp_path):
    source, base, out = tmp_path / "run", tmp_path / "base", tmp_path / "out"
    for folder in (source, base):
        folder.mkdir()
    protected = {"the source": source, "the base model": base}
    assert "is the source" in destination_problem(source, protected, overwrite=True)
    assert "contains the source" in destination_problem(tmp_path, protected, overwrite=True)
    assert "is the base model" in destination_problem(base, protected, overwrite=True)
    assert destination_problem(out, protected, overwrite=False) is None
    out.mkdir()
    assert destination_problem(out, protected, overwrite=False) is None  # empty
    (out / "notes.txt").write_text("mine")
    assert "--overwrite" in destination_problem(out, protected, overwrite=False)
    assert destination_problem(out, protected, overwrite=True) is None
    (out / EXPORT_MARKER).write_text("{}")
    assert destination_problem(out, protected, overwrite=False) is None
    (tmp_path / "file").write_text("x")
    assert "is a file" in destination_problem(tmp_path / "file", protected, overwrite=True)


def test_staged_folder_replaces_only_when_complete(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_folder(out, {}) as staging:
        (staging / "half.txt").write_text("half")
        raise RuntimeError("killed")
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"] and len(list(tmp_path.iterdir())) == 1
    with staged_folder(out, {"source": "s"}) as staging:
        (staging / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == sorted([EXPORT_MARKER, "new.txt"])
    assert len(list(tmp_path.iterdir())) == 1


# --- metrics and generation settings ---

def test_answer_scores_by_hand():
    # words a b c d vs a b c e: 3 of 4 unigrams, 2 of 3 bigrams, longest common subsequence 3 of 4.
    scores = answer_scores(["a b c d"], ["a b c e"])
    assert (scores["rouge-1"], scores["rouge-2"], scores["rouge-l"]) == (75.0, 66.6667, 75.0)
    assert scores["exact_match"] == 0.0
    perfect = answer_scores(["It is four.", " 你好，世界！ "], ["It is four.", "你好，世界！"])
    assert set(perfect.values()) == {100.0}
    assert WordTokenizer().tokenize("Hi, 你好 world") == ["Hi", ",", "你", "好", "world"]


def test_generation_kwargs_and_answer_cut():
    greedy = GenerationSettings(do_sample=False).generate_kwargs([7, 1], pad_token_id=2)
    assert greedy["do_sample"] is False and greedy["temperature"] is None and greedy["eos_token_id"] == [7, 1]
    sampled = GenerationSettings(temperature=0.5, top_p=0.9).generate_kwargs([7], None)
    assert (sampled["temperature"], sampled["top_p"], sampled["pad_token_id"]) == (0.5, 0.9, 7)
    assert answer_ids([5, 6, 7, 2, 2], [7, 1]) == [5, 6] and answer_ids([5, 6], [7]) == [5, 6]


BASE = {"model_name_or_path": "org/model", "output_dir": "out", "dataset": "demo"}


@pytest.mark.parametrize(("values", "expected"), [
    ({"do_predict": True, "predict_with_generate": True, "eval_dataset": "demo"}, None),
    ({"do_predict": True, "predict_with_generate": True, "do_train": False, "dataset": "demo"}, None),
    ({"do_predict": True, "eval_dataset": "demo"}, "without predict_with_generate"),
    ({"do_predict": True, "predict_with_generate": True}, "needs eval_dataset"),
    ({"predict_with_generate": True}, "without do_predict"),
    ({"do_train": False}, "nothing to do"),
    ({"do_predict": True, "predict_with_generate": True, "eval_dataset": "demo", "stage": "pt"}, "stage sft"),
    ({"export_dir": "x"}, "read by `shardtune export FILE`"),
    ({"infer_dtype": "bfloat16"}, "read by `shardtune chat`"),
])
def test_generation_key_rules(values, expected):
    problems = cross_key_problems(build_config({**BASE, **values}))
    matching = [p for p in problems if expected and expected in p]
    assert matching if expected else not [p for p in problems if "predict" in p or "do_train" in p], problems


def test_llamafactory_inference_backends_other_than_huggingface_are_refused():
    with pytest.raises(ConfigError, match="infer_backend: 'vllm' is not allowed"):
        build_config({**BASE, "infer_backend": "vllm"})


def test_vllm_notes_for_adapters():
    from shardtune.export.vllm import adapter_notes

    assert adapter_notes({"r": 8}, None, None) == ["vLLM: loadable as a LoRA adapter with --enable-lora (rank 8)"]
    assert "--max-lora-rank 64" in adapter_notes({"r": 64}, None, None)[0]
    blocked = adapter_notes({"r": 8, "use_dora": True, "modules_to_save": ["embed_tokens"]}, 2100, 2048)[0]
    assert "DoRA" in blocked and "modules_to_save" in blocked and "tokens added" in blocked
    assert "--merge-lora" in blocked


def hub_cache_with(model_dir: Path, cache: Path, model_id: str) -> None:
    """``model_dir``'s files as the Hugging Face cache holds a downloaded ``model_id`` (refs/main, one snapshot)."""
    import shutil

    revision = "0" * 40
    repo = cache / f"models--{model_id.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


@pytest.mark.parametrize("kind", ["image-text", "text"])
def test_a_model_trained_from_a_hub_id_gets_the_processor_files_it_loaded(kind, arch_model_dir, tiny_model_dir,
                                                                          tmp_path):
    """model_name_or_path a hub id: the image processor was read from the hub cache, and the saved folder must read
    images as that did (only a local folder's files were copied before). A text model gets none."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    source = arch_model_dir("image-text:qwen3_vl") if kind == "image-text" else tiny_model_dir
    hub_cache_with(source, tmp_path / "hub", "org/tiny")
    out = tmp_path / "saved"
    out.mkdir()
    script = ("import sys; from pathlib import Path; from shardtune.export.serving import copy_processor_files; "
              "print(copy_processor_files('org/tiny', Path(sys.argv[1])))")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, "-c", script, str(out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = sorted(p.name for p in source.glob("*processor_config.json"))
    assert kind == "text" or expected  # the tiny image-text model keeps its image processor
    assert sorted(p.name for p in out.iterdir()) == expected
    for name in expected:
        assert (out / name).read_text() == (source / name).read_text()
