"""A model usable the minute training ends, through the real CLI on tiny models: the saved folder keeps the base
checkpoint's dtype and stops at the template's stop token, `chat` answers (one-shot, from a file, in a terminal),
`do_predict` and `eval` write LLaMA-Factory's prediction files, and `export` never destroys a folder."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardtune.export.destination import EXPORT_MARKER
from tests.conftest import REPO, cli_env, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PAIRS = [("What color is the sky?", "The sky is blue."), ("Name a fruit.", "An apple."),
         ("What is two plus two?", "It is four."), ("Say hello.", "Hello there!")]


def bf16_copy(model_dir: Path, out: Path) -> Path:
    """The tiny model saved in bfloat16, as most released checkpoints are."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def parrot_data(folder: Path) -> Path:
    """Four question/answer pairs (repeated for training) and the same four as eval data."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"instruction": q, "input": "", "output": a} for q, a in PAIRS]
    (folder / "parrot.json").write_text(json.dumps(rows * 4))
    (folder / "parrot_eval.json").write_text(json.dumps(rows))
    (folder / "dataset_info.json").write_text(json.dumps({"parrot": {"file_name": "parrot.json"},
                                                          "parrot_eval": {"file_name": "parrot_eval.json"}}))
    return folder


def parrot_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """``train`` arguments of the parrot run; ``extra`` key=value pairs replace its own."""
    keys = {"model_name_or_path": model, "stage": "sft", "finetuning_type": "full", "dataset": "parrot",
            "eval_dataset": "parrot_eval", "dataset_dir": data, "template": "chatml", "cutoff_len": 64,
            "output_dir": out, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "max_steps": 40,
            "save_strategy": "no", "logging_steps": 10, "do_predict": "true", "predict_with_generate": "true",
            "do_sample": "false", "max_new_tokens": 16, "per_device_eval_batch_size": 2}
    keys.update(dict(pair.split("=", 1) for pair in extra))
    return ["train", *(f"{key}={value}" for key, value in keys.items())]


@pytest.fixture(scope="module")
def bf16_base(tiny_model_dir, tmp_path_factory) -> Path:
    return bf16_copy(tiny_model_dir, tmp_path_factory.mktemp("bf16") / "tiny-bf16")


@pytest.fixture(scope="module")
def parrot(bf16_base, tmp_path_factory) -> Path:
    """A full fine-tune of the bf16 tiny model that learned four answers, with do_predict after training."""
    root = tmp_path_factory.mktemp("parrot")
    out = root / "out"
    result = run_cli(*parrot_args(bf16_base, parrot_data(root / "data"), out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def safetensors_dtypes(folder: Path) -> set[str]:
    from safetensors import safe_open

    found = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            found |= {f.get_slice(name).get_dtype() for name in f.keys()}
    return found


def test_full_output_keeps_the_base_dtype_template_and_stop_token(parrot, bf16_base):
    from transformers import AutoTokenizer

    assert json.loads((parrot / "config.json").read_text())["dtype"] == "bfloat16"
    assert safetensors_dtypes(parrot) == {"BF16"}
    assert (parrot / "model.safetensors").stat().st_size <= (bf16_base / "model.safetensors").stat().st_size * 1.01
    tokenizer = AutoTokenizer.from_pretrained(parrot)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|pad|>"
    generation = json.loads((parrot / "generation_config.json").read_text())
    assert generation["eos_token_id"][0] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": PAIRS[0][0]}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        f"<|im_start|>user\n{PAIRS[0][0]}<|im_end|>\n<|im_start|>assistant\n"


def test_saved_model_generation_stops_at_the_stop_token(parrot):
    """Served as it is (its own generation_config.json), the model ends its answer with <|im_end|>."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(parrot)
    model = AutoModelForCausalLM.from_pretrained(parrot)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PAIRS[1][0]}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=30, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
    assert out[-1] == tokenizer.eos_token_id and len(out) < 30
    assert tokenizer.decode(out, skip_special_tokens=True) == PAIRS[1][1]


def test_do_predict_after_training_writes_llamafactory_files(parrot):
    rows = [json.loads(line) for line in (parrot / "generated_predictions.jsonl").read_text().splitlines()]
    assert [(r["predict"], r["label"]) for r in rows] == [(a, a) for _, a in PAIRS]
    assert rows[0]["prompt"] == f"<|im_start|>user\n{PAIRS[0][0]}<|im_end|>\n<|im_start|>assistant\n"
    results = json.loads((parrot / "predict_results.json").read_text())
    assert {k: results[k] for k in ("predict_bleu-4", "predict_rouge-1", "predict_rouge-2", "predict_rouge-l",
                                    "predict_exact_match")} == dict.fromkeys(
        ["predict_bleu-4", "predict_rouge-1", "predict_rouge-2", "predict_rouge-l", "predict_exact_match"], 100.0)
    assert results["predict_samples"] == 4


def test_eval_command_scores_the_saved_model_from_its_run_config(parrot, tmp_path):
    result = run_cli("eval", str(parrot), f"output_dir={tmp_path / 'predict'}", "do_sample=false",
                     "max_new_tokens=16")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "predict" / "predict_results.json").read_text())["predict_exact_match"] == 100.0
    assert (tmp_path / "predict" / ".shardtune" / "eval_config.yaml").is_file()  # the run's data keys


@pytest.mark.matrix
def test_eval_command_with_a_config_file_scores_an_untrained_model_low(parrot, tiny_model_dir, tmp_path):
    config = tmp_path / "eval.yaml"
    config.write_text((parrot / "shardtune_config.json").read_text())  # JSON is YAML: the run's own keys
    result = run_cli("eval", str(tiny_model_dir), str(config), f"output_dir={tmp_path / 'untrained'}",
                     "do_sample=false", "max_new_tokens=8")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "untrained" / "predict_results.json").read_text())["predict_exact_match"] == 0.0


