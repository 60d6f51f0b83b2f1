"""NEFTune: noise on the input embeddings while the model trains (the Hugging Face Trainer's neftune_noise_alpha)."""

from __future__ import annotations

from typing import Any


def apply_neftune(model: Any, alpha: float, slices: int = 1) -> Any:
    """NEFTune (as the Hugging Face Trainer adds it): while the model trains, add uniform noise of magnitude
    ``alpha / sqrt(seq_len * hidden)`` to the input embeddings; eval and inference see them unchanged. ``slices``:
    under sequence parallelism each rank embeds 1/N of every row, and ``seq_len`` is the whole row's (N x the slice),
    so every token gets the noise one process gives it.

    A forward hook on the embedding module itself, so it survives every engine's wrapping (FSDP and ZeRO keep the
    module and run its hooks) and keys on the module's own ``training`` flag. Returns the hook's handle.
    """
    import torch

    def add_noise(module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        magnitude = alpha / (slices * output.size(1) * output.size(2)) ** 0.5
        return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)

    return model.get_input_embeddings().register_forward_hook(add_noise)
