"""A DeepSpeed engine on a CPU machine starts without compiling DeepSpeed's shared-memory all-reduce op (48 s on 2
cores the first time, for tensor-parallel inference only)."""

from __future__ import annotations

import pytest

deepspeed = pytest.importorskip("deepspeed")


def test_the_engine_leaves_the_inference_all_reduce_op_unbuilt_on_a_cpu(monkeypatch, tmp_path):
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    from shardtune.engines.deepspeed import deepspeed_for_training

    if get_accelerator().device_name() != "cpu":
        pytest.skip("the op is DeepSpeed's CPU accelerator's")
    compatible = deepspeed.ops.__compatible_ops__
    # DeepSpeed would build it here: the op is buildable on this machine (a compiler is on the path).
    assert compatible["deepspeed_shm_comm"], "nothing to leave out: DeepSpeed finds the op unbuildable here"
    monkeypatch.setitem(compatible, "deepspeed_shm_comm", True)  # restored for later tests after this one
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert deepspeed_for_training() is deepspeed
    assert build_shm_op() is None
    assert not any(tmp_path.iterdir()), "a JIT build started"


def test_zero_collectives_are_called_by_torch_current_names():
    """torch 2.13 warns on every call of the old names DeepSpeed looks up (all_gather_into_tensor,
    reduce_scatter_tensor); the backend is given the current ones, and a collective DeepSpeed found none for stays
    without."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from shardtune.engines.deepspeed import use_current_collective_names

    old = getattr(dist, "all_gather_into_tensor", None)
    backend = SimpleNamespace(all_gather_function=old, reduce_scatter_function=None)
    use_current_collective_names(backend)
    assert backend.all_gather_function is getattr(dist, "all_gather_single", old)
    assert backend.reduce_scatter_function is None
