"""Mixture-of-experts training under the engines, 2 gloo processes on CPU, against one process.

The tiny Qwen3-MoE (4 experts, top-2, fused 3-D expert weights) trains with each rank on tokens from its own half
of the vocabulary, so the ranks' routers choose different experts (counted by a hook in the worker). Checked: the
per-step loss (LM loss + coef x router aux loss) and the aux loss itself equal the one-process run of the same
micro-batches under every engine (DDP, ZeRO-2, ZeRO-3, FSDP2, FSDP1; full and LoRA but FSDP1's), and no engine
hangs; ZeRO-3 registers the sparse block as a leaf; FSDP2 shards the fused expert weights along the expert
dimension.
Mixtral, DeepSeek-V3 (a dense first layer, shared experts, no aux loss: its routing bias balances the experts) and
GPT-OSS run the same checks in the matrix. CLI runs check the product path: the per-expert checkpoint filled into
fused weights by the sharding engines, aux_loss logged next to loss, the saved output reloaded by plain
transformers/peft (every MoE family x engine x finetuning, with resume: test_architectures.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed.helpers import check_saved_model, logged, losses, train
from tests.distributed.test_deepspeed_engine import REPO, worker_env
from tests.rank_server import run_python

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

WORKER = Path(__file__).resolve().parent / "moe_worker.py"
RTOL = 1e-5  # same micro-batches, same windows: only the engines' reduction order differs
# Launched together in `make test` (one process group; about 2 s per case): every engine once.
REPRESENTATIVE = ("z3_full", "fsdp2_lora", "z2_lora", "fsdp1_full", "ddp_full")
# With the representative ones: every engine (DDP, ZeRO-2, ZeRO-3, FSDP2, FSDP1) x (full, LoRA) on Qwen3-MoE, but
# FSDP1 LoRA, which refuses LoRA on fused expert weights (test_architectures.py checks the refusal, and FSDP1 LoRA
# of the attention projections of every MoE family)
MATRIX = ("ddp_lora", "z3_lora", "fsdp2_full", "z2_full")


def run_worker(args: list[str], timeout: float) -> None:
    start = time.perf_counter()
    proc = run_python(args, worker_env(), REPO, timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args[-4:])} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    print(f"[moe-test] {' '.join(args[-4:])}: {time.perf_counter() - start:.1f}s")


@pytest.fixture(scope="module")
def moe_model(arch_model_dir) -> Path:
    return arch_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def worker_results(arch_model_dir, tmp_path_factory):
    """``worker_results(arch, case)``: the one-process reference of ``arch`` and the case's result. One launch
    runs every case of its group (the representative ones, or the matrix) in one process group."""
    references: dict[str, dict] = {}
    launched: set[tuple[str, tuple[str, ...]]] = set()

    def result(arch: str, case: str) -> tuple[dict, dict]:
        out = tmp_path_factory.getbasetemp() / f"moe-{arch}"
        model = str(arch_model_dir(arch))
        if arch not in references:
            out.mkdir(exist_ok=True)
            run_worker([sys.executable, str(WORKER), "--model", model, "--out", str(out), "--reference"], 300)
            references[arch] = json.loads((out / "reference.json").read_text())
        group = next(g for g in GROUPS[arch] if case in g)
        if (arch, group) not in launched:
            launched.add((arch, group))
            run_worker([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(WORKER), "--model", model, "--out", str(out), "--cases", ",".join(group)], 600)
        return references[arch], json.loads((out / f"{case}.json").read_text())

    return result


OTHER_FAMILIES = ("z3_full", "fsdp2_lora")
# Mixtral; DeepSeek-V3 (a dense first layer, shared experts, no aux loss); GPT-OSS (expert biases, eager attention)
OTHERS = ("mixtral", "deepseek_v3", "gpt_oss")
GROUPS = {"qwen3_moe": (REPRESENTATIVE, MATRIX), **{arch: (OTHER_FAMILIES,) for arch in OTHERS}}
LEAF = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "mixtral": "MixtralSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE",
        "gpt_oss": "GptOssMLP"}
CASES = [*(("qwen3_moe", c) for c in REPRESENTATIVE),
         *(pytest.param("qwen3_moe", c, marks=pytest.mark.matrix) for c in MATRIX),
         *(pytest.param(a, c, marks=pytest.mark.matrix) for a in OTHERS for c in OTHER_FAMILIES)]


@pytest.mark.parametrize(("arch", "case"), CASES)
def test_moe_engine_matches_one_process_with_ranks_routing_differently(arch, case, worker_results):
    engine, finetuning = case.split("_")
    reference, result = worker_results(arch, case)
    expected = reference[finetuning]
    assert [m["loss"] for m in result["metrics"]] == pytest.approx([m["loss"] for m in expected], rel=RTOL)
    if arch == "deepseek_v3":
        assert not any("aux_loss" in m for m in result["metrics"])  # no router aux loss in this family
    else:
        aux = [m["aux_loss"] for m in result["metrics"]]
        assert aux == pytest.approx([m["aux_loss"] for m in expected], rel=RTOL)
        assert all(a > 0 for a in aux)
    # the ranks' routers chose different experts (each rank's own top-k counts, gathered after training)
    rank0, rank1 = result["expert_counts"]
    assert sum(rank0) == sum(rank1) > 0 and rank0 != rank1
    if engine == "z3":
        assert result["z3_leaves"] == [LEAF[arch]]
    if engine == "fsdp2":
        shards = result["expert_shards"]
        assert len(shards) >= 2  # gate_up_proj and down_proj of every sparse block
        for full, local in shards.values():
            assert local[0] * 2 == full[0] and local[1:] == full[1:]  # the experts split between the ranks


# z3-lora: under ZeRO-3 the model is built partitioned, so the fused expert weights must be found by their full
# shape (ds_shape) for lora_target: all to adapt them as on one process
CLI_RUNS = [("z3", "full"), *(pytest.param(e, "lora", marks=pytest.mark.matrix) for e in ("fsdp2", "z3"))]
ENGINE_KEYS = {"z3": ("deepspeed=z3",), "fsdp2": ("fsdp=full_shard auto_wrap",)}


@pytest.mark.parametrize(("engine", "finetuning"), CLI_RUNS)
def test_cli_logs_the_router_aux_loss_and_matches_one_process(engine, finetuning, moe_model, tmp_path_factory):
    """Through the real CLI under ZeRO-3: aux_loss is logged beside loss, and the 2-process losses equal the
    1-process run of the same global batch. The aux term is a mean over micro-batches, and the sampler groups the
    rows differently on one and two processes, so only the LM part is exactly batch-invariant: the aux loss is
    compared loosely, the total at the parity tests' tolerance (coef 0.001, the model's own)."""
    one, two = tmp_path_factory.mktemp("moe-cli-1"), tmp_path_factory.mktemp("moe-cli-2")
    train(moe_model, one, finetuning, 1, 4)
    train(moe_model, two, finetuning, 2, 2, *ENGINE_KEYS[engine])
    assert len(logged(two, "aux_loss")) == len(losses(two)) == 4
    assert losses(two) == pytest.approx(losses(one), rel=2e-3)
    assert logged(two, "aux_loss") == pytest.approx(logged(one, "aux_loss"), rel=5e-2)
    # the model was filled from per-expert files into fused weights, sharded, trained, gathered and saved
    check_saved_model(two, moe_model, finetuning)  # every weight (or adapter matrix) trained and saved
    ids = torch.randint(5, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    # the 2-process model predicts as the 1-process one (Adam amplifies tiny gradient noise on rarely-seen
    # embedding rows, so single weights are not compared)
    assert saved_model_loss(two, moe_model, finetuning, ids) == pytest.approx(
        saved_model_loss(one, moe_model, finetuning, ids), rel=2e-3)


def saved_model_loss(out: Path, base: Path, finetuning: str, ids: torch.Tensor) -> float:
    """The loss on ``ids`` of the saved output, reloaded by plain transformers (and peft)."""
    from transformers import AutoModelForCausalLM

    if finetuning == "lora":
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
        assert any(".experts." in n and ".lora_B." in n for n, _ in model.named_parameters())
    else:
        model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)
