"""What every benchmark records beside its numbers: the machine and the library versions."""

from __future__ import annotations

import os
import platform


def machine() -> dict:
    import deepspeed
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "deepspeed": deepspeed.__version__,
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_line(info: dict) -> str:
    line = (f"Machine: {info['platform']}, {info['cpus']} CPUs; Python {info['python']}, torch {info['torch']}, "
            f"transformers {info['transformers']}, DeepSpeed {info['deepspeed']}")
    return line + (f"; GPU {info['gpu']}." if "gpu" in info else ".")
