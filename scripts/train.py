"""Script entry for launchers that want a file path rather than a module:

    deepspeed --num_gpus 2 scripts/train.py CONFIG.yaml [key=value ...]
    torchrun --nproc-per-node 2 scripts/train.py CONFIG.yaml

Same as `python -m shardtune.train`.
"""

import sys

from shardtune.errors import run_reporting_errors
from shardtune.launch.worker import worker_command

if __name__ == "__main__":
    sys.exit(run_reporting_errors(worker_command, sys.argv[1:]))
