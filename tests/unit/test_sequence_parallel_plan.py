"""Sequence parallelism planned before anything is spent: other spellings of the size (LLaMA-Factory's cp_size,
axolotl's context_parallel_size, a DeepSpeed JSON's own key), every refusal of `shardtune check` in one round, the
dry run's layout line and the estimate's activations per rank."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from shardtune.cli import main
from shardtune.config.lf_v1 import is_v1_file, translate_file_values
from shardtune.config.load import build_config
from shardtune.errors import ConfigError
from tests.conftest import REPO

BASE = {"model_name_or_path": "org/model", "dataset": "demo", "output_dir": "out"}
LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_PORT", "MASTER_ADDR", "FORCE_TORCHRUN", "RANK",
                    "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RDZV_ID", "USE_RAY")


# --- spellings ---

@pytest.mark.parametrize("key", ["cp_size", "context_parallel_size"])
def test_other_spellings_set_sequence_parallel_size(key):
    assert build_config({**BASE, key: 2}).sequence_parallel_size == 2


@pytest.mark.parametrize(("values", "named"), [
    ({"cp_size": 2, "sequence_parallel_size": 4}, "'cp_size' (2) contradicts 'sequence_parallel_size' (4)"),
    ({"sequence_parallel_size": 4, "context_parallel_size": 2},
     "'context_parallel_size' (2) contradicts 'sequence_parallel_size' (4)"),
    ({"cp_size": 2, "context_parallel_size": 4}, "'context_parallel_size' (4) contradicts 'sequence_parallel_size'"),
])
def test_two_spellings_that_disagree_are_refused(values, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        build_config({**BASE, **values})
    same = {key: 2 for key in values}
    assert build_config({**BASE, **same}).sequence_parallel_size == 2


def test_llamafactory_v1_context_parallel_keys_are_read():
    """LLaMA-Factory v1's cp_size and cp_mode (ulysses, its only mode); a v0 file that borrows cp_size stays v0."""
    values, problems = translate_file_values({"model": "m", "cp_size": 2, "cp_mode": "ulysses", "output_dir": "o"})
    assert problems == []
    assert (values["sequence_parallel_size"], values["sequence_parallel_mode"]) == (2, "ulysses")
    assert not is_v1_file({"model_name_or_path": "m", "cp_size": 2})
    _, problems = translate_file_values({"model": "m", "cp_size": 2, "cp_mode": "ring"})
    assert len(problems) == 1 and "key 'cp_mode' ('ring')" in problems[0]


# --- the DeepSpeed JSON's own sequence_parallel_size ---

def ds_file(tmp_path: Path, **extra) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                                "train_batch_size": "auto", "gradient_accumulation_steps": "auto", **extra}))
    return path


def test_deepspeed_json_size_becomes_the_key_and_deepspeed_never_sees_it(tmp_path):
    from shardtune.engines.deepspeed_config import deepspeed_inputs, load_deepspeed_setting, resolve_deepspeed_config
    from shardtune.engines.sequence_parallel_plan import with_deepspeed_sequence_parallel
    from shardtune.world import WorldLayout

    for setting in (str(ds_file(tmp_path, sequence_parallel_size=2)), {"sequence_parallel_size": 2}):
        config, problems = with_deepspeed_sequence_parallel(build_config({**BASE, "deepspeed": setting}))
        assert problems == [] and config.sequence_parallel_size == 2
    config = build_config({**BASE, "deepspeed": str(ds_file(tmp_path, sequence_parallel_size=2))})
    raw, _ = load_deepspeed_setting(str(tmp_path / "ds.json"))
    resolved = resolve_deepspeed_config(raw, deepspeed_inputs(config, WorldLayout(1, 2, sequence_parallel=2)))
    assert "sequence_parallel_size" not in resolved
    assert resolved["train_batch_size"] == 2  # every rank counted as data parallel by DeepSpeed


