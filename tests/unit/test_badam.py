"""BAdam (optim/badam.py): one block of decoder layers trains at a time, through the badam package.

Checked by effect on a 4-layer LLaMA: which weights a step changes (the active block's only), which block each step
trains for every switch mode (the package's schedule: the first switch after interval - 1 steps, then every
interval; random: a permutation per round drawn from the seed, the global random state untouched), that the
learning-rate schedule reaches the AdamW that steps the block, and that a run resumed from the state dict (and the
weights) takes the uninterrupted run's steps exactly, also across a switch and with bfloat16 weights whose fp32
copies only the state dict holds. The keys are refused before launch where the steps cannot hold.
"""

from __future__ import annotations

import io

import pytest
import torch

pytest.importorskip("badam", reason="use_badam needs the badam package (requirements.txt; pip install badam)")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from shardtune.config.load import build_config  # noqa: E402
from shardtune.engines.plan import plan_engine  # noqa: E402
from shardtune.errors import ConfigError  # noqa: E402
from shardtune.launch.optimizer_checks import badam_launch_problems  # noqa: E402
from shardtune.launch.validate import cross_key_problems  # noqa: E402
from shardtune.optim.badam import ResumableBlockOptimizer  # noqa: E402
from shardtune.optim.build import build_optimizer, build_scheduler  # noqa: E402
from shardtune.optim.settings import BlockSwitching, ExtraOptimizer, OptimizerSettings, optimizer_settings  # noqa: E402

LAYERS = 4


@pytest.fixture(autouse=True)
def _no_full_collection_per_switch(monkeypatch):
    """The package runs gc.collect() at every block switch: 0.7 s in a test process holding transformers (once per
    badam_switch_interval steps in a run). It only frees memory; the tests switch at nearly every step."""
    import badam.block_optim

    monkeypatch.setattr(badam.block_optim.gc, "collect", lambda *args: 0)


def _model(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
                         num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(config).to(dtype)


def _build(model: torch.nn.Module, lr: float = 1e-2, **blocks) -> ResumableBlockOptimizer:
    settings = OptimizerSettings(optim="adamw_torch", learning_rate=lr,
                                 extra=ExtraOptimizer("badam", blocks=BlockSwitching(**blocks)))
    optimizer = build_optimizer(list(model.parameters()), settings, None, model)
    assert isinstance(optimizer, ResumableBlockOptimizer)
    return optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, scheduler=None) -> None:
    """The engine's order: backward, step, schedule, zero_grad; the batch from its own generator."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _changed(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


def _trained_blocks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[int]:
    """The decoder layer each step changed, read from the weights."""
    trained = []
    for step in range(steps):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        _step(model, optimizer, step)
        layers = {int(n.split(".")[2]) for n in _changed(model, before)}
        assert len(layers) == 1, layers
        trained.append(layers.pop())
    return trained


def test_a_step_changes_the_active_blocks_weights_only():
    model = _model()
    optimizer = _build(model, switch_interval=5)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if n.startswith("model.layers.0.")}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _step(model, optimizer, 0)
    assert _changed(model, before) == {n for n, _ in model.named_parameters() if n.startswith("model.layers.0.")}


@pytest.mark.parametrize(("mode", "start", "expected"), [
    ("ascending", None, [0, 1, 1, 2, 2, 3, 3, 0]),
    ("descending", None, [3, 2, 2, 1, 1, 0, 0, 3]),
    ("ascending", 2, [2, 3, 3, 0, 0, 1, 1, 2]),
    ("fixed", 1, [1] * 8),
])
def test_blocks_switch_every_interval_in_the_configured_order(mode, start, expected):
    model = _model()
    assert _trained_blocks(model, _build(model, switch_mode=mode, start_block=start, switch_interval=2), 8) == expected


def test_interval_minus_one_never_switches():
    model = _model()
    assert _trained_blocks(model, _build(model, switch_interval=-1), 5) == [0] * 5


def _random_order(seed: int, rounds: int) -> list[int]:
    model = _model()
    optimizer = _build(model, switch_mode="random", switch_interval=1, seed=seed)
    state = torch.get_rng_state()
    order = _trained_blocks(model, optimizer, rounds * LAYERS)
    assert torch.equal(torch.get_rng_state(), state)  # the order is drawn from its own generator
    return order


def test_random_order_is_a_permutation_per_round_drawn_from_the_seed():
    order = _random_order(seed=7, rounds=2)
    assert sorted(order[:LAYERS]) == sorted(order[LAYERS:]) == list(range(LAYERS))
    assert _random_order(seed=7, rounds=2) == order
    assert any(_random_order(seed=s, rounds=1) != order[:LAYERS] for s in (8, 9))


def test_the_schedule_reaches_the_blocks_adamw():
    model = _model()
    optimizer = _build(model, switch_interval=10)
    scheduler = build_scheduler(optimizer, "linear", total_steps=4, warmup_steps=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _step(model, optimizer, 0, scheduler)  # warm-up step 0: learning rate 0, nothing moves
    assert not _changed(model, before)
    used = []
    for step in (1, 2):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        used.append(optimizer.base_optimizer.param_groups[0]["lr"])
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    assert used == pytest.approx([0.5e-2, 1e-2])
    assert _changed(model, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_from_the_state_dict_takes_the_uninterrupted_steps(dtype):
    """17 steps straight against 10 steps, a save (weights and optimizer, loaded as a checkpoint is, weights_only)
    and 7 steps on a fresh model and optimizer. The save falls inside a block of random's second round (the block's
    fp32 copies have moved off the bfloat16 weights); switches and the third round's permutation come after it."""
    keys = {"switch_mode": "random", "switch_interval": 2, "seed": 3}
    straight = _model(dtype)
    optimizer = _build(straight, **keys)
    scheduler = build_scheduler(optimizer, "cosine", total_steps=17, warmup_steps=1)
    for step in range(17):
        _step(straight, optimizer, step, scheduler)

    first = _model(dtype)
    optimizer = _build(first, **keys)
    scheduler = build_scheduler(optimizer, "cosine", total_steps=17, warmup_steps=1)
    for step in range(10):
        _step(first, optimizer, step, scheduler)
    weights, buffer = {n: p.detach().clone() for n, p in first.named_parameters()}, io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed = _model(dtype)
    optimizer = _build(resumed, **keys)
    scheduler = build_scheduler(optimizer, "cosine", total_steps=17, warmup_steps=1)
    with torch.no_grad():  # the engine loads the weights first, then the optimizer
        for name, param in resumed.named_parameters():
            param.copy_(weights[name])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    for step in range(10, 17):
        _step(resumed, optimizer, step, scheduler)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_start_block_past_the_last_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"badam_start_block \(4\): the model has 4 blocks"):
        _build(_model(), start_block=4)


