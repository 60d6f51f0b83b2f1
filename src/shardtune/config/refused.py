"""LLaMA-Factory keys shardtune does not honour, each with the reason and what to do instead.

A file copied from LLaMA-Factory may carry keys for what shardtune does not do (multimodal models, inference and
export back-ends, preference stages, other trainers and trackers). Each is refused by name with its reason, so a
user never believes a setting took effect. Keys shardtune honours live in ``schema`` (or ``compat`` for another
spelling); a unit test keeps the three sets apart. ``docs/llamafactory.md`` lists every LLaMA-Factory key's status.
"""

from __future__ import annotations

import re


def _group(reason: str, keys: str) -> dict[str, str]:
    return dict.fromkeys(keys.split(), reason)


# Back-ends shardtune does not run. A file written for one says so in the first line of its refusal
# (``names_other_backend``): its other keys' problems would only distract.
KTRANSFORMERS_REASON = ("this file is for KTransformers (use_kt: MoE experts computed on the CPU), a back-end "
                        "shardtune does not run; its engines are DDP, FSDP and DeepSpeed: train the model with "
                        "`deepspeed:` (ZeRO-3, offload) or `fsdp:` and remove it")
KTRANSFORMERS_KEYS = """_kt_adapter_artifact_path _kt_config_handle _kt_inference_config kt_cpu_activation
    kt_expert_checkpoint_path kt_lora_expert_intermediate_size kt_lora_expert_num kt_non_expert_weight_path
    kt_use_lora_experts kt_weight_path use_kt"""
# Megatron's context_parallel_size and expert_model_parallel_size are shardtune's sequence_parallel_size and
# expert_parallel_size (config/compat.py), so they are not listed.
MEGATRON_REASON = ("this file is for Megatron-Core (LLaMA-Factory's USE_MCA=1 back-end) or Megatron Bridge: tensor "
                   "and pipeline parallelism are not in shardtune, whose engines are DDP, FSDP and "
                   "DeepSpeed (every rank holds whole layers, sharded): remove the Megatron settings and choose "
                   "`fsdp:` or `deepspeed:` (context parallelism is sequence_parallel_size, expert parallelism "
                   "expert_parallel_size)")
MEGATRON_KEYS = """use_mca use_megatron_bridge megatron_bridge_args tensor_model_parallel_size
    pipeline_model_parallel_size virtual_pipeline_model_parallel_size
    expert_tensor_parallel_size sequence_parallel use_distributed_optimizer overlap_param_gather overlap_grad_reduce
    bias_activation_fusion apply_rope_fusion moe_grouped_gemm moe_token_dispatcher_type recompute_granularity
    recompute_method recompute_num_layers mixed_precision use_packed_sequences export_hf_on_finish"""
# LLaMA-Factory's `use_v1_kernels: true` applies its v1 "auto" kernels for the device, a set defined for Ascend NPUs
# only (fused MoE, RMSNorm, RoPE, SwiGLU; v1/plugins/model_plugins/kernels/interface.py): on a CUDA GPU or a CPU it
# applies none, and that is what shardtune does on the devices it runs on.
V1_KERNELS_MEANING = ("LLaMA-Factory's automatic v1 kernels exist for Ascend NPUs only, so on CUDA GPUs and CPUs "
                      "it selects none, there as here")
OTHER_BACKEND_KEYS = frozenset((KTRANSFORMERS_KEYS + " " + MEGATRON_KEYS).split())

# Training variants of LLaMA-Factory that shardtune does not implement, each with what to use instead.
VARIANT_REASONS = {
    **_group("accuracy during evaluation (compute_accuracy) is not computed by shardtune, which reports eval_loss; "
             "remove it", "compute_accuracy"),
    **_group("early stopping is not in shardtune; pick max_steps from a run's eval_loss curve and remove it",
             "early_stopping_steps"),
    **_group("extra trainable modules beside the last layers (freeze_extra_modules) are not offered; use "
             "freeze_trainable_modules, or lora with additional_target", "freeze_extra_modules"),
}