def test_deepspeed_json_size_that_is_no_size_is_refused_and_auto_defers_to_the_key():
    from shardtune.engines.deepspeed_config import sequence_parallel_in

    assert sequence_parallel_in({"sequence_parallel_size": "auto"}, "ds.json", 4) == (4, [])
    assert sequence_parallel_in({}, "ds.json", 4) == (4, [])
    size, problems = sequence_parallel_in({"sequence_parallel_size": 0}, "ds.json", 1)
    assert size == 1 and problems == ["sequence_parallel_size in ds.json: must be a whole number of at least 1, got 0"]


def check_lines(monkeypatch, capsys, tmp_path: Path, model: Path, values: dict, nproc: int | str = 1,
                argv: tuple[str, ...] = ()) -> tuple[int, list[str], str]:
    """`shardtune check` in this process on the tiny model with ``values`` over a sound config, ``nproc`` ranks;
    (exit code, error lines, stdout)."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", str(nproc))
    path = tmp_path / "cfg.yaml"
    config = {"model_name_or_path": str(model), "dataset": "demo", "dataset_dir": str(REPO / "data"),
              "template": "chatml", "output_dir": str(tmp_path / "run"), "max_steps": 2, "cutoff_len": 128, **values}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    code = main(["check", str(path), *argv])
    out, err = capsys.readouterr()
    return code, [line for line in err.splitlines() if line.startswith("shardtune: error:")], out


def test_deepspeed_json_size_disagreeing_with_the_key_is_refused_naming_both(tiny_model_dir, tmp_path, monkeypatch,
                                                                             capsys):
    ds = ds_file(tmp_path, sequence_parallel_size=2)
    code, lines, _ = check_lines(monkeypatch, capsys, tmp_path, tiny_model_dir,
                                 {"deepspeed": str(ds), "sequence_parallel_size": 4}, nproc=4)
    assert code == 2 and len(lines) == 1, lines
    assert f"sequence_parallel_size (2) in {ds} contradicts sequence_parallel_size (4)" in lines[0]
    code, lines, out = check_lines(monkeypatch, capsys, tmp_path, tiny_model_dir, {"deepspeed": str(ds)}, nproc=2)
    assert code == 0, lines
    assert "world size 2 (2 ranks per sequence), global batch 1 " in out  # 1 x 1 x 2 / 2: one sequence per step


# --- refusals of `shardtune check`: one line each, naming the key and the fix, all in one round ---

def stateful_model(tmp_path: Path, tiny: Path) -> Path:
    model = Path(shutil.copytree(tiny, tmp_path / "stateful"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "layer_types": ["linear_attention", "full_attention"]}))
    return model


@pytest.mark.parametrize(("values", "nproc", "fragment"), [
    ({"sequence_parallel_mode": "ulysses", "sequence_parallel_size": 4}, 4,
     "has 4 attention heads and 2 KV heads, which must both divide by sequence_parallel_size (4); use "
     "sequence_parallel_mode: allgather (any head count) or auto"),
    ({"do_predict": True, "predict_with_generate": True, "eval_dataset": "demo"}, 2,
     "do_predict (true) with sequence_parallel_size (2): generation runs whole sequences on each rank"),
    ({"cutoff_len": 3, "sequence_parallel_size": 4}, 4, "cutoff_len (3) is below sequence_parallel_size (4)"),
    ({}, 3, "sequence_parallel_size (2) does not divide the world size (3)"),
    ({"model": "stateful"}, 2, "has linear_attention layers, whose state runs along the whole sequence and cannot "
                               "be split over ranks; set sequence_parallel_size: 1"),
    ({"mixture_of_depths": "convert", "finetuning_type": "full"}, 2,
     "mixture_of_depths (convert) with sequence_parallel_size (2): the router keeps the top 12.5% of a whole row's "
     "tokens"),
    ({"attn_implementation": "varlen"}, 2,
     "attn_implementation (varlen) with sequence_parallel_size (2): the split attention replaces the model's kernel"),
    ({"rope_scaling": "dynamic", "cutoff_len": 4096}, 2,
     "rope_scaling (dynamic) with sequence_parallel_size (2): dynamic NTK takes its RoPE frequencies from the "
     "largest position id in each forward"),
], ids=["ulysses-heads", "do-predict", "cutoff-len", "world-size", "stateful-layers", "mixture-of-depths", "varlen",
        "dynamic-rope"])
def test_check_refuses_what_the_split_cannot_run(values, nproc, fragment, tiny_model_dir, tmp_path, monkeypatch,
                                                 capsys):
    values = {"sequence_parallel_size": 2, **values}
    model = stateful_model(tmp_path, tiny_model_dir) if values.pop("model", None) else tiny_model_dir
    code, lines, _ = check_lines(monkeypatch, capsys, tmp_path, model, values, nproc=nproc)
    assert code == 2
    assert sum(fragment in line for line in lines) == 1, lines


@pytest.mark.parametrize("stage", [
    {"stage": "pt"},
    {"stage": "dpo", "dataset": "demo_dpo", "finetuning_type": "full"},  # a frozen reference, split too
    {"stage": "dpo", "dataset": "demo_dpo", "pref_loss": "orpo"},
    {"stage": "kto", "dataset": "demo_kto"},
    {"stage": "rm", "dataset": "demo_dpo"},
], ids=["pt", "dpo", "orpo", "kto", "rm"])
def test_a_split_that_can_run_passes_check(stage, tiny_model_dir, tmp_path, monkeypatch, capsys):
    code, lines, out = check_lines(monkeypatch, capsys, tmp_path, tiny_model_dir,
                                   {**stage, "sequence_parallel_size": 2, "sequence_parallel_mode": "ulysses",
                                    "attn_implementation": "eager"}, nproc=2)
    assert code == 0, lines
    assert "(2 ranks per sequence)" in out


def test_a_reference_model_the_split_cannot_run_is_refused(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """ref_model's forwards are split as the policy's: its layers are checked as the policy's are."""
    reference = stateful_model(tmp_path, tiny_model_dir)
    code, lines, _ = check_lines(monkeypatch, capsys, tmp_path, tiny_model_dir,
                                 {"stage": "dpo", "dataset": "demo_dpo", "ref_model": str(reference),
                                  "sequence_parallel_size": 2}, nproc=2)
    assert code == 2
    assert sum(f"{reference} has linear_attention layers" in line for line in lines) == 1, lines


