"""Muon over FSDP2 shards (optim/sharded_muon.py) steps as torch.optim.Muon on the whole weights.

Two gloo processes shard a small stack of Linear layers with ``fully_shard`` (row counts that 2 does not divide, so
the shards are uneven as FSDP2 cuts them), feed both ranks the same batch (the averaged gradient is then the
one-process gradient exactly) and step ShardedMuon three times; each rank also steps torch's Muon on an unsharded
copy. The gathered weights must equal the copy's, and the momentum buffers must stay shards.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.distributed.helpers import run_under_torchrun

SHAPES = ((6, 9), (9, 7), (7, 3))  # (in, out) per Linear: weights of 9, 7 and 3 rows

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_sharded_muon_matches_torch_muon_on_whole_weights(tmp_path):
    run_under_torchrun(Path(__file__), 2, "--out", str(tmp_path), timeout=240)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["local_rows"] == ([5, 4, 2] if rank == 0 else [4, 3, 1])  # torch.chunk's split
        assert result["buffers_sharded"]
        assert result["moved"] and result["max_difference"] == 0.0, result


def _stack():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(i, o, bias=False) for i, o in SHAPES))


def worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from shardtune.optim.sharded_muon import ShardedMuon

    dist.init_process_group("gloo")
    sharded, whole = _stack(), _stack()
    start = [p.detach().clone() for p in whole.parameters()]
    for layer in sharded:
        fully_shard(layer)
    fully_shard(sharded)
    ours = ShardedMuon(list(sharded.parameters()), lr=0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    reference = torch.optim.Muon(list(whole.parameters()), lr=0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    inputs = torch.randn(4, SHAPES[0][0], generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, optimizer in ((sharded, ours), (whole, reference)):
            model(inputs).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    gathered = [p.full_tensor() for p in sharded.parameters()]
    result = {
        "local_rows": [p.to_local().shape[0] for p in sharded.parameters()],
        "buffers_sharded": all(isinstance(ours.state[p]["momentum_buffer"], DTensor) for p in sharded.parameters()),
        "moved": all(not torch.equal(a, b) for a, b in zip(gathered, start, strict=True)),
        "max_difference": max((a - b).abs().max().item() for a, b in zip(gathered, whole.parameters(), strict=True)),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    worker(parser.parse_args().out)
