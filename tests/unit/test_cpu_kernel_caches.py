"""CPU ranks bound oneDNN's and ideep's kernel caches (shardtune/cpu_kernel_caches.py): bf16 matmuls over rows of
changing length no longer grow a rank's resident memory step after step."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardtune.cpu_kernel_caches import CPU_KERNEL_CACHE_ENTRIES, CPU_KERNEL_CACHE_SETTINGS, bound_cpu_kernel_caches

# A LLaMA-like MLP in bf16, trained on rows of 150 different lengths (as batches of a run are): the resident memory
# gained after the first 30, in MiB.
GROWTH = """
import random, sys
import torch
if sys.argv[1] == "bounded":
    from shardtune.cpu_kernel_caches import bound_cpu_kernel_caches
    bound_cpu_kernel_caches()

def rss_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024

random.seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(64, 176), torch.nn.SiLU(), torch.nn.Linear(176, 64)).to(torch.bfloat16)
lengths = random.sample(range(16, 400), 150)
for i, rows in enumerate(lengths):
    if i == 30:
        start = rss_mib()
    mlp(torch.randn(rows, 64, dtype=torch.bfloat16)).float().square().mean().backward()
print(rss_mib() - start)
"""


def test_the_bound_keeps_what_the_user_set():
    env = {"LRU_CACHE_CAPACITY": "256"}
    bound_cpu_kernel_caches(env)
    assert env == {"LRU_CACHE_CAPACITY": "256", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(CPU_KERNEL_CACHE_ENTRIES)}


def growth_mib(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in CPU_KERNEL_CACHE_SETTINGS}
    done = subprocess.run([sys.executable, "-c", GROWTH, mode], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"}, check=True)
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_bf16_matmuls_over_new_lengths_stop_growing_once_bounded():
    bounded = growth_mib("bounded")
    assert bounded < 25, f"{bounded:.0f} MiB gained over 120 new lengths with the caches bounded"
    default = growth_mib("default")
    if default < 4 * max(bounded, 10):
        pytest.skip(f"this CPU's bf16 matmuls keep no kernel per shape here ({default:.0f} MiB without the bound)")
    # Measured on 2 cores with avx512_bf16 (2026-11-30): 390 MiB without the bound, 2 MiB with it.