def test_two_problems_of_one_config_are_two_lines_in_one_round(tiny_model_dir, tmp_path, monkeypatch, capsys):
    code, lines, _ = check_lines(monkeypatch, capsys, tmp_path, tiny_model_dir,
                                 {"sequence_parallel_size": 4, "sequence_parallel_mode": "ulysses",
                                  "cutoff_len": 3}, nproc=4)
    assert code == 2 and len(lines) == 2, lines
    assert "cutoff_len (3) is below" in lines[0] and "sequence_parallel_mode (ulysses)" in lines[1]


def test_a_bad_launch_variable_does_not_hide_the_split_refusals(tiny_model_dir, tmp_path, monkeypatch, capsys):
    code, lines, _ = check_lines(monkeypatch, capsys, tmp_path, tiny_model_dir,
                                 {"sequence_parallel_size": 2, "do_predict": True, "predict_with_generate": True,
                                  "eval_dataset": "demo"}, nproc="two")
    assert code == 2
    assert "NPROC_PER_NODE='two' is not an integer" in lines[0]
    assert any("do_predict (true) with sequence_parallel_size (2)" in line for line in lines[1:]), lines


def test_flash_attention_under_a_split_is_sdpas_flash_kernel_on_a_cuda_gpu(monkeypatch):
    """The split attention runs sdpa per segment: fa2 there loads the model with sdpa (no flash-attn package), whose
    flash backend runs the segments on a GPU (tests/gpu/test_sequence_parallel_gpu.py); without CUDA the rank
    refuses in one line."""
    import torch

    from shardtune.config.schema import TrainConfig
    from shardtune.errors import ModelError
    from shardtune.train.setup import loaded_kernel

    split = TrainConfig(model_name_or_path="m", attn_implementation="flash_attention_2", sequence_parallel_size=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelError, match=r"with sequence_parallel_size \(2\): the split attention runs sdpa's flash "
                                         "kernel, which needs a CUDA GPU"):
        loaded_kernel(split)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loaded_kernel(split) == "sdpa"
    whole = TrainConfig(model_name_or_path="m", attn_implementation="flash_attention_2")
    assert loaded_kernel(whole) == "flash_attention_2"


