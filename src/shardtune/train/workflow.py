"""One training run on this rank, top to bottom: tokenizer, data, model, engine, loop, save."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardtune import run_files
from shardtune.config.generation import predicts_only
from shardtune.config.load import config_to_dict
from shardtune.config.schema import TrainConfig
from shardtune.engines.base import Engine
from shardtune.errors import ConfigError
from shardtune.model.compile import CompileReport
from shardtune.model.finetuning.lora import leave_adapter_inputs_to_autocast, store_frozen_bases_in
from shardtune.optim.build import build_optimizer, build_scheduler, parameter_names, warmup_steps_for
from shardtune.optim.settings import optimizer_settings
from shardtune.startup_gc import resume_collection, start_loop_collection
from shardtune.train import checkpoint
from shardtune.train.checkpoint import resume_source
from shardtune.train.checkpoint_folders import checkpoint_folders, is_shardtune_checkpoint
from shardtune.train.grpo_run import repeated_windows
from shardtune.train.hooks import RunHooks, StopRequest, run_name
from shardtune.train.kernels import apply_kernels, check_kernel_devices
from shardtune.train.loop import (
    LoopSettings,
    TrainState,
    run_loop,
    steps_per_epoch,
    total_training_steps,
)
from shardtune.train.objectives import asft_anchor, stage_objective, with_reference_logps
from shardtune.train.pissa import PissaConversion
from shardtune.train.profile import StepProfile, profile_line
from shardtune.train.rank_log import rank_log_path
from shardtune.train.reporting import LOG_FILE, plot_loss
from shardtune.train.settings import finetuning_settings, token_weighting
from shardtune.train.setup import (
    build_loader,
    epoch_batches_for,
    has_images,
    is_stream,
    model_source,
    prepare_datasets,
    prepare_model_dir,
    train_micro_batches,
    with_attention_resolved,
)

RESULTS_FILE = run_files.RESULTS
RESOLVED_CONFIG_FILE = run_files.RESOLVED_CONFIG


def run_training(config: TrainConfig, engine: Engine, stop: StopRequest | None = None,
                 memory: MemoryProbe | None = None) -> dict[str, Any]:
    """Train as configured with ``engine`` and return the results written to train_results.json.

    When ``stop`` is raised (Ctrl-C, SIGTERM) the run ends after the current step with a checkpoint and returns
    ``{"interrupted": True, ...}`` without a final model, so the same command resumes.
    """
    if predicts_only(config):
        from shardtune.train.predict import predict_only

        resume_collection()  # generation makes garbage of its own
        return {"predict_only": True, **predict_only(config, engine)}
    set_seed(config.seed)
    if not apply_tf32(config.tf32) and config.tf32 and engine.is_main:
        print("[shardtune] tf32: no CUDA device here; CPU matmuls never use TF32, nothing changes", flush=True)
    output_dir = Path(config.output_dir or "output")
    prepare_model_dir(config, engine)
    config = with_attention_resolved(config, engine.is_main)
    check_kernel_devices(config)  # before the data and the weights: a rank whose device cannot run them says so
    from shardtune.model.load import load_tokenizer

    tokenizer = load_tokenizer(config.model_name_or_path or "", trust_remote_code=config.trust_remote_code)
    config = with_new_tokens(tokenizer, config)
    train_set, eval_set = prepare_datasets(tokenizer, config, engine)
    train_loader = build_loader(train_set, tokenizer, config.per_device_train_batch_size, engine, config, True)
    eval_loader = build_loader(eval_set, tokenizer, config.per_device_eval_batch_size, engine, config, False)
    if train_loader is None:
        raise RuntimeError("no training data loader: prepare_datasets returned no training set")
    if config.dataloader_drop_last and not is_stream(train_set) and len(train_loader) == 0:
        raise ConfigError(f"dataloader_drop_last (true): each rank has fewer than per_device_train_batch_size "
                          f"({config.per_device_train_batch_size}) samples, so no batch is left; turn it off or "
                          "use more data")
    warn_dense_packed_masks(config, engine.is_main)
    repeats = config.num_iterations if config.stage == "grpo" else 1  # grpo reuses each window's rollouts
    loop = loop_settings(config, train_micro_batches(train_loader, config) * repeats, eval_loader is not None)
    source = model_source(*model_config(config), tokenizer_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                          reads_images=has_images(train_set))
    model = engine.build_model(source)
    keep_long_row_weights_trained(model, engine.is_main)
    apply_kernels(model, config, engine.is_main)
    compiling = start_compile(model, config)
    loop = dataclasses.replace(loop, router_aux_loss_coef=router_aux_setting(model, config, engine.is_main),
                               objective=stage_objective(config, source, engine, tokenizer),
                               anchor=asft_anchor(config, source, engine))
    # Before the engine touches the weights (ZeRO casts them to bf16): the adapter exactly as initialised.
    pissa = PissaConversion.start(model, output_dir, engine.is_main) if config.pissa_convert else None
    engine.prepare(
        model,
        lambda params: build_optimizer(params, optimizer_settings(config), parameter_names(model), model),
        lambda opt: build_scheduler(opt, config.lr_scheduler_type, loop.total_steps,
                                    warmup_steps_for(loop.total_steps, config.warmup_steps, config.warmup_ratio)),
    )
    engine.verify()
    autocast = engine.autocast()
    if isinstance(autocast, torch.autocast):
        leave_adapter_inputs_to_autocast(engine.unwrapped_model())
        if not engine.shards_weights:  # a sharding engine's parameters are its own (FSDP QLoRA autocasts)
            store_frozen_bases_in(engine.unwrapped_model(), autocast.fast_dtype)
    choose_experts_implementation(engine)
    if engine.sequence is not None:  # after the engine's setup forwards (DDP's probe), which take whole rows
        mode = engine.sequence.attach(engine.unwrapped_model())
        if engine.is_main:
            print(f"[shardtune] sequence parallel: {engine.sequence.size} ranks per sequence ({mode}) x "
                  f"{engine.data_parallel_size} data parallel", flush=True)
    if memory is not None:
        memory.mark_setup_done()
    if config.precompute_ref_log_probs:  # validated: only for dpo/kto losses that have a reference
        train_set, eval_set = with_reference_logps(engine, tokenizer, config, train_set, eval_set)
        train_loader = build_loader(train_set, tokenizer, config.per_device_train_batch_size, engine, config, True)
        eval_loader = build_loader(eval_set, tokenizer, config.per_device_eval_batch_size, engine, config, False)
        if train_loader is None:
            raise RuntimeError("no training data loader after scoring the reference log-probabilities")
    state = start_state(engine, config, output_dir, loop.objective)
    hooks = RunHooks(engine, config, output_dir, loop.total_steps, eval_loader, state.global_step,
                     stop or StopRequest(), loop.objective, estimated_peak(memory),
                     memory.baseline.rss_bytes if memory is not None else None, compiling,
                     StepProfile(config.profile_steps) if config.profile_steps else None)
    start_loop_collection()  # paused while the rank started; the loop collects itself (startup_gc.py)
    hooks.meter.start()
    batches = repeated_windows(epoch_batches_for(train_loader), config.gradient_accumulation_steps, repeats)
    state = run_loop(engine, batches, loop, state, hooks)
    hooks.finish_saves()  # a checkpoint still being written is waited for, then marked complete
    if state.interrupted:
        hooks.rank_log.close(state.global_step, interrupted=True)
        hooks.reporter.close()
        engine.close()
        return {"interrupted": True, "global_step": state.global_step}
    if pissa is not None:
        pissa.save_converted(engine.unwrapped_model(), engine.is_main)
    return finish_run(engine, tokenizer, config, output_dir, state, hooks, memory)


def estimated_peak(memory: MemoryProbe | None) -> float | None:
    """The estimate's peak bytes on the busiest rank (None without an estimate), for the rank logs."""
    return None if memory is None or memory.estimate is None else float(memory.estimate.peak)


