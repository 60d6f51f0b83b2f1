"""Stage grpo through the real CLI on the tiny model, one process: the shipped example learns its toy reward (the
mean reward rises clearly within 40 CPU steps), a run is deterministic (same seed: the same completions, rewards,
losses and gradient norms), LoRA with a KL to the adapters-off reference and num_iterations 2 (the second step on the
same rollouts moves off-policy: the ratio is clipped somewhere), each loss type trains, and a reward function that
raises or answers with the wrong count, or a prompt longer than the cutoff allows (before launch, as `check` says
it), ends the run in one line naming it.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.e2e.test_train_cli import read_log, train

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

EXAMPLE = "examples/grpo/tiny_letter.yaml"
QUICK = ("max_steps=4", "save_strategy=no")


def error_lines(stderr: str) -> list[str]:
    """The error lines (a progress bar left without its newline may stand in front of one)."""
    return [line[line.index("shardtune: error:"):] for line in stderr.splitlines() if "shardtune: error:" in line]


def logged(out, key: str) -> list[float]:
    return [r[key] for r in read_log(out) if key in r and "loss" in r]


def test_the_example_learns_its_reward(tiny_model_dir, tmp_path):
    out = tmp_path / "grpo"
    train(EXAMPLE, tiny_model_dir, out)
    rewards = logged(out, "reward")
    assert len(rewards) == 40
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > 3 * first and last > 0.2, rewards
    for key in ("reward_std", "completions/mean_length", "frac_reward_zero_std", "clip_ratio/low_mean",
                "rewards/letter_share/mean", "grad_norm", "rollout_seconds"):
        assert key in read_log(out)[-1], key
    assert (out / "model.safetensors").is_file()


def test_same_seed_same_run(tiny_model_dir, tmp_path):
    for name in ("a", "b"):
        train(EXAMPLE, tiny_model_dir, tmp_path / name, *QUICK)
    for key in ("loss", "grad_norm", "reward", "completions/mean_length"):
        assert logged(tmp_path / "a", key) == logged(tmp_path / "b", key), key
    assert len(set(logged(tmp_path / "a", "reward"))) == 4  # the policy and so its completions change each step


def test_lora_with_kl_and_two_iterations(tiny_model_dir, tmp_path):
    out = tmp_path / "lora"
    train(EXAMPLE, tiny_model_dir, out, *QUICK, "finetuning_type=lora", "lora_target=all", "beta=0.04",
          "num_iterations=2", "learning_rate=5e-2", "epsilon_high=0.28", "loss_type=grpo")
    kl, high, low = logged(out, "kl"), logged(out, "clip_ratio/high_mean"), logged(out, "clip_ratio/low_mean")
    assert len(kl) == 4 and kl[0] == pytest.approx(0, abs=1e-7)  # step 1: the policy is the reference (B = 0)
    assert kl[1] > 0
    assert high[0] == low[0] == 0  # on-policy: ratio 1, nothing clipped
    assert max(high[1::2] + low[1::2]) > 0  # the repeat of a window trains off-policy
    assert (out / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("loss_type", ["dr_grpo", "gspo"])
def test_loss_types_train(loss_type, tiny_model_dir, tmp_path):
    out = tmp_path / loss_type
    train(EXAMPLE, tiny_model_dir, out, *QUICK, f"loss_type={loss_type}", "scale_rewards=batch")
    assert all(g > 0 for g in logged(out, "grad_norm"))


@pytest.mark.parametrize(("reward", "said"), [
    ("tests.grpo_rewards:raises", "reward_funcs (tests.grpo_rewards:raises) raised ValueError: this reward always "
                                  "fails on data row"),
    ("tests.grpo_rewards:one_short", "reward_funcs (tests.grpo_rewards:one_short) returned 3 values for the 4 "
                                     "completions of data row"),
])
def test_a_failing_reward_function_is_named_with_its_row(reward, said, tiny_model_dir, tmp_path):
    result = run_cli("train", EXAMPLE, f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path / 'r'}",
                     *QUICK, f"reward_funcs={reward}")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and said in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_a_prompt_longer_than_the_cutoff_allows_is_refused_before_launch(tiny_model_dir, tmp_path):
    """`check` finds it (the launching host builds the prompts as the ranks would), and so `train` refuses before
    any rank starts."""
    for command in ("check", "train"):
        result = run_cli(command, EXAMPLE, f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path / 'p'}",
                         *QUICK, "cutoff_len=24", NPROC_PER_NODE="2")
        assert result.returncode == 2, result.stderr[-3000:]
        errors = error_lines(result.stderr)
        assert len(errors) == 1 and "prompts are longer than cutoff_len (24) - max_completion_length (12)" in errors[0]
        assert "[rank" not in result.stdout + result.stderr


def test_a_reward_model_folder_scores_the_completions(tiny_model_dir, tmp_path):
    """A stage rm output named in reward_funcs scores each prompt + completion (the batch padded on the right) as its
    own forward scores one row alone: the score at the last token that is not padding."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from shardtune.train.reward_model_scorer import RewardModelScorer

    rm = tmp_path / "rm"
    train("examples/tiny/dpo_lora.yaml", tiny_model_dir, rm, "stage=rm", "finetuning_type=full", "max_steps=2",
          "save_strategy=no", "learning_rate=1e-3", "plot_loss=false")
    out = tmp_path / "grpo"
    train(EXAMPLE, tiny_model_dir, out, *QUICK, f"reward_funcs={rm}")
    rewards = logged(out, "rewards/rm/mean")
    assert len(rewards) == 4 and len(set(rewards)) == 4 and min(logged(out, "reward_std")) > 0
    scorer = RewardModelScorer(str(rm), torch.device("cpu"), AutoTokenizer.from_pretrained(tiny_model_dir))
    rows = [[5, 9, 13, 40, 41, 42, 7], [5, 9, 13, 40], [5, 9, 13, 40, 99]]
    model = AutoModelForSequenceClassification.from_pretrained(rm)
    with torch.no_grad():
        alone = [float(model(input_ids=torch.tensor([row])).logits[0, 0]) for row in rows]
    assert scorer.score(rows) == pytest.approx(alone, abs=1e-5)