def test_auto_attention_takes_no_flash_kernel_under_a_split():
    from shardtune.model.attention import AUTO, KernelSupport, choose_attention

    support = KernelSupport("LlamaForCausalLM", flash=True, sdpa=True, sinks=False, mask_per_layer_type=False)
    assert choose_attention(AUTO, support, flash_usable=True, model="m").kernel == "flash_attention_2"
    split = choose_attention(AUTO, support, flash_usable=True, model="m", splits_sequences=True)
    assert split.kernel == "sdpa" and "sequence_parallel_size" in split.reason


# --- the dry run ---

def test_dry_run_names_the_split_and_its_data_parallel_size(tiny_model_dir, tmp_path, monkeypatch, capsys):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", "4")
    ds = ds_file(tmp_path, sequence_parallel_size=2)
    assert main(["train", str(REPO / "examples/tiny/sft_full.yaml"), "--dry-run",
                 f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path / 'o'}", f"deepspeed={ds}"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "sequence parallel: 2 ranks per sequence (mode auto: ulysses) x data parallel: 2" in lines
    assert ("global batch: 4 (per_device_train_batch_size) x 2 (gradient_accumulation_steps) x 2 (data-parallel size "
            "(world 4 / sequence_parallel_size 2)) = 16") in lines
    settings = json.loads(out[out.index("engine settings:\n") + len("engine settings:\n"):])
    assert "sequence_parallel_size" not in settings
    assert not (tmp_path / "o").exists()


# --- the estimate ---

LLAMA3_8B_CONFIG = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}


@pytest.mark.parametrize("mode", ["ulysses", "allgather"])
def test_activations_per_rank_shrink_with_the_split(mode):
    from shardtune.estimate import Workload
    from shardtune.estimate.activations import activation_bytes, exchange_bytes
    from shardtune.estimate.shape import shape_from_config

    shape = shape_from_config(LLAMA3_8B_CONFIG)

    def activations(n: int) -> int:
        w = Workload(1, 32768, precision="bf16", gradient_checkpointing=True, sequence_parallel=n,
                     sequence_parallel_mode=mode)
        return activation_bytes(shape, w, 4)

    whole, split = activations(1), activations(2)
    assert split < 0.75 * whole, (whole, split)
    w = Workload(1, 32768, precision="bf16", sequence_parallel=2, sequence_parallel_mode=mode)
    kv = 8 * 128  # KV heads x head dim
    expected = 2 * 32768 * kv * 2 if mode == "allgather" else 2 * 16384 * 2 * (2 * 4096 + 2 * kv)
    assert exchange_bytes(shape, w) == expected


def test_estimate_command_counts_the_split(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))

    def ddp_activations(n: int) -> int:
        argv = [str(REPO / "examples/tiny/sft_full.yaml"), f"model_name_or_path={tmp_path}", "cutoff_len=32768",
                "per_device_train_batch_size=1", f"sequence_parallel_size={n}", "--gpus-per-node", "2",
                "--gpu-memory", "80GiB", "--cpu-memory", "512GiB", "--json"]
        assert main(["estimate", *argv]) == 0
        data = json.loads(capsys.readouterr().out)
        return next(o for o in data["options"] if o["name"] == "DDP")["device_bytes"]["activations"]

    assert ddp_activations(2) < 0.75 * ddp_activations(1)


