"""Every config key shardtune accepts, declared once with its type, default and a one-line doc.

Names follow LLaMA-Factory and Hugging Face ``TrainingArguments`` so existing YAML files work.
This module must stay import-light: ``shardtune --help`` renders from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MODEL, FINETUNE, DATA, OUTPUT, TRAIN, ENGINE = "model", "finetuning", "data", "output", "training", "engine"
PREFERENCE, RAY, GENERATE, EXPORT, GRPO = "preference", "ray", "generation", "export", "grpo"
GROUP_TITLES = {
    MODEL: "Model",
    FINETUNE: "Fine-tuning method",
    PREFERENCE: "Preference training (stage dpo, kto, rm)",
    GRPO: "Online reinforcement learning (stage grpo; TRL's GRPOConfig names, docs/grpo.md)",
    DATA: "Data",
    OUTPUT: "Output, logging and saving",
    TRAIN: "Optimisation",
    ENGINE: "Distributed engine",
    GENERATE: "Generation (do_predict with predict_with_generate, shardtune chat and eval)",
    EXPORT: "Export (shardtune export FILE.yaml, as llamafactory-cli export reads it)",
    RAY: "Ray launch (USE_RAY=1)",
}
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")
# optim name -> the bitsandbytes class it builds (optim/build.py); a run that names one needs bitsandbytes on every rank
BITSANDBYTES_OPTIMIZERS = {"adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit",
                           "paged_adamw_32bit": "PagedAdamW32bit"}
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", *BITSANDBYTES_OPTIMIZERS, "sgd", "adafactor")
REPORT_TO = ("none", "tensorboard", "wandb", "mlflow")
# LLaMA-Factory's spellings; only bnb quantizes on load here (pre-quantized checkpoints are read from config.json).
QUANTIZATION_METHODS = ("bnb", "gptq", "awq", "aqlm", "quanto", "eetq", "hqq", "mxfp4", "fp8")


def _key(
    default: Any,
    doc: str,
    group: str,
    *,
    choices: tuple[Any, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    path: bool = False,
) -> Any:
    """Declare one config key; ``minimum``/``maximum`` bound numbers, ``choices`` enumerate values, ``path`` marks
    file and folder names (``~`` and ``$VAR`` are expanded in them)."""
    meta = {"doc": doc, "group": group, "choices": choices, "minimum": minimum, "maximum": maximum,
            "exclusive_minimum": exclusive_minimum, "path": path}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """The resolved settings of one training run (all keys optional except where validation says)."""

    # --- model ---
    model_name_or_path: str | None = _key(None, "local model directory or hub id (config.json required)", MODEL,
                                          path=True)
    trust_remote_code: bool = _key(False, "allow code from the model directory to run (off by default)", MODEL)
    attn_implementation: str = _key(
        "auto", "attention kernel passed to transformers; auto: flash_attention_2 where flash-attn and a CUDA GPU are "
                "present and the model supports it, else varlen for rows packed with sample boundaries on a CUDA GPU "
                "in bf16/fp16, else sdpa if the model supports that, else eager. varlen: packed rows by sequence "
                "offsets, no dense mask (torch's varlen flash kernel on a GPU, SDPA per sample on the CPU)", MODEL,
        choices=("auto", "sdpa", "eager", "flash_attention_2", "varlen"))
    build_tiny_model_if_missing: bool = _key(
        False, "build a random tiny LLaMA + local tokenizer at model_name_or_path if that folder does not exist and "
               "its name says it is a tiny model (contains 'tiny'); never at a hub id or into an existing folder",
        MODEL)
    adapter_name_or_path: list[str] = _key(
        [], "LoRA adapter folders, comma separated: all but the last are merged into the base, the last one "
            "continues training", MODEL, path=True)
    create_new_adapter: bool = _key(
        False, "merge every adapter of adapter_name_or_path into the base and train a new one", MODEL)
    rope_scaling: str | None = _key(None, "stretch RoPE to cutoff_len beyond the model's trained context", MODEL,
                                    choices=(None, "linear", "dynamic", "yarn", "llama3"))
    quantization_method: str = _key("bnb", "how quantization_bit quantizes on load (bitsandbytes only)", MODEL,
                                    choices=QUANTIZATION_METHODS)
    quantization_type: str = _key("nf4", "4-bit data type of bitsandbytes", MODEL, choices=("nf4", "fp4"))
    double_quantization: bool = _key(True, "4-bit: quantize the quantization constants too (bitsandbytes)",
                                     MODEL)
    add_tokens: list[str] = _key([], "ordinary tokens added to the tokenizer, comma separated (implies resize_vocab)",
                                 MODEL)
    add_special_tokens: list[str] = _key(
        [], "special tokens added to the tokenizer, comma separated (implies resize_vocab; new_special_tokens is "
            "LLaMA-Factory's older name)", MODEL)
    resize_vocab: bool = _key(
        False, "grow the embedding and output layer to the tokenizer (rows padded to a multiple of 64, new rows the "
               "mean of the old plus noise); LoRA then trains and saves both layers in full", MODEL)
    enable_liger_kernel: bool = _key(
        False, "replace the model's RMSNorm, RoPE and gated MLP with Liger's Triton kernels (liger-kernel, CUDA GPU); "
               "the loss stays shardtune's (Liger's fused linear cross-entropy is not used)", MODEL)

    # --- fine-tuning method ---
    stage: str = _key("sft", "training stage: supervised fine-tuning, pre-training, preference optimisation (dpo "
                             "with pref_loss), KTO, or a pairwise reward model (rm)", FINETUNE,
                      choices=("sft", "pt", "dpo", "kto", "rm", "grpo"))
    do_train: bool = _key(True, "run training (false only with do_predict: generate with the model as it is)",
                          FINETUNE)
    finetuning_type: str = _key("lora", "which parameters train (lora and oft train a peft adapter)", FINETUNE,
                                choices=("lora", "full", "freeze", "oft"))
    lora_rank: int = _key(8, "LoRA rank r", FINETUNE, minimum=1)
    lora_alpha: int | None = _key(None, "LoRA scaling alpha (default: 2 x lora_rank)", FINETUNE, minimum=1)
    lora_dropout: float = _key(0.0, "dropout on the LoRA path", FINETUNE, minimum=0, maximum=1)
    lora_target: list[str] = _key(["all"], "module names to adapt, comma separated, or 'all' linear layers",
                                  FINETUNE)
    oft_rank: int = _key(0, "OFT: rotation blocks per adapted layer (r); 0: in_features / oft_block_size. Set "
                            "this or oft_block_size, not both", FINETUNE, minimum=0)
    oft_block_size: int = _key(32, "OFT: size of each orthogonal block, a divisor of every target's in_features; "
                                   "0: in_features / oft_rank", FINETUNE, minimum=0)
    oft_target: list[str] = _key(["all"], "OFT: module names to adapt, comma separated, or 'all' linear layers",
                                 FINETUNE)
    module_dropout: float = _key(0.0, "OFT: multiplicative dropout that swaps whole rotation blocks for the identity "
                                      "while training", FINETUNE, minimum=0, maximum=1)
    freeze_trainable_layers: int = _key(
        2, "freeze: train the last N decoder layers (negative: the first -N)", FINETUNE)
    freeze_trainable_modules: list[str] = _key(
        ["all"], "freeze: module names inside the trainable layers, or 'all'", FINETUNE)
    use_llama_pro: bool = _key(False, "freeze / lora: train only the blocks a LLaMA-Pro expansion added (every "
                               "(layers / freeze_trainable_layers)-th layer; `shardtune expand-model` adds them)",
                               FINETUNE)
    mixture_of_depths: str | None = _key(None, "full: mixture of depths, every second decoder layer sees only "
                                               "the top 12.5% of a row's tokens by a learned router; 'convert' "
                                               "adds routers to a checkpoint, 'load' trains a routed one",
                                         FINETUNE, choices=(None, "convert", "load"))
    freeze_vision_tower: bool = _key(True, "image-text models: do not train the vision tower (LoRA leaves it "
                                           "unadapted)", FINETUNE)
    freeze_multi_modal_projector: bool = _key(True, "image-text models: do not train the projector between the "
                                                    "vision tower and the language model", FINETUNE)
    freeze_language_model: bool = _key(False, "image-text models: do not train the language model", FINETUNE)
    quantization_bit: int | None = _key(None, "load the base model in 4 or 8 bits (bitsandbytes, CUDA only)",
                                        FINETUNE, choices=(4, 8, None))

    # --- preference training (LLaMA-Factory's names) ---
    pref_beta: float = _key(0.1, "dpo/kto: beta, the strength of the pull towards the reference model (SimPO: the "
                                 "reward scale; IPO: tau)", PREFERENCE, minimum=0, exclusive_minimum=True)
    pref_loss: str = _key("sigmoid", "dpo: the loss; sigmoid (DPO), hinge, ipo, orpo and simpo (the last two use no "
                                     "reference model)", PREFERENCE,
                          choices=("sigmoid", "hinge", "ipo", "orpo", "simpo"))
    pref_ftx: float = _key(0.0, "dpo: add this times the chosen answer's average negative log-likelihood (an SFT term)",
                           PREFERENCE, minimum=0)
    simpo_gamma: float = _key(0.5, "dpo with pref_loss simpo: the target reward margin gamma", PREFERENCE)
    dpo_label_smoothing: float = _key(0.0, "dpo with pref_loss sigmoid: the assumed share of flipped preference "
                                           "labels (conservative DPO)", PREFERENCE, minimum=0, maximum=0.5)
    kto_chosen_weight: float = _key(1.0, "kto: weight of the desirable answers' loss", PREFERENCE, minimum=0)
    kto_rejected_weight: float = _key(1.0, "kto: weight of the undesirable answers' loss", PREFERENCE, minimum=0)
    precompute_ref_log_probs: bool = _key(
        False, "dpo/kto: score the data with the reference once before training and keep only those numbers, so no "
               "reference sits beside the policy (full fine-tuning: no frozen copy, so sharded engines work too)",
        PREFERENCE)
    ref_model: str | None = _key(None, "dpo/kto/use_asft_loss: a separate reference model folder (default: the "
                                       "model being trained as loaded: LoRA with its adapters off, full a frozen "
                                       "copy)", PREFERENCE, path=True)
    ref_model_adapters: str | None = _key(None, "dpo/kto/use_asft_loss: LoRA adapters merged into ref_model "
                                                "(comma-separated; not under ZeRO-3/FSDP)", PREFERENCE, path=True)
    ref_model_quantization_bit: int | None = _key(None, "dpo/kto/use_asft_loss: load ref_model in 4 or 8 bits "
                                                        "(bitsandbytes: a CUDA GPU; not under ZeRO-3/FSDP)", PREFERENCE,
                                                  choices=(4, 8, None))
    # --- online RL (stage grpo; TRL's names; rules in config/grpo.py) ---
    reward_funcs: list[str] = _key([], "grpo: reward functions as module:function (or a built-in: answer_match, "
                                       "format_match), comma separated", GRPO)
    reward_weights: list[str] | None = _key(None, "grpo: one weight per reward function (default: 1 each)", GRPO)
    reward_format_regex: str | None = _key(None, "grpo: the regular expression the built-in format_match reward "
                                                 "wants the whole completion to match", GRPO)
    num_generations: int = _key(8, "grpo: completions sampled per prompt (a group); must divide "
                                   "per_device_train_batch_size, which counts completions", GRPO, minimum=2)
    max_completion_length: int = _key(256, "grpo: most tokens generated per completion", GRPO, minimum=1)
    beta: float = _key(0.0, "grpo: weight of the KL to the reference model (0: no reference is loaded)", GRPO,
                       minimum=0)
    epsilon: float = _key(0.2, "grpo: the ratio's lower clip, 1 - epsilon (and its upper one without "
                               "epsilon_high)", GRPO, minimum=0, maximum=1, exclusive_minimum=True)
    epsilon_high: float | None = _key(None, "grpo: the ratio's upper clip, 1 + epsilon_high (DAPO: 0.28)", GRPO,
                                      minimum=0, exclusive_minimum=True)
    loss_type: str = _key("dapo", "grpo: per-token loss over the batch's tokens (dapo), per-sequence means (grpo), "
                                  "over rows x max_completion_length (dr_grpo), or grpo's with one importance ratio "
                                  "per sequence (gspo)", GRPO, choices=("grpo", "dapo", "dr_grpo", "gspo"))
    scale_rewards: str = _key("group", "grpo: divide advantages by the group's reward std, the batch's, or not",
                              GRPO, choices=("group", "batch", "none"))
    num_iterations: int = _key(1, "grpo: optimizer steps per batch of rollouts (mu; > 1 reuses them)", GRPO,
                               minimum=1)
    mask_truncated_completions: bool = _key(False, "grpo: truncated completions count for nothing in the loss", GRPO)
    use_bias_correction_kl: bool = _key(True, "grpo: the KL term times the importance ratio (TRL's default)", GRPO)
    rollout_backend: str = _key("transformers", "grpo: the policy generates (transformers) or vLLM, its weights "
                                "streamed after each step (GPU; vllm_protocol_cpu: that protocol's CPU test double)",
                                GRPO, choices=("transformers", "vllm", "vllm_protocol_cpu"))
    vllm_importance_sampling_correction: bool = _key(True, "grpo: weigh the loss by the trainer's over the sampler's "
                                                     "probability, for a generator with weights of its own", GRPO)
    vllm_importance_sampling_mode: str = _key("sequence_mask", "grpo: that ratio per token or per completion, "
                                              "clamped to [clip_min, clip_max] or zeroed outside", GRPO,
                                              choices=("token_truncate", "token_mask", "sequence_truncate",
                                                       "sequence_mask"))
    vllm_importance_sampling_clip_max: float | None = _key(3.0, "grpo: that ratio's upper bound", GRPO, minimum=0,
                                                           exclusive_minimum=True)
    vllm_importance_sampling_clip_min: float | None = _key(None, "grpo: that ratio's lower bound", GRPO, minimum=0)
    use_dora: bool = _key(False, "LoRA: weight-decomposed LoRA (DoRA; a trained magnitude per output row)", FINETUNE)
    use_rslora: bool = _key(False, "LoRA: rank-stabilised scaling lora_alpha / sqrt(lora_rank)", FINETUNE)
    pissa_init: bool = _key(False, "LoRA: initialise from the principal singular vectors of each weight (PiSSA)",
                            FINETUNE)
    pissa_iter: int = _key(16, "PiSSA: fast-SVD iterations (-1: exact SVD)", FINETUNE, minimum=-1)
    pissa_convert: bool = _key(
        False, "PiSSA: also save the adapter converted to a plain LoRA of the original model (pissa_converted/)",
        FINETUNE)
    loraplus_lr_ratio: float | None = _key(
        None, "LoRA+: lora_B matrices (and 1-D adapter weights) learn at learning_rate x this ratio", FINETUNE,
        minimum=0, exclusive_minimum=True)
    loraplus_lr_embedding: float = _key(1e-6, "LoRA+: learning rate of lora_embedding_B matrices", FINETUNE, minimum=0)
    additional_target: list[str] | None = _key(
        None, "LoRA: modules (e.g. embed_tokens,lm_head) trained in full beside the adapter and saved with it",
        FINETUNE)

    # --- data ---
    dataset: list[str] = _key([], "dataset names from dataset_info.json, comma separated", DATA)
    dataset_dir: str = _key("data", "folder holding dataset_info.json and the data files", DATA, path=True)
    template: str = _key("default", "chat template under LLaMA-Factory's name (default, empty, alpaca, vicuna, chatml, "
                         "llama2, llama3, llama4, mistral, qwen, qwen3, qwen3_nothink, qwen3_5, qwen3_5_nothink, "
                         "qwen2_vl, qwen3_vl, qwen3_vl_nothink, gemma, gemma3, gemma4, phi, phi4, deepseek, deepseek3, "
                         "deepseekr1, glm4, glm4_moe, yi, cohere, intern2, gpt_oss, zephyr) or auto (the tokenizer's "
                         "own)", DATA)
    default_system: str | None = _key(None, "system prompt for samples without one (replaces the template's default)",
                                      DATA)
    enable_thinking: bool = _key(True, "reasoning templates (qwen3, qwen3_5, qwen3_vl, glm4_moe, gemma4, deepseekr1): "
                                 "train the think block; false masks an empty one", DATA)
    tool_format: str | None = _key(None, "tool-call format overriding the template's own (qwen, qwen3_5, llama3, "
                                   "mistral, glm4, glm4_moe: each writes its family's turn markers, so pair it with "
                                   "that layout)", DATA,
                                   choices=("qwen", "qwen3_5", "llama3", "mistral", "glm4", "glm4_moe", None))
    cutoff_len: int = _key(1024, "maximum tokens per training sequence", DATA, minimum=2)
    max_samples: int | None = _key(None, "use at most this many samples per dataset", DATA, minimum=1)
    val_size: float = _key(0.0, "held-out eval split: a fraction (< 1) or a sample count", DATA, minimum=0)
    packing: bool | None = _key(None, "pack several samples per sequence (default: on for pt, off for sft)", DATA)
    padding_free: bool | None = _key(
        None, "unpacked rows: put each micro-batch's samples into as few rows as hold them (kept apart as packed rows "
              "are; same samples, same loss) instead of padding each to the longest, where packing keeps samples "
              "apart (sft, pt; not with the MoE router loss); null: on the CPU and under flash_attention_2 or varlen "
              "(sequence offsets), "
              "off on a GPU under sdpa/eager, whose causal kernel a dense block mask would replace", DATA)
    micro_batch_tokens: int | None = _key(
        None, "token budget of each training micro-batch, in place of per_device_train_batch_size samples: as many "
              "samples as fit, in the shuffled order, counting padded slots (longest x samples) or, with padding-free "
              "rows, their tokens, then put in one row (LLaMA-Factory v1's dynamic_batching, dynamic_padding_free); "
              "at least cutoff_len; sft and pt", DATA, minimum=1)
    train_on_prompt: bool = _key(False, "compute the loss on prompt tokens too", DATA)
    group_by_length: bool = _key(False, "batch samples of similar length together (less padding, unpacked)",
                                 DATA)
    preprocessing_num_workers: int | None = _key(None, "processes used to tokenise the data", DATA, minimum=1)
    overwrite_cache: bool = _key(False, "re-tokenise instead of reusing the datasets cache or tokenized_path", DATA)
    eval_dataset: list[str] = _key([], "dataset names evaluated on (comma separated), instead of a val_size hold-out",
                                   DATA)
    mix_strategy: str = _key("concat", "how several datasets mix: concatenated or interleaved by interleave_probs "
                             "until the first (under) or every dataset (over, repeating) runs out, or each once",
                             DATA, choices=("concat", "interleave_under", "interleave_over", "interleave_once"))
    interleave_probs: list[str] = _key([], "interleave: probability of drawing from each dataset, comma separated, "
                                       "summing to 1 (default: equal)", DATA)
    mask_history: bool = _key(False, "train only on the last turn's answer; earlier turns are context", DATA)
    excess_length_strategy: str = _key(
        "truncate", "a sft or preference sample longer than cutoff_len: truncate keeps its prompt whole and cuts its "
                    "answers (dropped only when the prompt leaves no room for an answer token), drop drops it; the "
                    "run logs how many were cut and dropped (axolotl's key)", DATA, choices=("truncate", "drop"))
    neat_packing: bool = _key(False, "pack sft samples without attention between them (turns packing on; shardtune's "
                              "sft packing is always neat)", DATA)
    preprocessing_batch_size: int = _key(1000, "records per batch of the preprocessing map calls", DATA, minimum=1)
    streaming: bool = _key(False, "read, shuffle and tokenise the data on the fly instead of up front (needs "
                           "max_steps; val_size must be a count)", DATA)
    buffer_size: int = _key(16384, "streaming: records in the shuffle buffer (1 keeps the file order)", DATA,
                            minimum=1)
    image_max_pixels: int = _key(768 * 768, "images: the most pixels an image keeps (larger ones are scaled down, "
                                 "aspect ratio kept; each merged patch is one token)", DATA, minimum=1)
    image_min_pixels: int = _key(32 * 32, "images: the fewest pixels an image keeps (smaller ones are scaled up)",
                                 DATA, minimum=1)
    tokenized_path: str | None = _key(
        None, "folder for the tokenised datasets: built by one rank once, then loaded by later runs and ranks", DATA,
        path=True)

    # --- output ---
    output_dir: str | None = _key(None, "where checkpoints, logs and the final model go", OUTPUT, path=True)
    overwrite_output_dir: bool = _key(False, "start afresh in a non-empty output_dir", OUTPUT)
    logging_steps: int = _key(10, "log every N optimizer steps", OUTPUT, minimum=1)
    logging_first_step: bool = _key(False, "log the first optimizer step too", OUTPUT)
    run_name: str | None = _key(None, "name of the run in train_results.json and trackers (default: output_dir's "
                                      "name)", OUTPUT)
    logging_dir: str | None = _key(None, "tensorboard folder (default: output_dir/runs)", OUTPUT, path=True)
    save_strategy: str = _key("steps", "when to write checkpoints", OUTPUT, choices=("no", "steps", "epoch"))
    save_steps: int = _key(500, "checkpoint every N optimizer steps (save_strategy steps)", OUTPUT, minimum=1)
    save_total_limit: int | None = _key(None, "keep at most N checkpoints (oldest deleted)", OUTPUT, minimum=1)
    save_only_model: bool = _key(
        False, "checkpoints hold the model only (no optimizer/scheduler state; a resume restarts the optimizer)",
        OUTPUT)
    async_save: bool = _key(
        False, "checkpoints are copied into host memory and written by a background thread while training goes on "
               "(one checkpoint per rank held at most; docs/checkpoints.md)", OUTPUT)
    plot_loss: bool = _key(False, "write training_loss.png at the end", OUTPUT)
    save_dtype: str = _key("auto", "dtype of the saved full model (final output, export, merged LoRA); auto: the "
                                   "base checkpoint's dtype from its config.json", OUTPUT,
                           choices=("auto", "float32", "bfloat16", "float16"))
    replace_eos: bool = _key(True, "the saved tokenizer's eos_token and generation_config.json's eos_token_id become "
                                   "the template's stop token (e.g. <|im_end|>), so a served model stops", OUTPUT)
    report_to: list[str] = _key(["none"], "experiment trackers rank 0 writes to: none, tensorboard, wandb, mlflow "
                                          "(all: tensorboard); wandb and mlflow need their extras", OUTPUT)
    resume_from_checkpoint: str | None = _key(None, "checkpoint folder to resume from", OUTPUT, path=True)
    throughput_warmup_steps: int = _key(
        1, "first optimizer steps left out of the throughput figures in train_results.json", OUTPUT, minimum=0)
    profile_steps: int = _key(
        0, "run this many optimizer steps (after the first 2) under torch.profiler: train_results.json's profile "
           "gives the accelerator's busy fraction, host syncs per step and the operators with the most CPU time; "
           "those steps are left out of the throughput figures; 0: off", OUTPUT, minimum=0)

    # --- optimisation ---
    per_device_train_batch_size: int = _key(1, "micro batch per process", TRAIN, minimum=1)
    per_device_eval_batch_size: int = _key(1, "eval micro batch per process", TRAIN, minimum=1)
    gradient_accumulation_steps: int = _key(1, "micro batches per optimizer step", TRAIN, minimum=1)
    learning_rate: float = _key(5e-5, "peak learning rate", TRAIN, minimum=0, exclusive_minimum=True)
    weight_decay: float = _key(0.0, "AdamW weight decay (not applied to biases and norms)", TRAIN, minimum=0)
    adam_beta1: float = _key(0.9, "Adam beta1", TRAIN, minimum=0, maximum=1)
    adam_beta2: float = _key(0.999, "Adam beta2", TRAIN, minimum=0, maximum=1)
    adam_epsilon: float = _key(1e-8, "Adam epsilon", TRAIN, minimum=0, exclusive_minimum=True)
    max_grad_norm: float = _key(1.0, "clip the global gradient norm (0 disables)", TRAIN, minimum=0)
    optim: str = _key("adamw_torch_fused", "optimizer (adamw_torch_fused: torch's fused AdamW kernel, the HF Trainer's "
                                            "default)", TRAIN, choices=OPTIMIZERS)
    # LLaMA-Factory's optimizer replacements (one process and DDP; at most one on).
    use_muon: bool = _key(False, "Muon (torch.optim.Muon) for hidden 2-D weights, AdamW for embeddings, output head, "
                                 "norms and biases; one process, DDP or FSDP2", TRAIN)
    use_adam_mini: bool = _key(False, "Adam-mini (adam-mini package): one second moment per block", TRAIN)
    use_galore: bool = _key(False, "GaLore (galore-torch): low-rank projected gradients for galore_target", TRAIN)
    galore_target: list[str] = _key(["all"], "GaLore: Linear module names, comma separated, or 'all' (not lm_head)",
                                    TRAIN)
    galore_rank: int = _key(16, "GaLore: rank of the projected gradient", TRAIN, minimum=1)
    galore_update_interval: int = _key(200, "GaLore: steps between projection updates", TRAIN, minimum=1)
    galore_scale: float = _key(2.0, "GaLore: scale of the projected update", TRAIN, minimum=0, exclusive_minimum=True)
    galore_proj_type: str = _key("std", "GaLore: projection side", TRAIN,
                                 choices=("std", "reverse_std", "right", "left", "full"))
    galore_layerwise: bool = _key(False, "GaLore: one optimizer per weight, stepped in the backward as its gradient "
                                         "completes, then freed (one process, gradient_accumulation_steps 1, no fp16; "
                                         "max_grad_norm is not applied)", TRAIN)
    use_apollo: bool = _key(False, "APOLLO (apollo-torch): AdamW with low-rank scaled updates for apollo_target",
                            TRAIN)
    apollo_target: list[str] = _key(["all"], "APOLLO: Linear module names, comma separated, or 'all' (not lm_head)",
                                    TRAIN)
    apollo_rank: int = _key(16, "APOLLO: rank of the projection", TRAIN, minimum=1)
    apollo_update_interval: int = _key(200, "APOLLO: steps between projection updates", TRAIN, minimum=1)
    apollo_scale: float = _key(32.0, "APOLLO: scale of the update", TRAIN, minimum=0, exclusive_minimum=True)
    apollo_proj: str = _key("random", "APOLLO: projection algorithm", TRAIN, choices=("svd", "random"))
    apollo_proj_type: str = _key("std", "APOLLO: projection side", TRAIN, choices=("std", "right", "left"))
    apollo_scale_type: str = _key("channel", "APOLLO: scaling granularity", TRAIN, choices=("channel", "tensor"))
    apollo_scale_front: bool = _key(False, "APOLLO: norm-growth limiter before the gradient scaling", TRAIN)
    apollo_layerwise: bool = _key(False, "APOLLO: one optimizer per weight, stepped in the backward as its gradient "
                                         "completes, then freed (one process, gradient_accumulation_steps 1, no fp16; "
                                         "max_grad_norm is not applied)", TRAIN)
    use_badam: bool = _key(False, "BAdam (badam package): AdamW on one block of decoder layers at a time, the block "
                                  "switched every badam_switch_interval steps (full fine-tuning, one process)", TRAIN)
    badam_mode: str = _key("layer", "BAdam: 'layer' (blocks of decoder layers); 'ratio' is refused", TRAIN,
                           choices=("layer", "ratio"))
    badam_start_block: int | None = _key(None, "BAdam: index of the first block trained (default: by "
                                               "badam_switch_mode)", TRAIN, minimum=0)
    badam_switch_mode: str = _key("ascending", "BAdam: order of the blocks (random: a new permutation per round, "
                                               "drawn from `seed`; fixed: the start block only)", TRAIN,
                                  choices=("ascending", "descending", "random", "fixed"))
    badam_switch_interval: int = _key(50, "BAdam: optimizer steps per block (the package gives the first block one "
                                          "step fewer); -1: never switch", TRAIN, minimum=-1)
    badam_verbose: int = _key(0, "BAdam: 1 prints each block's prefixes at each switch, 2 also every parameter "
                                 "name (rank 0)", TRAIN, minimum=0, maximum=2)
    num_train_epochs: float = _key(3.0, "passes over the data (ignored when max_steps > 0)", TRAIN, minimum=0)
    max_steps: int = _key(-1, "total optimizer steps; overrides num_train_epochs when > 0 (-1: off)", TRAIN, minimum=-1)
    lr_scheduler_type: str = _key("linear", "learning-rate schedule (transformers.get_scheduler)", TRAIN,
                                  choices=LR_SCHEDULERS)
    warmup_ratio: float = _key(0.0, "fraction of steps to warm up over", TRAIN, minimum=0, maximum=1)
    warmup_steps: int = _key(0, "warm-up steps (overrides warmup_ratio when > 0)", TRAIN, minimum=0)
    bf16: bool = _key(False, "bfloat16 autocast (CPU and GPU)", TRAIN)
    fp16: bool = _key(False, "float16 autocast with loss scaling", TRAIN)
    pure_bf16: bool = _key(False, "weights, gradients and optimizer state in bfloat16, no fp32 master copy and no "
                                  "autocast (one process and DDP)", TRAIN)
    seed: int = _key(42, "random seed for weights of new modules, data order and dropout", TRAIN, minimum=0,
                     maximum=2**32 - 1)
    gradient_checkpointing: bool = _key(False, "recompute activations in backward to save memory", TRAIN)
    gradient_checkpointing_kwargs: dict | None = _key(
        None, "arguments of torch.utils.checkpoint, e.g. {use_reentrant: false} (the default)", TRAIN)
    loss_chunk_size: int = _key(1024, "tokens per chunk of the loss's logits and their gradients (0: full logits)",
                                TRAIN, minimum=0)
    torch_compile: bool = _key(False, "compile each decoder layer with torch.compile (regional: the rest stays eager); "
                                      "local, DDP, ZeRO-0/1/2 and FSDP2", TRAIN)
    torch_compile_mode: str | None = _key(None, "torch.compile mode (null: torch's default)", TRAIN,
                                          choices=(None, "default", "reduce-overhead", "max-autotune",
                                                   "max-autotune-no-cudagraphs"))
    torch_compile_backend: str = _key("inductor", "torch.compile backend (aot_eager: traced, not code-generated; "
                                                  "for checks)", TRAIN, choices=("inductor", "aot_eager", "eager"))
    fp8: bool = _key(False, "float8 training of the Linear layers (torchao; the output head and layers whose sizes "
                            "are not multiples of 16 stay in bf16); needs bf16 and a CUDA GPU of compute capability "
                            "8.9+ (H100, L4, RTX 4090); full and freeze fine-tuning", TRAIN)
    fp8_backend: str = _key("auto", "fp8 implementation (auto: torchao, the only one shardtune uses)", TRAIN,
                            choices=("auto", "torchao", "te", "msamp"))
    fp8_enable_fsdp_float8_all_gather: bool = _key(
        False, "FSDP2 with fp8: all-gather the weights as float8 (half of bf16's bytes), their scales computed once "
               "after each optimizer step; implies fp8 (as in LLaMA-Factory)", TRAIN)
    dataloader_num_workers: int = _key(0, "data loader worker processes", TRAIN, minimum=0)
    dataloader_pin_memory: bool = _key(True, "pin the loader's batches in page-locked memory (only with CUDA)", TRAIN)
    dataloader_drop_last: bool = _key(False, "drop each rank's last incomplete micro batch", TRAIN)
    dataloader_persistent_workers: bool = _key(
        False, "keep loader workers alive between epochs (needs dataloader_num_workers > 0)", TRAIN)
    neftune_noise_alpha: float | None = _key(
        None, "NEFTune: uniform noise of alpha / sqrt(seq_len x hidden) on input embeddings while training", TRAIN,
        minimum=0, exclusive_minimum=True)
    label_smoothing_factor: float = _key(0.0, "label smoothing of the cross entropy (0: none)", TRAIN,
                                         minimum=0, maximum=1)
    use_dft_loss: bool = _key(False, "sft/pt: DFT loss, each token's cross entropy scaled by its probability (taken as "
                              "a constant), as LLaMA-Factory's use_dft_loss", TRAIN)
    use_eaft_loss: bool = _key(False, "sft/pt: EAFT loss, each token's cross entropy scaled by (entropy of its top-20 "
                               "logits / 3) ^ eaft_alpha (a constant), as LLaMA-Factory's use_eaft_loss", TRAIN)
    eaft_alpha: float = _key(1.0, "use_eaft_loss: the power of the entropy weight", TRAIN, minimum=0)
    use_asft_loss: bool = _key(False, "sft/pt: ASFT loss, the DFT loss plus asft_alpha x each token's KL divergence "
                               "of the policy from the model as loaded (a frozen reference, or ref_model), as "
                               "LLaMA-Factory's use_asft_loss", TRAIN)
    asft_alpha: float = _key(0.1, "use_asft_loss: the weight of the KL term", TRAIN, minimum=0)
    moe_aux_loss_coef: float | None = _key(
        None, "mixture-of-experts: coefficient of the router's load-balancing loss added to the loss (null: the "
              "model's router_aux_loss_coef; 0: none)", TRAIN, minimum=0)
    tf32: bool | None = _key(None, "allow TF32 matmuls and convolutions on CUDA (no effect on CPU; null: torch's "
                             "default)", TRAIN)
    include_num_input_tokens_seen: str = _key(
        "no", "record num_input_tokens_seen in the logs: all (padding included), non_padding, no (true: all)", TRAIN,
        choices=("all", "non_padding", "no"))
    do_eval: bool = _key(False, "evaluate on the val_size split", TRAIN)
    eval_strategy: str = _key("no", "when to evaluate", TRAIN, choices=("no", "steps", "epoch"))
    eval_steps: int | None = _key(None, "evaluate every N steps (default: logging_steps)", TRAIN, minimum=1)

    # --- engine ---
    engine: str = _key("manual", "auto: pick the fastest engine the memory estimate says fits, at launch", ENGINE,
                       choices=("manual", "auto"))
    deepspeed: str | dict | None = _key(None, "DeepSpeed config: JSON path, inline mapping or preset name", ENGINE,
                                        path=True)
    fsdp: str | list | bool | None = _key(None, "FSDP options, e.g. 'full_shard auto_wrap'", ENGINE)
    fsdp_config: str | dict | None = _key(None, "FSDP settings: mapping or JSON/YAML path", ENGINE, path=True)
    ddp_timeout: int = _key(1800, "seconds a collective may wait before the job fails", ENGINE, minimum=1)
    ddp_find_unused_parameters: bool | None = _key(
        None, "DDP unused-parameter search (default: off, LoRA included)", ENGINE)
    sequence_parallel_size: int = _key(
        1, "split each sequence over this many ranks (long context); data parallelism runs over world / N "
           "(LLaMA-Factory: cp_size; axolotl: context_parallel_size)", ENGINE, minimum=1)
    expert_parallel_size: int = _key(
        1, "split each mixture-of-experts layer's experts over this many ranks (FSDP2); tokens travel to their "
           "experts by all-to-all; a divisor of the world size and of the expert count (LLaMA-Factory v1: "
           "dist_config.ep_size; torchtitan: expert_parallel_degree)", ENGINE, minimum=1)
    sequence_parallel_mode: str = _key(
        "auto", "how the ranks of a sequence exchange attention inputs: ulysses (all-to-all of heads; the heads and "
                "KV heads must divide by N), allgather (every rank gathers K and V; any head count), auto: ulysses "
                "where the heads divide, else allgather", ENGINE, choices=("auto", "ulysses", "allgather"))

    # --- generation (LLaMA-Factory's generating_args; do_predict, chat, eval) ---
    do_predict: bool = _key(False, "generate answers for the eval data (eval_dataset, the val_size hold-out, or "
                                   "dataset when do_train is false) after training: generated_predictions.jsonl and "
                                   "predict_results.json (needs predict_with_generate)", GENERATE)
    predict_with_generate: bool = _key(False, "do_predict generates with model.generate and scores the answers "
                                              "(BLEU-4, ROUGE-1/2/L, exact match)", GENERATE)
    do_sample: bool = _key(True, "sample (false: greedy, reproducible across engines and process counts)", GENERATE)
    temperature: float = _key(0.95, "sampling temperature", GENERATE, minimum=0, exclusive_minimum=True)
    top_p: float = _key(0.7, "nucleus sampling: the smallest set of tokens whose probability reaches top_p",
                        GENERATE, minimum=0, maximum=1, exclusive_minimum=True)
    top_k: int = _key(50, "sample among the top_k most likely tokens", GENERATE, minimum=0)
    num_beams: int = _key(1, "beam search width (1: none)", GENERATE, minimum=1)
    max_new_tokens: int = _key(1024, "most tokens generated per answer", GENERATE, minimum=1)
    repetition_penalty: float = _key(1.0, "penalty on tokens already present (1.0: none)", GENERATE, minimum=0,
                                     exclusive_minimum=True)
    length_penalty: float = _key(1.0, "beam search: exponent of the length normalisation", GENERATE)
    skip_special_tokens: bool = _key(True, "leave special tokens out of the decoded answers", GENERATE)
    infer_backend: str = _key("huggingface", "generation back-end of chat and eval (transformers' generate)",
                              GENERATE, choices=("huggingface",))
    infer_dtype: str = _key("auto", "chat: dtype the model is loaded in (auto: its config.json's)", GENERATE,
                            choices=("auto", "float16", "bfloat16", "float32"))

    # --- export (read by `shardtune export FILE.yaml`; train refuses them) ---
    export_dir: str | None = _key(None, "folder the export writes (refused when it is or contains the model, or "
                                        "holds other files)", EXPORT, path=True)
    export_size: int = _key(5, "largest safetensors shard of the export, in GB", EXPORT, minimum=1)
    export_device: str = _key("cpu", "device that merges the weights (auto: the GPU when there is one)", EXPORT,
                              choices=("cpu", "auto"))
    export_legacy_format: bool = _key(False, "false: safetensors (the only format shardtune writes)", EXPORT)

    # --- ray (read only under USE_RAY=1; LLaMA-Factory's names) ---
    ray_num_workers: int = _key(1, "USE_RAY=1: rank workers Ray Train starts, one device each (the world size)", RAY,
                                minimum=1)
    resources_per_worker: dict | None = _key(
        None, "USE_RAY=1: Ray resources each worker reserves, e.g. {GPU: 1, CPU: 4} (default: {GPU: 1} when the "
              "Ray cluster has GPUs, else {CPU: 1}); GPU workers use NCCL, CPU workers gloo", RAY)
    placement_strategy: str = _key("PACK", "USE_RAY=1: how Ray places the workers on its nodes", RAY,
                                   choices=PLACEMENT_STRATEGIES)
    ray_storage_path: str = _key(
        "./saves", "USE_RAY=1: where Ray Train keeps its run state (a folder every Ray node reaches); shardtune's "
                   "checkpoints, logs and model stay in output_dir", RAY, path=True)
    ray_run_name: str | None = _key(None, "USE_RAY=1: Ray Train's run name under ray_storage_path (default: "
                                          "output_dir's name)", RAY)
    ray_init_kwargs: dict | None = _key(
        None, "USE_RAY=1: arguments of ray.init, e.g. {address: auto} to join a running cluster (default: "
              "RAY_ADDRESS, else a local Ray instance)", RAY)


def config_fields() -> tuple[dataclasses.Field, ...]:
    """The declared keys, in declaration order."""
    return dataclasses.fields(TrainConfig)


def key_names() -> list[str]:
    return [f.name for f in config_fields()]
