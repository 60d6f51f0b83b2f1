"""Shared fixtures: repo paths, a tiny model built once per session, and a CLI runner."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "data"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random tiny LLaMA + locally trained tokenizer, the same builder `make demo` uses."""
    from shardtune.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def wider_model_dir(tmp_path_factory) -> Path:
    """A tiny LLaMA wide and deep enough (about 6M parameters) that weights, optimizer state and activations, not the
    process's baseline, decide a run's measured peak memory."""
    from shardtune.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "wider", hidden=256, layers=6, heads=4,
                            intermediate=1024)


@pytest.fixture(scope="session")
def arch_model_dir(tmp_path_factory):
    """``arch_model_dir(name)``: the tiny model of family ``name`` (model/architectures.py, or any model type of
    transformers' causal-LM registry; ``registry:NAME`` for the registry's class where a family has the name;
    ``image-text:NAME`` for the image-text class with its vision tower), built once per session."""
    from shardtune.model.tiny import build_tiny_model

    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            arch = name.split(":")[-1]
            built[name] = build_tiny_model(tmp_path_factory.mktemp("models") / f"tiny-{name.replace(':', '-')}",
                                           arch=arch, from_registry=name.startswith("registry:"),
                                           image_text=name.startswith("image-text:"))
        return built[name]

    return build