def warn_dense_packed_masks(c: TrainConfig, is_main: bool) -> None:
    """Packed rows on a GPU without a varlen kernel: said once, with the way out."""
    from shardtune.data.settings import packs_sample_boundaries
    from shardtune.model.attention import dense_mask_fallback_warning
    from shardtune.train.setup import padding_free_rows

    packed = packs_sample_boundaries(c) or padding_free_rows(c)
    line = dense_mask_fallback_warning(packed, torch.cuda.is_available(), c.attn_implementation)
    if line and is_main:
        print(line, flush=True)


def start_compile(model: torch.nn.Module, c: TrainConfig) -> CompileReport | None:
    """torch_compile: each decoder layer compiled in place before the engine wraps the model (model/compile.py)."""
    if not c.torch_compile:
        return None
    from shardtune.model.compile import apply_regional_compile

    layers = apply_regional_compile(model, c.torch_compile_mode, c.torch_compile_backend)
    return CompileReport(layers, c.torch_compile_mode, c.torch_compile_backend)


def with_new_tokens(tokenizer: Any, c: TrainConfig) -> TrainConfig:
    """Add add_tokens/add_special_tokens to ``tokenizer`` before the data is tokenised; as in LLaMA-Factory,
    tokens it did not have turn resize_vocab on."""
    from shardtune.model.vocab import add_new_tokens

    if add_new_tokens(tokenizer, c.add_tokens, c.add_special_tokens) and not c.resize_vocab:
        print("[shardtune] new tokens were added: resize_vocab turned on", flush=True)
        return dataclasses.replace(c, resize_vocab=True)
    return c


