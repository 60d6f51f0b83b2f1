"""Every LLaMA-Factory example file that runs, trained for 2 steps on 2 processes through `shardtune train`.

The fixtures and their verdicts are tests/fixtures/llamafactory_examples/ (see tests/llamafactory_examples.py);
`make test` checks every verdict with `shardtune check`, this matrix test trains the ``runs`` ones unchanged but for
the tiny model, our data folder and ``max_steps=2``, under the engine each file names (the files that need a GPU
where two CUDA GPUs are visible); the ``runs on one process`` ones on one process, in-process as `shardtune train`
runs a one-process launch.
"""

from __future__ import annotations

import json
import math

import pytest
import yaml

from tests.conftest import run_cli
from tests.llamafactory_examples import (
    NEEDS_GPU,
    RUNS,
    RUNS_ON_GPU,
    RUNS_ONE_PROCESS,
    expert_parallel_ranks,
    filled_in,
    load_manifest,
    make_work_folder,
)

MANIFEST = load_manifest()
RUNNING = [path for path, verdict in MANIFEST.items() if verdict == RUNS or verdict.startswith((RUNS_ON_GPU,
                                                                                                  NEEDS_GPU,
                                                                                                  RUNS_ONE_PROCESS))]

pytestmark = [pytest.mark.distributed, pytest.mark.matrix, pytest.mark.timeout(900)]


@pytest.mark.parametrize("relative", RUNNING)
def test_example_file_trains_two_steps_on_two_processes(relative, tiny_model_dir, tmp_path):
    import torch

    one_process = MANIFEST[relative].startswith(RUNS_ONE_PROCESS)
    if MANIFEST[relative] != RUNS and not one_process and torch.cuda.device_count() < 2:
        pytest.skip(MANIFEST[relative])
    work = make_work_folder(tmp_path / "work")
    out = tmp_path / "out"
    path = filled_in(relative, work, tiny_model_dir, out)
    processes = {"NPROC_PER_NODE": "1"} if one_process else {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}
    # Experts split over more ranks than the test starts (ep_size 16) are split over its 2.
    experts = ["expert_parallel_size=2"] if expert_parallel_ranks(yaml.safe_load(path.read_text())) > 2 else []
    result = run_cli("train", str(path), "max_steps=2", *experts, cwd=work, timeout=800, **processes)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    results = json.loads((out / "train_results.json").read_text())
    assert results["world_size"] == int(processes["NPROC_PER_NODE"]) and results["global_step"] == 2
    assert math.isfinite(results["final_loss"])
