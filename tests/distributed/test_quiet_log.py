"""A normal 2-process run of the tiny examples prints no warning: every line a rank prints reaches the user as many
times as there are ranks, and a library's alarm without cause (FSDP2's "view tensor ... wrong gradients" from the
chunked loss's output, DeepSpeed's "unable to detect" an accelerator, torch's deprecation of the collectives
DeepSpeed calls) teaches users to skip the warnings that matter."""

from __future__ import annotations

import re

import pytest

from tests.conftest import run_cli
from tests.distributed.helpers import ENGINE_KEYS

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

# The shipped examples as they are (evaluation, saves, the loss plot), shortened to a few steps.
SHORT = ("max_steps=4", "eval_steps=2", "save_steps=2", "max_samples=80")


def warning_lines(output: str) -> list[str]:
    """The lines that say 'warning' (Python's UserWarning/FutureWarning, loggers' [WARNING], our own)."""
    return [line for line in output.splitlines() if "warning" in line.lower()]


def test_warning_lines_are_counted():
    output = ("x.py:3: UserWarning: FSDP2-wrapped module returned a view tensor\n"
              "[2026-11-29 07:33:37] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU\n"
              "[shardtune] done: final loss 7.6336\n")
    assert len(warning_lines(output)) == 2


@pytest.mark.parametrize("example", ["sft_full", "sft_lora"])
@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_two_process_run_prints_no_warning(engine, example, tiny_model_dir, tmp_path):
    result = run_cli("train", f"examples/tiny/{example}.yaml", f"model_name_or_path={tiny_model_dir}",
                     f"output_dir={tmp_path}", *SHORT, *ENGINE_KEYS[engine], FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "world size 2" in result.stdout + result.stderr
    warnings = warning_lines(result.stdout + result.stderr)
    assert warnings == [], f"{len(warnings)} warning line(s):\n" + "\n".join(warnings)
    # ZeRO-3 builds the model partitioned: its count is of full sizes, not of the empty placeholders ("0 of 0").
    counts = [(int(t.replace(",", "")), int(n.replace(",", "")))
              for t, n in re.findall(r"trainable params ([\d,]+) of ([\d,]+)", result.stdout + result.stderr)]
    assert counts and all(0 < trainable <= total for trainable, total in counts), counts
