"""Module entry for launchers: `python -m shardtune.train CONFIG.yaml [key=value ...]` (or the plan file)."""

import sys

from shardtune.startup_gc import pause_collection

pause_collection()  # until the first step: the imports and set-up below allocate for the whole run

from shardtune.errors import run_reporting_errors  # noqa: E402
from shardtune.launch.worker import worker_command  # noqa: E402

sys.exit(run_reporting_errors(worker_command, sys.argv[1:]))
