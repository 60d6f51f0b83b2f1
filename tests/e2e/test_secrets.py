"""Secrets in the environment (tracker and hub tokens) never reach logs, saved configs or checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SECRETS = {"WANDB_API_KEY": "wandb-secret-7f3a91", "HF_TOKEN": "hf_secret_c0ffee42",
           "MLFLOW_TRACKING_PASSWORD": "mlflow-secret-5e11"}


def leaks(text: str) -> list[str]:
    return [name for name, value in SECRETS.items() if value in text]


def test_environment_secrets_stay_out_of_every_output(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    common = ["examples/tiny/sft_lora.yaml", f"model_name_or_path={tiny_model_dir}", f"output_dir={out}",
              "max_steps=3", "save_steps=2", "report_to=tensorboard", "val_size=0", "do_eval=false",
              "eval_strategy=no"]
    dry = run_cli("train", *common, "--dry-run", NPROC_PER_NODE="2", **SECRETS)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "torchrun_agent" in dry.stdout
    run = run_cli("train", *common, **SECRETS)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not leaks(dry.stdout + dry.stderr + run.stdout + run.stderr)
    written = [p for p in Path(out).rglob("*") if p.is_file()]
    assert any(p.name == "shardtune_config.json" for p in written) and any("checkpoint-2" in str(p) for p in written)
    for path in written:
        assert not leaks(path.read_bytes().decode("latin-1")), path
