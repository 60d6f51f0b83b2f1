"""Build a tiny random LLaMA and a locally trained tokenizer: demos and tests need no model hub."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path

SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
# chatml, so that `template: auto` has a chat template to use.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bundled_corpus() -> Iterator[str]:
    """Lines of the text shipped with the package for training the tiny tokenizer."""
    text = resources.files("shardtune.model").joinpath("tiny_corpus.txt").read_text(encoding="utf-8")
    yield from (line for line in text.splitlines() if line.strip())


def build_tiny_tokenizer(texts: Iterable[str], vocab_size: int = 2048):
    """A byte-level BPE trained on ``texts``, with LLaMA-3 and chatml special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|pad|>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(
    out_dir: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 172,
    vocab_size: int = 2048,
    max_positions: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a random-weight ``LlamaForCausalLM`` and its tokenizer to ``out_dir`` (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer(bundled_corpus(), vocab_size=vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        # Larger than the usual 0.02 so the output head can express a peaked distribution: with a
        # 64-wide model and 0.02, logits stay near uniform and LoRA (head frozen) cannot lower the loss.
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
