"""Shared mechanics of the engines that use a plain torch optimizer (local, DDP, FSDP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from shardtune.engines.base import Engine, OptimizerFactory, PrecisionSettings, SchedulerFactory
from shardtune.engines.checkpoint_writer import CheckpointWriter
from shardtune.engines.replicated import WEIGHTS_FILE

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"


class TorchEngine(Engine):
    """Autocast, fp16 loss scaling, clipping and the optimizer step, for a wrapped torch module."""

    def __init__(self, precision: PrecisionSettings, device: torch.device) -> None:
        super().__init__(precision, device)
        self.scaler = torch.amp.GradScaler(device.type) if precision.fp16 else None

    def prepare(self, model: torch.nn.Module, build_optimizer: OptimizerFactory,
                build_scheduler: SchedulerFactory) -> None:
        model.to(self.device)
        self.model = self.wrap(model)
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad])
        self.scheduler = build_scheduler(self.optimizer)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def step(self, max_grad_norm: float) -> float:
        return float(self.step_on_device(max_grad_norm))

    def step_on_device(self, max_grad_norm: float) -> torch.Tensor:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = self.clip_grad_norm(max_grad_norm if max_grad_norm > 0 else float("inf"))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.detach().float().reshape(())

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(self.iter_trainable()), max_norm)

    def unwrapped_model(self) -> torch.nn.Module:
        return self.model

    def save_model(self, out_dir: Path) -> None:
        if self.is_main:
            from shardtune.model.saved import (
                as_saves_pretrained,
                expected_saved_parameters,
                verify_saved,
                without_deepspeed_lookup,
            )

            model = as_saves_pretrained(self.unwrapped_model())
            # peft would add whole embedding layers once the vocabulary grew; modules_to_save already holds them.
            extra = {"save_embedding_layers": False} if hasattr(model, "peft_config") else {}
            with without_deepspeed_lookup():
                model.save_pretrained(out_dir, safe_serialization=True, **extra)
            verify_saved(out_dir, expected_saved_parameters(model))

    # Resume state: trainable weights as safetensors, optimizer/scheduler as tensor-only pickles
    # that load with weights_only=True (no arbitrary objects).
    def save_state(self, ckpt_dir: Path, writer: CheckpointWriter | None = None) -> None:
        if not self.is_main:
            return
        writer = writer or CheckpointWriter(background=False)
        trained = self.trained_names()
        weights = {n: p.detach().contiguous() for n, p in self.unwrapped_model().named_parameters() if n in trained}
        writer.save_safetensors(weights, ckpt_dir / WEIGHTS_FILE)
        writer.save_torch(self.optimizer.state_dict(), ckpt_dir / OPTIMIZER_FILE)
        writer.save_torch(self.scheduler_state(), ckpt_dir / SCHEDULER_FILE)

    def trained_names(self) -> set[str]:
        """The weights a checkpoint must hold: those that take gradients now and every one the optimizer holds
        (BAdam, optim/badam.py, trains one block at a time and leaves the others without ``requires_grad``)."""
        held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        return {n for n, p in self.unwrapped_model().named_parameters() if p.requires_grad or id(p) in held}

    def scheduler_state(self) -> dict[str, Any]:
        # LambdaLR stores None for plain-function lambdas: the schedule itself is rebuilt from the config.
        return self.scheduler.state_dict()

    def load_state(self, ckpt_dir: Path) -> None:
        model = self.unwrapped_model()
        weights = load_file(str(ckpt_dir / WEIGHTS_FILE), device=str(self.device))
        missing = sorted(self.trained_names() - weights.keys())
        if missing:
            raise RuntimeError(f"checkpoint {ckpt_dir} lacks trainable weights: {missing[:3]}")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)
        # Straight onto this rank's device: without map_location every rank would load onto the device that
        # saved the file (GPU 0).
        self.optimizer.load_state_dict(torch.load(ckpt_dir / OPTIMIZER_FILE, map_location=self.device,
                                                  weights_only=True))
        self.scheduler.load_state_dict(torch.load(ckpt_dir / SCHEDULER_FILE, map_location="cpu", weights_only=True))
