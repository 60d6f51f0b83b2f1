"""Run by tests/unit/test_estimate_zero3_lora.py: one ZeRO-3 rank (gloo, world size 1), a 3-layer LLaMA with LoRA
on every Linear, gradient checkpointing and a bound of 1,000 live parameters. Prints, as JSON, the most frozen
parameters gathered at once in the forward and in the backward's recompute, one decoder layer's frozen parameters
and the largest frozen parameter."""

import json
import os
import sys

import torch

# The group starts from a file (no port to find); DeepSpeed then finds it up and sees its variables set.
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                  GLOO_SOCKET_IFNAME="lo", DS_ACCELERATOR="cpu")
torch.distributed.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
import deepspeed  # noqa: E402
import peft  # noqa: E402
import transformers  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402

deepspeed.init_distributed("gloo")
config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1000, "stage3_max_reuse_distance": 0,
                                "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0}}
torch.manual_seed(0)
shape = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128)
with deepspeed.zero.Init(config_dict_or_path=config):
    model = transformers.AutoModelForCausalLM.from_config(shape)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(
    [p for p in model.parameters() if p.requires_grad], lr=1e-4), config=config)

frozen = [p for p in model.parameters() if not p.requires_grad]
most = {"forward": 0, "backward": 0}


def count(module, *args):
    phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
    gathered = sum(p.ds_numel for p in frozen if p.ds_status == ZeroParamStatus.AVAILABLE)
    most[phase] = max(most[phase], gathered)


for module in model.modules():
    if isinstance(module, torch.nn.Linear):
        module.register_forward_pre_hook(count)
        module.register_forward_hook(count)
tokens = torch.randint(0, 128, (1, 16))
for _ in range(2):  # the second step runs with the trace the first recorded
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
layer = sum(p.ds_numel for p in model.base_model.model.model.layers[0].parameters() if not p.requires_grad)
largest = max(p.ds_numel for p in frozen)
print(json.dumps({**most, "layer": layer, "largest": largest}))
