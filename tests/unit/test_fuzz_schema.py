"""The schema-driven fuzzer: `check` is the contract, and `train` keeps it.

For every input tests/schema_fuzz.py generates from the schema, `shardtune check` either passes (exit 0) or exits 2
with a few lines, no traceback, naming the key at fault; never hangs, never changes a file it was given. Inputs that
must be refused (a wrong type, a value past a bound, an unknown choice, a misspelt key) are. Then `train
--max_steps 1` runs a sample of what `check` accepted: every "check passed, train refused or crashed" is a failure.

`make test` runs a fast setting; `make test-matrix` (``-m matrix``) runs more pairs and a larger train sample.
The seed is fixed (the same cases every run); SHARDTUNE_FUZZ_SEED widens the search by hand.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardtune.cli import main
from tests.conftest import REPO
from tests.schema_fuzz import (
    EMPTY,
    FILE,
    FOLDER,
    LOOP,
    MISSING,
    OTHER_FORMAT,
    Case,
    config_cases,
    mapped_key_cases,
    pair_cases,
    sequence_parallel_refusal_cases,
)

SEED = int(os.environ.get("SHARDTUNE_FUZZ_SEED", "20261129"))
MAX_LINES = 8  # "a few lines": a mistake and what follows from it
HANG_SECONDS = 60
TRAIN_SECONDS = 300  # one step, compiled ones included, on a loaded 2-core machine: a hang, not a slow step
CASES = config_cases(SEED) + mapped_key_cases()
PAIRS_FAST = pair_cases(SEED, 120)
PAIRS_MATRIX = pair_cases(SEED + 1, 1200)
TRAIN_SAMPLE_FAST, TRAIN_SAMPLE_MATRIX = 8, 80


@pytest.fixture(scope="module")
def base(tiny_model_dir, tmp_path_factory) -> dict[str, Any]:
    config = yaml.safe_load((REPO / "examples/tiny/sft_lora.yaml").read_text())
    out = tmp_path_factory.mktemp("fuzz-out")
    return {**config, "model_name_or_path": str(tiny_model_dir), "dataset_dir": str(REPO / "data"),
            "output_dir": str(out / "run"), "plot_loss": False}


def materialize(value: Any, folder: Path) -> Any:
    """A path placeholder of schema_fuzz made real in ``folder``."""
    if not isinstance(value, str) or not value.startswith("@"):
        return value
    if value == MISSING:
        return str(folder / "no-such-thing")
    if value == FOLDER:
        (folder / "a-folder").mkdir(exist_ok=True)
        return str(folder / "a-folder")
    if value == FILE:
        (folder / "a-file.txt").write_text("text\n")
        return str(folder / "a-file.txt")
    if value == EMPTY:
        (folder / "empty.json").write_text("")
        return str(folder / "empty.json")
    if value == LOOP:
        with contextlib.suppress(FileExistsError):
            os.symlink(folder / "loop-b", folder / "loop-a")
            os.symlink(folder / "loop-a", folder / "loop-b")
        return str(folder / "loop-a")
    if value == OTHER_FORMAT:
        (folder / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
        return str(folder / "picture.png")
    return value


def fingerprint(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by content (links by target): what a run must leave as it was."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            found[str(path)] = "->" + os.readlink(path)
        elif path.is_file():
            found[str(path)] = hashlib.sha1(path.read_bytes()).hexdigest()
    return found


@contextlib.contextmanager
def bounded(seconds: int) -> Iterator[None]:
    """Fail instead of hanging: an alarm interrupts the command after ``seconds``."""
    def hung(signum, frame):
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_command(argv: list[str], seconds: int = HANG_SECONDS) -> tuple[int, str]:
    err = io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with bounded(seconds), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code if isinstance(exit_.code, int) else 1
    except Exception:  # a crash is a finding: reported with the case that made it, not as the test's own error
        import traceback

        code = 1
        err.write(traceback.format_exc())
    finally:
        for sig, handler in handlers.items():  # train installs its stop handlers in this process
            signal.signal(sig, handler)
    return code, err.getvalue()


def config_for(case: Case, base: dict[str, Any], folder: Path) -> Path:
    config = {k: v for k, v in base.items() if k not in case.removed}
    config.update({k: materialize(v, folder) for k, v in case.values.items()})
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    return path


def reproduce(case: Case, config: Path) -> str:
    test = "test_check_refuses_what_sequence_parallelism_cannot_run" if case.names_all else "test_check_contract"
    return (f"case {case.id}: pytest {shlex.quote(f'tests/unit/test_fuzz_schema.py::{test}[{case.id}]')}"
            f"\nconfig:\n{config.read_text()[:3000]}")


CHECK_SAID: dict[Path, str] = {}  # check's stderr by case folder, for train's comparison


def check_contract(case: Case, base: dict[str, Any], folder: Path) -> int:
    """`shardtune check` on the case: exit 0, or exit 2 in a few lines naming a culprit; no file changed."""
    config = config_for(case, base, folder)
    before = fingerprint(folder) | fingerprint(REPO / "data")
    with contextlib.chdir(folder):  # a relative path a case gives lands in its own folder
        code, err = run_command(["check", str(config)])
    CHECK_SAID[folder] = err
    about = reproduce(case, config) + f"\nexit {code}, stderr:\n{err[-3000:]}"
    assert code in (0, 2), about
    assert "Traceback" not in err, about
    assert fingerprint(folder) | fingerprint(REPO / "data") == before, "check changed a file: " + about
    if case.must_refuse:
        assert code == 2, "accepted a value that must be refused: " + about
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) <= MAX_LINES, "too many lines: " + about
        assert all(line.startswith(("shardtune: error:", "shardtune: warning:")) for line in lines), about
        named = any(c in line for line in lines if line.startswith("shardtune: error:") for c in case.culprits)
        assert named, f"the refusal names none of {case.culprits}: " + about
        together = any(all(c in line for c in case.culprits) for line in lines if line.startswith("shardtune: error:"))
        assert together or not case.names_all, f"no refusal line names all of {case.culprits}: " + about
    return code


def estimate_contract(case: Case, base: dict[str, Any], folder: Path) -> None:
    """`shardtune estimate` reads the same config: exit 0 or 2 in a few lines, no traceback, no file changed, and
    a value check must refuse, it refuses too (one owner per rule: the schema)."""
    config = config_for(case, base, folder)
    before = fingerprint(folder)
    with contextlib.chdir(folder):
        code, err = run_command(["estimate", str(config), "--gpu-memory", "80GiB"])
    about = f"shardtune estimate {config} --gpu-memory 80GiB ({case.id})\nexit {code}, stderr:\n{err[-3000:]}"
    assert code in (0, 2) and "Traceback" not in err, about
    assert fingerprint(folder) == before, "estimate changed a file: " + about
    assert len([line for line in err.splitlines() if line.startswith("shardtune: error:")]) <= MAX_LINES, about
    if case.must_refuse:
        assert code == 2, "estimate accepted a value that must be refused: " + about


@pytest.mark.parametrize("case", CASES + PAIRS_FAST, ids=lambda c: c.id)
def test_check_contract(case, base, tmp_path):
    check_contract(case, base, tmp_path)


@pytest.mark.parametrize("case", CASES[::4], ids=lambda c: c.id)
def test_estimate_contract(case, base, tmp_path):
    estimate_contract(case, base, tmp_path)


@pytest.mark.matrix
@pytest.mark.parametrize("case", [c for i, c in enumerate(CASES) if i % 4], ids=lambda c: c.id)
def test_estimate_contract_matrix(case, base, tmp_path):
    estimate_contract(case, base, tmp_path)


@pytest.mark.parametrize("case", sequence_parallel_refusal_cases(), ids=lambda c: c.id)
def test_check_refuses_what_sequence_parallelism_cannot_run(case, base, tmp_path, monkeypatch):
    """engines/sequence_parallel_plan.py's COMBINATIONS table, refused pair by pair, in a world the split fits."""
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    check_contract(case, base, tmp_path)


