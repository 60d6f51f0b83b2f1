"""Memory estimate and engine recommendation, before anything is launched.

Pure and import-light (no torch or transformers): the model's shape comes from its config.json.
Start at ``estimate_command`` (the CLI), ``recommend_for_config`` (engine: auto), ``options.build_options``
(the memory model) and ``estimate_run_memory`` + ``compare_run_memory`` (a finished run's measured peak against
the estimate of the same quantity); the formulas are in README.md next to this file.
"""

from shardtune.estimate.command import estimate_command
from shardtune.estimate.compare import RunMemoryEstimate, compare_run_memory
from shardtune.estimate.config import (
    estimate_for_run,
    estimate_run_memory,
    fit_warning,
    recommend_for_config,
    workload_from_config,
)
from shardtune.estimate.hardware import Hardware, format_size, parse_size
from shardtune.estimate.measure import mark_memory_baseline, measured_peak_memory_bytes
from shardtune.estimate.options import build_options
from shardtune.estimate.parts import Components, Option, Setup
from shardtune.estimate.recommend import Recommendation, recommend
from shardtune.estimate.shape import ModelShape, load_model_shape
from shardtune.estimate.workload import Workload

__all__ = [
    "Components",
    "Hardware",
    "ModelShape",
    "Option",
    "Recommendation",
    "RunMemoryEstimate",
    "Setup",
    "Workload",
    "build_options",
    "compare_run_memory",
    "estimate_command",
    "estimate_for_run",
    "estimate_run_memory",
    "fit_warning",
    "format_size",
    "load_model_shape",
    "mark_memory_baseline",
    "measured_peak_memory_bytes",
    "parse_size",
    "recommend",
    "recommend_for_config",
    "workload_from_config",
]
