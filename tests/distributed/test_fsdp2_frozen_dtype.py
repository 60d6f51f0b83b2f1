"""FSDP2 under bf16 mixed precision stores an adapter run's frozen weights in bf16: the same training, half the bytes.

FSDP2 casts each unit's parameters to bf16 before gathering them, so a frozen fp32 shard was only ever the source of
that cast (``engines/fsdp.py::store_frozen_in_gather_dtype``). Two ranks train the tiny LLaMA with LoRA on all
linear layers, once with the frozen shards kept fp32 (the earlier path) and once stored in bf16: every loss,
gradient norm and final adapter weight must be bitwise the same, and the frozen shards half the size. Run as a
test it launches itself under torchrun (2 CPU ranks, gloo) once per mode.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from tests.distributed.helpers import run_under_torchrun

STEPS = 3
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _launch(model_dir: Path, out: Path, mode: str) -> dict:
    out.mkdir(parents=True)
    run_under_torchrun(Path(__file__), 2, "--model", str(model_dir), "--out", str(out), "--mode", mode, timeout=500)
    return json.loads((out / "result.json").read_text())


def test_frozen_weights_in_bf16_train_the_same(tiny_model_dir, tmp_path):
    kept = _launch(tiny_model_dir, tmp_path / "fp32-frozen", "fp32-frozen")
    stored = _launch(tiny_model_dir, tmp_path / "bf16-frozen", "bf16-frozen")
    assert stored["frozen_dtypes"] == ["torch.bfloat16"] and kept["frozen_dtypes"] == ["torch.float32"]
    assert stored["trainable_dtypes"] == kept["trainable_dtypes"] == ["torch.float32"]
    assert stored["frozen_shard_bytes"] * 2 == kept["frozen_shard_bytes"]
    assert stored["losses"] == kept["losses"]
    assert stored["grad_norms"] == kept["grad_norms"]
    ref = torch.load(tmp_path / "fp32-frozen" / "adapter.pt", weights_only=True)
    got = torch.load(tmp_path / "bf16-frozen" / "adapter.pt", weights_only=True)
    assert got.keys() == ref.keys() and any("lora_B" in key for key in got)
    for key, tensor in got.items():
        assert torch.equal(tensor, ref[key]), key


def worker(model_dir: str, out: Path, mode: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from shardtune.engines.engine_plan import FsdpSettings
    from shardtune.engines.fsdp import settle_fsdp2_trainable, store_frozen_in_gather_dtype
    from shardtune.engines.fsdp_wrap import shard_fsdp2
    from shardtune.model.finetuning.apply import apply_finetuning
    from shardtune.model.finetuning.settings import FinetuningSettings

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)  # LoRA's A matrices start from the same random values on every rank
    model = apply_finetuning(model, FinetuningSettings(finetuning_type="lora", lora_target=("all",)))
    if mode == "bf16-frozen":
        store_frozen_in_gather_dtype(model, torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    model = shard_fsdp2(model, FsdpSettings(), mesh, torch.device("cpu"), torch.bfloat16)
    settle_fsdp2_trainable(model)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    losses, norms = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, 2000, (4, 24), generator=generator).chunk(world)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(trained, 1.0).full_tensor().item())
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    adapter = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
    if rank == 0:
        torch.save({k: v.detach().cpu() for k, v in adapter.items()}, out / "adapter.pt")
        (out / "result.json").write_text(json.dumps({
            "losses": losses, "grad_norms": norms,
            "frozen_dtypes": sorted({str(p.dtype) for p in frozen}),
            "trainable_dtypes": sorted({str(p.dtype) for p in trained}),
            "frozen_shard_bytes": sum(p.to_local().nbytes for p in frozen)}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=["fp32-frozen", "bf16-frozen"], required=True)
    args = parser.parse_args()
    worker(args.model, args.out, args.mode)
