"""What sequence parallelism (``sequence_parallel_size`` N > 1) needs, decided on the launching host before any rank
starts: the kernels, models and layouts it is built for (every stage splits: sft and pt in the loop's token loss,
dpo/kto/rm in train/preference_step.py and train/reward.py), the mode ``auto`` becomes, the size a DeepSpeed JSON
asks for, the dry run's line, and ``COMBINATIONS``: how every feature a user switches on combines with the split
(exact, with the test that proves it, or refused before launch). Pure: it reads config.json files, never torch (the
split itself is engines/sequence_parallel.py, which runs on the ranks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from shardtune.config.schema import TrainConfig
from shardtune.errors import ConfigError, ModelError
from shardtune.model.folder import model_config_json
from shardtune.world import WorldLayout

FIX = "set sequence_parallel_size: 1"


@dataclass(frozen=True)
class Combination:
    """How the feature ``key`` (at ``value``; None: any value but the default) combines with the split: ``exact``
    (``why`` it stays equal to one process, ``test`` the test that proves it, empty where only a GPU or a package
    this repository's tests lack could) or ``refused`` before launch (``why`` the split cannot run it, ``fix``)."""

    key: str
    kind: str
    why: str
    test: str = ""
    value: Any = None
    fix: str = FIX


EXACT, REFUSED = "exact", "refused"
_SPLIT = "tests/distributed/test_sequence_parallel.py::test_split_sequences_match_one_process"
_ROW = "tests/distributed/test_sequence_parallel_exact.py::test_split_row_gives_the_whole_rows_loss_and_gradients"
# Features that change weights or the optimizer, never which tokens a layer sees: each token's computation is the
# one-process one on its rank, and the gradient the engines sum is the whole row's (_SPLIT compares gradient norms;
# its "cell" names the matrix cell that runs the feature). Rows without a test are exact by that construction only:
# they need a GPU, a package or a model (an expanded one for use_llama_pro) the tests here lack.
_WEIGHTS = "changes weights, not which tokens a layer sees; the summed gradient is the whole row's"
_OPTIMIZER = "steps on the summed gradient, which is the whole row's (DDP; sharding engines refuse it anyway)"
_TOKENWISE = "runs token by token; the split only changes attention and the loss's normalisation"
_FIXED_ROPE = "each position's angles are fixed up front, whichever rank holds it"
_TOKEN_LOSS = "weighs each token's loss by that token's own logits, against the slice's next tokens (shift_labels)"

# Every feature of tests/schema_fuzz.py FEATURES (and a few more) against sequence_parallel_size > 1. What of a model
# or dataset the split cannot run (stateful layers, sinks, a router auxiliary loss, images) is found from their files
# by the *_problems functions below, not keyed here. The refusals of keys are made from it
# (combination_problems) and docs/long-context.md's table is generated from it (tests/unit/test_sequence_parallel_plan).
COMBINATIONS: tuple[Combination, ...] = (
    Combination("packing", EXACT, "the whole row's segment ids stay on every rank: a query sees its own sample only "
                "(stage pt: the row's earlier text, pt-packed cell)", _SPLIT),
    Combination("neat_packing", EXACT, "turns packing on, whose sft rows keep samples apart already", _SPLIT),
    Combination("padding_free", EXACT, "the micro-batch's samples become one row, split by its segment ids "
                "(padding-free cell)", _SPLIT),
    Combination("gradient_checkpointing", EXACT, "the recomputed attention runs inside the same split scope",
                _SPLIT),
    Combination("torch_compile", EXACT, "the split attention stays outside the compiled layers: one set of graphs "
                "serves every packed layout", "tests/distributed/test_sequence_parallel_compile.py::"
                "test_a_new_packed_layout_compiles_nothing_again"),
    Combination("train_on_prompt", EXACT, "changes labels only, shifted over the whole row before slicing", _ROW),
    Combination("mask_history", EXACT, "changes labels only, shifted over the whole row before slicing", _ROW),
    Combination("neftune_noise_alpha", EXACT, "the noise is scaled by the whole row's length, not the slice's "
                "(equal in scale; the draws are random)", "tests/unit/test_lf_training.py::"
                "test_neftune_under_sequence_parallelism_scales_by_the_whole_rows_length"),
    Combination("fp8", EXACT, "rows are padded to N x 16 tokens, so every slice holds a multiple of 16 (GPU only)",
                "tests/unit/test_fp8.py::test_fp8_under_sequence_parallelism_gives_every_rank_a_multiple_of_16_tokens"),
    Combination("attn_implementation", EXACT, "the split attention runs sdpa's flash backend per segment (CUDA)",
                "tests/gpu/test_sequence_parallel_gpu.py::"
                "test_segments_take_the_flash_kernel_and_equal_the_block_causal_row", value="flash_attention_2"),
    Combination("finetuning_type", EXACT, _WEIGHTS + " (full, lora and freeze run split; oft by construction)",
                _SPLIT),
    Combination("use_dora", EXACT, _WEIGHTS + " (packed-lora-variants cell)", _SPLIT),
    Combination("pissa_init", EXACT, _WEIGHTS + " (packed-pissa cell)", _SPLIT),
    Combination("use_rslora", EXACT, _WEIGHTS + " (packed-lora-variants cell)", _SPLIT),
    Combination("loraplus_lr_ratio", EXACT, _WEIGHTS + " (packed-lora-variants cell)", _SPLIT),
    Combination("use_llama_pro", EXACT, _WEIGHTS),
    Combination("resize_vocab", EXACT, _WEIGHTS + " (packed-resized cell)", _SPLIT),
    Combination("quantization_bit", EXACT, _WEIGHTS + " (bitsandbytes on a CUDA GPU)"),
    Combination("optim", EXACT, "steps on the summed gradient, which is the whole row's (AdamW and SGD run split)",
                _SPLIT),
    Combination("use_galore", EXACT, _OPTIMIZER + " (packed-galore cell)", _SPLIT),
    Combination("use_apollo", EXACT, _OPTIMIZER + " (packed-apollo cell)", _SPLIT),
    Combination("use_adam_mini", EXACT, _OPTIMIZER + " (packed-adam-mini cell)", _SPLIT),
    Combination("bf16", EXACT, _TOKENWISE + " (equal within bf16's precision: packed-bf16 cell)", _SPLIT),
    Combination("fp16", EXACT, _TOKENWISE + " (equal within fp16's precision)"),
    Combination("enable_liger_kernel", EXACT, "norms, MLP and RoPE (from the global positions) run token by token; "
                "the loss stays shardtune's (GPU only)"),
    Combination("streaming", EXACT, "the stream is dealt by data-parallel group: the ranks of a group read the same "
                "rows (streaming cell)", _SPLIT),
    Combination("val_size", EXACT, "evaluation runs the same split forward and token loss as training "
                "(packed-eval cell)", _SPLIT),
    Combination("report_to", EXACT, "reports the loss the loop computes; touches no tensor"),
    Combination("async_save", EXACT, "stages and writes the engine's own checkpoint state, which splitting the rows "
                "does not change", "tests/distributed/test_async_checkpoints.py::"
                "test_async_save_trains_like_sync_and_each_checkpoint_resumes_the_curve"),
    Combination("save_only_model", EXACT, "saves the model as the final save writes it; the split attention is "
                "detached from the saved module"),
    Combination("use_dft_loss", EXACT, _TOKEN_LOSS + " (packed-dft cell)", _SPLIT),
    Combination("use_eaft_loss", EXACT, _TOKEN_LOSS + " (packed-eaft cell)", _SPLIT),
    Combination("use_asft_loss", EXACT, _TOKEN_LOSS + "; the anchor's reference scores the same slice "
                "(packed-asft cell)", _SPLIT),
    Combination("label_smoothing_factor", EXACT, _TOKEN_LOSS + " (packed-smoothed cell)", _SPLIT),
    Combination("use_muon", EXACT, "steps on the summed gradient, which is the whole row's (packed-muon cell)",
                _SPLIT),
    Combination("rope_scaling", EXACT, _FIXED_ROPE, "tests/unit/test_sequence_parallel_plan.py::"
                "test_dynamic_rope_frequencies_depend_on_the_positions_one_forward_holds", value="linear"),
    Combination("rope_scaling", EXACT, _FIXED_ROPE, value="yarn"),
    Combination("rope_scaling", EXACT, _FIXED_ROPE, value="llama3"),
    Combination("mixture_of_depths", REFUSED, "the router keeps the top 12.5% of a whole row's tokens, and a rank "
                "holds a slice: it would rank the slice's tokens, and its chosen few would not fit the split "
                "attention's layout of N equal slices"),
    Combination("do_predict", REFUSED, "generation runs whole sequences on each rank and is not split",
                fix="predict in a run of its own with sequence_parallel_size: 1"),
    Combination("attn_implementation", REFUSED, "the split attention replaces the model's kernel", value="varlen",
                fix="use attn_implementation: sdpa or flash_attention_2"),
    Combination("rope_scaling", REFUSED, "dynamic NTK takes its RoPE frequencies from the largest position id in "
                "each forward, and a rank holds its slice's positions only (the first slice of a row past the "
                "trained context would rotate unscaled)", value="dynamic",
                fix="use rope_scaling: linear, yarn or llama3 (fixed frequencies), or sequence_parallel_size: 1"),
    Combination("expert_parallel_size", EXACT, "a slice's tokens go to their experts' ranks whichever sequence group "
                "holds them, and expert gradients are summed over every rank that sent tokens (FSDP2 and ZeRO-2's "
                "AutoEP; 2 and 4 ranks)", "tests/distributed/test_expert_sequence_parallel.py::"
                "test_split_experts_and_sequences_match_one_process"),
    Combination("use_badam", REFUSED, "BAdam steps on one process (it changes the trainable weights DDP registered "
                "at set-up), and a split runs N >= 2", fix="train on one process"),
)


def switched_on(c: TrainConfig, row: Combination) -> Any:
    """The value with which ``c`` switches ``row``'s feature on, or None."""
    value = getattr(c, row.key)
    if row.value is not None:
        return value if value == row.value else None
    return value if value not in (None, False, getattr(TrainConfig(), row.key)) else None


def refusal(c: TrainConfig, row: Combination) -> str | None:
    """The refusal's line, naming both keys and values and the fix, when ``c`` switches a refused feature on."""
    value = switched_on(c, row) if row.kind == REFUSED and c.sequence_parallel_size > 1 else None
    if value is None:
        return None
    shown = str(value).lower() if isinstance(value, bool) else value
    return f"{row.key} ({shown}) with sequence_parallel_size ({c.sequence_parallel_size}): {row.why}; {row.fix}"


def refusal_for(c: TrainConfig, key: str) -> str | None:
    """The refusal of ``key``'s value under ``c``'s split, if the table refuses it (a rank's own guard asks too)."""
    return next((line for row in COMBINATIONS if row.key == key and (line := refusal(c, row))), None)


def combination_problems(c: TrainConfig) -> list[str]:
    """Every refused feature of ``COMBINATIONS`` that ``c`` switches on, one line each."""
    return [line for row in COMBINATIONS if (line := refusal(c, row))]


def combinations_markdown() -> str:
    """``COMBINATIONS`` as docs/long-context.md's table."""
    lines = ["| key | with sequence_parallel_size > 1 | why | proved by |", "|---|---|---|---|"]
    for row in sorted(COMBINATIONS, key=lambda r: (r.kind, r.key)):
        key = f"`{row.key}: {row.value}`" if row.value is not None else f"`{row.key}`"
        why = row.why if row.kind == EXACT else f"{row.why}; {row.fix}"
        proof = f"`{row.test}`" if row.test else ("refused before launch" if row.kind == REFUSED else
                                                  "by construction (no test here)")
        lines.append(f"| {key} | {row.kind} | {why} | {proof} |")
    return "\n".join(lines) + "\n"


def head_counts(model_config: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """(attention heads, KV heads) of a config.json (a multimodal one's text model); KV heads default to the heads.
    None when the config does not say."""
    config = (model_config or {}).get("text_config") or model_config or {}
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return None
    return heads, kv_heads


def resolved_mode(mode: str, model_config: Mapping[str, Any] | None, size: int) -> str:
    """The mode the ranks run: ``auto`` is ulysses when the heads and KV heads divide by ``size``, else allgather
    (the rule of engines/sequence_parallel.py ``resolve_mode``); ``auto`` stays when the heads are not known here."""
    if mode != "auto":
        return mode
    counts = head_counts(model_config)
    if counts is None:
        return "auto"
    return "ulysses" if all(count % size == 0 for count in counts) else "allgather"


def sequence_parallel_problems(c: TrainConfig, layout: WorldLayout | None = None) -> list[str]:
    """Why this run cannot split its sequences over ``c.sequence_parallel_size`` ranks, one line each naming the key
    and the fix (empty with N = 1). ``layout``: the world's rules too (None while the world size is unknown).
    Every attention kernel splits: the split attention runs sdpa per segment, and flash_attention_2 there is sdpa's
    flash backend, FlashAttention-2 inside torch, on the rank's CUDA GPU (train/setup.py ``loaded_kernel``)."""
    n = c.sequence_parallel_size
    if n == 1:
        return []
    key = f"sequence_parallel_size ({n})"
    problems = combination_problems(c)
    if c.cutoff_len < n:
        problems.append(f"cutoff_len ({c.cutoff_len}) is below {key}: a rank would hold less than one token of a "
                        "sequence; raise cutoff_len or lower sequence_parallel_size")
    problems += model_problems(c) + router_aux_problems(c) + image_data_problems(c)
    if layout is not None:
        problems += layout.sequence_parallel_problems()
    return problems


def model_problems(c: TrainConfig) -> list[str]:
    """What of the model, and of a preference run's ``ref_model`` (its forwards are split too), the split cannot run
    (their config.json, where this machine has them)."""
    models = dict.fromkeys(m for m in (c.model_name_or_path, c.ref_model) if m)
    return [problem for model in models for problem in one_model_problems(c, model)]


def router_aux_problems(c: TrainConfig) -> list[str]:
    """A mixture-of-experts model's load-balancing loss (the trained model's only): it is a statistic of one
    forward's tokens, and a rank's forward holds its slice, padding included (the split hands the model no padding
    mask), so each slice would be balanced alone where one process balances the rows' real tokens."""
    from shardtune.model.moe import configured_router_aux_coef

    if not c.model_name_or_path:
        return []
    try:
        config = model_config_json(c.model_name_or_path)
    except ModelError:
        return []  # reported by the folder checks
    coef = configured_router_aux_coef(config or {}, c.moe_aux_loss_coef)
    if not coef:
        return []
    source = "" if c.moe_aux_loss_coef is not None else ", the model's router_aux_loss_coef"
    return [f"moe_aux_loss_coef ({coef:g}{source}) with sequence_parallel_size ({c.sequence_parallel_size}): the "
            "router's load-balancing loss would balance each rank's slice of the rows, padding counted, not the "
            "rows' real tokens; set moe_aux_loss_coef: 0 to train without it, or sequence_parallel_size: 1"]


def image_data_problems(c: TrainConfig) -> list[str]:
    """The datasets whose images the split cannot run (data/images.py ``NOT_SPLIT``), from dataset_info.json's
    columns (a v1 dataset file's image parts are found on the rank, by the image collator)."""
    from shardtune.data.images import NOT_SPLIT
    from shardtune.data.registry import load_registry

    names = dict.fromkeys([*c.dataset, *c.eval_dataset])
    if not names:
        return []
    registry, _ = load_registry(c.dataset_dir)  # an unreadable registry is the data checks' to name
    entries = {name: registry.get(name) for name in names}
    return [f"dataset '{name}' has images (columns.images), which sequence_parallel_size ({c.sequence_parallel_size}) "
            f"does not split ({NOT_SPLIT}); {FIX}"
            for name, entry in entries.items() if isinstance(entry, dict) and "images" in (entry.get("columns") or {})]


def one_model_problems(c: TrainConfig, model: str) -> list[str]:
    """What of ``model`` (a folder or hub id) the split cannot run."""
    from shardtune.model.attention import kernel_support, stateful_layer_kinds

    n = c.sequence_parallel_size
    try:
        config = model_config_json(model)
    except ModelError:
        return []  # reported by the folder checks
    if config is None:
        return []
    problems = []
    counts = head_counts(config)
    if c.sequence_parallel_mode == "ulysses" and counts is not None and any(count % n for count in counts):
        problems.append(f"sequence_parallel_mode (ulysses): {model} has {counts[0]} attention heads and {counts[1]} "
                        f"KV heads, which must both divide by sequence_parallel_size ({n}); use "
                        "sequence_parallel_mode: allgather (any head count) or auto")
    stateful = stateful_layer_kinds(config)
    if stateful:
        problems.append(f"sequence_parallel_size ({n}): {model} has {', '.join(stateful)} layers, whose state runs "
                        f"along the whole sequence and cannot be split over ranks; {FIX}")
    text = config.get("text_config") or config
    support = kernel_support(config)
    if (support is not None and support.sinks) or text.get("attn_logit_softcapping"):
        problems.append(f"sequence_parallel_size ({n}): {model}'s attention uses attention sinks or soft-capping, "
                        f"which the split attention (sdpa) does not compute; {FIX}")
    return problems


def with_deepspeed_sequence_parallel(c: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """The config with the size a DeepSpeed JSON's own ``sequence_parallel_size`` asks for (DeepSpeed never sees
    the key: ``resolve_deepspeed_config`` drops it), and the problems of that key. A JSON that cannot be read is
    left to the engine plan's problems."""
    from shardtune.engines.deepspeed_config import load_deepspeed_setting, sequence_parallel_in

    if not c.deepspeed:
        return c, []
    try:
        raw, source = load_deepspeed_setting(c.deepspeed)
    except ConfigError:
        return c, []
    size, problems = sequence_parallel_in(raw, source, c.sequence_parallel_size)
    return (replace(c, sequence_parallel_size=size) if size != c.sequence_parallel_size else c), problems


def describe_sequence_parallel(c: TrainConfig, layout: WorldLayout) -> str | None:
    """The dry run's line for a split run (None without one)."""
    n = layout.sequence_parallel
    if n == 1:
        return None
    try:
        config = model_config_json(c.model_name_or_path)
    except ModelError:
        config = None
    mode = resolved_mode(c.sequence_parallel_mode, config, n)
    if mode == "auto":
        mode = "auto, decided on each rank from the model's heads"
    elif c.sequence_parallel_mode == "auto":
        mode = f"auto: {mode}"
    return (f"sequence parallel: {n} ranks per sequence (mode {mode}) x data parallel: "
            f"{layout.data_parallel_size}")