# Values of honoured keys that name a variant shardtune does not implement: refused with the reason, not only as
# "not allowed" (load.coerce_value).
_AdEMAMIX = ("AdEMAMix is not offered; use optim: paged_adamw_8bit (bitsandbytes' paged AdamW, its state moved "
             "to CPU memory under pressure) or adamw_8bit")
_LION = "Lion is not offered; use optim: adamw_torch or adamw_8bit (or use_muon / use_adam_mini)"
REFUSED_VALUES: dict[str, dict[str, str]] = {
    "optim": {**_group(_AdEMAMIX, "paged_ademamix_8bit paged_ademamix_32bit"),
              **_group(_LION, "lion_8bit lion_32bit paged_lion_8bit paged_lion_32bit")},
}


def names_other_backend(problem: str) -> bool:
    """True when ``problem`` refuses a key that only another back-end (Megatron, KTransformers, NPU kernels) reads."""
    return any(key in OTHER_BACKEND_KEYS for key in re.findall(r"key '(\w+)'", problem))


REFUSED_REASONS: dict[str, str] = {
    **_group("video and audio inputs are not read by shardtune (images are: columns.images, image_max_pixels, "
             "image_min_pixels); remove it", "audio_sampling_rate use_audio_in_video"),
    **_group("an image setting of processors shardtune does not run this way (Gemma 3's pan-and-scan crops, Llama "
             "4's patches): Qwen images are scaled into image_max_pixels, Gemma 3 images resized to the tower's "
             "size; remove it", "crop_to_patches image_do_pan_and_scan"),
    **_group("images are read relative to dataset_dir (as LLaMA-Factory's default media_dir); move them there or "
             "give absolute paths, and remove it", "media_dir"),
    **_group("an inference setting of LLaMA-Factory's vLLM/SGLang back-ends or one shardtune's chat does not "
             "read (generation length is max_new_tokens): remove it (serve the exported model with your inference "
             "engine)",
             """max_length sglang_config sglang_lora_backend sglang_maxlen sglang_mem_fraction sglang_tp_size
             use_kv_cache vllm_config vllm_enforce_eager vllm_gpu_util vllm_max_lora_rank vllm_maxlen
             eval_num_beams"""),
    **_group("a setting of `llamafactory-cli export` that shardtune does not do (GPTQ quantization, pushing to the "
             "hub); `shardtune export` writes the merged model in safetensors: remove it",
             """export_hub_model_id export_quantization_bit export_quantization_dataset export_quantization_maxlen
             export_quantization_nsamples"""),
    **_group("a setting of `llamafactory-cli eval` (MMLU-style benchmarks); shardtune does not run benchmarks: "
             "remove it",
             "batch_size download_mode lang n_shot save_dir task task_dir eval_on_each_dataset"),
    **_group("reinforcement learning (stage ppo) and these preference options are not in shardtune yet (stages dpo, "
             "kto and rm are, see docs/config.md); remove it",
             """ld_alpha pref_bco_weight ppo_buffer_size ppo_epochs ppo_score_norm ppo_target ppo_whiten_rewards
             reward_model reward_model_adapters reward_model_quantization_bit reward_model_type"""),
    **_group("hub downloads read the hub clients' own variables instead (HF_TOKEN, HF_HOME / HF_HUB_CACHE, "
             "MODELSCOPE_CACHE; docs/data.md, 'Hub datasets'), and a revision other than the default branch is read "
             "from a folder (`hf download ID --revision REV --local-dir DIR`, then model_name_or_path: DIR): remove it",
             "cache_dir hf_hub_token model_revision ms_hub_token om_hub_token"),
    **_group("hub data is downloaded once per node before the ranks start, and once in all when HF_HOME is on a "
             "shared file system (the first process takes a lock, the others read its download): remove it",
             "data_shared_file_system"),
    **_group(KTRANSFORMERS_REASON, KTRANSFORMERS_KEYS),
    **_group(MEGATRON_REASON, MEGATRON_KEYS),
    **_group("HyperParallel is a back-end shardtune does not run; its engines are DDP, FSDP and DeepSpeed (`fsdp:` or "
             "`deepspeed:`): remove it", "use_hyper_parallel hyper_parallel_args hyper_parallel_cp_size"),
    **_group("SwanLab tracking is not supported; use report_to: tensorboard and remove it",
             """swanlab_api_key swanlab_lark_secret swanlab_lark_webhook_url swanlab_logdir swanlab_mode
             swanlab_project swanlab_run_name swanlab_workspace use_swanlab"""),
    **_group("the torch profiler is not wired into shardtune's loop; profile with `python -m torch.profiler` "
             "tooling around `shardtune.train` and remove it",
             """enable_torch_profiler profile_modules profiler_active_steps profiler_output_dir
             profiler_profile_memory profiler_record_shapes profiler_repeat profiler_wait_steps
             profiler_warmup_steps profiler_with_stack"""),
    **_group("Ray's cloud storage (s3, gs) is not wired into shardtune, whose checkpoints live in output_dir; "
             "remove it and point ray_storage_path at a folder every Ray node reaches", "ray_storage_filesystem"),
    **_group("set the launch address with the MASTER_ADDR / MASTER_PORT environment variables and remove it",
             "master_addr master_port"),
    **_group("Unsloth kernels are not used by shardtune; remove it", "use_unsloth_gc"),
    **VARIANT_REASONS,
    **_group("models load with shardtune's own device placement (sharded by the engine); remove it",
             "device_map low_cpu_mem_usage offload_folder quantization_device_map"),
    **_group("an internal or tokenizer detail of LLaMA-Factory that shardtune sets itself (the tokenizer's "
             "length from cutoff_len, the compute dtype from bf16/fp16, the attention mask from packing); remove it",
             "block_diag_attn compute_dtype model_max_length split_special_tokens upcast_lmhead_output "
             "print_param_status"),
    **_group("adapters are given by adapter_name_or_path (one or several folders); remove it", "adapter_folder"),
    **_group("tokens are added with add_tokens / add_special_tokens (new rows start as noise_init); a per-token "
             "config file is not read: remove it", "new_special_tokens_config"),
    **_group("shardtune fine-tunes the weights in model_name_or_path; random initialisation is not offered: "
             "remove it (make-tiny-model builds random test models)", "train_from_scratch"),
    **_group("the official Qwen3 template keeps only the last turn's reasoning and shardtune follows it; "
             "remove it", "preserve_thinking"),
}


