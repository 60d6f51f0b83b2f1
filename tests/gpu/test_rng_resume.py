"""The CUDA generator is part of a checkpoint's RNG state: dropout and sampling on the GPU continue after resume."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shardtune.train.checkpoint import load_rng_file, rng_state, save_rng_file
from tests.conftest import REPO, cli_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def cuda_draws() -> list[float]:
    return torch.rand(4, device="cuda").tolist()


def test_cuda_rng_state_round_trips_through_the_rng_file(tmp_path):
    torch.cuda.manual_seed(5)
    cuda_draws()  # initialises CUDA and moves the generator off its seed
    assert "cuda" in rng_state()
    save_rng_file(tmp_path / "rng.pt")
    expected = cuda_draws()
    cuda_draws()
    load_rng_file(tmp_path / "rng.pt")
    assert cuda_draws() == expected


def test_a_fresh_process_resumes_the_cuda_generator(tmp_path):
    """As on resume: the restoring process has not used CUDA before it reads the file."""
    torch.cuda.manual_seed(7)
    cuda_draws()
    save_rng_file(tmp_path / "rng.pt")
    expected = cuda_draws()
    code = ("import sys, torch; from shardtune.train.checkpoint import load_rng_file; "
            "load_rng_file(sys.argv[1]); print(torch.rand(4, device='cuda').tolist())")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "rng.pt")], cwd=REPO, env=cli_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(expected)