def test_engine_auto_splits_rows_only_when_nothing_fits_them_whole():
    """Llama-3-8B full, gradient checkpointing, 8 x 80 GiB: ZeRO-2 fits 64k-token rows whole; at 128k no option
    does, and engine auto proposes the smallest split that fits (a divisor of the GPUs per node)."""
    from shardtune.config.args import load_config
    from shardtune.estimate.config import recommend_for_config
    from tests.unit.test_estimate import LLAMA3_FULL, GiB

    def chosen(cutoff: int, *extra: str) -> dict:
        config, _ = load_config([LLAMA3_FULL, f"cutoff_len={cutoff}", "gradient_checkpointing=true", *extra])
        return recommend_for_config(config, 8, 8, 80 * GiB, 1024 * GiB)[0]

    assert "sequence_parallel_size" not in chosen(65536)
    assert chosen(131072)["sequence_parallel_size"] == 2
    # flash_attention_2 keeps less: 128k fits whole (ZeRO-3 with offload), 256k does not; the split keeps the kernel
    # (its segments run on sdpa's flash backend) and is estimated as the split attention it runs.
    flash = "attn_implementation=flash_attention_2"
    assert "sequence_parallel_size" not in chosen(131072, flash)
    assert chosen(262144, flash) == {"deepspeed": "z3_offload", "sequence_parallel_size": 2}


