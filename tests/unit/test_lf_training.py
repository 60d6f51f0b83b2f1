"""Training keys users copy from LLaMA-Factory / the HF Trainer, each shown by its effect: label_smoothing_factor
(chunked and plain loss equal torch's), neftune_noise_alpha (training forward only), tf32, dataloader_*,
include_num_input_tokens_seen."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shardtune.config.load import build_config
from shardtune.launch.validate import cross_key_problems
from shardtune.model.finetuning.apply import apply_finetuning
from shardtune.model.finetuning.neftune import apply_neftune
from shardtune.model.finetuning.settings import FinetuningSettings
from shardtune.train.loop import TrainState
from shardtune.train.loss import causal_lm_loss_sum, linear_cross_entropy_sum
from shardtune.train.setup import build_loader, loader_options
from shardtune.train.workflow import apply_tf32
from tests.conftest import run_cli
from tests.unit.test_chunked_loss import M, tiny_llama

SMOOTHING = 0.1


# --- label_smoothing_factor ---

def _rows(seed: int = 0, n: int = 23, hidden: int = 16, vocab: int = 37, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, hidden, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=g, dtype=dtype, requires_grad=True)
    bias = torch.randn(vocab, generator=g, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[::4] = M  # ignored rows
    return rows, weight, bias, targets


def test_chunked_label_smoothing_equals_torch_cross_entropy_value_and_gradients():
    rows, weight, bias, targets = _rows()
    ours = linear_cross_entropy_sum(rows, weight, bias, targets, 5, SMOOTHING)
    ours_grads = torch.autograd.grad(ours, (rows, weight, bias))
    reference = F.cross_entropy(F.linear(rows, weight, bias), targets, ignore_index=M, reduction="sum",
                                label_smoothing=SMOOTHING)
    reference_grads = torch.autograd.grad(reference, (rows, weight, bias))
    torch.testing.assert_close(ours, reference)
    for mine, theirs in zip(ours_grads, reference_grads, strict=True):
        torch.testing.assert_close(mine, theirs)
    unsmoothed = torch.autograd.grad(linear_cross_entropy_sum(rows, weight, bias, targets, 5), weight)[0]
    assert not torch.allclose(ours_grads[1], unsmoothed, atol=1e-3)  # the factor changes the update


def test_chunked_label_smoothing_gradients_match_finite_differences_in_fp64():
    """gradcheck's numerical half, by hand: the chunked loss hands its gradients over once (a head-sized buffer
    must not outlive the step), so gradcheck's repeated backward passes cannot run on it."""
    rows, weight, bias, targets = _rows(n=7, hidden=4, vocab=6, dtype=torch.float64)
    incoming = 2.5  # the backward scales the gradients formed in the forward
    loss = linear_cross_entropy_sum(rows, weight, bias, targets, 3, SMOOTHING)
    grads = torch.autograd.grad(loss * incoming, (rows, weight, bias))
    eps = 1e-6
    with torch.no_grad():
        for tensor, grad in zip((rows, weight, bias), grads, strict=True):
            for index in range(tensor.numel()):
                flat = tensor.view(-1)
                flat[index] += eps
                plus = linear_cross_entropy_sum(rows, weight, bias, targets, 3, SMOOTHING)
                flat[index] -= 2 * eps
                minus = linear_cross_entropy_sum(rows, weight, bias, targets, 3, SMOOTHING)
                flat[index] += eps
                numeric = incoming * (plus - minus) / (2 * eps)
                torch.testing.assert_close(grad.view(-1)[index], numeric, rtol=1e-6, atol=1e-7)


def test_chunked_loss_refuses_a_second_backward_with_the_key_to_change():
    rows, weight, bias, targets = _rows(n=7, hidden=4, vocab=6)
    loss = linear_cross_entropy_sum(rows, weight, bias, targets, 3)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="set loss_chunk_size: 0"):
        loss.backward()


@pytest.mark.parametrize("chunk_size", [0, 8])
def test_model_loss_with_label_smoothing_equals_torch_on_the_full_logits(chunk_size):
    model = tiny_llama()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 101, (2, 15), generator=g)
    labels = ids.clone()
    labels[:, :4] = M
    loss = causal_lm_loss_sum(model, {"input_ids": ids}, labels, chunk_size, SMOOTHING)
    logits = model(input_ids=ids).logits[:, :-1]
    expected = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=M,
                               reduction="sum", label_smoothing=SMOOTHING)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-4)


# --- neftune_noise_alpha ---

def test_neftune_noise_only_while_training_and_within_its_bound():
    alpha = 5.0
    clean, noisy = tiny_llama(), tiny_llama()
    apply_neftune(noisy, alpha)
    ids = torch.randint(0, 101, (2, 9))
    embeddings = noisy.get_input_embeddings()
    noisy.train()
    trained = embeddings(ids)
    plain = clean.get_input_embeddings()(ids)
    bound = alpha / (9 * 32) ** 0.5
    assert not torch.equal(trained, plain)
    assert float((trained - plain).abs().max()) <= bound + 1e-6
    assert float((trained - plain).abs().max()) > bound / 2  # uniform over the whole range, not a tiny jitter
    noisy.eval()
    torch.testing.assert_close(noisy(input_ids=ids).logits, clean.eval()(input_ids=ids).logits, rtol=0, atol=0)


