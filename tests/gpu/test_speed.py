"""Speed switches on CUDA against their CPU-checked references: fused AdamW (the default there), regional
compilation with inductor, padding-free rows. Skipped without CUDA; not run in this repository's CI."""

from __future__ import annotations

import copy

import pytest
import torch

from shardtune.model.compile import CompileReport, apply_regional_compile
from shardtune.optim.build import fused_adamw_fits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_fused_adamw_is_chosen_and_matches_the_foreach_update():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32, device="cuda")) for _ in range(3)]
    assert fused_adamw_fits(params)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = torch.optim.AdamW(params, lr=1e-2, fused=True)
    foreach = torch.optim.AdamW(twins, lr=1e-2, foreach=True)
    for _ in range(3):
        for a, b in zip(params, twins, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        fused.step()
        foreach.step()
    for a, b in zip(params, twins, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_inductor_compiled_layers_match_eager_on_the_gpu():
    from shardtune.train.loop import train_step
    from tests.unit.test_chunked_loss import batch_of, features, tiny_llama
    from tests.unit.test_loop import make_engine

    def run(compiled: bool) -> list[float]:
        model = copy.deepcopy(tiny_llama()).cuda()
        report = CompileReport(apply_regional_compile(model, None, "inductor"), None, "inductor") if compiled else None
        engine = make_engine(model, optim="adamw_torch", lr=1e-2, device="cuda")  # prepare() moves the model there
        losses = []
        for step in range(1, 5):
            losses.append(train_step(engine, [batch_of(features(seed=step))], 1.0)["loss"])
            if report is not None:
                report.on_step(step)
        if report is not None:
            assert report.summary()["recompiles_after_step_2"] == 0
        return losses

    assert run(True) == pytest.approx(run(False), rel=1e-3)
