"""DeepSpeed's checkpoint files read with ``torch.load(weights_only=True)``, never a full unpickle.

DeepSpeed loads its own files with ``weights_only=False`` (its checkpoint engine, the ZeRO-3 and universal
readers, ``zero_to_fp32``, ``ds_to_universal``), which would run any code a tampered checkpoint carries. Its
files hold only tensors, plain containers and three small record classes, so inside ``weights_only_loads()``
every ``torch.load`` is forced to ``weights_only=True`` with exactly those classes allowed. A file holding
anything else fails to load with torch's "Unsupported global" error instead of executing it.

``python -m shardtune.engines.safe_load MODULE ARGS...`` runs a DeepSpeed command-line module the same way.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from collections.abc import Iterator

import torch


def deepspeed_record_classes() -> list[type]:
    """The non-tensor classes DeepSpeed pickles into its checkpoint files (DeepSpeed 0.19)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    original = torch.load
    allowed = deepspeed_record_classes()

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(allowed):
            return original(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def main(argv: list[str]) -> int:
    module, *args = argv
    sys.argv = [module, *args]
    with weights_only_loads():
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
