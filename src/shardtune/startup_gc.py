"""Python's cyclic garbage collector: paused while a rank starts, and during the loop run by the loop itself.

A rank imports torch, transformers, peft and datasets and builds its model and data: millions of new container
objects, and every 700 allocations the collector scans the young ones, every few scans all of them. None of that
finds garbage worth a pause (the objects live for the whole run), and it costs time on every start: importing those
libraries takes 4.7 s with the collector and 4.0 s without it on this 2-core CPU, and a normal exit scans them all
once more (1.2 s; ranks leave with os._exit, torchrun's agent freezes first).

Before the first step the objects made so far are frozen (moved where the collector never looks again). During the
loop the automatic collector stays off and the loop collects the young generations every ``COLLECT_EVERY`` steps
(as torchtitan does): a step's tensors are freed by reference counting, and what cycles a step leaves wait a few
steps instead of interrupting one at an allocation count.
"""

from __future__ import annotations

import gc

COLLECT_EVERY = 50  # steps between collections of the young generations in the loop


def pause_collection() -> None:
    gc.disable()


def start_loop_collection() -> None:
    """Freeze what start-up made; automatic collection stays off (a process that never paused is left as it is)."""
    if not gc.isenabled():
        gc.freeze()


def collect_between_steps(step: int) -> None:
    if not gc.isenabled() and step % COLLECT_EVERY == 0:
        gc.collect(1)


def resume_collection() -> None:
    """Automatic collection on again (generation, evaluation-only runs, data-loading workers)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def loader_worker_collects(_worker_id: int) -> None:
    """A data-loading worker forked from a rank whose collector is off collects as usual."""
    gc.enable()
