"""The default optimizer is the HF Trainer's: adamw_torch_fused, torch's fused AdamW kernel on every device."""

from __future__ import annotations

import torch

from shardtune.config.schema import TrainConfig
from shardtune.optim.build import build_optimizer
from shardtune.optim.settings import OptimizerSettings


def parameters() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]


def test_the_default_is_the_trainers_fused_adamw_on_the_cpu_too():
    assert TrainConfig.__dataclass_fields__["optim"].default == "adamw_torch_fused"
    assert OptimizerSettings().optim == "adamw_torch_fused"
    optimizer = build_optimizer(parameters(), OptimizerSettings())
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True


def test_adamw_torch_keeps_the_per_tensor_loop_on_the_cpu():
    optimizer = build_optimizer(parameters(), OptimizerSettings(optim="adamw_torch"))
    assert not optimizer.defaults["fused"]


def test_the_fused_update_equals_the_loop_to_rounding():
    trained = {}
    for optim in ("adamw_torch", "adamw_torch_fused"):
        params = parameters()
        optimizer = build_optimizer(params, OptimizerSettings(optim=optim, learning_rate=1e-2, weight_decay=0.1))
        for step in range(10):
            for i, p in enumerate(params):
                p.grad = torch.full_like(p, 0.1 * (step - i))
            optimizer.step()
        trained[optim] = torch.cat([p.detach().flatten() for p in params])
    torch.testing.assert_close(trained["adamw_torch_fused"], trained["adamw_torch"], rtol=1e-6, atol=1e-6)
    start = torch.cat([p.detach().flatten() for p in parameters()])
    assert (trained["adamw_torch"] - start).abs().min() > 1e-3  # every weight moved: the comparison is not vacuous
