"""Mixture of depths (model/depths.py; LLaMA-Factory's ``mixture_of_depths: convert | load``)."""

from __future__ import annotations

import pytest
import torch

from shardtune.errors import ConfigError
from shardtune.model.depth_checks import FAMILIES, depth_problem
from shardtune.model.depths import CAPACITY, apply_mixture_of_depths, routed_layer_ids
from shardtune.model.registry import tiny_registry_config

VOCAB = 512


def tiny(family: str = "llama", attention: str = "sdpa", layers: int = 4) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = tiny_registry_config(family, VOCAB)
    config.num_hidden_layers = layers
    for key in ("layer_types", "mlp_only_layers"):
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, (getattr(config, key) * layers)[:layers])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention)


def logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids = (torch.arange(2 * 48).view(2, 48) * 7 + 3) % VOCAB
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0  # the second row is 40 tokens, padded on the right
    return ids, mask


def seen_lengths(model: torch.nn.Module, index: int) -> list[int]:
    lengths: list[int] = []
    model.model.layers[index].self_attn.register_forward_hook(lambda _m, _a, out: lengths.append(out[0].shape[1]))
    return lengths


def test_every_second_layer_is_routed_and_sees_an_eighth_of_the_tokens():
    model = tiny()
    assert apply_mixture_of_depths(model, "convert", "") == routed_layer_ids(4) == [1, 3]
    assert model.config.mixture_of_depths == {"capacity": CAPACITY, "layers": [1, 3]}
    full, routed = seen_lengths(model, 0), seen_lengths(model, 1)
    logits(model, *rows())
    assert full == [48] and routed == [6]  # 48 x 12.5%: the padded row's own budget is 5, the batch takes 6


def test_tokens_the_router_passes_by_are_not_changed_by_the_layer():
    model = tiny()
    apply_mixture_of_depths(model, "convert", "")
    layer = model.model.layers[1]
    seen: dict[str, torch.Tensor] = {}
    layer.register_forward_hook(lambda _m, args, out: seen.update(inp=args[0], out=out))
    ids, _ = rows()
    logits(model, ids)
    changed = (seen["out"] - seen["inp"]).abs().amax(dim=-1) > 0
    assert changed.sum(dim=1).tolist() == [6, 6]


def test_a_row_is_routed_the_same_alone_and_beside_a_longer_row():
    """Its budget is its own tokens' share: two processes, each with other rows, compute what one process does."""
    model = tiny()
    apply_mixture_of_depths(model, "convert", "")
    ids, mask = rows()
    together = logits(model, ids, mask)[1, :40]
    alone = logits(model, ids[1:, :40])[0]
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


def test_eager_and_sdpa_route_alike_with_padding():
    ids, mask = rows()
    results = []
    for attention in ("eager", "sdpa"):
        model = tiny(attention=attention)
        apply_mixture_of_depths(model, "convert", "")
        results.append(logits(model, ids, mask))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results[0][1, :40], results[1][1, :40], rtol=1e-4, atol=1e-5)


def test_the_router_learns_and_generation_runs_every_layer():
    model = tiny()
    apply_mixture_of_depths(model, "convert", "")
    logits(model, *rows()).float().pow(2).mean().backward()
    assert model.model.layers[1].mod_router.weight.grad.abs().sum() > 0
    routed = seen_lengths(model, 1)
    model.generate(input_ids=rows()[0][:1, :10], max_new_tokens=2, do_sample=False)
    assert routed[0] == 10 and routed[1:] == [1]  # with a KV cache every token goes through every layer


def test_a_saved_routed_model_loads_routed_in_shardtune_and_plain_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny()
    apply_mixture_of_depths(model, "convert", "")
    with torch.no_grad():
        model.model.layers[1].mod_router.weight.normal_()
    model.save_pretrained(tmp_path)
    ids, mask = rows()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert "mod_router" not in str([name for name, _ in loaded.named_parameters()])  # transformers: dense
    apply_mixture_of_depths(loaded, "load", str(tmp_path))
    torch.testing.assert_close(logits(loaded, ids, mask), logits(model, ids, mask))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_routes_forward_and_backward(family):
    model = tiny(family)
    routed = apply_mixture_of_depths(model, "convert", "")
    lengths = seen_lengths(model, routed[0])
    logits(model, *rows()).float().pow(2).mean().backward()
    assert lengths == [6]
    assert all(p.grad is not None for p in model.parameters())


def test_checkpoints_that_cannot_be_routed_are_refused_with_the_fix():
    assert "use load" in depth_problem("convert", {"model_type": "llama", "mixture_of_depths": {}})
    assert "use convert" in depth_problem("load", {"model_type": "llama"})
    assert "bloom" not in FAMILIES and "'bloom' is not routed" in depth_problem("convert", {"model_type": "bloom"})
    with pytest.raises(ConfigError, match="use convert"):
        apply_mixture_of_depths(tiny(), "load", "")


@pytest.mark.parametrize(("extra", "said"), [
    (("finetuning_type=lora",), "use finetuning_type: full (not lora)"),
    (("packing=true",), "set packing: false"),
    (("fsdp=full_shard auto_wrap",), "with fsdp: the routers are added to the whole model"),
    (("deepspeed=z3",), "with DeepSpeed ZeRO-3"),
])
def test_check_refuses_what_cannot_be_routed_before_launch(extra, said, tiny_model_dir):
    from tests.conftest import run_cli

    result = run_cli("check", "examples/tiny/sft_full.yaml", f"model_name_or_path={tiny_model_dir}",
                     "mixture_of_depths=convert", *extra)
    assert result.returncode == 2 and said in result.stderr, result.stderr[-1500:]
    assert "Traceback" not in result.stderr
