"""The DeepSpeed engine with ``expert_parallel_size`` E > 1 run by DeepSpeed's AutoEP (with E = 1 it is the plain
DeepSpeed engine): the config gains AutoEP's section, ``initialize`` replaces the MoE blocks, and the saved model
is written back under the family's Hugging Face names (deepspeed_autoep_runtime.py says how and why)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from shardtune.engines import deepspeed_autoep_runtime as autoep
from shardtune.engines.base import OptimizerFactory, PrecisionSettings, SchedulerFactory
from shardtune.engines.checkpoint_writer import CheckpointWriter
from shardtune.engines.deepspeed import DeepSpeedEngine
from shardtune.engines.deepspeed_autoep import autoep_enabled, with_autoep
from shardtune.engines.deepspeed_config import CHECKPOINT_TAG
from shardtune.engines.distributed import DistContext
from shardtune.model.folder import model_config_json
from shardtune.model.saved import as_saves_pretrained, expected_saved_parameters, saved_weights_problem

if TYPE_CHECKING:
    from shardtune.config.schema import TrainConfig
    from shardtune.engines.engine_plan import EnginePlan


class DeepSpeedEngineEP(DeepSpeedEngine):
    """DeepSpeed ZeRO; with ``expert_parallel`` in its config, AutoEP's experts split over the ranks."""

    @classmethod
    def from_plan(cls, config: TrainConfig, plan: EnginePlan, ctx: DistContext,
                  precision: PrecisionSettings) -> DeepSpeedEngine:
        engine = super().from_plan(config, plan, ctx, precision)
        model_type = (model_config_json(config.model_name_or_path) or {}).get("model_type")
        engine.ds_config = with_autoep(engine.ds_config, config.expert_parallel_size, model_type)
        return engine

    def __init__(self, ds_config: dict, precision: PrecisionSettings, ctx: DistContext) -> None:
        super().__init__(ds_config, precision, ctx)
        self.hf_blocks: dict[str, autoep.HfBlockNames] = {}
        self.traffic: autoep.AutoEPTraffic | None = None

    @property
    def autoep(self) -> bool:
        return autoep_enabled(self.ds_config)

    def prepare(self, model: torch.nn.Module, build_optimizer: OptimizerFactory,
                build_scheduler: SchedulerFactory) -> None:
        if not self.autoep:
            super().prepare(model, build_optimizer, build_scheduler)
            return
        self.hf_blocks = autoep.record_hf_blocks(model)
        with autoep.registry_accepts_string_keys():
            super().prepare(model, build_optimizer, build_scheduler)
        self.traffic = autoep.count_expert_rows(self.unwrapped_model())

    def _client_optimizer(self, params: list[torch.nn.Parameter], build_optimizer: OptimizerFactory) -> Any:
        # A callable: DeepSpeed builds it after AutoEP replaced the experts, with their groups split off.
        if self.autoep:
            return autoep.moe_grouped_optimizer(build_optimizer)  # offload is refused with AutoEP
        return super()._client_optimizer(params, build_optimizer)

    def save_model(self, out_dir: Path) -> None:
        """Every rank gathers its expert-parallel group's experts; rank 0 writes transformers' names."""
        if not self.autoep:
            super().save_model(out_dir)
            return
        model = self.unwrapped_model()
        state = autoep.hf_state_dict(model, self.hf_blocks, self.is_main, self.zero_stage == 3)
        error = None
        if state is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            as_saves_pretrained(model).save_pretrained(str(out_dir), state_dict=state)
            error = saved_weights_problem(out_dir, expected_saved_parameters(model, state))
        error = self._broadcast_from_main(error)
        if error:
            raise RuntimeError(error)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The model under transformers' names (rank 0; None elsewhere): a collective under AutoEP."""
        if not self.autoep:
            return self._full_state_dict(adapter_only=False)
        return autoep.hf_state_dict(self.unwrapped_model(), self.hf_blocks, self.is_main, self.zero_stage == 3)

    def save_state(self, ckpt_dir: Path, writer: CheckpointWriter | None = None) -> None:
        """Under AutoEP DeepSpeed writes its own universal-checkpoint info (and refuses ours) with the experts'
        files."""
        if not self.autoep:
            super().save_state(ckpt_dir, writer)
            return
        # Imported here: it imports deepspeed, which must not load before the engine says the ranks' device.
        from shardtune.engines.deepspeed_checkpoint import writing_through

        with writing_through(self.ds, writer or CheckpointWriter(background=False)):
            self.ds.save_checkpoint(str(ckpt_dir), tag=CHECKPOINT_TAG)

    def expert_parallel_report(self, steps: int) -> dict[str, Any] | None:
        if self.traffic is None:
            return None
        per_rank = self.gather_objects(autoep.rank_report(self.unwrapped_model(), self.traffic))
        return autoep.summary(cast(list[dict[str, Any]], per_rank), steps, self.world_size)