def model_config(c: TrainConfig) -> tuple[TrainConfig, Any]:
    """The config the model is built from: ``c``, or for a model-only checkpoint to resume, one that loads its
    weights (they are the model's starting point; nothing else of the engine's state was saved)."""
    source = resume_source(c)
    if source is not None and checkpoint.is_model_only(source):
        c = checkpoint.model_only_config(c, source)
    return c, finetuning_settings(c)


@dataclass
class MemoryProbe:
    """Where peak-memory measurement started and what the estimate predicted (bytes per rank)."""

    baseline: Any
    estimate: Any  # estimate.compare.RunMemoryEstimate, or None for an unknown model shape
    setup_peaks: tuple[int, int] = (0, 0)  # this rank's (gained, whole-process) peak once the model was set up

    def mark_setup_done(self) -> None:
        """Model built, loaded and sharded, optimizer ready: the peak so far is the setup peak."""
        from shardtune.estimate.measure import measured_peak_memory_bytes

        self.setup_peaks = (measured_peak_memory_bytes(self.baseline), measured_peak_memory_bytes())

    def per_rank(self, engine: Engine) -> dict[str, list[int]]:
        """Every rank's measurements, by train_results.json key (one reduction)."""
        from shardtune.estimate.measure import host_peak_bytes, measured_peak_memory_bytes

        mine = {"peak_memory_bytes_per_rank": measured_peak_memory_bytes(self.baseline),
                "peak_process_memory_bytes_per_rank": measured_peak_memory_bytes(),
                "peak_setup_memory_bytes_per_rank": self.setup_peaks[0],
                "peak_setup_process_memory_bytes_per_rank": self.setup_peaks[1],
                "peak_host_memory_bytes_per_rank": host_peak_bytes(),
                "weights_bytes_read_per_rank": engine.weights_bytes_read}
        table = torch.zeros(len(mine), engine.world_size, dtype=torch.float64, device=engine.device)
        table[:, engine.rank] = torch.tensor([float(v) for v in mine.values()], dtype=torch.float64)
        summed = engine.all_reduce_sum(table).tolist()
        return {key: [int(v) for v in row] for key, row in zip(mine, summed, strict=True)}


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def apply_tf32(tf32: bool | None) -> bool:
    """``tf32`` as the HF Trainer sets it: TF32 matmuls and cuDNN convolutions on CUDA; null keeps torch's default.
    CPU kernels never use TF32, so on a machine without CUDA nothing is changed. True when the flags were set."""
    if tf32 is None or not torch.cuda.is_available():
        return False
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    return True


def loop_settings(c: TrainConfig, micro_batches: int, has_eval: bool) -> LoopSettings:
    per_epoch = steps_per_epoch(micro_batches, c.gradient_accumulation_steps)
    eval_on = has_eval and (c.do_eval or c.eval_strategy != "no")
    return LoopSettings(
        total_steps=total_training_steps(per_epoch, c.num_train_epochs, c.max_steps),
        steps_per_epoch=per_epoch,
        gradient_accumulation_steps=c.gradient_accumulation_steps,
        max_grad_norm=c.max_grad_norm,
        logging_steps=c.logging_steps,
        logging_first_step=c.logging_first_step,
        save_steps=c.save_steps if c.save_strategy == "steps" else None,
        save_each_epoch=c.save_strategy == "epoch",
        eval_steps=(c.eval_steps or c.logging_steps) if eval_on and c.eval_strategy == "steps" else None,
        eval_each_epoch=eval_on and c.eval_strategy == "epoch",
        loss_chunk_size=c.loss_chunk_size,
        label_smoothing=c.label_smoothing_factor,
        token_weighting=token_weighting(c),
    )


