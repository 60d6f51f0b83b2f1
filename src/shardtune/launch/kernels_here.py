"""The GPU kernels a config names, checked on the launching host when its ranks run on this host.

``check`` passes a config that names flash-attn, Liger or fp8 anywhere: its ranks may run on another machine.
``train`` on this host starts its ranks here (torchrun, accelerate, deepspeed, Slurm's one task per node), so a
kernel this host cannot run would fail every rank right after launch; the same one-line refusal the rank would
give is raised here instead, before anything starts. Nothing here imports torch: GPUs are counted from the driver
(host.py) and packages are looked up, not imported.
"""

from __future__ import annotations

import importlib.util

from shardtune.config.schema import TrainConfig


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def local_kernel_problems(c: TrainConfig, visible_gpus: int) -> list[str]:
    """The refusals this host's ranks would raise for the kernels ``c`` names, one line each."""
    from shardtune.data.settings import half_precision
    from shardtune.model.attention import flash_problem, varlen_device_problem
    from shardtune.model.fp8 import float8_device_problem

    has_cuda = visible_gpus > 0
    problems = []
    if c.attn_implementation == "flash_attention_2":
        problems.append(flash_problem(has_cuda, installed("flash_attn"), c.sequence_parallel_size))
    problems.append(varlen_device_problem(c.attn_implementation, has_cuda=has_cuda,
                                             half_precision=half_precision(c)))
    if c.fp8:  # the GPU's compute capability is only known on a rank (it imports torch)
        problems.append(float8_device_problem(has_cuda, None, installed("torchao")))
    if c.enable_liger_kernel:
        from shardtune.model.liger import liger_device_problem

        problems.append(liger_device_problem(has_cuda, installed("liger_kernel")))
    return [problem for problem in problems if problem]
