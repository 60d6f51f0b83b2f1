"""Bounded caches of compiled CPU kernels: set in each rank before its first matmul.

PyTorch's bf16 (and fp16) matmuls on the CPU run through oneDNN, which compiles a kernel (a primitive) per
operator and input shape and keeps it in two caches: oneDNN's own (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and
ideep's, PyTorch's wrapper (``LRU_CACHE_CAPACITY``), 1,024 entries each by default. A training run's rows change
length from batch to batch, so nearly every batch adds entries, and a CPU rank's resident memory grew with every
step until both caches were full: the tiny LoRA example in bf16, one process, 40 steps, reached 1,235 MiB, where
fp32 (MKL, no such cache) stays at 227 MiB; two ranks of DDP 1,161 MiB; the 206M-parameter ZeRO-3 LoRA run of
``make test-big`` grew from 670 MiB after 3 steps to 791 MiB after 12. With 64 entries each the same runs stay
flat (287 MiB; 672 and 677 MiB) and the loop is as fast (40 steps: 3.96-4.00 s against 4.38-4.46 s): a step
uses fewer distinct shapes than that. At 4 entries the kernels are compiled again within a step (9.5 s).
Measured 2026-11-30, torch 2.13 (oneDNN 3.12), on 2 CPU cores with avx512_bf16 (docs/estimate.md).

Both libraries read the setting when first used, so a rank sets it before the model loads. A value already in
the environment is kept (0 for ideep's cache crashes PyTorch's matmul: a value of at least 1 is the user's to set).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CPU_KERNEL_CACHE_ENTRIES = 64
CPU_KERNEL_CACHE_SETTINGS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_cpu_kernel_caches(environ: MutableMapping[str, str] = os.environ) -> None:
    """Cap oneDNN's and ideep's kernel caches where the environment does not set them."""
    for name in CPU_KERNEL_CACHE_SETTINGS:
        environ.setdefault(name, str(CPU_KERNEL_CACHE_ENTRIES))