@pytest.fixture(autouse=True)
def _launch_kind(request):
    """``@pytest.mark.real_launch``: this test's ``run_cli`` calls are real launches (tests/rank_server.py). A test
    whose served cells left a process running or a file in the temporary folder fails, naming them."""
    from tests import rank_server

    rank_server.REAL_LAUNCHES.append(request.node.get_closest_marker("real_launch") is not None)
    leaks_before = len(rank_server.LEAKS)
    yield
    rank_server.REAL_LAUNCHES.pop()
    if len(rank_server.LEAKS) > leaks_before:
        pytest.fail("cells left processes or temporary files behind (tests/rank_server.py): "
                    + "; ".join(rank_server.LEAKS[leaks_before:]), pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Each test process gets a temporary folder of its own (TMPDIR, inherited by what it starts), so that what a
    cell leaves there is its own and nothing is left on the machine; under ``pytest -n`` the controlling process
    makes the pool of cores its workers share (tests/cores.py)."""
    from tests import cores, rank_server

    if not hasattr(config, "workerinput"):
        if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
            os.environ[cores.ENV] = cores.make_pool()
            config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(cores.ENV), ignore_errors=True))
    config._tmp_path_factory.getbasetemp()  # pytest's own folders stay where they are (kept for a failure's look)
    session_tmp = tempfile.mkdtemp(prefix=f"st-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
    os.environ["TMPDIR"] = tempfile.tempdir = session_tmp
    config.add_cleanup(lambda: shutil.rmtree(session_tmp, ignore_errors=True))
    config.add_cleanup(rank_server.stop)  # first: the server's socket and log are in that folder


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under ``pytest -n``, a test runs (setup to teardown) while it holds the cores it needs (tests/cores.py)."""
    from tests import cores

    pool = os.environ.get(cores.ENV)
    if pool is None:
        yield
        return
    marker = item.get_closest_marker("cores")
    need = cores.need_of(item.nodeid, marker.args[0] if marker else None, cores.measured_needs(), cores.machine_cores())
    asked = time.time()
    with cores.holding(pool, need):
        held = time.time()
        yield
    cores.record_timeline(item.nodeid, need, asked, held, time.time())


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("SHARDTUNE_DEBUG", None)
    # Tests that run inside a Slurm job must not have their launches taken over by the job's variables.
    for name in [n for n in env if n.startswith(("SLURM_", "SLURMD_")) and n != "SLURM_CONF"]:
        del env[name]
    env.update(extra)
    return env


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run the real `shardtune` entry point in a new process. Tests build a command from shared base arguments
    plus their own ``key=value`` overrides; the CLI refuses a key given twice, so a later override replaces an
    earlier one here, as the test's author means it.

    The process is forked by the test session's rank server (tests/rank_server.py: the same entry, arguments,
    environment and working directory, without importing torch again), and so are the ranks of a `train` it
    launches; a real `python -m shardtune` where the server cannot serve it or SHARDTUNE_TEST_LAUNCH=real."""
    from tests.rank_server import run_cli_on_server

    argv, full_env = overrides_merged(args), cli_env(**env)
    served = run_cli_on_server(argv, full_env, cwd, timeout)
    if served is not None:
        return served
    return subprocess.run([sys.executable, "-m", "shardtune", *argv], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def overrides_merged(args: tuple[str, ...] | list[str]) -> list[str]:
    """``args`` with each ``key=value`` given once: the last value, at the place of the first."""
    merged: list[str] = []
    where: dict[str, int] = {}
    for arg in args:
        key, sep, _ = arg.partition("=")
        if sep and key.isidentifier():
            if key in where:
                merged[where[key]] = arg
                continue
            where[key] = len(merged)
        merged.append(arg)
    return merged


# The engine matrix of the LLaMA-Factory features is large; `make test` runs a representative slice (every
# feature under at least one sharded engine) and `make test-matrix` runs the rest. Both must pass before an issue is
# called resolved (README, Tests).
MATRIX_ONLY = {
    # 2026-11-27 evening: make test had grown to 27 minutes (1,623 s); OFT keeps ZeRO-3 and FSDP2 here, ASFT ZeRO-3.
    "tests/distributed/test_lf_adapters_engines.py::test_adapter_variant_matches_one_process[ddp-oft]",
    "tests/distributed/test_lf_adapters_engines.py::test_adapter_variant_matches_one_process[fsdp1-oft]",
    "tests/distributed/test_lf_training_engines.py::test_asft_matches_one_process[ddp-full]",
    "tests/distributed/test_lf_adapters_engines.py::test_adapter_variant_matches_one_process[ddp-dora]",
    "tests/distributed/test_lf_adapters_engines.py::test_adapter_variant_matches_one_process[fsdp1-dora]",
    "tests/distributed/test_lf_adapters_engines.py::test_adapter_variant_matches_one_process[fsdp2-loraplus]",
    "tests/distributed/test_lf_adapters_engines.py::test_adapter_variant_matches_one_process[zero2-pissa]",
    "tests/distributed/test_lf_training_engines.py::test_label_smoothing_matches_one_process[zero3]",
    "tests/distributed/test_lf_vocab_engines.py::test_sharded_engines_fill_the_grown_rows_like_one_process[zero3]",
    "tests/distributed/test_lf_optimizers.py::test_replacement_trains_and_ddp_matches_one_process[galore]",
    "tests/distributed/test_lf_optimizers.py::test_replacement_trains_and_ddp_matches_one_process[adam_mini]",
    "tests/distributed/test_lf_optimizers.py::test_resume_matches_uninterrupted_run[galore]",
    "tests/distributed/test_lf_optimizers.py::test_lora_with_muon_trains_under_ddp",
    "tests/distributed/test_lf_streaming.py::test_two_rank_stream_matches_one_process[fsdp2-full_shard]",
    "tests/unit/test_fsdp_qlora.py::test_4bit_lora_sharded_matches_one_unsharded_process[fsdp1]",
    "tests/distributed/test_engines_cli.py::test_engine_matches_single_process[ddp-find_unused-full]",
    "tests/distributed/test_engines_cli.py::test_engine_matches_single_process[ddp-compile-full]",
    "tests/distributed/test_engines_cli.py::test_engine_matches_single_process[ddp-compile-lora]",
    "tests/distributed/test_engines_cli.py::test_engine_matches_single_process[fsdp2-full_shard-compile-full]",
    "tests/distributed/test_engines_cli.py::test_engine_matches_single_process[deepspeed-z2-compile-full]",
    "tests/distributed/test_engines_cli.py::test_engine_matches_single_process[fsdp2-full_shard-compile-lora]",
    "tests/distributed/test_engines_cli.py::test_engine_matches_single_process[deepspeed-z2-compile-lora]",
    "tests/distributed/test_llamafactory_files.py::test_llamafactory_file_trains_unchanged_on_two_processes"
    "[llama3_lora_stream_pissa.yaml]",
    "tests/distributed/test_lf_training_engines.py::test_neftune_trains_under_zero3",
    "tests/distributed/test_lf_adapters_engines.py::test_adapter_variant_matches_one_process[zero3-loraplus]",
    "tests/distributed/test_lf_optimizers.py::test_replacement_trains_and_ddp_matches_one_process[apollo]",
    # Muon's FSDP2 resume (its ChainedOptimizer under torch's set_state_dict: unit-tested) and layer-wise resume.
    "tests/distributed/test_lf_optimizers.py::test_resume_matches_uninterrupted_run[muon-fsdp2]",
    "tests/distributed/test_lf_optimizers.py::test_layerwise_apollo_resumes_like_an_uninterrupted_run",
    "tests/distributed/test_lf_optimizers.py::test_layerwise_galore_takes_the_plain_runs_steps_on_one_process",
    # stage rm: DDP and ZeRO-3 (the partitioned body under a plain score layer) stay in make test.
    "tests/distributed/test_preference_engines.py::test_preference_stage_matches_one_process[zero2-rm-full]",
    "tests/distributed/test_preference_engines.py::test_preference_stage_matches_one_process[fsdp2-rm-full]",
    "tests/distributed/test_preference_engines.py::test_preference_stage_matches_one_process[fsdp1-rm-full]",
    "tests/distributed/test_preference_engines.py::test_sharded_reward_model_resumes_on_the_same_curve[zero3]",
    "tests/distributed/test_preference_engines.py::test_preference_stage_matches_one_process[zero2-kto-lora]",
    "tests/distributed/test_preference_engines.py::test_preference_stage_matches_one_process[zero3-kto-full]",
    # The LLaMA-Factory-style DPO YAML learning the pairs on 2 processes: ZeRO-3 stays in make test.
    *(f"tests/distributed/test_preference_example_engines.py::"
      f"test_llamafactory_style_dpo_yaml_learns_the_pairs_on_two_processes[{engine}]"
      for engine in ("ddp", "zero2", "fsdp2", "fsdp1")),
    # LoRA reward models: ZeRO-3 stays in make test.
    *(f"tests/distributed/test_preference_engines.py::test_preference_stage_matches_one_process[{case}]" for case in (
        "ddp-rm-lora", "zero2-rm-lora", "fsdp2-rm-lora", "fsdp1-rm-lora", "zero3-rm-freeze", "fsdp2-rm-freeze")),
    # make test's time (about 25 minutes on 2 cores): the rest of each engine matrix; a representative case of
    # each engine, launcher and check stays in make test.
    *(f"tests/distributed/test_engines_cli.py::test_engine_matches_single_process[{case}]" for case in (
        "ddp-lora", "fsdp2-shard_grad_op-forward_prefetch-full", "fsdp2-no_shard-full", "fsdp2-full_shard-offload-full",
        "fsdp2-size_wrap-full_state_dict-full", "fsdp1-full_shard-lora", "fsdp1-shard_grad_op-prefetch-full",
        "fsdp1-no_shard-full", "deepspeed-z0-full", "deepspeed-z1-full", "deepspeed-z2-lora",
        "deepspeed-z2_offload-full", "deepspeed-z3_offload-full", "deepspeed-z3_offload-lora")),
    *(f"tests/distributed/test_engines_cli.py::test_hybrid_shard_four_processes_keeps_replicas_equal[{case}]"
      for case in ("fsdp2-hybrid_shard_zero2", "fsdp1-hybrid_shard_zero2")),
    "tests/distributed/test_engines_cli.py::test_bf16_engine_matches_single_process[deepspeed-z2]",
    "tests/distributed/test_engines_cli.py::test_bf16_engine_matches_single_process[fsdp2-full_shard]",
    *(f"tests/distributed/test_checkpoints.py::test_resume_matches_uninterrupted_run[{case}]" for case in (
        "fsdp2-full_state_dict", "fsdp1-full_state_dict", "deepspeed-z2", "deepspeed-z3", "fsdp2-lora")),
    *(f"tests/distributed/test_checkpoints.py::test_resume_on_a_different_world_size[{case}]" for case in (
        "deepspeed-z2-1-2", "deepspeed-z2-lora-2-1", "deepspeed-z2-2-1")),
    *(f"tests/distributed/test_chunked_loss.py::test_chunked_loss_matches_full_logits[{case}]" for case in (
        "ddp-full-untied", "deepspeed-z2-lora-untied", "deepspeed-z2-full-tied", "deepspeed-z3-full-tied",
        "fsdp1-full-untied")),
    "tests/distributed/test_llamafactory_files.py::test_llamafactory_file_trains_unchanged_on_two_processes"
    "[qwen3_lora_sft_extras.yaml]",
    *(f"tests/distributed/test_launchers.py::test_accelerate_launch_with_shipped_config[{name}]" for name in (
        "fsdp_config.yaml", "fsdp_config_offload.yaml", "single_node.yaml")),
    "tests/distributed/test_checkpointing_engines.py::test_checkpointing_keeps_losses_and_lowers_peak_memory[zero3-lora]",
    *(f"tests/distributed/test_preference_engines.py::test_preference_stage_matches_one_process[{case}]" for case in (
        "ddp-dpo-full", "zero2-dpo-lora", "zero2-dpo-full", "zero3-dpo-lora", "fsdp2-dpo-lora",
        "fsdp2-dpo-full-precomputed", "ddp-kto-lora", "fsdp1-dpo-full", "fsdp2-kto-full",
        "zero3-dpo-lora-ref-model")),
    "tests/distributed/test_preference_engines.py::test_live_sharded_reference_equals_precomputed[fsdp2]",
    *(f"tests/e2e/test_preference_cli.py::test_other_pref_losses_train[{loss}]" for loss in ("ipo", "hinge")),
    "tests/distributed/test_nodes_netns.py::test_two_namespaces_train_like_one_process[slurm]",
    "tests/distributed/test_ray_launch.py::test_killed_ray_worker_without_restarts_is_one_line",
    # make test under 30 minutes on 2 cores (2026-11-25): cells whose path another make-test cell already takes.
    # Accelerate's FSDP config stays (the DeepSpeed JSON path is taken by the deepspeed launcher test).
    "tests/distributed/test_launchers.py::test_accelerate_launch_with_shipped_config[deepspeed_z3.yaml]",
    # Chunked loss: ZeRO-3 LoRA with a tied head stays.
    "tests/distributed/test_chunked_loss.py::test_chunked_loss_matches_full_logits[fsdp2-full-tied]",
    # Resume: ZeRO-3 LoRA and FSDP2 sharded stay; DDP resume is also the e2e resume and SIGTERM tests' path.
    "tests/distributed/test_checkpoints.py::test_resume_matches_uninterrupted_run[ddp]",
    "tests/distributed/test_checkpoints.py::test_resume_on_a_different_world_size[fsdp2-sharded-2-1]",
    # Kubeflow: the 2x2 PyTorchJob stays (nodes and processes per node).
    "tests/e2e/test_kubeflow_pods.py::test_operator_pods_train_as_one_job[trainjob-2x1]",
    "tests/distributed/test_lf_optimizers.py::test_resume_matches_uninterrupted_run[muon]",
    # Precomputed reference: the e2e equality test stays; the sharded reward-model resume runs in the matrix.
    "tests/distributed/test_preference_engines.py::test_preference_stage_matches_one_process[zero3-dpo-full-precomputed]",
    "tests/distributed/test_preference_engines.py::test_sharded_reward_model_resumes_on_the_same_curve[fsdp2]",
    # Checkpointing's memory saving: the FSDP2 2-process cell (test_checkpointing_engines.py) stays.
    "tests/e2e/test_lf_outputs.py::test_gradient_checkpointing_lowers_peak_memory_with_equal_losses",
    # make test under 30 minutes on 2 cores (2026-11-27, measured with --durations): cells whose path another make-test
    # cell takes. ZeRO 0-3 full and LoRA parity, saves and resume are test_deepspeed_engine.py's one launch; its
    # offload launch (which compiles DeepSpeed's cpu_adam first) runs in the matrix.
    *(f"tests/distributed/test_engines_cli.py::test_engine_matches_single_process[{case}]" for case in (
        "deepspeed-z2-full", "deepspeed-z3-full", "deepspeed-z3-lora")),
    "tests/distributed/test_engines_cli.py::test_bf16_engine_matches_single_process[deepspeed-z3]",  # bf16 DDP stays
    "tests/distributed/test_engines_cli.py::test_hybrid_shard_four_processes_keeps_replicas_equal[fsdp2-hybrid_shard]",
    *(f"tests/distributed/test_deepspeed_engine.py::{test}[{case}]"
      for test in ("test_losses_match_single_process", "test_saved_model_is_complete_and_reloads",
                   "test_offload_steps_with_deepspeed_cpu_adam")
      for case in ("z2_offload", "z3_offload", "z3_offload_streamed")),
    "tests/distributed/test_checkpoints.py::test_resume_matches_uninterrupted_run[deepspeed-z3-lora]",
    # Export: a ZeRO-3 and an FSDP checkpoint to a full folder stay; merged LoRA export is also test_after_training's.
    "tests/distributed/test_export.py::test_export_lora_checkpoint_merged",
    *(f"tests/distributed/test_preference_engines.py::test_preference_stage_matches_one_process[{case}]" for case in (
        "ddp-rm-full", "fsdp2-dpo-full", "zero3-rm-lora")),
    "tests/distributed/test_preference_engines.py::test_live_sharded_reference_equals_precomputed[zero3]",
    "tests/distributed/test_sequence_parallel.py::test_split_sequences_match_one_process"
    "[ddp-full-packed-checkpointed-2procs-sp2-ulysses]",
    "tests/distributed/test_sequence_parallel.py::test_resume_across_sequence_parallel_sizes[ddp-sp2-then-sp1]",
    "tests/distributed/test_architectures.py::test_family_under_engine_matches_one_process_saves_and_resumes"
    "[phi3-ddp-lora]",
    # MoE: the five engines' parity launch stays; the router aux loss through the CLI runs in the matrix.
    "tests/distributed/test_moe_engines.py::test_cli_logs_the_router_aux_loss_and_matches_one_process[z3-full]",
    "tests/distributed/test_llamafactory_files.py::test_llamafactory_file_trains_unchanged_on_two_processes"
    "[qwen3_lora_sft_fsdp.yaml]",
    "tests/distributed/test_lf_adapters_engines.py::test_adapter_variant_matches_one_process[fsdp2-dora]",
    "tests/distributed/test_predict_engines.py::test_two_ranks_generate_what_one_process_generates[zero3]",
    "tests/distributed/test_launchers.py::test_accelerate_multi_node_config_two_machines",
    "tests/e2e/test_data_speed.py::test_packed_grouped_and_padded_epochs_train_the_same_tokens",
    # make test on a 2-core AVX2-only machine took 45.7 minutes (2026-11-28, --durations of the whole suite): cells
    # whose path another make-test cell takes. ZeRO-3 resuming on another data-parallel size stays as
    # test_sequence_parallel.py's zero3-sp1-then-sp2 (2 -> 1 data-parallel ranks); a reward model under ZeRO-3 as
    # the sequence-parallel preference cell; ZeRO-3 DPO as zero3-dpo-full; a changed loss under a sharded engine
    # as label smoothing under FSDP2, ASFT through the CLI as its full cell; ZeRO-3 sequence parallelism as its
    # resume cell; DeepSeek-V3.2 under DDP LoRA as test_registry_matrix.py's slice; OFT under ZeRO-3; images as
    # the FSDP2 DPO cell; Muon as its FSDP2 cell; routed depths under DDP; ORPO and SimPO as unit-tested formulas
    # beside the CLI's DPO and KTO runs; chat as the terminal chat; varlen against the dense mask as
    # test_varlen_attention.py and test_data_packing.py (in-process, gradients too); compile's recompile count as
    # its full cell.
    "tests/distributed/test_checkpoints.py::test_resume_on_a_different_world_size[deepspeed-z3-2-1]",
    "tests/distributed/test_preference_engines.py::test_preference_stage_matches_one_process[zero3-rm-full]",
    "tests/distributed/test_preference_example_engines.py::"
    "test_llamafactory_style_dpo_yaml_learns_the_pairs_on_two_processes[zero3]",
    "tests/distributed/test_lf_training_engines.py::test_asft_matches_one_process[zero3-full]",
    "tests/distributed/test_lf_training_engines.py::test_token_weighting_matches_one_process[eaft-fsdp2-full]",
    "tests/distributed/test_sequence_parallel.py::test_split_sequences_match_one_process"
    "[zero3-lora-packed-sgd-2procs-sp2-allgather]",
    "tests/distributed/test_lf_adapters_engines.py::test_adapter_variant_matches_one_process[fsdp2-oft]",
    "tests/distributed/test_image_training.py::test_images_on_one_rank_text_on_the_other_match_one_process"
    "[qwen3_vl-ddp-lora]",
    "tests/distributed/test_lf_optimizers.py::test_replacement_trains_and_ddp_matches_one_process[muon]",
    "tests/distributed/test_depths_engines.py::test_two_processes_route_and_train_as_one[zero2]",
    "tests/e2e/test_preference_cli.py::test_other_pref_losses_train[orpo]",
    "tests/e2e/test_preference_cli.py::test_other_pref_losses_train[simpo]",
    # Stage grpo (issue 44): make test keeps DDP full, ZeRO-3 LoRA and FSDP2 LoRA (the sharded generate whose root
    # peft wraps); the other cells take the same rollout and loss paths on engines those three cover.
    *(f"tests/distributed/test_grpo_engines.py::test_grpo_matches_one_process[{cell}]" for cell in (
        "ddp-lora", "zero2-full", "zero2-lora", "zero3-full", "fsdp2-full", "fsdp1-full", "fsdp1-lora")),
    # and resumes on 2 processes from a 1-process checkpoint; resuming on the same count takes the same path.
    "tests/distributed/test_grpo_engines.py::test_a_resumed_run_samples_the_same_prompts_and_continues_the_curve"
    "[same-1]",
    "tests/e2e/test_after_training.py::test_chat_one_shot",
    "tests/e2e/test_attention_cli.py::test_packed_sft_under_varlen_equals_the_dense_block_mask",
    "tests/unit/test_compile.py::test_padded_rows_and_a_shorter_last_batch_compile_nothing_after_step_2[lora]",
    "tests/unit/test_asft_loss.py::test_asft_trains_from_the_cli_anchored_to_the_model_as_loaded[lora]",
    # The weight sync of a generator with its own weights (issue 44): ZeRO-3 LoRA (the merge of gathered layers)
    # stays in make test; the other cells take the same sync under FSDP2's and DDP's gathers.
    *(f"tests/distributed/test_weight_sync.py::"
      f"test_the_generator_holds_the_trained_weights_bit_for_bit_after_every_step[{cell}]"
      for cell in ("zero3-full", "fsdp2-full", "fsdp2-lora", "ddp-lora")),
    "tests/distributed/test_weight_sync.py::test_a_cli_run_with_the_protocol_generator_logs_the_one_process_run"
    "[fsdp2-full]",
    # Packed hybrid rows (issue 43.2): make test keeps Qwen3-Next under ZeRO-3 (the engine that gathers the stateful
    # blocks whole); DDP and FSDP2, and Nemotron-H under all three, take paths that cell and the unit tier cover.
    *(f"tests/distributed/test_packed_state_engines.py::test_packed_hybrid_rows_under_engine_match_one_process"
      f"[{cell}]" for cell in ("qwen3_next-ddp", "qwen3_next-fsdp2", "nemotron_h-ddp", "nemotron_h-zero3",
                               "nemotron_h-fsdp2", "nemotron_h-zero3-lora")),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in MATRIX_ONLY:
            item.add_marker(pytest.mark.matrix)


def crash_after_checkpoint(finished: Path, crashed: Path, step: int) -> None:
    """A copy of a finished run as it was when the process died right after checkpoint-``step``: that checkpoint,
    the log up to it and the run's own files survive, nothing written later."""
    import json
    import shutil

    shutil.copytree(finished, crashed)
    for path in crashed.iterdir():
        if path.name not in (f"checkpoint-{step}", "trainer_log.jsonl", "shardtune_config.json", ".shardtune"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    kept = [x for x in (crashed / "trainer_log.jsonl").read_text().splitlines()
            if json.loads(x)["current_steps"] <= step]
    (crashed / "trainer_log.jsonl").write_text("\n".join(kept) + "\n")


def run_and_kill_a_worker(argv: list[str], env: dict[str, str], checkpoint: Path, is_worker: Callable[[str], bool],
                          finish_timeout: float, start_timeout: float = 400) -> tuple[int, str, str]:
    """Start a training command, SIGKILL its last worker process (a descendant whose command line satisfies
    ``is_worker``) once ``checkpoint`` is complete, and let it finish: (exit code, stdout, stderr)."""
    job = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout
        while not (checkpoint / "COMPLETE").is_file():
            if time.monotonic() > deadline or job.poll() is not None:
                raise TimeoutError(f"{checkpoint} never completed (exit code {job.poll()})")
            time.sleep(0.2)
        os.kill(descendant_pids(job.pid, is_worker)[-1], signal.SIGKILL)
        stdout, stderr = job.communicate(timeout=finish_timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return job.returncode, stdout, stderr


def descendant_pids(root: int, matches: Callable[[str], bool]) -> list[int]:
    """Descendants of process ``root`` whose command line (arguments joined by spaces) satisfies ``matches``."""
    found: list[int] = []
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        children = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
        for child in map(int, children):
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # ended meanwhile
                continue
            if matches(cmdline):
                found.append(child)
            frontier.append(child)
    assert found, "no worker process found"
    return sorted(found)
