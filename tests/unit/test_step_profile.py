"""profile_steps: torch.profiler over a few steps, summarised (train/profile.py)."""

from __future__ import annotations

import torch

from shardtune.train.profile import StepProfile, profile_line


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reads: int) -> None:
    loss = model(torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    for _ in range(reads):  # each read of a device value into Python is one host sync
        loss.item()


def run(profile: StepProfile, steps: int, reads: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        step(model, optimizer, reads)
        profile.after_step()
    profile.finish()


def test_the_profiled_steps_come_after_the_warm_up_and_count_host_reads():
    profile = StepProfile(steps=3, after=2)
    run(profile, steps=10, reads=2)
    summary = profile.summary
    assert summary is not None and summary["steps"] == 3
    assert summary["host_syncs_per_step"] == 2.0
    assert summary["device_busy_fraction"] is None  # no accelerator here
    names = [o["name"] for o in summary["top_cpu_operators"]]
    assert "aten::addmm" in names or "aten::mm" in names
    linear = next(o for o in summary["top_cpu_operators"] if o["name"] in ("aten::addmm", "aten::mm"))
    assert linear["calls_per_step"] >= 2  # two Linear layers' forward each step, profiled steps only
    assert "profile of 3 steps" in profile_line(summary) and "n/a (no accelerator)" in profile_line(summary)


def test_a_run_shorter_than_planned_profiles_the_steps_it_ran():
    profile = StepProfile(steps=5, after=1)
    run(profile, steps=3, reads=0)
    assert profile.summary is not None and profile.summary["steps"] == 2
    assert profile.summary["host_syncs_per_step"] == 0.0


def test_a_run_that_ends_during_the_warm_up_has_no_profile():
    profile = StepProfile(steps=2, after=4)
    run(profile, steps=3, reads=1)
    assert profile.summary is None