def choose_experts_implementation(engine: Engine) -> None:
    """How fused MoE experts compute, decided from the dtype their weights have in forward (model/moe.py)."""
    from shardtune.model.moe import apply_experts_implementation, fused_expert_parameters

    model = engine.unwrapped_model()
    names = fused_expert_parameters(model)
    if not names:
        return
    stored = dict(model.named_parameters()).get(names[0])
    dtype = engine.forward_weight_dtype(stored.dtype if stored is not None else torch.float32)
    line = apply_experts_implementation(model, engine.device.type, str(dtype).removeprefix("torch."))
    if line and engine.is_main:
        print(f"[shardtune] {line}", flush=True)


def keep_long_row_weights_trained(model: torch.nn.Module, is_main: bool) -> None:
    """Weights only long rows reach get zero gradients on short ones, so every rank reduces the same tensors."""
    from shardtune.model.length_dependent import keep_length_dependent_in_graph

    names = keep_length_dependent_in_graph(model)
    if names and is_main:
        print(f"[shardtune] {len(names)} modules reach the loss only on long rows (e.g. {names[0]}): on shorter "
              "micro-batches their weights get zero gradients, so every rank reduces the same tensors", flush=True)


def router_aux_setting(model: torch.nn.Module, c: TrainConfig, is_main: bool) -> float | None:
    """The router auxiliary loss coefficient training adds (MoE models), said in the run log."""
    from shardtune.model.moe import has_router_aux_loss, preference_aux_loss_problem, router_aux_loss_coef

    model_config = getattr(model, "config", None)
    coef = router_aux_loss_coef(model_config, c.moe_aux_loss_coef)
    if coef is not None and c.stage in ("dpo", "kto", "rm", "grpo"):
        raise ConfigError(preference_aux_loss_problem(coef, c.stage))
    if is_main and coef is not None:
        print(f"[shardtune] mixture of experts: loss = LM loss + {coef:g} x router aux_loss (logged as aux_loss)",
              flush=True)
    elif is_main and c.moe_aux_loss_coef and not has_router_aux_loss(model_config):
        print(f"[shardtune] moe_aux_loss_coef ({c.moe_aux_loss_coef:g}): this model has no router auxiliary loss "
              "(no router_aux_loss_coef in its config); nothing is added", flush=True)
    return coef


def start_state(engine: Engine, c: TrainConfig, output_dir: Path, objective: object = None) -> TrainState:
    """Fresh state, or the state of the checkpoint to resume (explicit, else the latest complete one), the
    objective's own included."""
    if engine.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        if c.overwrite_output_dir:
            clear_previous_run(output_dir)
        (output_dir / RESOLVED_CONFIG_FILE).write_text(json.dumps(config_to_dict(c), indent=2))
    engine.barrier()
    source = checkpoint.agreed_resume_source(engine, c, output_dir)
    if source is None:
        return TrainState()
    if engine.is_main:
        restart = (": it holds the model only (save_only_model), so the optimizer state starts afresh"
                   if checkpoint.is_model_only(source) else "")
        print(f"[shardtune] resuming from {source}{restart}", flush=True)
    return checkpoint.load_checkpoint(engine, source, objective)


# A final model's weight files as shardtune (through transformers / peft) saves them.
SAVED_WEIGHTS = ("adapter_config.json", "adapter_model.safetensors", "model.safetensors",
                 "model.safetensors.index.json", "model-*-of-*.safetensors")


def clear_previous_run(output_dir: Path) -> None:
    """overwrite_output_dir: drop our own logs and checkpoints so a later auto-resume cannot pick them up, and the
    final model of an earlier shardtune run there (its shardtune_config.json says it was one): a LoRA adapter left
    beside a full model's weights would make the folder neither (and fail the saved-weights check)."""
    import shutil

    if (output_dir / RESOLVED_CONFIG_FILE).is_file():
        for pattern in SAVED_WEIGHTS:
            for old_weights in output_dir.glob(pattern):
                old_weights.unlink(missing_ok=True)
    (output_dir / LOG_FILE).unlink(missing_ok=True)
    (output_dir / RESULTS_FILE).unlink(missing_ok=True)
    for old_log in rank_log_path(output_dir, 0).parent.glob("rank_*.jsonl"):
        old_log.unlink(missing_ok=True)
    for old in checkpoint_folders(output_dir):
        if is_shardtune_checkpoint(old):  # never another trainer's folder of the same name
            shutil.rmtree(old, ignore_errors=True)


