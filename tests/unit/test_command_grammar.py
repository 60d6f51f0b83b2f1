"""One command-line grammar (issue 46, point 6): every subcommand that takes settings reads a config key as
``key=value``, ``--key value`` and ``--key=value`` alike, refuses a misspelt key with the same one line naming the
closest key (exit 2), and lists the keys it reads in ``--help``. config/args.py owns the grammar."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from shardtune.arguments import CommandParser
from shardtune.cli import main
from shardtune.config.args import parse_command_line, split_settings
from tests.conftest import REPO

# Each subcommand that takes settings: its arguments ({model}, {cfg}, {merge}, {tmp} filled in by the test) and a key
# it reads, with a value that shows.
WALK = {
    "train": (["{cfg}", "--dry-run"], "per_device_train_batch_size", "2"),
    "check": (["{cfg}"], "per_device_train_batch_size", "2"),
    "estimate": (["{cfg}", "--gpu-memory", "80GiB", "--json"], "cutoff_len", "64"),
    "chat": (["{model}", "--prompt", "hi", "template=chatml", "do_sample=false"], "max_new_tokens", "3"),
    "eval": (["{model}", "{cfg}", "--dry-run"], "max_new_tokens", "3"),
    "export": (["{merge}"], "export_size", "1"),
    "convert-config": (["{cfg}"], "max_steps", "3"),
    "slurm": (["{cfg}", "--nodes", "1", "--gpus-per-node", "1", "--script", "{tmp}/job.sbatch"],
              "per_device_train_batch_size", "2"),
    "k8s": (["{cfg}", "--nodes", "1", "--gpus-per-node", "1", "--image", "img:1", "--out", "{tmp}/job.yaml"],
            "per_device_train_batch_size", "2"),
}


def spellings(key: str, value: str) -> dict[str, list[str]]:
    return {"key=value": [f"{key}={value}"], "--key value": [f"--{key}", value], "--key=value": [f"--{key}={value}"],
            "--key-with-dashes value": [f"--{key.replace('_', '-')}", value]}


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exited:
            code = exited.code if isinstance(exited.code, int) else 1
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def places(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("grammar")
    cfg = folder / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": str(tiny_model_dir), "dataset": "demo",
                                   "dataset_dir": str(REPO / "data"), "template": "chatml",
                                   "output_dir": str(folder / "out"), "max_steps": 2}))
    merge = folder / "merge.yaml"
    merge.write_text(yaml.safe_dump({"model_name_or_path": str(tiny_model_dir), "template": "chatml",
                                     "export_dir": str(folder / "merged")}))
    return {"model": str(tiny_model_dir), "cfg": str(cfg), "merge": str(merge)}


def written(command: str, tmp: Path) -> str:
    """What the command wrote besides its output (slurm's script, k8s's manifest), with the folder made neutral."""
    name = {"slurm": "job.sbatch", "k8s": "job.yaml"}.get(command)
    return (tmp / name).read_text().replace(str(tmp), "TMP") if name else ""


@pytest.mark.e2e
@pytest.mark.parametrize("command", list(WALK))
def test_every_spelling_of_a_key_works_alike(command, places, tmp_path, monkeypatch):
    base, key, value = WALK[command]
    outcomes = {}
    for spelling, words in spellings(key, value).items():
        folder = tmp_path / spelling.replace(" ", "_")
        folder.mkdir()
        monkeypatch.chdir(folder)
        argv = [command, *(a.format(**places, tmp=folder) for a in base), *words]
        code, out, err = run(argv)
        assert code == 0, f"shardtune {' '.join(argv)}\nexit {code}\n{err[-3000:]}"
        outcomes[spelling] = (out.replace(str(folder), "TMP"), written(command, folder))
    assert len(set(outcomes.values())) == 1, outcomes
    if command in ("train", "check"):  # the value was read, not only accepted
        assert "global batch: 2" in outcomes["key=value"][0] or "global batch 2" in outcomes["key=value"][0]
    if command in ("slurm", "k8s"):
        assert f"{key}={value}" in outcomes["key=value"][1]


@pytest.mark.e2e
@pytest.mark.parametrize("command", list(WALK))
@pytest.mark.parametrize("spelling", ["key=value", "--key value", "--key=value"])
def test_a_misspelt_key_is_one_line_naming_the_closest(command, spelling, places, tmp_path, monkeypatch):
    base, key, value = WALK[command]
    monkeypatch.chdir(tmp_path)
    typo = key[:-1] + "z"
    argv = [command, *(a.format(**places, tmp=tmp_path) for a in base), *spellings(typo, value)[spelling]]
    code, _, err = run(argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert lines == [f"shardtune: error: command line: unknown key '{typo}' (did you mean '{key}'?)"], err
    assert not (tmp_path / "job.sbatch").exists() and not (tmp_path / "job.yaml").exists()


@pytest.mark.parametrize("command", list(WALK))
def test_help_lists_the_keys_the_command_reads(command):
    _, key, _ = WALK[command]
    code, out, _ = run([command, "--help"])
    assert code == 0
    assert "config keys (in the YAML" in out and f"\n  {key} " in out, out[-2000:]


def test_chat_help_lists_its_keys_only():
    _, out, _ = run(["chat", "--help"])
    assert "\n  max_new_tokens " in out and "\n  learning_rate " not in out


def chat_like_parser() -> CommandParser:
    parser = CommandParser(prog="shardtune chat")
    parser.add_argument("model")
    parser.add_argument("--prompt")
    parser.add_argument("--max-shard-size")
    parser.add_argument("--overwrite", action="store_true")
    return parser


def test_settings_are_split_from_the_commands_own_options():
    own, settings = split_settings(["RUN", "--prompt", "hi", "--max_new_tokens", "8", "do_sample=false",
                                    "--skip-special-tokens", "--temperature=0.3", "--max_shard_size", "5GB",
                                    "--overwrite", "--local_rank=1", "--dry-run"], chat_like_parser())
    assert own == ["RUN", "--prompt", "hi", "--max-shard-size", "5GB", "--overwrite"]
    assert settings == ["max_new_tokens=8", "do_sample=false", "--skip-special-tokens", "temperature=0.3",
                        "--local_rank=1", "--dry-run"]
    assert parse_command_line(settings).values == {"max_new_tokens": 8, "do_sample": False,
                                                   "skip_special_tokens": True, "temperature": 0.3}


def test_a_true_false_key_takes_only_a_true_false_word():
    own, settings = split_settings(["--do_sample", "RUN", "--skip_special_tokens", "no"], chat_like_parser())
    assert own == ["RUN"] and settings == ["--do_sample", "skip_special_tokens=no"]


def test_a_typo_of_the_commands_own_option_stays_with_its_options():
    own, settings = split_settings(["RUN", "--promt", "hi", "--max_new_tokns", "8"], chat_like_parser())
    assert own == ["RUN", "--promt", "hi"] and settings == ["max_new_tokns=8"]


@pytest.mark.parametrize("setting, says", [
    ("--export_siz", "command line: unknown key 'export_siz' (did you mean 'export_size'?)"),
    ("--export_size", "export: export_size: config keys are read from FILE.yaml"),
])
def test_export_folder_form_names_config_keys_it_does_not_read(setting, says, tiny_model_dir, tmp_path):
    code, _, err = run(["export", str(tiny_model_dir), "--out", str(tmp_path / "x"), setting, "1"])
    assert code == 2 and err.startswith(f"shardtune: error: {says}") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "x").exists()
