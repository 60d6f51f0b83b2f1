"""torchrun itself (``torch.distributed.run.main``, every argument as torchrun reads it), ending without the
interpreter's final garbage collection.

The agent has torch's whole import graph loaded, and a normal interpreter exit collects it: 0.3 s on this CPU after
the last rank has exited, on every run (measured: a process that imported torch exits in 0.41 s, 0.10 s with its
objects frozen first). ``gc.freeze`` moves every object out of the collector's reach, so the teardown frees memory
without scanning it; the import of torch runs with the collector off, for the same reason. Nothing else changes:
torchrun's arguments, its exit code, its failure report on stderr.

    python -m shardtune.launch.torchrun_agent --nproc-per-node=2 ... -m shardtune.train PLAN
"""

from __future__ import annotations

import gc


def main() -> None:
    gc.disable()  # importing torch allocates for the whole run: nothing for the collector to find (startup_gc.py)
    from torch.distributed.run import main as torchrun_main

    gc.freeze()
    gc.enable()
    try:
        torchrun_main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    main()
