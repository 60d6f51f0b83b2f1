"""The collector paused while a rank starts, frozen and left to the loop during training (startup_gc.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from shardtune.startup_gc import (
    COLLECT_EVERY,
    collect_between_steps,
    loader_worker_collects,
    pause_collection,
    resume_collection,
    start_loop_collection,
)


@pytest.fixture
def collector():
    was = gc.isenabled()
    yield
    gc.unfreeze()
    if was:
        gc.enable()


def collections_during(action) -> int:
    found: list[int] = []

    def seen(phase, info):
        if phase == "start":
            found.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        action()
    finally:
        gc.callbacks.remove(seen)
    return len(found)


def test_the_loop_runs_frozen_without_automatic_collection_and_collects_every_n_steps(collector):
    pause_collection()
    junk = [[i] for i in range(50_000)]  # start-up's objects
    start_loop_collection()
    assert not gc.isenabled() and gc.get_freeze_count() >= len(junk)
    assert collections_during(lambda: [[i] for i in range(50_000)]) == 0  # no automatic collection in a step
    assert collections_during(lambda: collect_between_steps(COLLECT_EVERY - 1)) == 0
    assert collections_during(lambda: collect_between_steps(COLLECT_EVERY)) == 1


def test_resume_turns_automatic_collection_back_on_and_leaves_an_unpaused_process_alone(collector):
    pause_collection()
    resume_collection()
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    young = [[i] for i in range(10_000)]  # a freeze would move these to the permanent generation
    start_loop_collection()  # never paused: nothing changes
    # (not equality: another thread of the test process, pytest-xdist's, may free frozen objects meanwhile)
    assert gc.isenabled() and gc.get_freeze_count() < frozen + len(young)


class Flags(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> bool:
        return gc.isenabled()


def test_loader_workers_of_a_paused_rank_collect(collector):
    pause_collection()
    loader = torch.utils.data.DataLoader(Flags(), num_workers=1, worker_init_fn=loader_worker_collects,
                                         multiprocessing_context="fork")
    assert [bool(flag) for flag in loader] == [True, True]
