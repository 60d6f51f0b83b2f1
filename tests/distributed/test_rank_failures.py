"""A rank that fails or hangs mid-training ends the whole 2-process job promptly, with one clear message.

The fault comes from the model itself: a copy of the tiny model whose remote code (trust_remote_code) raises,
or sleeps, in rank 1's forward after a few calls, while rank 0 trains on normally.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, overrides_merged

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

ARGS = ("examples/tiny/sft_full.yaml", "max_steps=50", "logging_steps=1", "save_strategy=no", "do_eval=false",
        "eval_strategy=no", "val_size=0", "plot_loss=false", "max_samples=80", "per_device_train_batch_size=2",
        "gradient_accumulation_steps=1", "trust_remote_code=true")

MODELING = '''
import os
import time

from transformers import LlamaConfig, LlamaForCausalLM


class FaultyConfig(LlamaConfig):
    model_type = "faulty_llama"


class FaultyLlamaForCausalLM(LlamaForCausalLM):
    config_class = FaultyConfig
    calls = 0

    def forward(self, *args, **kwargs):
        type(self).calls += 1
        if os.environ.get("RANK") == "1" and type(self).calls > 3:
            FAULT
        return super().forward(*args, **kwargs)
'''
FAULTS = {"raise": 'raise RuntimeError("boom")',
          "hang": "time.sleep(120)"}  # bounded, so that a failing test cannot leave a process behind for long


def faulty_model(base: Path, where: Path, fault: str) -> Path:
    """The tiny model as remote code that fails in rank 1's fourth forward."""
    model = where / f"faulty-{fault}"
    shutil.copytree(base, model)
    (model / "modeling_faulty.py").write_text(MODELING.replace("FAULT", FAULTS[fault]))
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="faulty_llama", architectures=["FaultyLlamaForCausalLM"],
                  auto_map={"AutoConfig": "modeling_faulty.FaultyConfig",
                            "AutoModelForCausalLM": "modeling_faulty.FaultyLlamaForCausalLM"})
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def train_2_processes(model: Path, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    """`shardtune train` with 2 processes; also checks that no rank outlives the command."""
    argv = [sys.executable, "-m", "shardtune", "train",
            *overrides_merged([*ARGS, f"model_name_or_path={model}", f"output_dir={out}", *extra])]
    env = cli_env(NPROC_PER_NODE="2", HF_MODULES_CACHE=str(out.parent / "hf_modules"))
    start = time.monotonic()
    try:
        result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    finally:
        leftovers = kill_leftover_ranks(out)
    assert not leftovers, f"processes of the run were still alive after it ended: {leftovers}"
    return result, time.monotonic() - start


def kill_leftover_ranks(out: Path) -> list[int]:
    """Processes still running with this run's config (ranks, torchrun); killed so no test leaves them."""
    import os
    import signal

    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(out) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue
    return found


def test_rank_that_raises_ends_the_job_with_one_message(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result, seconds = train_2_processes(faulty_model(tiny_model_dir, tmp_path, "raise"), out)
    shown = result.stdout + result.stderr
    assert result.returncode == 1, shown[-4000:]
    assert seconds < 30
    assert shown.count("boom") == 1, shown[-4000:]
    assert "[shardtune] rank 1 failed: RuntimeError: boom (full traceback: " in result.stderr
    assert "Traceback" not in shown and "ChildFailedError" not in shown, shown[-4000:]
    saved = (out / ".shardtune" / "rank-1-error.txt").read_text()
    assert "Traceback" in saved and 'raise RuntimeError("boom")' in saved


def test_rank_that_hangs_ends_the_job_after_ddp_timeout(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result, seconds = train_2_processes(faulty_model(tiny_model_dir, tmp_path, "hang"), out, "ddp_timeout=5")
    shown = result.stdout + result.stderr
    assert result.returncode == 1, shown[-4000:]
    assert seconds < 30, "the hanging rank must not hold the job until torchrun's SIGKILL"
    assert shown.count("a collective waited longer than ddp_timeout (5 s)") == 1, shown[-4000:]
    assert "[shardtune] rank 0 failed: " in result.stderr
    assert "Traceback" not in shown and "ChildFailedError" not in shown, shown[-4000:]
    assert (out / ".shardtune" / "rank-0-error.txt").is_file()


def test_bad_input_found_by_every_rank_is_shown_once_with_exit_2(tiny_model_dir, tmp_path):
    """lora_target is checked against the loaded model, so inside the ranks: both find it, one line shows."""
    result, _ = train_2_processes(tiny_model_dir, tmp_path / "out", "finetuning_type=lora", "lora_target=q_prj",
                                  "trust_remote_code=false")
    assert result.returncode == 2, result.stderr[-4000:]
    errors = [line for line in result.stderr.splitlines() if "shardtune: error:" in line]
    assert len(errors) == 1 and "lora_target: q_prj not found" in errors[0], result.stderr[-4000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