@pytest.mark.matrix
@pytest.mark.parametrize("case", PAIRS_MATRIX, ids=lambda c: c.id)
def test_check_contract_pairs_matrix(case, base, tmp_path):
    check_contract(case, base, tmp_path)


def runs_in_this_process(case: Case) -> bool:
    """One process, no engine that needs a process group, no tracker service: train can run inside pytest."""
    return not ({"deepspeed", "fsdp", "sequence_parallel_size", "report_to"} & set(case.values))


# Refusals only the tokenised data can make: `check` reads no tokenizer (it stays fast and loads nothing), so train
# makes them, in one line naming the key, after tokenising and before the model loads (docs/troubleshooting.md).
TOKENISED_DATA_RULES = ("is too small for every one of its",)


def needs_the_tokenised_data(err: str, case: Case) -> bool:
    lines = [line for line in err.splitlines() if line.startswith("shardtune: error:")]
    return bool(lines) and all(any(rule in line for rule in TOKENISED_DATA_RULES) and
                               any(c in line for c in case.culprits) for line in lines)


def said_by_check(err: str, folder: Path) -> bool:
    """Every refusal of train's was among check's warnings (what this machine cannot run: a config may be meant
    for another machine's ranks, so check warns where train, starting them here, refuses)."""
    lines = [line.removeprefix("shardtune: error: ") for line in err.splitlines()
             if line.startswith("shardtune: error:")]
    warned = CHECK_SAID.get(folder, "")
    return bool(lines) and all(f"train would refuse: {line}" in warned for line in lines)


