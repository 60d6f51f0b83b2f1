"""Cells for tests/distributed/test_rank_server.py, run as `python -m tests.distributed.rank_server_cells MODE OUT`.

``env``: this process's environment as a rank sees it (JSON). ``disturb``: change every kind of global state a cell
could leave behind (a process group, an environment variable, DeepSpeed's and accelerate's globals, the RNGs, a
module's attribute, a thread), then end without cleaning up. ``observe``: report that state (JSON), for comparison
between a process the rank server forked after ``disturb`` ran on it and a new process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time


def observe() -> dict:
    import random

    import torch
    import torch.distributed as dist
    from deepspeed.runtime.zero import partition_parameters

    import shardtune.launch.run_lock as run_lock

    return {
        "process_group": dist.is_initialized(),
        "variable": os.environ.get("SHARDTUNE_CELL_LEFT_THIS"),
        "torch_rng": torch.rand(3).tolist(),
        "python_rng": random.random(),
        "deepspeed_zero_init_context": partition_parameters.zero_init_context,
        "torch_empty_patched": torch.empty is not partition_parameters._orig_torch_empty,
        "module_attribute": run_lock.HEARTBEAT_SECONDS,
        "threads": threading.active_count(),
        "default_dtype": str(torch.get_default_dtype()),
        "torch_threads": torch.get_num_threads(),
    }


def disturb() -> None:
    import random

    import torch
    import torch.distributed as dist
    from deepspeed.runtime.zero import partition_parameters

    import shardtune.launch.run_lock as run_lock

    store = tempfile.mktemp(prefix="cell-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    os.environ["SHARDTUNE_CELL_LEFT_THIS"] = "1"
    torch.manual_seed(1234)
    random.seed(1234)
    partition_parameters.zero_init_context = 3
    torch.empty = lambda *a, **k: None  # as ZeRO-3's Init patches the constructors
    run_lock.HEARTBEAT_SECONDS = 0.01
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()


def main(mode: str, out: str) -> None:
    if mode == "env":
        result: dict = dict(os.environ)
    elif mode == "leak":  # a process still running and a file in the temporary folder when the cell ends
        result = {"pid": subprocess.Popen(["sleep", "60"]).pid, "file": tempfile.mkstemp(prefix="left-by-cell-")[1]}
    elif mode == "disturb":
        disturb()
        result = {"disturbed": True}
    else:
        result = observe()
    if "RANK" in os.environ:
        out = f"{out}.rank{os.environ['RANK']}"
    with open(out, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(*sys.argv[1:3])
