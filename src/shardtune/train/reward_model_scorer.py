"""A reward model folder (stage rm's output) as a reward function of stage grpo: its score of each prompt +
completion, read at the last token that is not padding, as stage rm trained it (model/reward_head.py).

The model scores the token ids the policy produced (the prompt as the template rendered it, the completion up to and
with its stop token), so it must share the policy's tokenizer; a folder whose vocabulary differs is refused by name.
It is loaded whole on every rank, frozen, in the dtype it was saved in, and runs without gradients.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardtune.errors import ConfigError


class RewardModelScorer:
    """``score(rows)``: one float per row of token ids."""

    def __init__(self, folder: str, device: torch.device, policy_tokenizer: Any) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        own = AutoTokenizer.from_pretrained(folder)
        if own.get_vocab() != policy_tokenizer.get_vocab():
            raise ConfigError(f"reward_funcs ({folder}): its tokenizer's vocabulary differs from the trained model's; "
                              "a reward model scores the policy's token ids, so train it from the same base model")
        with torch.random.fork_rng(devices=[]):  # loading draws nothing the run should miss
            model = AutoModelForSequenceClassification.from_pretrained(folder, dtype="auto")
        self.model = model.to(device).eval().requires_grad_(False)
        self.pad_token_id = int(model.config.pad_token_id if model.config.pad_token_id is not None
                                else own.pad_token_id)
        self.device = device
        self.name = Path(folder).name

    @torch.no_grad()
    def score(self, rows: list[list[int]]) -> list[float]:
        longest = max(len(r) for r in rows)
        ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return logits[:, 0].float().cpu().tolist()
