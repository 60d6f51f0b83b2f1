"""DeepSpeedEngine under 2 gloo processes: same losses as one process, complete saves, exact resume.

Two torchrun launches in all, each running several cases one engine after another (a launch costs ~10-20 s
of start-up): the ZeRO 0-3 cases (full and LoRA), and the offload cases, whose first run also compiles
DeepSpeed's cpu_adam op (~60-90 s, then cached in TORCH_EXTENSIONS_DIR). One single-process run of the same
worker gives the reference.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.rank_server import run_python

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "ds_worker.py"
LAUNCHES = {
    "zero": ["z0", "z1", "z2", "z3", "z2_lora", "z3_lora"],
    "offload": ["z2_offload", "z3_offload", "z3_offload_streamed"],
}
CASES = [case for cases in LAUNCHES.values() for case in cases]
RESUME_CASES = ["z3", "z2_lora", "z3_lora"]
OFFLOAD_CASES = LAUNCHES["offload"]
RTOL = 1e-3


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TOKENIZERS_PARALLELISM="false",
               # Compiled DeepSpeed ops (shm comm, cpu_adam) are cached per environment, not per run.
               TORCH_EXTENSIONS_DIR=env.get("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")))
    return env


def run_worker(args: list[str], timeout: float) -> float:
    """Run the worker; fail with its output tail if it fails. Returns the wall time."""
    start = time.perf_counter()
    proc = run_python(args, worker_env(), REPO, timeout)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args[-4:])} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    print(f"[ds-test] {' '.join(args[-4:])}: {elapsed:.1f}s")
    return elapsed


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deepspeed")


@pytest.fixture(scope="module")
def single_process_reference(out_dir) -> dict:
    run_worker([sys.executable, str(WORKER), "--out", str(out_dir), "--reference"], timeout=120)
    return json.loads((out_dir / "reference.json").read_text())


@pytest.fixture(scope="module")
def deepspeed_run(out_dir) -> Callable[[str], dict]:
    """Results of one case; its launch (all cases of the group) runs the first time one is asked for."""
    launched: dict[str, str | None] = {}  # group -> failure message, None when it ran

    def result(case: str) -> dict:
        group = next(g for g, cases in LAUNCHES.items() if case in cases)
        if group not in launched:
            launched[group] = "launch did not finish"
            launched[group] = launch(group, out_dir)
        if launched[group] is not None:
            pytest.fail(f"the {group} launch failed; see the first failing test for its output")
        return json.loads((out_dir / f"{case}.json").read_text())

    return result


def launch(group: str, out_dir: Path) -> None:
    run_worker([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(WORKER), "--out", str(out_dir), "--cases", ",".join(LAUNCHES[group])], timeout=280)


def kind(case: str) -> str:
    return "lora" if case.endswith("lora") else "full"


@pytest.mark.parametrize("case", CASES)
def test_losses_match_single_process(case, single_process_reference, deepspeed_run):
    result = deepspeed_run(case)
    expected = single_process_reference[kind(case)]["metrics"]
    got = result["metrics"]
    assert result["zero_stage"] == int(case[1])
    assert len(got) == len(expected) == 4
    assert [m["trainable_tokens"] for m in got] == [m["trainable_tokens"] for m in expected]
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in expected], rel=RTOL)
    assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in expected], rel=RTOL)
    # The weights moved: a step that DeepSpeed silently skipped would leave the losses flat.
    assert got[0]["loss"] != pytest.approx(got[2]["loss"], rel=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_saved_model_is_complete_and_reloads(case, single_process_reference, deepspeed_run):
    result = deepspeed_run(case)
    weights = "adapter_model.safetensors" if kind(case) == "lora" else "model.safetensors"
    assert weights in result["saved_files"]
    # Reloaded by transformers (peft for LoRA), the saved weights give the reference model's loss.
    assert result["reload_eval_loss"] == pytest.approx(single_process_reference[kind(case)]["eval_loss"], rel=1e-4)


@pytest.mark.parametrize("case", RESUME_CASES)
def test_resume_from_checkpoint_replays_the_same_steps(case, deepspeed_run):
    result = deepspeed_run(case)
    replayed = [m["loss"] for m in result["resumed_metrics"]]
    assert replayed == pytest.approx([m["loss"] for m in result["metrics"][2:]], rel=1e-5)


@pytest.mark.parametrize("case", OFFLOAD_CASES)
def test_offload_steps_with_deepspeed_cpu_adam(case, deepspeed_run):
    assert deepspeed_run(case)["optimizer"] == "DeepSpeedCPUAdam"
