"""The weight sync of a generator with its own weights (train/weight_sync.py) on one process, into the real generator
process (train/protocol_generator.py): checkpoint names, bit-for-bit copies (LoRA merged as peft merges), buckets
sized by full tensor bytes, the peak of one layer plus a bucket, and completions equal to the policy's own."""

from __future__ import annotations

import copy

import pytest
import torch

from shardtune.engines.base import PrecisionSettings
from shardtune.engines.local import LocalEngine
from shardtune.train.grpo_loss import completion_logps
from shardtune.train.protocol_generator import GeneratorClient, GeneratorProcess, tensor_digest
from shardtune.train.rollout import Sampling, TransformersRollout
from shardtune.train.weight_sync import SyncReport, checkpoint_name, sync_weights

LAYER = 2048 * 128 * 4  # the largest layer of the model below: its embedding (and its untied output layer)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from shardtune.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("sync") / "m", hidden=128, layers=2, intermediate=512)


@pytest.fixture(scope="module")
def generator(model_dir):
    process = GeneratorProcess(model_dir, torch.float32)
    yield process
    process.stop()


def engine_for(model_dir, finetuning: str) -> LocalEngine:
    from transformers import AutoModelForCausalLM

    from shardtune.model.finetuning.apply import apply_finetuning
    from shardtune.model.finetuning.settings import FinetuningSettings

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if finetuning == "lora":
        model = apply_finetuning(model, FinetuningSettings(finetuning_type="lora", lora_rank=4))
    engine = LocalEngine(PrecisionSettings(), torch.device("cpu"))
    engine.prepare(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                   lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))
    return engine


def train_one_step(engine: LocalEngine) -> None:
    ids = torch.randint(3, 2048, (2, 10), generator=torch.Generator().manual_seed(1))
    engine.model(input_ids=ids, labels=ids).loss.backward()
    engine.step(1.0)


def checkpoint_digests(model: torch.nn.Module) -> dict[str, str]:
    plain = copy.deepcopy(model)
    plain = plain.merge_and_unload() if hasattr(plain, "peft_config") else plain
    return {name: tensor_digest(t) for name, t in plain.state_dict().items()}


class RecordingReceiver:
    """A receiver that keeps what it is sent (the protocol's receiving side, in this process)."""

    dtype = torch.float32

    def __init__(self) -> None:
        self.buckets: list[list[tuple[str, int]]] = []
        self.finished = 0

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.buckets.append([(name, t.nelement() * t.element_size()) for name, t in named])

    def finish_weight_update(self) -> None:
        self.finished += 1


def test_names_are_the_ones_save_pretrained_writes():
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert checkpoint_name("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight") is None
    assert checkpoint_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert checkpoint_name("base_model.model.lm_head.original_module.weight") is None
    assert checkpoint_name("model.layers.1._checkpoint_wrapped_module.mlp.down_proj.weight") == \
        "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_the_generator_holds_the_trained_weights_bit_for_bit_after_every_step(finetuning, model_dir, generator):
    engine = engine_for(model_dir, finetuning)
    client = GeneratorClient(generator.address, torch.float32, [2], 0)
    before = None
    for _ in range(2):
        report = sync_weights(engine, client, bucket_bytes=LAYER // 2)
        expected = checkpoint_digests(engine.unwrapped_model())
        assert client.digest() == expected
        assert sorted(report.names) == sorted(expected)  # every tensor once, tied or not
        assert before is None or any(expected[k] != before[k] for k in expected)  # the step moved the weights
        before = expected
        train_one_step(engine)
    client.close()


def test_the_generator_samples_what_the_policy_samples(model_dir, generator):
    engine = engine_for(model_dir, "full")
    train_one_step(engine)
    client = GeneratorClient(generator.address, torch.float32, [2], 0)
    sync_weights(engine, client)
    sampling = Sampling(temperature=0.9, top_p=0.95, top_k=50, max_completion_length=6, seed=3)
    own = TransformersRollout(engine, [2], 0).generate([5, 9, 17], 3, sampling, row=7)
    served = client.generate([5, 9, 17], 3, sampling, row=7)
    assert torch.equal(own.ids, served.ids) and torch.equal(own.mask, served.mask)
    assert own.logps is None  # the policy samples with the weights it trains: no gap to correct, no logits kept
    prompt = torch.tensor([[5, 9, 17]] * 3)
    model = engine.unwrapped_model().eval()
    with torch.no_grad():  # what the importance-sampling correction compares the sampler's numbers with
        logits = model(input_ids=torch.cat([prompt, served.ids], 1),
                       attention_mask=torch.cat([torch.ones_like(prompt), served.mask], 1)).logits[:, 2:-1]
    trainer = completion_logps(logits, served.ids, sampling.temperature) * served.mask
    assert served.logps is not None and torch.allclose(trainer, served.logps, atol=1e-5)
    client.close()


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_buckets_hold_full_tensor_bytes_and_the_peak_is_one_layer_plus_a_bucket(finetuning, model_dir):
    engine = engine_for(model_dir, finetuning)
    receiver = RecordingReceiver()
    limit = LAYER // 2
    report: SyncReport = sync_weights(engine, receiver, bucket_bytes=limit)
    sizes = [sum(size for _, size in bucket) for bucket in receiver.buckets]
    assert all(size <= limit or len(bucket) == 1 for size, bucket in zip(sizes, receiver.buckets, strict=True))
    assert len(receiver.buckets) == report.buckets > 2 and receiver.finished == 1
    model_bytes = sum(sizes)
    assert report.largest_unit_bytes == LAYER and model_bytes > 3 * LAYER
    assert LAYER <= report.peak_bytes < 2 * LAYER
    whole = sync_weights(engine, RecordingReceiver(), bucket_bytes=10 * model_bytes)
    assert whole.buckets == 1 and whole.peak_bytes > 2 * LAYER  # one bucket as big as the model: what it avoids


def test_a_weight_the_generator_does_not_have_is_an_error_naming_it(generator):
    client = GeneratorClient(generator.address, torch.float32, [2], 0)
    with pytest.raises(RuntimeError, match="weight model.no_such.weight"):
        client.load_weights([("model.no_such.weight", torch.zeros(2))])
    with pytest.raises(RuntimeError, match=r"weight lm_head.weight \(torch.float32 \[3\]\)"):
        client.load_weights([("lm_head.weight", torch.zeros(3))])
    client.close()


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_a_bf16_generator_holds_the_trained_weights_cast_bit_for_bit(finetuning, model_dir):
    """The generator's dtype is what is sent: each fp32 weight (LoRA: merged in fp32, then cast) rounded to bf16."""
    engine = engine_for(model_dir, finetuning)
    train_one_step(engine)
    process = GeneratorProcess(model_dir, torch.bfloat16)
    try:
        client = GeneratorClient(process.address, torch.bfloat16, [2], 0)
        report = sync_weights(engine, client, bucket_bytes=LAYER // 4)
        plain = copy.deepcopy(engine.unwrapped_model())
        plain = plain.merge_and_unload() if finetuning == "lora" else plain
        expected = {name: tensor_digest(t.to(torch.bfloat16)) for name, t in plain.state_dict().items()}
        assert client.digest() == expected
        assert report.bytes_sent == sum(t.nelement() * 2 for t in plain.state_dict().values())
        client.close()
    finally:
        process.stop()
