"""Which trainable parameters the language-model loss never reaches, found from the graph of one small forward.

Some models hold parameters that the LM loss gives no gradient: the sparse-attention indexers of DeepSeek-V3.2 /
GLM-5 (trained by their own loss upstream; a top-k selection has no gradient), the vision tower of an image-text
checkpoint fine-tuned on text, a seq2seq decoder's cross-attention used as a causal LM. DistributedDataParallel
waits for a gradient of every registered parameter and fails ("Expected to have finished reduction") unless it
searches the graph every step (``find_unused_parameters``, a cost per step). Such a parameter is structurally
unused: it gets no gradient from any batch, so the optimizer never moves it, and it can be frozen with no change
to what is trained.
"""

from __future__ import annotations

from typing import Any

import torch

PROBE_TOKENS = 16


class ProbeFailed(Exception):
    """The probe's forward did not run; its message is the first line of the cause."""


def parameters_without_gradient(model: torch.nn.Module, device: torch.device,
                                image: dict[str, torch.Tensor] | None = None, tokens: int = PROBE_TOKENS) -> list[str]:
    """Names of the trainable parameters the logits of ``tokens`` tokens (and ``image``, when the data has images: the
    token ids that stand for one image and its pixel inputs, data/images.py's blank image) do not depend on.

    The autograd graph of one forward is walked from the logits to its leaves (as DDP's unused-parameter search
    does), so no backward runs and no gradient is allocated. In eval mode: no dropout (no random numbers drawn)
    and no activation checkpointing (a reentrant checkpoint would hide its parameters from the graph). A forward
    that cannot run on these inputs raises ``ProbeFailed`` with its reason: the caller cannot know what is unused."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        return []
    was_training = model.training
    model.eval()
    try:
        ids = (torch.arange(tokens, device=device) % max(2, _vocab_size(model))).unsqueeze(0)
        inputs: dict[str, torch.Tensor] = {}
        if image is not None:  # text tokens other than the image's own, then the image
            own = set(image["input_ids"].flatten().tolist())
            text = [token for token in range(tokens + len(own)) if token not in own][:tokens]
            ids = torch.cat([torch.tensor([text], device=device), image["input_ids"].to(device)], dim=1)
            inputs = {key: value.to(device) for key, value in image.items() if key != "input_ids"}
            for key, value in inputs.items():  # per-token image flags (mm_token_type_ids, ...): none on the text
                if key.endswith("type_ids"):
                    inputs[key] = torch.cat([torch.zeros(1, tokens, dtype=value.dtype, device=device), value],
                                            dim=1)
        reached = graph_leaves(model(input_ids=ids, **inputs, use_cache=False).logits)  # as training calls it
    except Exception as error:  # noqa: BLE001 - any failure of the probe leaves the answer unknown, said by the caller
        raise ProbeFailed(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error
    finally:
        model.train(was_training)
    return [name for name, p in trainable if id(p) not in reached]


def graph_leaves(output: torch.Tensor) -> set[int]:
    """ids of the leaf tensors (parameters) the autograd graph of ``output`` accumulates gradients into."""
    found: set[int] = set()
    seen: set[Any] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node holds its leaf
        if variable is not None:
            found.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return found


def _vocab_size(model: Any) -> int:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "vocab_size", None) or 2)


def is_expert_parameter(name: str) -> bool:
    """An expert's weight can miss a gradient in one batch and get one in the next (routing): never frozen."""
    return ".experts." in name or name.endswith(".experts")

