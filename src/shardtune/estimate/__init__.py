"""Memory estimate and engine recommendation, before anything is launched.

Pure and import-light (no torch or transformers): the model's shape comes from its config.json.
Start at ``estimate_command`` (the CLI), ``recommend_for_config`` (engine: auto) and ``options.build_options``
(the memory model); the formulas are in README.md next to this file.
"""

from shardtune.estimate.command import estimate_command
from shardtune.estimate.config import estimate_for_run, fit_warning, recommend_for_config, workload_from_config
from shardtune.estimate.hardware import Hardware, format_size, parse_size
from shardtune.estimate.measure import mark_memory_baseline, measured_peak_memory_bytes
from shardtune.estimate.options import Components, Option, build_options
from shardtune.estimate.recommend import Recommendation, recommend
from shardtune.estimate.shape import ModelShape, load_model_shape
from shardtune.estimate.workload import Workload

__all__ = [
    "Components",
    "Hardware",
    "ModelShape",
    "Option",
    "Recommendation",
    "Workload",
    "build_options",
    "estimate_command",
    "estimate_for_run",
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