def memory_results(per_rank: dict[str, list[int]], estimate: Any, announce: bool) -> dict[str, Any]:
    """Measured peaks per rank beside the estimate of the same things; the comparison is printed."""
    from shardtune.estimate.compare import compare_run_memory

    fields, line = compare_run_memory(estimate, per_rank["peak_memory_bytes_per_rank"],
                                      per_rank["peak_setup_memory_bytes_per_rank"])
    if announce and line:
        print(line, flush=True)
    return {**per_rank, **fields}


def save_servable(output_dir: Path, tokenizer: Any, c: TrainConfig) -> None:
    """The tokenizer beside the final model, and the folder made ready to serve (dtype, chat template, stop token);
    the run's own tokenizer object is left as it was."""
    from shardtune.export.serving import ServingSettings, finish_servable
    from shardtune.model.load import load_tokenizer

    tokenizer.save_pretrained(output_dir)
    settings = ServingSettings(None if c.stage == "pt" else c.template, c.model_name_or_path or "",
                               c.default_system, c.enable_thinking, c.tool_format, c.replace_eos, c.save_dtype)
    for note in finish_servable(output_dir, load_tokenizer(str(output_dir), trust_remote_code=c.trust_remote_code),
                                settings):
        print(f"[shardtune] saved model: {note}", flush=True)


def finish_run(engine: Engine, tokenizer: Any, c: TrainConfig, output_dir: Path, state: TrainState,
               hooks: RunHooks, memory: MemoryProbe | None = None) -> dict[str, Any]:
    """Save the final model and tokenizer, evaluate, and write train_results.json."""
    runtime = time.perf_counter() - hooks.reporter.start_time
    engine.save_model(output_dir)
    results: dict[str, Any] = {
        "run_name": run_name(c, output_dir),
        "epoch": round(state.epoch, 4),
        "global_step": state.global_step,
        "train_loss": sum(hooks.train_losses) / max(len(hooks.train_losses), 1),
        "final_loss": hooks.train_losses[-1] if hooks.train_losses else None,
        "train_runtime": round(runtime, 3),
        "train_tokens": state.tokens_seen,
        "train_tokens_per_second": round(state.tokens_seen / max(runtime, 1e-9), 2),
        "train_steps_per_second": round(len(hooks.train_losses) / max(runtime, 1e-9), 4),
        "engine": engine.name,
        "attn_implementation": c.attn_implementation,
        "world_size": engine.world_size,
        "throughput": hooks.meter.summary(),
        "trainable_parameter_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in engine.iter_trainable()}),
    }
    if engine.sequence is not None:
        results["sequence_parallel"] = {"size": engine.sequence.size, "mode": engine.sequence.mode,
                                        "data_parallel_size": engine.data_parallel_size}
    experts = engine.expert_parallel_report(state.global_step)
    if experts is not None:
        results["expert_parallel"] = experts
    if hooks.eval_loader is not None:
        results.update(hooks.eval_metrics())
    if state.input_tokens_seen(c.include_num_input_tokens_seen) is not None:
        results["num_input_tokens_seen"] = state.input_tokens_seen(c.include_num_input_tokens_seen)
    profiled = hooks.profile.finish() if hooks.profile is not None else None
    if profiled is not None:
        results["profile"] = profiled
        if engine.is_main:
            print(profile_line(profiled), flush=True)
    if hooks.compiling is not None:
        results["torch_compile"] = hooks.compiling.summary()
        if engine.is_main:
            print(hooks.compiling.line(), flush=True)
    if memory is not None:
        results.update(memory_results(memory.per_rank(engine), memory.estimate, engine.is_main))
    if engine.is_main:
        save_servable(output_dir, tokenizer, c)
        (output_dir / RESULTS_FILE).write_text(json.dumps(results, indent=2))
        if c.plot_loss:
            plot_loss(output_dir)
    hooks.reporter.close()
    if c.do_predict:
        from shardtune.train.predict import run_prediction

        run_prediction(engine, tokenizer, c, output_dir)
    hooks.rank_log.close(state.global_step, interrupted=False)
    engine.barrier()
    engine.close()
    return results
