"""LLaMA-Factory's v1 format (``USE_V1=1 llamafactory-cli train``), recognised so that a v1 file is refused with
that reason first, and each of its keys with the flat key that does the same in shardtune.

v1 files carry keys of their own (``model``, ``dist_config``, ``train_dataset``, ``micro_batch_size``, plugin
sections): read as LLaMA-Factory's flat format they would be a list of unknown keys with misleading "did you mean"
hints. The table below is what each v1 key is for (LLaMA-Factory's ``v1/config/*_args.py``) and the flat key or
keys shardtune reads instead; ``None`` where shardtune has no counterpart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

V1_KEYS: dict[str, str | None] = {
    "model": "model_name_or_path (a local folder)",
    "model_class": "nothing: text models (llm) need no class, and other classes (multimodal) are not trained by "
                   "shardtune",
    "init_config": None,
    "peft_config": "finetuning_type: lora with lora_rank (r), lora_alpha, lora_dropout, lora_target "
                   "(target_modules)",
    "kernel_config": "nothing: shardtune picks the attention kernel itself (attn_implementation: auto) and "
                     "computes the loss head in chunks (loss_chunk_size)",
    "quant_config": "quantization_bit (4 or 8, bitsandbytes) for QLoRA",
    "custom_chat_template": "template (a LLaMA-Factory template name, or auto: the tokenizer's own)",
    "train_dataset": "dataset (names in dataset_dir/dataset_info.json) and dataset_dir",
    "micro_batch_size": "per_device_train_batch_size",
    "global_batch_size": "gradient_accumulation_steps (global batch = per_device_train_batch_size x processes "
                         "x gradient_accumulation_steps)",
    "batching_strategy": "packing: true (packed rows) or padding_free: true (rows without padding)",
    "batching_workers": "preprocessing_num_workers",
    "enable_activation_checkpointing": "gradient_checkpointing",
    "dist_config": "fsdp (e.g. 'full_shard auto_wrap') or deepspeed (a ZeRO JSON or z0..z3)",
    "dp_size": "nothing: data parallelism is every process (NPROC_PER_NODE x NNODES)",
    "mp_replicate_size": "fsdp: hybrid_shard (replicas across nodes)",
    "mp_shard_size": "fsdp: hybrid_shard (shards within a node)",
    "dist_timeout": "ddp_timeout",
    "optim_config": "optim (adamw_torch, muon, ...) and its LLaMA-Factory keys",
    "lr_scheduler_config": "lr_scheduler_type and warmup_ratio / warmup_steps",
    "save_epochs": "save_strategy: epoch",
    "save_ckpt_as_hf": "nothing: checkpoints and the final model are saved as Hugging Face folders",
    "sample_backend": "nothing while training; `shardtune chat` generates with transformers",
}
# Keys of both formats: read as the flat format reads them once the file is rewritten.
_SHARED = {"output_dir", "cutoff_len", "learning_rate", "num_train_epochs", "max_steps", "max_grad_norm", "seed",
           "resume_from_checkpoint", "save_steps", "save_total_limit", "logging_steps", "trust_remote_code",
           "eval_dataset", "max_new_tokens", "flash_attn", "cp_size", "cp_mode", "full_determinism", "pref_loss",
           "pref_beta", "pref_ftx", "simpo_gamma", "dpo_label_smoothing", "ld_alpha"}
# Present in a v1 file, never in a flat one: what marks the format.
_MARKERS = set(V1_KEYS) - {"model"}


def v1_keys(values: Mapping[str, Any]) -> list[str]:
    """The keys of ``values`` that only LLaMA-Factory's v1 format has; empty for a flat file."""
    if not _MARKERS & set(values):
        return []
    return [key for key in values if key in V1_KEYS]


def v1_format_problem(source: str, keys: list[str]) -> str:
    return (f"{source}: this is LLaMA-Factory's v1 format (run with USE_V1=1; its keys {', '.join(keys)}); "
            "shardtune reads LLaMA-Factory's flat format: rewrite these keys as named below "
            "(docs/from-llamafactory.md, 'The v1 format')")


def v1_key_problem(key: str) -> str:
    instead = V1_KEYS[key]
    if instead is None:
        return f"LLaMA-Factory v1 key '{key}' has no counterpart in shardtune: remove it"
    if instead.startswith("nothing"):
        return f"LLaMA-Factory v1 key '{key}': {instead}; remove it"
    return f"LLaMA-Factory v1 key '{key}': use {instead}"
