"""Shared utilities of the aaren_jax examples: backbone, optimiser, checkpoints, loop, results.

The examples run as scripts (``python examples/forecasting/main.py``) or as modules of the
``examples`` namespace package (tests, ``python -m``); either way the repository root must be on
``sys.path``, which each ``main.py`` and ``sweep.py`` ensures.
"""

from examples.common.backbone import BACKBONES, make_backbone, sinusoidal_positions
from examples.common.checkpoint import CheckpointIO
from examples.common.loop import LoopConfig, TrainResult, TrainStep, fit, make_train_step
from examples.common.optim import OptimConfig, make_optimizer, weight_decay_mask
from examples.common.progress import setup_logging
from examples.common.results import (
    append_record,
    claim_run,
    load_records,
    record_key,
    results_path,
)
from examples.common.runs import ConfigMismatchError, RunDir, default_run_dir, plot_history

__all__ = [
    "BACKBONES",
    "CheckpointIO",
    "ConfigMismatchError",
    "LoopConfig",
    "OptimConfig",
    "RunDir",
    "TrainResult",
    "TrainStep",
    "append_record",
    "claim_run",
    "default_run_dir",
    "fit",
    "load_records",
    "make_backbone",
    "make_optimizer",
    "make_train_step",
    "plot_history",
    "record_key",
    "results_path",
    "setup_logging",
    "sinusoidal_positions",
    "weight_decay_mask",
]