def test_a_start_block_past_the_last_is_refused_before_launch(tiny_model_dir):
    from shardtune.launch.model_checks import layer_problems

    keys = {"use_badam": True, "model_name_or_path": str(tiny_model_dir)}
    layers = LlamaConfig.from_pretrained(tiny_model_dir).num_hidden_layers
    assert layer_problems(build_config({**keys, "badam_start_block": layers})) == [
        f"badam_start_block ({layers}): the model has {layers} decoder layers, BAdam's blocks 0 to {layers - 1}; "
        "choose one of them or leave it unset"]
    assert layer_problems(build_config({**keys, "badam_start_block": layers - 1})) == []


def test_a_checkpoint_without_decoder_layer_names_is_refused_before_launch(tiny_model_dir, arch_model_dir):
    from shardtune.launch.optimizer_checks import badam_layer_problems

    assert badam_layer_problems(build_config({"use_badam": True, "model_name_or_path": str(tiny_model_dir)})) == []
    gpt2 = build_config({"use_badam": True, "model_name_or_path": str(arch_model_dir("gpt2"))})  # h.N. blocks
    assert badam_layer_problems(gpt2) == [
        "use_badam (true): no weight name of the checkpoint holds 'layers.N.', so BAdam finds no decoder layers to "
        "train block by block; use finetuning_type: full without BAdam for this model"]
    assert badam_layer_problems(build_config({"model_name_or_path": str(arch_model_dir("gpt2"))})) == []


# --- config ---

def test_llamafactory_keys_reach_the_settings():
    c = build_config({"use_badam": True, "finetuning_type": "full", "badam_mode": "layer",
                      "badam_switch_mode": "descending", "badam_switch_interval": 20, "badam_start_block": 1,
                      "badam_verbose": 2, "seed": 5,
                      "badam_update_ratio": 0.1, "badam_mask_mode": "scatter"})  # ratio-mode settings: inert
    extra = optimizer_settings(c).extra
    assert extra.kind == "badam" and extra.blocks == BlockSwitching(1, "descending", 20, 2, 5)
    assert not [p for p in cross_key_problems(c) if "badam" in p]
    assert optimizer_settings(build_config({"badam_mode": "layer"})).extra.kind is None  # off: inert


@pytest.mark.parametrize(("keys", "expected"), [
    ({"badam_mode": "ratio"}, "badam_mode (ratio): the ratio mode"),
    ({"finetuning_type": "lora"}, "use_badam (true) with finetuning_type (lora)"),
    ({"optim": "sgd"}, "use_badam (true) with optim (sgd)"),
    ({"badam_switch_interval": 0}, "badam_switch_interval (0)"),
    ({"use_galore": True}, "use_galore and use_badam each replace the optimizer"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
     "use_badam (true) with gradient_checkpointing_kwargs.use_reentrant (true)"),
])
def test_what_cannot_hold_is_refused_naming_the_key(keys, expected):
    problems = cross_key_problems(build_config({"use_badam": True, "optim": "adamw_torch", **keys}))
    assert any(expected in p for p in problems), problems


def test_more_than_one_process_is_refused_and_one_is_not():
    c = build_config({"use_badam": True})
    plan, problems = plan_engine(c, world_size=1, has_cuda=False)
    assert plan.kind == "local" and not problems
    _, problems = plan_engine(c, world_size=2, has_cuda=False)
    assert any(p.startswith("use_badam (true) with ddp") for p in problems), problems
    for engine, label in (({"deepspeed": "z3"}, "deepspeed"), ({"fsdp": "full_shard auto_wrap"}, "fsdp")):
        _, problems = plan_engine(build_config({"use_badam": True, **engine}), world_size=2, has_cuda=False)
        assert any(p.startswith(f"use_badam (true) with {label}") and "one process" in p for p in problems), problems
    assert badam_launch_problems(c, force_torchrun=True) and not badam_launch_problems(c, force_torchrun=False)

