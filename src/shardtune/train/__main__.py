"""Module entry for launchers: `python -m shardtune.train CONFIG.yaml [key=value ...]` (or the plan file)."""

import sys

from shardtune.errors import run_reporting_errors
from shardtune.launch.worker import worker_command

sys.exit(run_reporting_errors(worker_command, sys.argv[1:]))