def test_a_folder_that_is_no_reward_model_is_refused_before_launch(tiny_model_dir, tmp_path):
    result = run_cli("check", EXAMPLE, f"model_name_or_path={tiny_model_dir}", f"reward_funcs={tiny_model_dir}",
                     f"output_dir={tmp_path}")
    assert result.returncode == 2
    assert f"reward_funcs ({tiny_model_dir}) is not a reward model" in result.stderr, result.stderr


@pytest.mark.parametrize("kind", [("finetuning_type=full",),
                                  ("finetuning_type=lora", "lora_target=all", "learning_rate=5e-2",
                                   "vllm_importance_sampling_correction=false")],
                         ids=["full-corrected", "lora"])
def test_a_generator_with_its_own_synced_weights_gives_the_policys_own_run(kind, tiny_model_dir, tmp_path):
    """rollout_backend vllm_protocol_cpu (the vLLM protocol's CPU test double: a generator process with its own
    weights, streamed to it after every step; LoRA merged) samples the completions the policy itself samples, so
    the run logs the transformers back-end's rewards and lengths exactly, and the sync's seconds. Without the
    importance-sampling correction the losses and gradient norms are exactly the policy's own too; with it (the
    default) the generator's log-probabilities are the trainer's within fp32 noise, so every ratio is 1 within 1e-4
    and the losses equal within that."""
    train(EXAMPLE, tiny_model_dir, tmp_path / "own", *QUICK, *kind[:3])
    train(EXAMPLE, tiny_model_dir, tmp_path / "synced", *QUICK, *kind, "rollout_backend=vllm_protocol_cpu")
    corrected = "vllm_importance_sampling_correction=false" not in kind
    for key in ("loss", "grad_norm", "reward", "completions/mean_length"):
        own, synced = logged(tmp_path / "own", key), logged(tmp_path / "synced", key)
        if corrected and key in ("loss", "grad_norm"):
            assert synced == pytest.approx(own, rel=1e-4, abs=1e-6), key
        else:
            assert synced == own, key
    if corrected:
        assert max(logged(tmp_path / "synced", "sampling/sampling_logp_difference/max")) < 1e-4
        for key in ("min", "mean", "max"):
            assert logged(tmp_path / "synced", f"sampling/importance_sampling_ratio/{key}") == \
                pytest.approx([1.0] * 4, abs=1e-4), key
    else:
        assert "sampling/importance_sampling_ratio/mean" not in read_log(tmp_path / "synced")[-1]
    assert len(set(logged(tmp_path / "own", "reward"))) == 4  # the weights, and so the completions, change each step
    assert all(s > 0 for s in logged(tmp_path / "synced", "weight_sync_seconds"))
