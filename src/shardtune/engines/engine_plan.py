"""The engine a run uses and its resolved settings: the plan the launching host writes and every rank reads.

The shared type of the engine records (engines/spec.py and each engine's record module take an ``EnginePlan``);
it imports no record, so the planner (engines/plan.py) can import the records without a circle.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class FsdpSettings:
    """Resolved FSDP options; ``version`` 2 is torch ``fully_shard``, 1 is ``FullyShardedDataParallel``."""

    version: int = 2
    sharding_strategy: str = "FULL_SHARD"
    offload_params: bool = False
    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    transformer_layer_cls_to_wrap: tuple[str, ...] = ()
    min_num_params: int = 100_000_000
    state_dict_type: str = "SHARDED_STATE_DICT"
    backward_prefetch: str = "BACKWARD_PRE"
    forward_prefetch: bool = False
    cpu_ram_efficient_loading: bool = False
    sync_module_states: bool = True
    use_orig_params: bool = True
    hsdp_shard_size: int | None = None
    ignored: tuple[str, ...] = field(default=())

    @property
    def is_hybrid(self) -> bool:
        return self.sharding_strategy.startswith("HYBRID")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("ignored")
        return data


@dataclass(frozen=True)
class EnginePlan:
    kind: str  # a key of engines.plan.ENGINE_SPECS
    fsdp: FsdpSettings | None = None
    deepspeed_raw: dict[str, Any] | None = None
    deepspeed_source: str | None = None

    @property
    def needs_process_group(self) -> bool:
        return self.kind != "local"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, for the plan the launching host writes for its ranks."""
        return {"kind": self.kind, "fsdp": self.fsdp.to_dict() if self.fsdp else None,
                "deepspeed_raw": self.deepspeed_raw, "deepspeed_source": self.deepspeed_source}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EnginePlan:
        fsdp = data.get("fsdp")
        settings = None if fsdp is None else FsdpSettings(
            **{**fsdp, "transformer_layer_cls_to_wrap": tuple(fsdp["transformer_layer_cls_to_wrap"])})
        return cls(data["kind"], settings, data.get("deepspeed_raw"), data.get("deepspeed_source"))
