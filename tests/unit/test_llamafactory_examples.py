"""Every training file of LLaMA-Factory's examples/ folder runs or says exactly why not.

Each fixture (tests/fixtures/llamafactory_examples/, one per LLaMA-Factory example at the same relative path) goes
through `shardtune check` in-process with the tiny model and our data folder filled in; the verdict must be the one
its manifest gives: check passes (``runs``, ``runs on one process``), or its first error line holds the manifest's
text. The matrix test in
tests/distributed/test_llamafactory_examples_train.py trains the ``runs`` ones.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from shardtune.cli import main
from tests.llamafactory_examples import (
    FIXTURES,
    NEEDS_GPU,
    NOT_TRAINING,
    REFUSED,
    RUNS,
    RUNS_ON_GPU,
    RUNS_ONE_PROCESS,
    expert_parallel_ranks,
    filled_in,
    first_error,
    load_manifest,
    make_work_folder,
    training_files,
)

MANIFEST = load_manifest()


def cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("relative", training_files(MANIFEST))
def test_example_file_gets_its_verdict(relative, tiny_model_dir, tmp_path, monkeypatch, capsys):
    work = make_work_folder(tmp_path / "work")
    monkeypatch.chdir(work)  # LLaMA-Factory resolves data/ and examples/deepspeed/ from the cwd
    monkeypatch.setenv("WANDB_MODE", "offline")  # files with report_to: wandb need a W&B login otherwise
    path = filled_in(relative, work, tiny_model_dir, tmp_path / "out")
    config = yaml.safe_load(path.read_text())
    split = max(config.get("cp_size") or 1, expert_parallel_ranks(config))
    if split > 1:  # a file splitting rows (cp_size) or experts (ep_size) over ranks is launched with that many
        monkeypatch.setenv("NPROC_PER_NODE", str(split))
    code = main(["check", str(path)])
    captured = capsys.readouterr()
    verdict = MANIFEST[relative]
    if verdict == RUNS or verdict.startswith((RUNS_ON_GPU, RUNS_ONE_PROCESS)) or (verdict.startswith(NEEDS_GPU)
                                                                              and cuda_visible()):
        assert code == 0, captured.err
        assert captured.out.startswith("ok: ") or "\nok: " in captured.out
        return
    expected = verdict.removeprefix(REFUSED).removeprefix(NEEDS_GPU)
    assert code == 2 and expected in first_error(captured.err), captured.err


def test_every_training_file_has_a_fixture_and_every_fixture_a_verdict():
    fixtures = {str(p.relative_to(FIXTURES)) for p in FIXTURES.rglob("*.yaml")
                if p.name != "manifest.yaml" and p.parent != FIXTURES / "data"}
    assert fixtures == set(training_files(MANIFEST))
    verdicts = {verdict.split(":")[0] for verdict in MANIFEST.values()}
    assert verdicts <= {RUNS, *(kind.rstrip(": ") for kind in (REFUSED, NEEDS_GPU, RUNS_ON_GPU, RUNS_ONE_PROCESS,
                                                               NOT_TRAINING))}


def test_the_docs_table_is_current(repo):
    done = subprocess.run([sys.executable, "scripts/llamafactory_examples.py", "table", "--check"], cwd=repo,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
