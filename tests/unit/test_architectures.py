"""`make-tiny-model --arch`: every family builds from its own transformers config, loads as a real checkpoint,
keeps the structural feature it is there for, and carries a chat template that renders as shardtune's template."""

from __future__ import annotations

import pytest
import torch

from shardtune.data.templates import get_template
from shardtune.model.architectures import FAMILIES, SLIDING_WINDOW
from shardtune.model.tiny import build_tiny_model

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And now?"},
                {"role": "assistant", "content": "Still here."}]
FEATURES = {  # family -> what its tiny model must keep
    "qwen3": lambda m: m.config.tie_word_embeddings and m.lm_head.weight is m.model.embed_tokens.weight,
    "gemma3": lambda m: m.config.layer_types == ["sliding_attention", "full_attention"]
    and m.config.sliding_window == SLIDING_WINDOW,
    "mistral": lambda m: m.config.sliding_window == SLIDING_WINDOW,
    "qwen3_moe": lambda m: m.config.num_experts > m.config.num_experts_per_tok,
    "deepseek_v3": lambda m: m.config.first_k_dense_replace == 1 and m.config.kv_lora_rank > 0,
    "gpt_oss": lambda m: any(n.endswith("sinks") for n, _ in m.named_parameters()),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("arch")
    return {name: build_tiny_model(root / name, arch=name) for name in FAMILIES}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_builds_loads_and_trains_a_step(name, built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(built[name])
    assert model.config.model_type == FAMILIES[name].model_type
    tokenizer = AutoTokenizer.from_pretrained(built[name])
    ids = torch.tensor([tokenizer(tokenizer.apply_chat_template(CONVERSATION, tokenize=False))["input_ids"]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    if name in FEATURES:
        assert FEATURES[name](model)


@pytest.mark.parametrize("name", [n for n in FAMILIES if not get_template(FAMILIES[n].template).thinking])
def test_chat_template_renders_as_shardtunes_template(name, built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built[name])
    template = get_template(FAMILIES[name].template)
    turns = template.render_turns(CONVERSATION[0]["content"], CONVERSATION[1:], tokenizer)
    expected = "".join(prompt + response for prompt, response in turns)
    if name == "llama":  # the default model keeps chatml, which the demo and most tests render
        expected = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == expected
    for token in template.literal_special_tokens():
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token


def test_building_a_tiny_model_leaves_the_callers_random_stream_alone(tmp_path):
    """build_tiny_model_if_missing builds on the main rank inside the run: the run's LoRA initialisation and
    dropout must be those of every later run of the same config (the first `make demo` once ended at another
    loss than the second)."""
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    build_tiny_model(tmp_path / "tiny", arch="llama")
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)