def traced_not_generated(case: Case) -> list[str]:
    """A compiled case traces its layers without generating their code (one step took 46 s with inductor on 2 cores,
    11 s traced), as every make-test compile cell does: what is sampled is agreement with check; inductor's own code
    is compiled in make test-matrix (tests/unit/test_varlen_attention.py)."""
    if "torch_compile" in case.values and "torch_compile_backend" not in case.values:
        return ["torch_compile_backend=aot_eager"]
    return []


def train_keeps_checks_word(cases: list[Case], count: int, base: dict[str, Any], folder: Path) -> None:
    """`train --max_steps 1` on ``count`` inputs `check` accepted, spread over ``cases`` (the same every run)."""
    # (sizes at their bounds train as asked, for as long as that takes: micro_batch_tokens 2**70 is the whole data
    # in one micro-batch, minutes of backward on the CPU; agreement is what is sampled, not run time)
    local = [c for c in cases if runs_in_this_process(c) and not c.must_refuse
             and not c.id.endswith(("-huge", "-maximum"))]
    step = max(1, len(local) // (count * 3))  # about a third of the inputs that may pass do
    trained, broken = 0, []
    spread = local[::step] + [c for i, c in enumerate(local) if i % step]  # then the rest, in order
    for index, case in enumerate(spread):
        if trained == count:
            break
        case_folder = folder / f"case-{index}"
        case_folder.mkdir()
        if check_contract(case, base, case_folder) != 0:
            continue
        trained += 1
        config = case_folder / "cfg.yaml"
        with contextlib.chdir(case_folder):
            code, err = run_command(["train", str(config), "max_steps=1", "save_steps=1000", "logging_steps=1",
                                     f"output_dir={case_folder / 'trained'}", "overwrite_output_dir=true",
                                     *traced_not_generated(case)], seconds=TRAIN_SECONDS)
        if sys.modules.get("bitsandbytes", True) is None:  # a run that needs no bitsandbytes hides it (worker.py)
            del sys.modules["bitsandbytes"]
        if code == 2 and (needs_the_tokenised_data(err, case) or said_by_check(err, case_folder)):
            continue
        if code != 0:
            broken.append(f"check passed, train did not: {reproduce(case, config)}\nexit {code}:\n{err[-2000:]}")
    assert trained == count, f"only {trained} of the sampled inputs passed check"
    assert not broken, "\n\n".join(broken)


@pytest.mark.e2e
def test_train_keeps_what_check_accepted(base, tmp_path):
    train_keeps_checks_word(CASES + PAIRS_FAST, TRAIN_SAMPLE_FAST, base, tmp_path)


@pytest.mark.matrix
def test_train_keeps_what_check_accepted_matrix(base, tmp_path):
    train_keeps_checks_word(CASES + PAIRS_MATRIX, TRAIN_SAMPLE_MATRIX, base, tmp_path)
