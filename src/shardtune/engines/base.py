"""The one interface the training loop talks to; each engine (local, DDP, FSDP, DeepSpeed) implements it."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import torch

from shardtune.model.varlen import generation_kernel

if TYPE_CHECKING:
    from shardtune.engines.checkpoint_writer import CheckpointWriter
    from shardtune.engines.sequence_parallel import SequenceParallel
    from shardtune.engines.sharded_loading import ShardedLoad
    from shardtune.model.source import ModelSource

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class Generates(Protocol):
    """A transformers or peft model (peft forwards ``generate`` to the model it wraps)."""

    training: bool

    def generate(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...

    def eval(self) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...


def generates(model: object) -> TypeGuard[Generates]:
    # hasattr, not a runtime_checkable isinstance: from Python 3.12 that skips peft's forwarding __getattr__.
    return hasattr(model, "generate")


@dataclass(frozen=True)
class PrecisionSettings:
    bf16: bool = False
    fp16: bool = False

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        if self.bf16:
            return torch.bfloat16
        if self.fp16:
            return torch.float16
        return None


class Engine(ABC):
    """Owns the model, optimizer and scheduler once prepared; the loop only calls these methods."""

    name: str = "engine"
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any

    def __init__(self, precision: PrecisionSettings, device: torch.device) -> None:
        self.precision = precision
        self.device = device
        self.loading: ShardedLoad | None = None  # set by sharding engines that fill a skeleton
        # This rank's sequence group when sequence_parallel_size > 1 (set by build_engine); None: whole rows.
        self.sequence: SequenceParallel | None = None

    # --- topology ---
    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different data: the ranks of a sequence group read the same rows."""
        return self.world_size // (self.sequence.size if self.sequence is not None else 1)

    @property
    def data_parallel_rank(self) -> int:
        return self.rank // (self.sequence.size if self.sequence is not None else 1)

    @property
    def loss_scale_for_mean_reduction(self) -> float:
        """Factor that undoes the engine's gradient averaging over data-parallel ranks.

        The loop divides each rank's summed token loss by the global token count; engines that average
        gradients across ranks would otherwise shrink the update by the world size.
        """
        return float(self.world_size)

    # --- setup ---
    def build_model(self, source: ModelSource) -> torch.nn.Module:
        """The model to train, loaded as this engine needs it: whole on the host unless the engine shards."""
        return source.load_full()

    @property
    def shards_weights(self) -> bool:
        """Whether each rank holds only a shard of the weights (FSDP, ZeRO-3)."""
        return False

    def load_frozen(self, source: ModelSource) -> torch.nn.Module:
        """``source`` as a frozen model (no gradients, eval mode) placed as this engine places the policy, for
        forwards under ``torch.no_grad`` only (a preference run's reference): whole on this rank's device here;
        sharding engines shard it as they shard the policy, so no rank ever holds it whole."""
        with torch.random.fork_rng(devices=[]):  # loading draws nothing the policy's run should miss
            model = source.load_full()
        model.requires_grad_(False)
        return model.to(self.device).eval()

    @property
    def weights_bytes_read(self) -> int:
        """Bytes of checkpoint weights this rank read itself (sharding engines load tensor by tensor)."""
        return self.loading.bytes_read if self.loading is not None else 0

    @abstractmethod
    def prepare(self, model: torch.nn.Module, build_optimizer: OptimizerFactory,
                build_scheduler: SchedulerFactory) -> None:
        """Wrap the model and build optimizer and scheduler over the (possibly sharded) parameters."""

    def verify(self) -> None:
        """Check after setup that the engine and world size are the ones asked for (no silent fallback)."""
        return None

    def forward_weight_dtype(self, stored: torch.dtype) -> torch.dtype:
        """The dtype a weight stored as ``stored`` has when the model runs (FSDP casts its shards for compute)."""
        return stored

    # --- per step ---
    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.precision.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def accumulation_context(self, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch; engines skip gradient sync on all but the last."""
        return contextlib.nullcontext()

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def step(self, max_grad_norm: float) -> float:
        """Clip, step optimizer and scheduler, zero grads; return the gradient norm before clipping."""

    def step_on_device(self, max_grad_norm: float) -> torch.Tensor:
        """``step``, with the gradient norm left where it was computed: reading it is the caller's one host sync
        (the loop reads it together with the step's other numbers)."""
        return torch.tensor(self.step(max_grad_norm), dtype=torch.float32)

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def barrier(self) -> None:
        return None

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        return [value]

    def expert_parallel_report(self, steps: int) -> dict[str, Any] | None:
        """Under expert parallelism (a collective: every rank calls): the mesh, the experts each rank holds and
        the all-to-all bytes per optimizer step, for train_results.json; None without it."""
        return None

    # --- generation (do_predict) ---
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``generate`` on this rank's prompts with the model as trained. Where the weights are sharded each forward
        gathers them (a collective), so ranks that finish first keep stepping until every rank is done
        (``synced_gpus``): every rank must call this as often as the others."""
        model = self.unwrapped_model()
        if not generates(model):
            raise RuntimeError(f"{type(model).__name__} has no generate(): not a transformers or peft model")
        was_training = model.training
        model.eval()
        synced = self.shards_weights and self.world_size > 1
        try:
            with torch.no_grad(), self.autocast(), self.generation_context(), generation_kernel(model):
                return model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(
                    self.device), synced_gpus=synced, **kwargs)
        finally:
            model.train(was_training)

    def generation_context(self) -> contextlib.AbstractContextManager:
        """What ``generate`` runs in, beyond no_grad and autocast (an engine whose root holds weights of its own
        that the model's forward hooks do not gather overrides it)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def gathered_weights(self, params: list[torch.nn.Parameter]) -> Iterator[list[torch.Tensor]]:
        """The whole tensors of ``params`` (parameters of ``unwrapped_model()``), valid inside the context only (a
        weight sync reads them there). Where weights are sharded this is a collective: every rank enters it with the
        same parameters in the same order. Here they are whole already."""
        yield [p.detach() for p in params]

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # --- saving ---
    @abstractmethod
    def unwrapped_model(self) -> torch.nn.Module: ...

    @abstractmethod
    def save_model(self, out_dir: Path) -> None:
        """Write the final model (or adapter) in Hugging Face format; main rank writes."""

    @abstractmethod
    def save_state(self, ckpt_dir: Path, writer: CheckpointWriter | None = None) -> None:
        """Write everything needed to resume: weights, optimizer, scheduler; through ``writer`` (staged and written in
        the background under ``async_save``), at once without one."""

    @abstractmethod
    def load_state(self, ckpt_dir: Path) -> None: ...

    def close(self) -> None:
        return None

    def iter_trainable(self) -> Iterator[torch.nn.Parameter]:
        return (p for p in self.model.parameters() if p.requires_grad)
