"""Dense, tied-embedding and mixture-of-experts families under every engine, 2 gloo processes on CPU against one
process.

Per family x engine x (full, LoRA), one run of 6 steps with a checkpoint at step 3 proves three things: its per-step
losses equal a 1-process run with the same global batch; the saved output reloads in plain transformers/peft with
the logits of the 1-process trained model (a tied model still tied: one matrix in the files, ``lm_head`` the
embedding after reload, also after ``shardtune export`` of the last checkpoint); and a copy of the run cut after
checkpoint-3 resumes onto the same curve and saves the same model. The MoE families train with their router aux
loss at the model's own coefficient (``assert_losses_match`` says how they are compared); that their ranks route to
different experts without hanging is test_moe_engines.py's check (a worker that controls each rank's tokens).

`make test` runs the slice in ``SLICE`` (each engine and each tied family at least once); the rest is marked
``matrix`` (`make test-matrix`). scripts/architecture_table.py renders this parametrization in docs/architectures.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.distributed.helpers import COMMON, ENGINE_KEYS, logged, losses, train
from tests.distributed.test_checkpoints import assert_resumed_like_finished, crash_after_first_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

FAMILIES = ("qwen3", "gemma3", "gemma2", "mistral", "phi3", "glm4", "qwen2")  # llama: test_engines_cli.py
# Trained as a user would: SFT without packing and the defaults. GPT-OSS needs eager attention (no sdpa, and
# flash-attn would drop its sinks): the default flash_attn: auto picks it. Packed rows would refuse its aux loss
# (one mask per layer type, train/loss.py), but sft does not pack unless asked.
MOE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
AUX_LOSS_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")  # DeepSeek-V3 balances its experts with a routing bias
# FSDP1 refuses LoRA on fused expert weights (engines/fsdp.py says why; test_fsdp1_refuses_lora_on_fused_experts):
# there the MoE families adapt what the refusal tells a user to, the attention projections.
ATTENTION_PROJECTIONS = {"deepseek_v3": "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"}
ENGINES = ENGINE_KEYS
FINETUNING = ("full", "lora")
# Steps 1-6 with a checkpoint after step 3 (what crash_after_first_checkpoint cuts at).
RUN = ("max_steps=6", "save_strategy=steps", "save_steps=3")
# In `make test` (kept small for its time): a tied and an untied family, full and LoRA, DDP and both FSDPs; the
# ZeRO engines take other families in test_engines_cli.py and test_moe_engines.py (Qwen3-MoE under ZeRO-3), and
# every family x engine cell, DeepSeek-V3 and GPT-OSS included, runs in make test-matrix.
SLICE = {("qwen3", "fsdp2", "lora"), ("gemma3", "fsdp1", "full"), ("phi3", "ddp", "lora")}
LOGITS_TOLERANCE = {"rtol": 2e-3, "atol": 2e-3}  # after 6 Adam steps; the losses match to 2e-3 relative


def cases() -> list:
    return [pytest.param(family, engine, finetuning, id=f"{family}-{engine}-{finetuning}",
                         marks=() if (family, engine, finetuning) in SLICE else pytest.mark.matrix)
            for family in (*FAMILIES, *MOE_FAMILIES) for engine in ENGINES for finetuning in FINETUNING]


@pytest.fixture(scope="session")
def one_process(arch_model_dir, tmp_path_factory):
    """``one_process(family, finetuning, *keys)``: the output folder of a 1-process run with the global batch (and
    ``keys``), run once."""
    found: dict[tuple[str, ...], Path] = {}

    def run(family: str, finetuning: str, *keys: str) -> Path:
        run_id = (family, finetuning, *keys)
        if run_id not in found:
            out = tmp_path_factory.mktemp(f"one-{family}-{finetuning}")
            train(arch_model_dir(family), out, finetuning, 1, 4, *RUN, *keys)
            found[run_id] = out
        return found[run_id]

    return run


def adapter_keys(family: str, engine: str, finetuning: str) -> tuple[str, ...]:
    if family in MOE_FAMILIES and engine == "fsdp1" and finetuning == "lora":
        return (f"lora_target={ATTENTION_PROJECTIONS.get(family, 'q_proj,k_proj,v_proj,o_proj')}",)
    return ()


def assert_losses_match(two: Path, one: Path, family: str, base: Path) -> None:
    """Per-step losses of the 2-process run equal the 1-process run's.

    An MoE total is LM loss + coef x router aux loss. The LM part is batch-invariant (a token sum over the global
    token count), but the aux loss is a mean over micro-batches of a per-micro-batch statistic, and one process with
    4 rows per micro-batch groups the rows differently from two processes with 2: it differs by a few percent. So
    the LM part (total - coef x aux, the model's own coef) is compared at the dense families' parity tolerance and
    the aux loss loosely. That the aux term reaches the gradients at its scale is test_moe_engines.py's check,
    where one process replays the ranks' micro-batches exactly.
    """
    if family not in AUX_LOSS_FAMILIES:
        assert logged(two, "aux_loss") == logged(one, "aux_loss") == []
        assert losses(two) == pytest.approx(losses(one), rel=2e-3)
        return
    coef = json.loads((base / "config.json").read_text())["router_aux_loss_coef"]
    aux = {run: logged(run, "aux_loss") for run in (one, two)}
    lm = {run: [total - coef * a for total, a in zip(losses(run), aux[run], strict=True)] for run in (one, two)}
    assert len(aux[two]) == len(losses(two)) and all(a > 0 for a in aux[two])
    assert lm[two] == pytest.approx(lm[one], rel=2e-3)
    assert aux[two] == pytest.approx(aux[one], rel=5e-2)


def assert_predicts_like_one_process(model: torch.nn.Module, one: Path, base: Path, family: str,
                                     finetuning: str) -> None:
    """The reloaded 2-process output predicts as the 1-process one: the same logits, or for a family with a router
    aux loss the same LM loss on fixed ids (as test_moe_engines.py's CLI test). Their aux gradients differ slightly
    (see assert_losses_match), and after 6 Adam steps single logits differ by up to ~2e-2 (measured: qwen3_moe,
    ZeRO-2 full; with moe_aux_loss_coef: 0 the same runs match to 2e-6). The tight checks of these outputs are the
    export and resume ones below, which compare 2-process models with each other."""
    if family not in AUX_LOSS_FAMILIES:
        torch.testing.assert_close(logits(model), logits(reloaded(one, base, finetuning)), **LOGITS_TOLERANCE)
        return
    assert lm_loss(model) == pytest.approx(lm_loss(reloaded(one, base, finetuning)), rel=2e-3)


def lm_loss(model: torch.nn.Module) -> float:
    ids = torch.randint(5, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 40).unsqueeze(0)).logits


def reloaded(out: Path, base: Path, finetuning: str) -> torch.nn.Module:
    """The saved output in plain transformers (peft for LoRA), as the class the folder declares (an image-text
    folder as its image-text class)."""
    from transformers import AutoConfig

    from shardtune.model.composite import auto_model_class

    if finetuning == "lora":
        from peft import PeftModel

        base_class = auto_model_class(AutoConfig.from_pretrained(base))
        return PeftModel.from_pretrained(base_class.from_pretrained(base), out)
    return auto_model_class(AutoConfig.from_pretrained(out)).from_pretrained(out)


def assert_tied_as_configured(model: torch.nn.Module, folder: Path) -> None:
    """A tied model keeps one matrix: the files hold no separate head, and after reload the head is the embedding."""
    from safetensors import safe_open

    tied = bool(model.config.tie_word_embeddings)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    names = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            names.update(handle.keys())
    assert ("lm_head.weight" in names) == (not tied), sorted(names)


@pytest.mark.parametrize(("family", "engine", "finetuning"), cases())
def test_family_under_engine_matches_one_process_saves_and_resumes(family, engine, finetuning, arch_model_dir,
                                                                   one_process, tmp_path):
    keys = adapter_keys(family, engine, finetuning)
    base, reference = arch_model_dir(family), one_process(family, finetuning, *keys)
    finished, crashed = tmp_path / "finished", tmp_path / "crashed"
    results = train(base, finished, finetuning, 2, 2, *RUN, *ENGINES[engine], *keys)
    assert results["world_size"] == 2
    assert_losses_match(finished, reference, family, base)

    model = reloaded(finished, base, finetuning)
    assert_predicts_like_one_process(model, reference, base, family, finetuning)
    if finetuning == "full":
        assert_tied_as_configured(model, finished)
        exported = tmp_path / "exported"
        result = run_cli("export", str(finished / "checkpoint-6"), "--out", str(exported))
        assert result.returncode == 0, result.stderr[-4000:]
        plain = reloaded(exported, base, finetuning)
        assert_tied_as_configured(plain, exported)
        torch.testing.assert_close(logits(plain), logits(model), rtol=1e-4, atol=1e-5)

    crash_after_first_checkpoint(finished, crashed)
    train(base, crashed, finetuning, 2, 2, *RUN, *ENGINES[engine], *keys, "overwrite_output_dir=false")
    assert_resumed_like_finished(finished, crashed, rel=1e-3)
    # The resumed run's save passed its own check (a tie lost on resume is two matrices: refused) and holds the
    # uninterrupted run's model.
    torch.testing.assert_close(logits(reloaded(crashed, base, finetuning)), logits(model), **LOGITS_TOLERANCE)


def test_fsdp1_refuses_lora_on_fused_experts(arch_model_dir, tmp_path):
    """LoRA on fused expert weights under FSDP1 stops with the key and the remedy, not with autograd's error."""
    result = run_cli("train", *COMMON, f"model_name_or_path={arch_model_dir('qwen3_moe')}", f"output_dir={tmp_path}",
                     "finetuning_type=lora", *ENGINES["fsdp1"], FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert result.returncode == 2, result.stderr[-4000:]
    assert "fsdp_version: 1" in result.stderr and "use fsdp_version: 2" in result.stderr, result.stderr[-4000:]
