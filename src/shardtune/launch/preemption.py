"""Stopping on request: which signals stop a run, the exit code that asks a scheduler to requeue it, and the warning
time a scheduler should give before it kills a job.

Ctrl-C (SIGINT) is a person stopping the run: exit 130. SIGTERM and SIGUSR1 are a scheduler taking the nodes back
(Slurm's ``--signal`` and its preemption, Kubernetes' pod deletion, Ray): the ranks finish the step, save a
checkpoint (staged, then written), and the run exits ``REQUEUE_EXIT_CODE``. 143 is the code of a process ended by
SIGTERM, which Kubeflow's ``restartPolicy: ExitCode`` retries, and the sbatch script ``shardtune slurm`` writes
requeues the job on it (``scontrol requeue``); the requeued job resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import signal

INTERRUPTED_EXIT_CODE = 130
REQUEUE_EXIT_CODE = 143
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

# What a save needs besides the write (finishing the step, staging, the marker), and the slowest write speed assumed
# for shared storage (a busy NFS or Lustre client).
SAVE_OVERHEAD_SECONDS = 60
ASSUMED_WRITE_BYTES_PER_SECOND = 200 * 2**20


def exit_code_for(signal_name: str | None) -> int:
    """The run's exit code when it stopped on ``signal_name`` (after its checkpoint was saved)."""
    return INTERRUPTED_EXIT_CODE if signal_name in (None, "SIGINT") else REQUEUE_EXIT_CODE


def warning_seconds(checkpoint_bytes_per_node: float, step_seconds: float = 0.0) -> int:
    """How long before the kill a scheduler should signal the job: one step to finish, the checkpoint written at
    ``ASSUMED_WRITE_BYTES_PER_SECOND``, plus the overhead; whole minutes, at least two."""
    needed = step_seconds + checkpoint_bytes_per_node / ASSUMED_WRITE_BYTES_PER_SECOND + SAVE_OVERHEAD_SECONDS
    return max(120, int(-(-needed // 60)) * 60)


# What the launching process says at the first stop request, whoever started the ranks (torchrun or the rank server).
STOP_NOTICE = ("[shardtune] interrupted: the ranks finish this step, save a checkpoint and exit (a second Ctrl-C kills "
               "them at once)")