def test_image_data_is_refused_before_launch(tmp_path):
    """Images are not split (data/images.py's VisionCollator refuses them on the rank too): the check names it."""
    from shardtune.config.schema import TrainConfig
    from shardtune.engines.sequence_parallel_plan import sequence_parallel_problems

    info = {"chats": {"file_name": "chats.json", "formatting": "sharegpt",
                      "columns": {"messages": "messages", "images": "images"}},
            "texts": {"file_name": "texts.json"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    config = TrainConfig(model_name_or_path="org/model", dataset=["texts", "chats"], dataset_dir=str(tmp_path),
                         sequence_parallel_size=2)
    problems = sequence_parallel_problems(config)
    assert [p for p in problems if "images" in p] == [
        "dataset 'chats' has images (columns.images), which sequence_parallel_size (2) does not split (the model "
        "builds an image's positions and features from the whole row); set sequence_parallel_size: 1"]
    assert not any("images" in p for p in sequence_parallel_problems(TrainConfig(
        model_name_or_path="org/model", dataset=["texts"], dataset_dir=str(tmp_path), sequence_parallel_size=2)))


# --- every feature against the split: one table (COMBINATIONS), the refusals and the docs made from it ---

def test_the_docs_table_is_the_combinations_table():
    from shardtune.engines.sequence_parallel_plan import combinations_markdown

    text = (REPO / "docs/long-context.md").read_text()
    start = text.index("<!-- combinations: generated from COMBINATIONS, do not edit by hand -->\n")
    section = text[text.index("\n", start) + 1:text.index("<!-- end of combinations -->")]
    assert section == combinations_markdown(), "docs/long-context.md is stale: paste combinations_markdown()"


def test_every_fuzzed_feature_has_a_row_and_every_named_test_exists():
    """The fuzzer's features (tests/schema_fuzz.py FEATURES, the keys of the schema) are each decided, and a row
    that names a test names one that is there."""
    from shardtune.config.schema import config_fields
    from shardtune.engines.sequence_parallel_plan import COMBINATIONS, EXACT, REFUSED
    from tests.schema_fuzz import FEATURES

    keys = {f.name for f in config_fields()}
    rows = {row.key for row in COMBINATIONS}
    assert rows <= keys
    assert {key for key in FEATURES if key in keys} - rows == {"sequence_parallel_size"}
    for row in COMBINATIONS:
        assert row.kind in (EXACT, REFUSED) and row.why, row
        if row.test:
            path, name = row.test.split("::")
            assert f"def {name}(" in (REPO / path).read_text(), row.test


@pytest.mark.parametrize("split", [1, 2])
def test_every_refused_row_makes_one_line_naming_both_keys_and_the_fix(split):
    from shardtune.config.schema import TrainConfig
    from shardtune.engines.sequence_parallel_plan import COMBINATIONS, REFUSED, combination_problems
    from tests.schema_fuzz import FEATURES

    refused = [row for row in COMBINATIONS if row.kind == REFUSED]
    for row in refused:
        value = row.value if row.value is not None else FEATURES[row.key]
        lines = combination_problems(TrainConfig(sequence_parallel_size=split, **{row.key: value}))
        if split == 1:
            assert lines == []
            continue
        assert len(lines) == 1 and lines[0].startswith(f"{row.key} (") and "with sequence_parallel_size (2): " in \
            lines[0] and lines[0].endswith(row.fix), lines


def test_a_rank_refuses_the_varlen_kernel_under_a_split_from_the_same_table():
    """A rank's own guard (train/setup.py ``loaded_kernel``) says the table's line, as check does."""
    from shardtune.config.schema import TrainConfig
    from shardtune.errors import ModelError
    from shardtune.train.setup import loaded_kernel

    config = TrainConfig(attn_implementation="varlen", sequence_parallel_size=2)
    with pytest.raises(ModelError, match=r"^attn_implementation \(varlen\) with sequence_parallel_size \(2\): the "
                                         r"split attention replaces the model's kernel; use attn_implementation: sdpa"):
        loaded_kernel(config)


def test_dynamic_rope_frequencies_depend_on_the_positions_one_forward_holds():
    """Why rope_scaling: dynamic is refused under a split: transformers' dynamic NTK rescales its frequencies from the
    largest position id of the forward, so the first slice of a row longer than the trained context (positions below
    it) rotates by other angles than the whole row does."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from shardtune.model.load import apply_rope_scaling

    config = LlamaConfig(hidden_size=16, num_attention_heads=2, max_position_embeddings=16)
    assert apply_rope_scaling(config, "dynamic", 32)
    x = torch.zeros(1, 32, 16)
    whole_row = LlamaRotaryEmbedding(config)(x, torch.arange(32)[None])[0][:, :16]
    first_slice = LlamaRotaryEmbedding(config)(x[:, :16], torch.arange(16)[None])[0]
    assert not torch.allclose(whole_row, first_slice)
    config.rope_parameters = {**config.rope_parameters, "rope_type": "linear"}  # fixed frequencies: the same angles
    whole_row = LlamaRotaryEmbedding(config)(x, torch.arange(32)[None])[0][:, :16]
    assert torch.equal(whole_row, LlamaRotaryEmbedding(config)(x[:, :16], torch.arange(16)[None])[0])


def test_a_router_auxiliary_loss_under_a_split_is_refused_unless_switched_off(tiny_model_dir, tmp_path, monkeypatch,
                                                                             capsys):
    """A rank's forward holds its slice: the router's load-balancing loss would balance each slice's tokens, padding
    counted (the split hands the model no padding mask), where one process balances the rows' real tokens."""
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "moe"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "router_aux_loss_coef": 0.02,
                                                   "output_router_logits": False}))
    code, lines, _ = check_lines(monkeypatch, capsys, tmp_path, model, {"sequence_parallel_size": 2}, nproc=2)
    assert code == 2
    assert sum(line.startswith("shardtune: error: moe_aux_loss_coef (0.02, the model's router_aux_loss_coef) with "
                               "sequence_parallel_size (2): ") for line in lines) == 1, lines
    code, lines, _ = check_lines(monkeypatch, capsys, tmp_path, model,
                                 {"sequence_parallel_size": 2, "moe_aux_loss_coef": 0}, nproc=2)
    assert code == 0, lines
