"""Expert parallelism under FSDP2, on 2 and 4 gloo processes, against one process and against FSDP2 without it.

The worker (moe_worker.py, cases ``fsdp2ep<E>_<finetuning>``) trains each MoE family with every rank on tokens from
its own slice of the vocabulary, so the ranks route to different experts. Checked per step: the loss, the router's
aux loss and the gradient norm equal the one-process run of the same micro-batches within 1e-5 (relative), and the
weights after the last step agree (a norm and a random projection of every weight, gathered whole), with the experts
computed by transformers' grouped matmul (its default) or by its per-expert loop; the run
reports which experts each rank held and that the all-to-alls moved rows (the split is on, not assumed). A router
forced to send the second half of the ranks no tokens neither hangs nor changes the result. The CLI cells check the
product path: sharded loading into the split experts, the dry run's mesh, train_results.json, the saved model
loading in transformers as the family's class with the EP = 1 run's logits, and resume across EP sizes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.distributed.helpers import logged, losses, train
from tests.distributed.test_moe_engines import WORKER, run_worker

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

RTOL = 1e-5
ATOL = 1e-6
METRICS = ("loss", "grad_norm", "aux_loss")
# (family, world) -> cases launched together. make test: Qwen3-MoE on 2 ranks; the matrix: the other families
# (Mixtral, DeepSeek-V3 with shared experts and a dense first layer, GPT-OSS with expert biases, Qwen2-MoE with a
# gated shared expert), each also on 4 ranks (EP 2 x expert-data-parallel 2, EP 4), full and LoRA.
# DeepSpeed's AutoEP (z<stage>ep<E>, ZeRO-1/2/3, full: deepspeed_autoep.py refuses the rest) against one process
# and against the same ZeRO stage without it (z<stage>_full): Qwen3-MoE's ZeRO-2 in make test (with a router that
# leaves a rank without tokens), the other families it has a preset for on 2 and 4 ranks (EP 2 x expert-data-parallel
# 2, EP 4) and Qwen3-MoE's ZeRO-1 and ZeRO-3 (experts partitioned over the expert-data-parallel pair) in the matrix.
AUTOEP_FAMILIES = ("mixtral", "deepseek_v3", "qwen2_moe")
AUTOEP = {("qwen3_moe", 2): ("z2_full", "z2ep2_full", "z2ep2_skewfull"),
          ("qwen3_moe", 4): ("z2_full", "z2ep2_full", "z2ep4_full", "z1ep2_full", "z3_full", "z3ep2_full"),
          **{(family, 2): ("z2_full", "z2ep2_full") for family in AUTOEP_FAMILIES},
          **{(family, 4): ("z2_full", "z2ep2_full", "z2ep4_full") for family in AUTOEP_FAMILIES}}
GROUPS: dict[tuple[str, int], tuple[str, ...]] = {
    ("qwen3_moe", 2): ("fsdp2_full", "fsdp2ep2_full", "fsdp2ep2_attnlora", "fsdp2ep2_lora", "fsdp2ep2_skewfull",
                       "fsdp2ep2_skewlora", "fsdp2ep2_loopfull"),
    **{(family, 2): ("fsdp2ep2_full", "fsdp2ep2_attnlora", "fsdp2ep2_lora") for family in ("mixtral", "deepseek_v3",
                                                                                          "gpt_oss", "qwen2_moe")},
    ("qwen3_moe", 4): ("fsdp2ep2_full", "fsdp2ep4_full", "fsdp2ep4_attnlora", "fsdp2ep2_lora", "fsdp2ep4_lora",
                       "fsdp2ep4_skewfull"),
    **{(family, 4): ("fsdp2ep2_full", "fsdp2ep4_full", "fsdp2ep2_lora", "fsdp2ep4_lora")
       for family in ("mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe")},
}
GROUPS = {key: cases + AUTOEP.get(key, ()) for key, cases in GROUPS.items()}
CELLS = [(family, world, case) for (family, world), cases in GROUPS.items() for case in cases if "ep" in case]
IN_MAKE_TEST = {("qwen3_moe", 2)}


@pytest.fixture(scope="module")
def ep_results(arch_model_dir, tmp_path_factory):
    """``ep_results(family, world, case)``: (the one-process reference, the case's result, FSDP2 EP=1's or None)."""
    references: dict[tuple[str, int], dict] = {}
    launched: set[tuple[str, int]] = set()

    def result(family: str, world: int, case: str) -> tuple[dict, dict, dict | None]:
        out = tmp_path_factory.getbasetemp() / f"ep-{family}-{world}"
        model = str(arch_model_dir(family))
        if (family, world) not in references:
            out.mkdir(exist_ok=True)
            run_worker([sys.executable, str(WORKER), "--model", model, "--out", str(out), "--reference",
                        "--world", str(world)], 300)
            references[family, world] = json.loads((out / "reference.json").read_text())
        if (family, world) not in launched:
            launched.add((family, world))
            run_worker([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(world), str(WORKER), "--model", model, "--out", str(out), "--world", str(world),
                        "--cases", ",".join(GROUPS[family, world])], 900)
        without = out / f"{case.split('ep')[0]}_full.json"  # the same engine without expert parallelism
        return (references[family, world], json.loads((out / f"{case}.json").read_text()),
                json.loads(without.read_text()) if without.is_file() else None)

    return result


def cell_params() -> list:
    return [pytest.param(f, w, c, id=f"{f}-{w}ranks-{c}",
                         marks=[] if (f, w) in IN_MAKE_TEST else [pytest.mark.matrix]) for f, w, c in CELLS]


def assert_close(expected: list[dict], got: list[dict], what: str) -> None:
    assert len(expected) == len(got), what
    for step, (a, b) in enumerate(zip(expected, got, strict=True), start=1):
        for key in METRICS:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=RTOL), f"{what}: step {step} {key} {b[key]} != {a[key]}"


# Adam's step is per element and scale-free, so an element whose gradient is tiny moves by the learning rate with the
# rounding of its gradient's sums: a key bias only shifts scores through RoPE's position differences, and Qwen2-MoE's
# has elements of 5e-8 whose fp32 rounding is 1e-3 of them (fp64 against fp32, one process); on 4 ranks the summation
# order moves it 1.6e-6 after the last step. The losses and gradient norms above still cover it.
ROUNDING_DRIVEN_WEIGHTS = ("self_attn.k_proj.bias",)


def assert_same_weights(expected: dict[str, list[float]], got: dict[str, list[float]], what: str) -> None:
    assert expected.keys() == got.keys(), what
    for name, (norm, projection) in expected.items():
        if name.endswith(ROUNDING_DRIVEN_WEIGHTS):
            continue
        # Near-zero weights (biases a few steps from zero) take Adam's sign-sized steps: an absolute floor for them.
        assert abs(got[name][1] - projection) <= RTOL * norm + ATOL, f"{what}: {name} differs after the last step"
        assert got[name][0] == pytest.approx(norm, rel=RTOL, abs=ATOL), f"{what}: {name} norm differs"


@pytest.mark.parametrize(("family", "world", "case"), cell_params())
def test_expert_parallel_equals_one_process(ep_results, family: str, world: int, case: str) -> None:
    reference, result, without = ep_results(family, world, case)
    finetuning = case.split("_")[1]
    size = int(case.split("_")[0].split("ep")[1])
    assert_close(reference[finetuning], result["metrics"], f"{family} {case} vs one process")
    if without is not None and finetuning in ("full", "loopfull"):  # loopfull: the loop equals the grouped matmul
        assert_close(without["metrics"], result["metrics"], f"{family} {case} vs the engine without expert parallelism")
    if "weights" in result:
        assert_same_weights(reference[f"{finetuning}:weights"], result["weights"], f"{family} {case}")
    report = result["expert_parallel"]
    assert report["size"] == size and report["expert_data_parallel_size"] == world // size
    ranks = report["ranks"]
    experts = report["experts_per_rank"] * size
    # The ranks of an ep group hold disjoint experts that together make the layer; every group holds them all.
    for first in range(0, world, size):
        held = [e for r in ranks[first:first + size] for e in r["experts_held"]]
        assert sorted(held) == list(range(experts)), f"ep group at rank {first} holds {held}"
    if report.get("via") == "deepspeed-autoep":  # DeepSpeed's dispatch: the rows its experts computed are counted
        assert "weights" in result
    else:
        assert all(r["all_to_all_bytes_per_step"] > 0 for r in ranks)
    if finetuning.startswith("skew"):  # the router sends every choice to the first half of the experts
        idle = [r["rows_received_per_step"] for r in ranks if min(r["experts_held"]) >= experts // 2]
        busy = [r["rows_received_per_step"] for r in ranks if max(r["experts_held"]) < experts // 2]
        # AutoEP pads each expert's rows to its alignment, so an expert without tokens still computes a few rows
        # (64 per step here, against 536 on the busy rank); the result equals the skewed one-process run above.
        padding = max(busy) // 4 if report.get("via") == "deepspeed-autoep" else 0
        assert idle and all(rows <= padding for rows in idle) and all(rows > padding for rows in busy), ranks
    else:
        assert all(r["rows_received_per_step"] > 0 for r in ranks)


CLI = ("fsdp=full_shard", "finetuning_type=full")


def test_cli_expert_parallel_run_saves_resumes_and_exports(arch_model_dir, tmp_path: Path) -> None:
    """Through `shardtune train`: EP = 2 (sharded loading into the split experts) equals FSDP2 without it step for
    step; the saved model loads in transformers as the family's class with the EP = 1 run's logits; a checkpoint
    written with EP = 2 resumes with EP = 1 onto the same curve, and one written with EP = 1 resumes with EP = 2."""
    model = arch_model_dir("qwen3_moe")
    with_ep, without, resumed = tmp_path / "ep2", tmp_path / "ep1", tmp_path / "resumed"
    results = train(model, with_ep, "full", 2, 2, *CLI, "expert_parallel_size=2", "save_strategy=steps",
                    "save_steps=2")
    train(model, without, "full", 2, 2, *CLI, "save_strategy=steps", "save_steps=2")
    assert losses(with_ep) == pytest.approx(losses(without), rel=RTOL)
    assert logged(with_ep, "grad_norm") == pytest.approx(logged(without, "grad_norm"), rel=RTOL)
    assert results["expert_parallel"]["size"] == 2
    assert [r["experts_held"] for r in results["expert_parallel"]["ranks"]] == [[0, 1], [2, 3]]
    assert_same_logits(with_ep, without)
    train(model, resumed, "full", 2, 2, *CLI, f"resume_from_checkpoint={with_ep / 'checkpoint-2'}")
    assert losses(resumed)[-2:] == pytest.approx(losses(with_ep)[-2:], rel=RTOL)
    split = tmp_path / "split"
    train(model, split, "full", 2, 2, *CLI, "expert_parallel_size=2",
          f"resume_from_checkpoint={without / 'checkpoint-2'}")
    assert losses(split)[-2:] == pytest.approx(losses(without)[-2:], rel=RTOL)


def test_cli_lora_on_the_experts_trains_and_saves_as_without_expert_parallelism(arch_model_dir,
                                                                                 tmp_path: Path) -> None:
    """LoRA on every target, the fused expert weights included (peft's target_parameters), with EP = 2: each rank
    applies its experts' slice of the adapters (engines/expert_adapters.py); the losses and gradient norms equal FSDP2
    without expert parallelism step for step, and so does every tensor of the saved adapter (under peft's names)."""
    from safetensors.torch import load_file

    model = arch_model_dir("qwen3_moe")
    lora = ("fsdp=full_shard", "lora_target=all", "learning_rate=1e-2")
    with_ep, without = tmp_path / "ep2", tmp_path / "ep1"
    train(model, with_ep, "lora", 2, 2, *lora, "expert_parallel_size=2")
    train(model, without, "lora", 2, 2, *lora)
    assert losses(with_ep) == pytest.approx(losses(without), rel=RTOL)
    assert logged(with_ep, "grad_norm") == pytest.approx(logged(without, "grad_norm"), rel=RTOL)
    saved, expected = (load_file(folder / "adapter_model.safetensors") for folder in (with_ep, without))
    assert saved.keys() == expected.keys() and any("experts" in name for name in saved)
    for name, tensor in expected.items():  # Adam's sign-sized steps on near-zero gradients: 2.5e-6 measured
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def assert_same_logits(trained: Path, other: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.arange(3, 19).unsqueeze(0)
    one, two = (AutoModelForCausalLM.from_pretrained(folder) for folder in (trained, other))
    assert type(one).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(one(ids).logits, two(ids).logits, rtol=RTOL, atol=1e-5)


def test_dry_run_prints_the_expert_mesh(arch_model_dir, tmp_path: Path) -> None:
    result = run_cli("train", "examples/tiny/sft_full.yaml", f"model_name_or_path={arch_model_dir('qwen3_moe')}",
                     f"output_dir={tmp_path / 'out'}", *CLI, "expert_parallel_size=2", "--dry-run",
                     NPROC_PER_NODE="4", FORCE_TORCHRUN="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("expert parallel: mesh (expert-data-parallel 2 x expert-parallel 2), 2 of 4 experts per layer on each "
            "rank; dense weights sharded over all 4 ranks") in result.stdout


@pytest.mark.matrix
def test_train_refuses_as_check_does(arch_model_dir, tmp_path: Path) -> None:
    """Through the real CLI (every refusal: tests/unit/test_expert_parallel_plan.py): one line naming the key and
    the reason, exit 2, nothing started, from `train` as from `check`."""
    args = ("examples/tiny/sft_full.yaml", f"model_name_or_path={arch_model_dir('qwen3_moe')}",
            f"output_dir={tmp_path / 'out'}", "finetuning_type=full", "expert_parallel_size=2")
    for command in ("check", "train"):
        result = run_cli(command, *args, NPROC_PER_NODE="2", FORCE_TORCHRUN="1")
        assert result.returncode == 2, (command, result.stdout[-1000:], result.stderr[-2000:])
        assert "expert_parallel_size (2) with engine ddp" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.matrix
def test_evaluation_and_generation_under_expert_parallelism(arch_model_dir, tmp_path: Path) -> None:
    """Evaluation and greedy generation (do_predict, ranks with different numbers of prompts: 41 over 2) run the
    dispatch in every forward; they equal the run without expert parallelism."""
    model = arch_model_dir("qwen3_moe")
    runs = {}
    for name, extra in (("ep2", ("expert_parallel_size=2",)), ("ep1", ())):
        out = tmp_path / name
        train(model, out, "full", 2, 2, *CLI, *extra, "do_eval=true", "eval_strategy=steps",
              "eval_steps=2", "do_predict=true", "predict_with_generate=true", "eval_dataset=demo",
              "max_new_tokens=8", "per_device_eval_batch_size=3", "do_sample=false", "max_samples=41")
        log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines() if line.strip()]
        runs[name] = ([r["eval_loss"] for r in log if "eval_loss" in r],
                      [json.loads(line)["predict"] for line in (out / "generated_predictions.jsonl").open()])
    assert runs["ep2"][0] and runs["ep2"][0] == pytest.approx(runs["ep1"][0], rel=RTOL)
    assert len(runs["ep2"][1]) == 41 and runs["ep2"][1] == runs["ep1"][1]


@pytest.mark.matrix
@pytest.mark.parametrize("saving", [("async_save=true",), ("fsdp_config={'state_dict_type': 'FULL_STATE_DICT'}",)],
                         ids=["async-save", "full-state-dict"])
def test_checkpoints_of_every_kind_resume_under_expert_parallelism(arch_model_dir, tmp_path: Path,
                                                                    saving: tuple[str, ...]) -> None:
    """A background (async_save) or whole (FULL_STATE_DICT) checkpoint of the split experts resumes onto the same
    curve."""
    model = arch_model_dir("qwen3_moe")
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    train(model, first, "full", 2, 2, *CLI, "expert_parallel_size=2", "save_strategy=steps", "save_steps=2", *saving)
    assert (first / "checkpoint-2" / "COMPLETE").is_file()
    train(model, resumed, "full", 2, 2, *CLI, "expert_parallel_size=2", *saving[1:] if "async" in saving[0] else saving,
          f"resume_from_checkpoint={first / 'checkpoint-2'}")
    assert losses(resumed)[-2:] == pytest.approx(losses(first)[-2:], rel=RTOL)


@pytest.mark.matrix
@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_cli_deepspeed_autoep_saves_resumes_and_exports(stage, arch_model_dir, tmp_path: Path) -> None:
    """Through `shardtune train` with ZeRO-2 (and ZeRO-3, whose experts are gathered module by module to save):
    AutoEP 2 equals the same run without it step for step, each rank held its half of the experts, the saved model
    loads in transformers as the family's class with the EP = 1 run's logits, and a checkpoint resumes (same EP
    size, same world) onto the same curve."""
    model = arch_model_dir("qwen3_moe")
    deepspeed = (f"deepspeed=examples/deepspeed/ds_z{stage}_config.json", "finetuning_type=full")
    with_ep, without, resumed = tmp_path / "ep2", tmp_path / "ep1", tmp_path / "resumed"
    results = train(model, with_ep, "full", 2, 2, *deepspeed, "expert_parallel_size=2", "save_strategy=steps",
                    "save_steps=2")
    train(model, without, "full", 2, 2, *deepspeed)
    assert losses(with_ep) == pytest.approx(losses(without), rel=RTOL)
    assert logged(with_ep, "grad_norm") == pytest.approx(logged(without, "grad_norm"), rel=RTOL)
    report = results["expert_parallel"]
    assert report["via"] == "deepspeed-autoep" and [r["experts_held"] for r in report["ranks"]] == [[0, 1], [2, 3]]
    assert_same_logits(with_ep, without)
    train(model, resumed, "full", 2, 2, *deepspeed, "expert_parallel_size=2",
          f"resume_from_checkpoint={with_ep / 'checkpoint-2'}")
    assert losses(resumed)[-2:] == pytest.approx(losses(with_ep)[-2:], rel=RTOL)


@pytest.mark.matrix
def test_a_checkpoint_of_two_expert_ranks_resumes_on_four(arch_model_dir, tmp_path: Path) -> None:
    """EP = 2 on 2 processes, resumed with EP = 4 on 4 (the same global batch): the experts are resharded from two
    ranks' halves into four quarters, and the run continues the same curve."""
    model = arch_model_dir("qwen3_moe")
    first, resumed = tmp_path / "ep2", tmp_path / "ep4"
    train(model, first, "full", 2, 2, *CLI, "expert_parallel_size=2", "save_strategy=steps", "save_steps=2")
    results = train(model, resumed, "full", 4, 1, *CLI, "expert_parallel_size=4",
                    f"resume_from_checkpoint={first / 'checkpoint-2'}")
    assert results["expert_parallel"]["size"] == 4
    assert losses(resumed)[-2:] == pytest.approx(losses(first)[-2:], rel=RTOL)
