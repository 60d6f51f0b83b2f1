"""stage rm's model: a causal LM's body under a one-label sequence-classification head.

The causal LM is loaded as for every stage (whole, or as a skeleton a sharding engine fills), then its body is
moved into ``AutoModelForSequenceClassification`` (``num_labels=1``): the output layer is dropped and a new
``score`` layer of one row is drawn with the run's seed, on the host, the same on every engine and rank. Fine-tuning
is applied after (model/source.py): full trains everything, freeze the chosen layers plus the score layer, LoRA
adapts the body and trains the score layer in full (peft's ``SEQ_CLS`` task keeps ``score`` in
``modules_to_save``, so the adapter folder holds it).

The saved folder loads with ``AutoModelForSequenceClassification.from_pretrained`` (a LoRA adapter on top of the
base loaded with ``num_labels=1``); the score of a sequence is the head's output at its last non-padding token
(transformers' pooling: the model's ``pad_token_id`` is the tokenizer's).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardtune.errors import ModelError

if TYPE_CHECKING:  # torch is imported where it runs: `shardtune check` reads this module without it
    import torch

SCORE_LAYER = "score"


@dataclass(frozen=True)
class RewardHead:
    """What the score head needs: the padding id its pooling looks for and the seed its row is drawn with."""

    pad_token_id: int
    seed: int


def to_reward_model(causal_lm: torch.nn.Module, head: RewardHead) -> torch.nn.Module:
    """A one-label sequence-classification model holding ``causal_lm``'s body (its tensors, not a copy).

    Draws nothing from the global generator. The body keeps its names (``model.*``), so a skeleton's tensors are
    still found in the files; the score layer is real (never meta), so a sharding engine takes it as a starting
    value, as it takes new adapter weights."""
    import torch
    from transformers import AutoModelForSequenceClassification

    config: Any = copy.deepcopy(causal_lm.config)  # a transformers PretrainedConfig
    config.num_labels, config.pad_token_id = 1, head.pad_token_id
    config.architectures = None  # save_pretrained writes the new class
    # The class's own body is never allocated (meta); the causal LM's body takes its place.
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(
            config, dtype=torch.float32, attn_implementation=config._attn_implementation)
    body_name = model.base_model_prefix
    body = getattr(causal_lm, body_name, None)
    score = getattr(model, SCORE_LAYER, None)
    if body is None or not isinstance(score, torch.nn.Linear):
        raise ModelError(f"stage rm: {type(causal_lm).__name__} has no '{body_name}' body or its sequence-"
                         "classification class no 'score' layer; this architecture cannot be a reward model here")
    setattr(model, body_name, body)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(head.seed)
        model.score = torch.nn.Linear(score.in_features, 1, bias=score.bias is not None)
        torch.nn.init.normal_(model.score.weight, std=getattr(config, "initializer_range", 0.02))
    body_tensors = {id(p) for p in body.parameters()}
    if any(p.is_meta for p in model.parameters() if id(p) not in body_tensors):
        raise ModelError(f"stage rm: {type(model).__name__} has layers besides '{body_name}' and 'score'; this "
                         "architecture cannot be a reward model here")
    return model