# Hugging Face TrainingArguments (and common LLaMA-Factory) names that shardtune does not implement.
# Refused by name so that a user never believes a setting took effect when it did not.
UNSUPPORTED_KEYS = frozenset(
    """
    accelerator_config adafactor auto_find_batch_size average_tokens_across_devices batch_eval_metrics
    bf16_full_eval data_seed
    dataloader_prefetch_factor ddp_backend ddp_broadcast_buffers ddp_bucket_cap_mb debug disable_tqdm
    dispatch_batches eval_accumulation_steps eval_delay eval_do_concat_batches eval_on_start
    eval_use_gather_object fp16_backend fp16_full_eval fp16_opt_level
    full_determinism generation_max_length generation_num_beams
    greater_is_better half_precision_backend hub_always_push
    hub_model_id hub_private_repo hub_strategy hub_token ignore_data_skip include_for_metrics
    include_inputs_for_metrics include_tokens_per_second jit_mode_eval label_names length_column_name
    load_best_model_at_end log_level log_level_replica log_on_each_node logging_nan_inf_filter logging_strategy
    lr_scheduler_kwargs metric_for_best_model mp_parameters no_cuda optim_args optim_target_modules past_index
    per_gpu_eval_batch_size per_gpu_train_batch_size prediction_loss_only push_to_hub
    push_to_hub_model_id push_to_hub_organization push_to_hub_token ray_scope remove_unused_columns
    restore_callback_states_from_checkpoint save_on_each_node skip_memory_metrics split_batches
    torch_empty_cache_steps torchdynamo tpu_metrics_debug tpu_num_cores
    use_cpu use_ipex use_legacy_prediction_loop use_mps_device
    use_unsloth shift_attn upcast_layernorm
    """.split()
)
