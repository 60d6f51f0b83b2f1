"""Every option of every subcommand, read from its own `--help`, given the values users mistype: the command exits
0 or 2 in a few lines, no traceback, no hang, no file of the user's changed (tests/unit/test_fuzz_schema.py does
the same for every config key)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from shardtune.cli import main
from tests.unit.test_fuzz_schema import MAX_LINES, fingerprint, run_command

# Each subcommand with the arguments that make the rest of its command line sound; {model}, {run}, {cfg} are
# filled in by the fixture. Commands that serve or watch (web, status --watch, doctor) get only values that must be
# refused: a value they accept would serve forever.
BASES = {
    "estimate": ["{cfg}"], "export": ["{run}", "--out", "{tmp}/exported"],
    "chat": ["{run}", "--prompt", "hi", "--max_new_tokens", "4"],  # a short answer: the contract is the options'
    "make-tiny-model": ["--out", "{tmp}/tiny-new"], "expand-model": ["{model}", "--out", "{tmp}/expanded",
                                                                     "--num-expand", "2"],
    "slurm": ["{cfg}", "--nodes", "1", "--gpus-per-node", "1", "--script", "{tmp}/job.sbatch"],
    "k8s": ["{cfg}", "--nodes", "1", "--gpus-per-node", "1", "--image", "img:1", "--out", "{tmp}/job.yaml"],
    "convert-config": ["{cfg}"], "status": ["{run}"], "web": ["{tmp}"], "doctor": ["{cfg}"],
}
SERVES = {"web", "status", "doctor"}
# A config key each command that takes settings reads, given as --key VALUE like its own options (config/args.py:
# every command reads settings in one grammar); export's folder form refuses config keys by name.
SETTINGS = {"estimate": "cutoff_len", "chat": "max_new_tokens", "export": "export_size", "slurm": "max_steps",
            "k8s": "max_steps", "convert-config": "max_steps"}
NUMBER = re.compile(r"^(N|M|SECONDS|PORT|ITERATIONS|LAYERS|HIDDEN|HEADS|KV_HEADS|INTERMEDIATE|VOCAB_SIZE|SEED|"
                    r"NODES|GPUS_PER_NODE|NPROC_PER_NODE|CPUS_PER_NODE|NUM_EXPAND)$")
PATHS = re.compile(r"^(OUT|FILE|PATH|MODEL|BASE|SCRIPT|OUTPUT)$")


def options_of(command: str) -> list[tuple[str, str]]:
    """(option, metavar) for each option of ``command`` that takes a value, read from its --help."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([command, "--help"])
    text = out.getvalue()
    return sorted(set(re.findall(r"^\s+(--[a-z][a-z0-9-]*) ([A-Z_]+)", text, flags=re.MULTILINE)))


def mistakes(command: str, metavar: str) -> list[str]:
    if NUMBER.match(metavar):  # (seconds may have a fraction: 1.5 is a sound --watch, which watches forever)
        fraction = [] if metavar == "SECONDS" else ["1.5"]
        return ["abc", "-1", *fraction] + ([] if command in SERVES else ["0", "99999999999"])
    if metavar == "SIZE" or metavar.startswith("MEMORY"):
        return ["abc", "-5GB", "5XB"]
    if PATHS.match(metavar):
        return ["{tmp}/no/such/folder/x", "{tmp}/a-file.txt/x", "https://example.com/x"]
    return [] if command in SERVES else ["", "a b;c"]


def cases() -> list[tuple[str, str, str]]:
    options = [(command, option, value) for command in sorted(BASES) for option, metavar in options_of(command)
               for value in mistakes(command, metavar)]
    return options + [(command, f"--{key}", value) for command, key in SETTINGS.items() for value in ("abc", "-1", "")]


@pytest.fixture(scope="module")
def places(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    from tests.conftest import REPO, run_cli

    folder = tmp_path_factory.mktemp("fuzz-commands")
    run = folder / "run"
    trained = run_cli("train", "examples/tiny/sft_lora.yaml", f"model_name_or_path={tiny_model_dir}",
                      f"output_dir={run}", "max_steps=2", "save_steps=1", "plot_loss=false", cwd=REPO, timeout=300)
    assert trained.returncode == 0, trained.stderr
    cfg = folder / "cfg.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: demo\ndataset_dir: {REPO / 'data'}\n"
                   f"template: chatml\noutput_dir: {folder / 'out'}\nmax_steps: 2\n")
    return {"model": str(tiny_model_dir), "run": str(run), "cfg": str(cfg)}


@pytest.mark.e2e
@pytest.mark.parametrize("command, option, value", cases(), ids=lambda v: str(v) or "empty")
def test_every_option_keeps_the_contract(command, option, value, places, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file.txt").write_text("mine\n")
    fill = {**places, "tmp": str(tmp_path)}
    base = [a.format(**fill) for a in BASES[command]]
    if option in base:  # the base gives it: replace its value
        at = base.index(option)
        base = base[:at] + base[at + 2:]
    argv = [command, *base, option, value.format(**fill)]
    watched = [Path(places["run"]), Path(places["model"])]
    before = [fingerprint(p) for p in watched] + [(tmp_path / "a-file.txt").read_text()]
    code, err = run_command(argv, seconds=180)  # chat loads the model and answers: bounded, not hurried
    about = f"shardtune {' '.join(argv)}\nexit {code}, stderr:\n{err[-3000:]}"
    assert code in (0, 2), about
    assert "Traceback" not in err, about
    assert len([line for line in err.splitlines() if line.strip()]) <= MAX_LINES, about
    assert [fingerprint(p) for p in watched] + [(tmp_path / "a-file.txt").read_text()] == before, about
    if command in SERVES:
        assert code == 2, about
