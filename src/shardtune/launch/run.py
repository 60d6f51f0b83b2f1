"""What `shardtune train` and `shardtune check` do on the launching host, and what each rank runs."""

from __future__ import annotations

from shardtune.config.args import load_config
from shardtune.config.schema import TrainConfig
from shardtune.config.validate import validate_config
from shardtune.errors import ConfigError


def preflight(argv: list[str]) -> tuple[TrainConfig, set[str]]:
    """Load and validate everything that can be checked without weights; raise all problems at once."""
    config, cmd = load_config(argv)
    validate_config(config)
    data_problems = _data_problems(config)
    if data_problems:
        raise ConfigError(*data_problems)
    return config, cmd.switches


def _data_problems(config: TrainConfig) -> list[str]:
    from shardtune.data import check_data_settings
    from shardtune.train.setup import data_settings

    if not config.dataset:
        return []
    return check_data_settings(data_settings(config))


def check_command(argv: list[str]) -> int:
    config, _ = preflight(argv)
    print(f"ok: {config.stage} / {config.finetuning_type} on {config.model_name_or_path} "
          f"with {','.join(config.dataset)} -> {config.output_dir}")
    return 0


def train_command(argv: list[str]) -> int:
    config, switches = preflight(argv)
    if "dry_run" in switches:
        print(f"would train in this process: {config.stage} / {config.finetuning_type}")
        return 0
    return run_worker(config)


def worker_command(argv: list[str]) -> int:
    """Entry of `python -m shardtune.train`: validate, then train in this process."""
    config, _ = preflight(argv)
    return run_worker(config)


def run_worker(config: TrainConfig) -> int:
    from shardtune.train.workflow import run_training

    results = run_training(config)
    print(f"[shardtune] done: final loss {results['final_loss']:.4f} after {results['global_step']} steps; "
          f"outputs in {config.output_dir}", flush=True)
    return 0
