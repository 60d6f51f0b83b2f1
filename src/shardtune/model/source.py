"""What a rank needs to build its model: loaded whole, or as an empty skeleton that an engine fills shard by shard.

Replicating engines (one process, DDP, ZeRO-0/1/2) call ``load_full``. Sharding engines (FSDP, ZeRO-3) call
``build_skeleton``: the same architecture and the same fine-tuning setup, but the base weights are never
allocated in full (meta tensors, or DeepSpeed's partitioned parameters when built inside ``zero.Init``); the
engine then reads each tensor through ``weights`` and keeps only its shard. Trainable tensors that do not come from
the checkpoint (new LoRA matrices) are created on the host with their initial values, drawing the same random
numbers as ``load_full`` does (``initialize_adapter_weights``), so both paths start from the same weights for
a given seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shardtune.errors import ModelError
from shardtune.model.conversion import converted_weights
from shardtune.model.finetuning.apply import apply_finetuning, count_parameters
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.model.load import Quantization, load_model_config
from shardtune.model.pretrained_adapters import AdapterPlan, merge_adapters
from shardtune.model.reward_head import RewardHead, to_reward_model
from shardtune.model.vocab import VocabGrowth, apply_vocab_growth, grown_tensor, vocab_tensors
from shardtune.model.weights import WeightsReader, open_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelSource:
    """How to load the model of a run (explicit settings, not the whole config)."""

    name_or_path: str
    finetuning: FinetuningSettings
    trust_remote_code: bool = False
    attn_implementation: str = "sdpa"
    quantization_bit: int | None = None
    quantization_type: str = "nf4"
    double_quantization: bool = True
    compute_dtype: torch.dtype = torch.float32
    adapters: AdapterPlan = AdapterPlan()  # earlier LoRA adapters to merge; the one to resume is in ``finetuning``
    rope_scaling: str | None = None
    max_length: int | None = None  # the longest sequence trained on (cutoff_len), for rope_scaling
    vocab: VocabGrowth | None = None  # new tokens outgrew the embedding: rows to add (resize_vocab)
    pure_bf16: bool = False  # every weight, adapters included, in bfloat16 (LLaMA-Factory's pure_bf16)
    reward_head: RewardHead | None = None  # stage rm: the body under a one-label score head (model/reward_head.py)
    reads_images: bool = False  # the data has images: the loss reaches the vision tower through pixel inputs
    mixture_of_depths: str | None = None  # 'convert' or 'load': routed decoder layers (model/depths.py)

    def load_full(self) -> torch.nn.Module:
        """The whole model in float32 on the host (quantised loads through bitsandbytes), fine-tuning applied."""
        from shardtune.model.load import load_causal_lm

        quantization = None
        if self.quantization_bit is not None:
            quantization = Quantization(self.quantization_bit, self.quantization_type, self.double_quantization)
        model = load_causal_lm(self.name_or_path, trust_remote_code=self.trust_remote_code,
                               attn_implementation=self.attn_implementation, quantization=quantization,
                               compute_dtype=self.compute_dtype, config=self._config())
        if self.vocab is not None:
            apply_vocab_growth(model, self.vocab)
        if self.mixture_of_depths is not None:
            from shardtune.model.depths import apply_mixture_of_depths

            routed = apply_mixture_of_depths(model, self.mixture_of_depths, self.name_or_path)
            print(f"[shardtune] mixture of depths ({self.mixture_of_depths}): layers {routed} see the top "
                  f"{model.config.mixture_of_depths['capacity']:.1%} of each row's tokens", flush=True)
        model = self._finish(merge_adapters(model, self.adapters.to_merge))
        # As LLaMA-Factory's pure_bf16: no fp32 copy of anything, trainable weights included; the optimizer then
        # keeps its state in bf16 too.
        return model.to(torch.bfloat16) if self.pure_bf16 else model

    def _config(self) -> PretrainedConfig:
        return load_model_config(self.name_or_path, trust_remote_code=self.trust_remote_code,
                                 rope_scaling=self.rope_scaling, max_length=self.max_length)

    def build_skeleton(self, construction: contextlib.AbstractContextManager | None = None) -> Skeleton:
        """The model without its base weights, fine-tuning applied; ``construction`` replaces the meta device.

        Building draws no random numbers (it runs under a forked generator), so the fine-tuning step that follows
        draws exactly what it draws after ``load_full``.
        """
        if self.mixture_of_depths is not None:
            raise ModelError("mixture_of_depths: the routers are added to the whole model, which a sharding engine "
                             "(FSDP, ZeRO-3) never loads; train with DDP or ZeRO-0/1/2")
        if self.adapters.to_merge:
            raise ModelError(f"adapter_name_or_path: merging {len(self.adapters.to_merge)} adapter(s) needs the whole "
                             "base model on each process, which a sharding engine (FSDP, ZeRO-3) never loads; merge "
                             "them first (shardtune export) or train with DDP or ZeRO-1/2")
        weights = open_weights(self.name_or_path)
        if weights is None:
            raise ModelError(f"model_name_or_path: {self.name_or_path} has no safetensors weights "
                             "(model.safetensors or model.safetensors.index.json) to load shard by shard")
        with torch.random.fork_rng(devices=[]):
            model = self._empty_model(construction)
        weights = converted_weights(weights, model)  # transformers' own checkpoint conversion, as from_pretrained
        checkpoint_names = checkpoint_names_by_parameter(model, weights)
        grown = self._grown_names(model, checkpoint_names)
        model = self._finish(model)
        names = _names_after_finetuning(model, checkpoint_names)
        fill_dora_magnitudes(model, weights, names)
        return Skeleton(model, weights, names, self.vocab, grown)

    def _grown_names(self, model: torch.nn.Module, by_id: dict[int, str]) -> dict[str, int]:
        """Names in the files of the tensors that have more rows than the files hold -> which (0: embedding)."""
        if self.vocab is None or not self.vocab.is_growing:
            return {}
        return {by_id[id(tensor)]: which for which, tensor in enumerate(vocab_tensors(model))}

    def _empty_model(self, construction: contextlib.AbstractContextManager | None) -> torch.nn.Module:
        from accelerate import init_empty_weights
        from transformers.initialization import no_init_weights

        from shardtune.model.composite import auto_model_class
        from shardtune.model.load import check_attention

        check_attention(self.attn_implementation)
        config = self._config()
        if self.vocab is not None and self.vocab.is_growing:
            config.vocab_size = self.vocab.new_rows  # the files' rows are copied in, the new ones drawn
        # Buffers (rotary frequencies) are computed at construction and are not in the checkpoint: keep them real.
        context = construction or init_empty_weights(include_buffers=False)
        with no_init_weights(), context:
            model = auto_model_class(config).from_config(config, dtype=torch.float32,
                                                         attn_implementation=self.attn_implementation,
                                                         trust_remote_code=self.trust_remote_code)
        # Tying ran inside the contexts, which give every assigned parameter a new tensor: tie again.
        model.tie_weights()
        return model

    def _finish(self, model: torch.nn.Module) -> torch.nn.Module:
        finetuning = self.finetuning
        if self.reward_head is not None:
            model = to_reward_model(model, self.reward_head)
            finetuning = dataclasses.replace(finetuning, score_head=True)
        model = apply_finetuning(model, finetuning)
        trainable, total = count_parameters(model)
        print(f"[shardtune] {self.finetuning.finetuning_type}: trainable params {trainable:,} of {total:,} "
              f"({100 * trainable / max(total, 1):.4f}%)", flush=True)
        return model


@dataclass
class Skeleton:
    """A model whose checkpoint tensors are still to be loaded, with where each one is found."""

    model: torch.nn.Module
    weights: WeightsReader
    checkpoint_names: dict[str, str]  # parameter or persistent-buffer name in ``model`` -> name in the files
    vocab: VocabGrowth | None = None
    grown: dict[str, int] = field(default_factory=dict)  # names in the files with rows to add -> grown_tensor's which

    def read(self, stored: str) -> torch.Tensor:
        """The whole tensor ``stored`` as the model holds it: from the files, grown when the vocabulary grows."""
        tensor = self.weights.read(stored)
        if stored in self.grown and self.vocab is not None:
            return grown_tensor(tensor, self.vocab, self.grown[stored])
        return tensor

    def read_slice(self, stored: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """A block of ``stored``; a grown tensor is built whole first (its new rows need the mean of all rows)."""
        if stored not in self.grown:
            return self.weights.read_slice(stored, offsets, shape)
        block = self.read(stored)
        for dim, (start, size) in enumerate(zip(offsets, shape, strict=True)):
            block = block.narrow(dim, start, size)
        return block

    def initial_values(self) -> dict[str, torch.Tensor]:
        """Tensors that already hold their starting values (new adapter weights), by name in ``model``."""
        return {name: tensor.detach().clone() for name, tensor in named_checkpoint_states(self.model)
                if not tensor.is_meta and name not in self.checkpoint_names}

    def non_persistent_buffers(self) -> dict[str, torch.Tensor]:
        """Buffers computed at construction and absent from checkpoints (rotary frequencies)."""
        found = {}
        for module_name, module in self.model.named_modules():
            for name in module._non_persistent_buffers_set:
                buffer = module._buffers.get(name)
                if buffer is not None:
                    found[f"{module_name}.{name}" if module_name else name] = buffer.detach().clone()
        return found


def named_checkpoint_states(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (shared ones once) and persistent buffers: what a checkpoint holds, in the same order on every
    rank."""
    yield from model.named_parameters()
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def checkpoint_names_by_parameter(model: torch.nn.Module, weights: WeightsReader) -> dict[int, str]:
    """id(tensor) -> its name in the weights files; a tensor the files lack is a ModelError naming it.

    A tied tensor (embedding and output layer) has several names; the one the files hold is used.
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for name, buffer in named_checkpoint_states(model):
        names.setdefault(id(buffer), []).append(name)
    found, missing = {}, []
    for key, aliases in names.items():
        stored = next((n for n in aliases if n in weights), None)
        if stored is None:
            missing.append(aliases[0])
        else:
            found[key] = stored
    if missing:
        raise ModelError(f"model_name_or_path: the weights in {weights.folder} lack {len(missing)} tensors of the "
                         f"model (first: {missing[0]}); the folder does not match its config.json")
    return found


def _names_after_finetuning(model: torch.nn.Module, by_id: dict[int, str]) -> dict[str, str]:
    """Names in the fine-tuning wrapper (peft renames and nests the base layers) -> names in the files.

    A module trained in full beside LoRA (``additional_target``: peft's ``modules_to_save``) is a copy of the
    original module made while its tensors were empty: the copy starts from the same tensors in the files.
    """
    mapped = {}
    # Every name of a tied tensor: FSDP1 may materialize the output layer before the embedding it shares.
    aliases = model.named_parameters(remove_duplicate=False)
    for name, tensor in itertools.chain(aliases, named_checkpoint_states(model)):
        stored = by_id.get(id(tensor))
        if stored is not None:
            mapped[name] = stored
    copies = re.compile(r"\.modules_to_save\.[^.]+\.")
    for name, _ in named_checkpoint_states(model):
        original = copies.sub(".original_module.", name, count=1)
        if original != name and original in mapped:
            mapped[name] = mapped[original]
    return mapped


def fill_dora_magnitudes(model: torch.nn.Module, weights: WeightsReader, names: dict[str, str]) -> None:
    """DoRA's magnitude starts as the norm of each output row of the base weight (the adapter's lora_B is zero).

    peft computes it from the weight in the model, which a skeleton does not hold yet: compute it from the files,
    one base weight at a time, so that it becomes a starting value like the LoRA matrices.
    """
    for module_name, module in model.named_modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if not magnitudes:
            continue
        stored = names.get(f"{module_name}.base_layer.weight")
        if stored is None:
            raise ModelError(f"use_dora: the base weight of {module_name} is not in the model's files")
        norm = torch.linalg.norm(weights.read(stored).float(), dim=1)
        for magnitude in magnitudes.values():
            magnitude.weight = torch.nn.Parameter(norm.to(torch.float32).clone(), requires_grad=True)
