"""What ``micro_batch_tokens`` (token-budget micro-batches, data/budget_batches.py) needs from the other keys."""

from __future__ import annotations

from shardtune.config.schema import TrainConfig


def micro_batch_tokens_problems(c: TrainConfig) -> list[str]:
    """Keys that token-budget micro-batches cannot work with, each named with its value."""
    budget = c.micro_batch_tokens
    if budget is None:
        return []
    problems = []
    if budget < c.cutoff_len:
        problems.append(f"micro_batch_tokens ({budget}) is below cutoff_len ({c.cutoff_len}): a sample of cutoff_len "
                        "tokens would not fit in a micro-batch; raise micro_batch_tokens (or lower cutoff_len)")
    if c.stage not in ("sft", "pt"):
        problems.append(f"micro_batch_tokens ({budget}) with stage ({c.stage}): token budgets batch sft and pt "
                        "samples, a preference stage takes per_device_train_batch_size pairs; unset "
                        "micro_batch_tokens")
    if c.streaming:
        problems.append(f"micro_batch_tokens ({budget}) with streaming (true): the budget's micro-batches are built "
                        "from every sample's length up front, which a stream does not know; unset one")
    if c.dataloader_drop_last:
        problems.append(f"micro_batch_tokens ({budget}) with dataloader_drop_last (true): token-budget "
                        "micro-batches keep every sample; unset dataloader_drop_last")
    return problems