def test_chat_one_shot(parrot):
    result = run_cli("chat", str(parrot), "--prompt", PAIRS[3][0], "do_sample=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == PAIRS[3][1]


@pytest.mark.matrix
def test_chat_answers_each_line_of_a_file(parrot, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PAIRS[0][0]}\n\n{PAIRS[2][0]}\n")
    result = run_cli("chat", str(parrot), "--file", str(prompts), "do_sample=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == [PAIRS[0][1], PAIRS[2][1]]


def run_in_terminal(args: list[str], typed: list[str], timeout: float = 240) -> str:
    """Run the CLI on a pseudo-terminal, typing each line after the next ``User:`` prompt; the screen's text."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "shardtune", *args], cwd=REPO, env=cli_env(), stdin=slave,
                            stdout=slave, stderr=subprocess.DEVNULL, close_fds=True)
    os.close(slave)
    screen, pending, deadline = b"", list(typed), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    break
                screen += chunk
            if pending and screen.count(b"User: ") > len(typed) - len(pending):
                os.write(master, pending.pop(0).encode() + b"\n")
            if proc.poll() is not None and not ready:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert proc.wait(timeout=10) == 0, screen.decode(errors="replace")
    return screen.decode(errors="replace").replace("\r\n", "\n")


def test_chat_in_a_terminal_keeps_history_and_stops(parrot):
    screen = run_in_terminal(["chat", str(parrot), "do_sample=false"],
                             [PAIRS[0][0], PAIRS[1][0], "clear", PAIRS[3][0], "exit"])
    answers = [line.split("Assistant: ", 1)[1] for line in screen.splitlines() if "Assistant: " in line]
    assert answers == [PAIRS[0][1], PAIRS[1][1], PAIRS[3][1]], screen
    assert "History cleared." in screen


# --- export: never destroys ---

def test_export_refuses_folders_it_would_destroy(parrot, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    nested = tmp_path / "holder"
    (nested / "run").mkdir(parents=True)
    for out, expected in [(parrot, "is the source"), (parrot.parent, "contains the source"),
                          (mine, "not an earlier export")]:
        result = run_cli("export", str(parrot), "--out", str(out))
        assert result.returncode == 2 and expected in result.stderr, result.stderr[-2000:]
        assert len(result.stderr.strip().splitlines()) == 1
    assert (mine / "notes.txt").read_text() == "keep me" and (parrot / "model.safetensors").is_file()
    exported = tmp_path / "exported"
    result = run_cli("export", str(parrot), "--out", str(exported))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "vLLM: loadable as it is" in result.stdout and (exported / EXPORT_MARKER).is_file()


@pytest.mark.matrix
def test_export_replaces_an_earlier_export_and_overwrites_on_request(parrot, tmp_path):
    exported = tmp_path / "exported"
    for _ in range(2):  # the second run replaces the earlier export without --overwrite
        result = run_cli("export", str(parrot), "--out", str(exported), "--dtype", "float32", "--max-shard-size",
                         "300KB")
        assert result.returncode == 0, result.stderr[-2000:]
    assert safetensors_dtypes(exported) == {"F32"} and len(list(exported.glob("model-*.safetensors"))) > 1
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("replace me")
    result = run_cli("export", str(parrot), "--out", str(mine), "--overwrite")
    assert result.returncode == 0 and not (mine / "notes.txt").exists(), result.stderr[-2000:]


def test_killed_export_leaves_no_half_folder(wider_model_dir, tmp_path):
    """SIGKILL while the export writes: the destination is absent (or the earlier export, intact); the next
    export removes the dead one's temporary folder."""
    out = tmp_path / "exported"
    argv = [sys.executable, "-m", "shardtune", "export", str(wider_model_dir), "--out", str(out)]
    job = subprocess.Popen(argv, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob(".exported.partial-*")) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=30)
    if job.returncode == 0:
        pytest.skip("the export finished before it could be killed")
    assert not out.exists()
    assert list(tmp_path.glob(".exported.partial-*"))
    result = run_cli("export", str(wider_model_dir), "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert not list(tmp_path.glob(".exported.partial-*")) and (out / "shardtune_export.json").is_file()


# --- full, freeze and merged LoRA keep a bf16 base's dtype; chat on a checkpoint ---

@pytest.mark.parametrize("method", ["lora", pytest.param("freeze", marks=pytest.mark.matrix)])
def test_freeze_and_merged_lora_keep_the_base_dtype(method, bf16_base, tmp_path):
    data = parrot_data(tmp_path / "data")
    out = tmp_path / "run"
    result = run_cli(*parrot_args(bf16_base, data, out, f"finetuning_type={method}", "max_steps=2",
                                  "do_predict=false", "predict_with_generate=false", "save_strategy=steps",
                                  "save_steps=2"))
    assert result.returncode == 0, result.stderr[-3000:]
    # chat reads a checkpoint of the run too (the base model under the checkpoint's trained weights)
    chat = run_cli("chat", str(out / "checkpoint-2"), "--prompt", PAIRS[0][0], "max_new_tokens=3")
    assert chat.returncode == 0 and chat.stdout.endswith("\n"), chat.stderr[-3000:]
    folder = out
    if method == "lora":
        folder = tmp_path / "merged"
        result = run_cli("export", str(out), "--out", str(folder), "--merge-lora")
        assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert safetensors_dtypes(folder) == {"BF16"}
