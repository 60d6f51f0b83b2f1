"""`shardtune status OUTPUT_DIR` on a 2-process CPU run while it trains and after it finished."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, cli_env, run_cli

pytestmark = pytest.mark.e2e


def test_status_of_a_running_then_finished_two_rank_run(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "shardtune", "train", "examples/tiny/sft_full.yaml",
                             f"model_name_or_path={tiny_model_dir}", f"output_dir={out}", "max_steps=60",
                             "save_steps=20", "logging_steps=5", "do_eval=false", "plot_loss=false"],
                            cwd=REPO, env=cli_env(NPROC_PER_NODE="2"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            logs = [out / "ranks" / f"rank_{r}.jsonl" for r in (0, 1)]
            if all(p.is_file() and p.read_text().count('"event":"step"') >= 3 for p in logs):
                break
            time.sleep(0.2)
        running = run_cli("status", str(out))
        shown = run_cli("status", str(out), "--json")
    finally:
        code = proc.wait(timeout=300)
    assert code == 0, proc.stderr.read()[-3000:]
    assert running.returncode == 0, running.stderr
    lines = running.stdout.splitlines()
    assert lines[0] == f"run {out} (run): running", running.stdout
    assert "/60 (" in lines[1] and "ETA" in lines[1]
    header = next(i for i, line in enumerate(lines) if line.startswith("rank  host"))
    assert [line.split()[0] for line in lines[header + 1:header + 3]] == ["0", "1"]
    live = json.loads(shown.stdout)
    assert live["state"] == "running" and live["total_steps"] == 60 and len(live["ranks"]) == 2
    assert all(r["step"] >= 3 and r["heartbeat_age"] < 30 for r in live["ranks"])

    finished = run_cli("status", str(out))
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.splitlines()[0] == f"run {out} (run): finished"
    assert "step 60/60 (100.0%)" in finished.stdout and "ETA" not in finished.stdout
    # save_total_limit (2) of the example keeps the last two.
    assert "checkpoints: checkpoint-40, checkpoint-60; resume the latest with:" in finished.stdout
    assert f"resume_from_checkpoint={out / 'checkpoint-60'}" in finished.stdout
