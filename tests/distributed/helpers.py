"""Shared by the multi-process tests: one training run through the real CLI and checks of its outputs."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from tests.conftest import REPO, run_cli
from tests.rank_server import run_python

STEPS = 4
COMMON = ("examples/tiny/sft_full.yaml", f"max_steps={STEPS}", "logging_steps=1", "save_strategy=no",
          "do_eval=false", "eval_strategy=no", "val_size=0", "plot_loss=false", "max_samples=80",
          "gradient_accumulation_steps=2", "learning_rate=1e-3", "lr_scheduler_type=constant", "warmup_ratio=0")


def gloo_case_worker(rank: int, init_file: str, model_dir: str, results: str, cases: tuple[str, ...],
                     run_case: Callable[[int, str, str], str]) -> None:
    """An ``mp.spawn`` worker of a 2-rank gloo group: ``run_case(rank, model_dir, case)`` for each case, its outcome
    (or its traceback) written to ``results/<case>.rank<rank>`` for the test to read."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for case in cases:
            try:
                outcome = run_case(rank, model_dir, case)
            except Exception:  # noqa: BLE001 - reported to the test
                outcome = "crash: " + traceback.format_exc()
            Path(results, f"{case}.rank{rank}").write_text(outcome)
    finally:
        dist.destroy_process_group()


def spawn_cases(folder: Path, model_dir: Path, cases: tuple[str, ...],
                run_case: Callable[[int, str, str], str]) -> Path:
    """Every case on the same two gloo processes (one start-up for all); the folder of their outcomes."""
    import torch.multiprocessing as mp

    results = folder / "results"
    results.mkdir()
    mp.spawn(gloo_case_worker, args=(str(folder / "init"), str(model_dir), str(results), cases, run_case), nprocs=2,
             join=True)
    return results


def run_under_torchrun(script: Path, nproc: int, *args: str, timeout: float) -> None:
    """Launch a test file that is also its own worker (its ``__main__`` part) on ``nproc`` gloo processes; fail with
    the output's tail if any rank fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script),
            *args]
    done = run_python(argv, env, REPO, timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


# The sharding engines by short name, as `shardtune train` keys (DDP: FORCE_TORCHRUN alone).
ENGINE_KEYS: dict[str, tuple[str, ...]] = {
    "ddp": (),
    "zero2": ("deepspeed=z2",),
    "zero3": ("deepspeed=z3",),
    "fsdp2": ("fsdp=full_shard auto_wrap",),
    "fsdp1": ("fsdp=full_shard auto_wrap", "fsdp_config={'fsdp_version': 1}"),
}


def losses(out: Path) -> list[float]:
    return logged(out, "loss")


def logged(out: Path, key: str) -> list[float]:
    """One value per logged training step (trainer_log.jsonl)."""
    records = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if x.strip()]
    return [r[key] for r in records if key in r and "loss" in r]


def train(model: Path, out: Path, finetuning: str, nproc: int, micro: int, *extra: str) -> dict:
    return train_with(COMMON, model, out, nproc, micro, f"finetuning_type={finetuning}", *extra)


def train_with(common: tuple[str, ...], model: Path, out: Path, nproc: int, micro: int, *extra: str) -> dict:
    """`shardtune train` of ``common`` + ``extra`` on ``nproc`` processes (torchrun when more than one); the run's
    train_results.json."""
    env = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(nproc)} if nproc > 1 else {}
    result = run_cli("train", *common, f"model_name_or_path={model}", f"output_dir={out}",
                     f"per_device_train_batch_size={micro}", *extra, **env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads((out / "train_results.json").read_text())


def reference_losses(tiny_model_dir, tmp_path_factory) -> dict[str, list[float]]:
    """Single-process losses with the global batch (4 per process x 2 processes = 8 per micro-step);
    ``"<finetuning>:grad_norm"`` holds the gradient norms of the same steps."""
    found = {}
    for finetuning in ("full", "lora"):
        out = tmp_path_factory.mktemp(f"ref-{finetuning}")
        train(tiny_model_dir, out, finetuning, 1, 4)
        found[finetuning] = losses(out)
        found[f"{finetuning}:grad_norm"] = logged(out, "grad_norm")
    return found


def check_saved_model(out: Path, base: Path, finetuning: str) -> None:
    from transformers import AutoModelForCausalLM

    base_model = AutoModelForCausalLM.from_pretrained(base)
    if finetuning == "lora":
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
        lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
        assert lora_b and all(p.abs().sum() > 0 for p in lora_b), "adapter weights are empty"
        return
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in base_model.parameters())
    changed = [not torch.equal(a, b) for a, b in zip(model.parameters(), base_model.parameters(), strict=True)]
    assert all(changed), "some saved weights equal the untrained ones (empty or partial save)"


