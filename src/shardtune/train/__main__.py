"""Module entry for launchers: `python -m shardtune.train CONFIG.yaml [key=value ...]`."""

import sys

from shardtune.cli import run_reporting_errors
from shardtune.launch.run import worker_command

sys.exit(run_reporting_errors(worker_command, sys.argv[1:]))
