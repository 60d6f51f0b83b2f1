"""One prompt's group of completions (stage grpo), and the groups a checkpoint must carry between two repeats of a
window (``num_iterations`` > 1).

The repeats of a window train on the same rollouts, against the log-probabilities the policy had before the first
of them. A run resumed between two repeats must therefore not draw the window's rollouts again (the resumed policy
has moved, so its completions and old log-probabilities differ): every rank writes the groups it holds, keyed by
prompt row, and a resumed rank takes the groups of its window's rows from every rank's file. Rows, not ranks, are
the key, so a run resumed on another number of processes finds its groups too (the step's rows are the same; only
which rank holds which differs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardtune.train.rollout import Completions


@dataclass
class Group:
    """One prompt's completions and everything the loss reads of them."""

    prompt: torch.Tensor
    completions: Completions
    mask: torch.Tensor  # the tokens that count (truncated completions masked out when asked)
    rewards: torch.Tensor  # (n, functions), unweighted
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    sampler: torch.Tensor | None = None  # the trainer/sampler importance ratio (a generator of its own)
    row: int = -1  # the prompt's row in the dataset (its seed; the key a resumed run finds it by)


ROLLOUTS_FILE = "grpo_rollouts.pt"  # rank<r>_ in front


def rollouts_file_name(rank: int) -> str:
    return f"rank{rank}_{ROLLOUTS_FILE}"


def rollouts_payload(groups: list[Group]) -> dict[int, dict[str, torch.Tensor]]:
    """Every tensor of each group (on the CPU), by the group's prompt row."""
    payload = {}
    for g in groups:
        c = g.completions
        tensors = {"prompt": g.prompt, "ids": c.ids, "completion_mask": c.mask, "truncated": c.truncated,
                   "logps": c.logps, "mask": g.mask, "rewards": g.rewards, "advantages": g.advantages,
                   "old_logps": g.old_logps, "ref_logps": g.ref_logps, "sampler": g.sampler}
        payload[g.row] = {name: t.detach().cpu() for name, t in tensors.items() if t is not None}
    return payload


def load_rollouts(checkpoint: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Every rank's groups written into ``checkpoint`` ({} when it was saved at the end of a window)."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(checkpoint.glob(f"rank*_{ROLLOUTS_FILE}")):
        found.update(torch.load(path, map_location="cpu", weights_only=True))
    return found


def group_from(row: int, tensors: dict[str, torch.Tensor], device: torch.device) -> Group:
    def on(name: str) -> Any:
        return tensors[name].to(device) if name in tensors else None

    completions = Completions(tensors["ids"], tensors["completion_mask"], tensors["truncated"], tensors.get("logps"))
    return Group(on("prompt"), completions, on("mask"), tensors["rewards"], on("advantages"), on("old_logps"),
                 on("ref_logps"), on("sampler"), row)