def test_neftune_under_sequence_parallelism_scales_by_the_whole_rows_length():
    """NEFTune's magnitude is alpha / sqrt(L * d) with L the row's length; a rank of a 2-way split embeds half the
    row, so its noise must be drawn as for 2 x its slice, as one process draws it for the whole row."""
    alpha, row = 5.0, 18
    clean, noisy = tiny_llama(), tiny_llama()
    apply_finetuning(noisy, FinetuningSettings(finetuning_type="full", neftune_noise_alpha=alpha,
                                               sequence_parallel=2))
    part = torch.randint(0, 101, (1, row // 2))  # this rank's slice
    noisy.train()
    torch.manual_seed(3)
    noise = noisy.get_input_embeddings()(part) - clean.get_input_embeddings()(part)
    torch.manual_seed(3)
    bound = alpha / (row * 32) ** 0.5
    expected = torch.zeros(1, row // 2, 32).uniform_(-bound, bound)
    torch.testing.assert_close(noise, expected, rtol=0, atol=1e-6)


def test_the_run_tells_neftune_how_many_ranks_share_a_row():
    from shardtune.config.schema import TrainConfig
    from shardtune.train.settings import finetuning_settings

    config = TrainConfig(model_name_or_path="org/model", finetuning_type="full", neftune_noise_alpha=5.0,
                         sequence_parallel_size=2)
    assert finetuning_settings(config).sequence_parallel == 2


def test_neftune_reaches_the_embedding_a_lora_model_calls():
    settings = FinetuningSettings(neftune_noise_alpha=5.0, additional_target=("embed_tokens",))
    model = apply_finetuning(tiny_llama(), settings)
    ids = torch.randint(0, 101, (1, 7))
    model.train()
    first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert not torch.equal(first, second)  # fresh noise each training forward
    model.eval()
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


# --- tf32 ---

def test_tf32_changes_nothing_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU behaviour")
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    apply_tf32(not before[0])
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tf32_sets_the_cuda_flags():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        apply_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        apply_tf32(False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


# --- dataloader_* ---

class _Engine:
    world_size, rank = 1, 0
    data_parallel_size, data_parallel_rank = 1, 0


class _Tokenizer:
    pad_token_id = 0


def test_dataloader_keys_reach_the_loader():
    from datasets import Dataset

    data = Dataset.from_dict({"input_ids": [[1, 2, 3]] * 10, "attention_mask": [[1, 1, 1]] * 10,
                              "labels": [[1, 2, 3]] * 10})
    plain = {"padding_free": False}  # padding-free rows read the model's config; this loader has no model
    kept = build_loader(data, _Tokenizer(), 4, _Engine(), build_config(plain), True)
    dropped = build_loader(data, _Tokenizer(), 4, _Engine(), build_config({**plain, "dataloader_drop_last": True}),
                           True)
    assert (len(kept), len(dropped)) == (3, 2)
    assert sum(len(b["input_ids"]) for b in dropped) == 8
    config = build_config({"dataloader_num_workers": 2, "dataloader_persistent_workers": True})
    from shardtune.startup_gc import loader_worker_collects

    assert loader_options(config, has_cuda=True) == {"num_workers": 2, "pin_memory": True, "drop_last": False,
                                                     "persistent_workers": True,
                                                     "worker_init_fn": loader_worker_collects}
    assert loader_options(config, has_cuda=False)["pin_memory"] is False  # pinning needs a GPU to copy to
    assert not kept.pin_memory or torch.cuda.is_available()
    problems = cross_key_problems(build_config({"dataloader_persistent_workers": True}))
    assert any(p.startswith("dataloader_persistent_workers (true) needs dataloader_num_workers") for p in problems)


# --- include_num_input_tokens_seen ---

def test_tokens_seen_counts():
    state = TrainState(tokens_seen=10, slots_seen=16)
    assert [state.input_tokens_seen(w) for w in ("all", "non_padding", "no")] == [16, 10, None]
    assert build_config({"include_num_input_tokens_seen": True}).include_num_input_tokens_seen == "all"
    assert build_config({"include_num_input_tokens_seen": False}).include_num_input_tokens_seen == "no"


def _cli_run(model_dir, out, *extra: str) -> dict:
    result = run_cli("train", "examples/tiny/sft_full.yaml", f"model_name_or_path={model_dir}", f"output_dir={out}",
                     "finetuning_type=lora", "max_steps=3", "logging_steps=1", "save_strategy=no", "do_eval=false",
                     "eval_strategy=no", "val_size=0", "plot_loss=false", "max_samples=40", *extra)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads((out / "train_results.json").read_text())


@pytest.mark.e2e
def test_tokens_seen_and_training_extras_through_the_cli(tiny_model_dir, tmp_path):
    padded = _cli_run(tiny_model_dir, tmp_path / "all", "include_num_input_tokens_seen=true")
    real = _cli_run(tiny_model_dir, tmp_path / "np", "include_num_input_tokens_seen=non_padding",
                    "neftune_noise_alpha=5", "label_smoothing_factor=0.1", "dataloader_drop_last=true",
                    "loraplus_lr_ratio=16", "tf32=true")
    assert real["num_input_tokens_seen"] == real["train_tokens"]
    assert padded["num_input_tokens_seen"] > padded["train_tokens"]  # padding counted
    records = [json.loads(x) for x in (tmp_path / "np" / "trainer_log.jsonl").read_text().splitlines()]
    seen = [r["num_input_tokens_seen"] for r in records if "loss" in r]
    assert seen == sorted(seen) and seen[-1] == real["num_input_tokens_seen"]
    # Same data and seed: smoothing and noise make the first loss differ from the plain run.
    assert real["final_loss"] != pytest.approx(padded["final_loss"], rel=1e-4)
