"""Trains and tests one event-forecasting model: ``python examples/event_forecasting/main.py``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import setup_logging  # noqa: E402
from examples.common.paths import ensure_importable  # noqa: E402
from examples.event_forecasting import configs, data, train  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dataset", default="sin", choices=list(data.DATASETS))
    p.add_argument("--model", default="aaren", choices=["aaren", "transformer"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-root", default=None, help="default: ../shared/data beside the repo")
    p.add_argument("--cache-dir", default=None, help="generated data (default: workdirs/...)")
    p.add_argument("--workdir", default=None, help="checkpoints and result.json (resumable)")
    p.add_argument("--epochs", type=int, default=None, help="override max epochs")
    p.add_argument("--steps-per-epoch", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None, help="override the width (d_ff = 2d)")
    p.add_argument("--layers", type=int, default=None, help="override the number of blocks")
    p.add_argument("--lr", type=float, default=None, help="override the peak learning rate")
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument("--tie-marks", action="store_true", help="mark logits from the embeddings")
    p.add_argument("--copy-marks", action="store_true", help="copy head on the mark logits")
    p.add_argument(
        "--copy-prior", action="store_true", help="copy head starts at repeat-the-previous-mark"
    )
    p.add_argument("--log-scale-max", type=float, default=None, help="upper log-scale clamp")
    p.add_argument(
        "--gap-ema", type=float, nargs="*", default=None, help="decay rates of the recency features"
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> configs.Config:
    cfg = configs.get_config(args.dataset, args.model, args.seed)
    cfg.data.data_root = args.data_root
    cfg.data.cache_dir = args.cache_dir
    if args.epochs is not None:
        cfg.loop.max_epochs = args.epochs
    if args.steps_per_epoch is not None:
        cfg.loop.steps_per_epoch = args.steps_per_epoch
    if args.d_model is not None:
        cfg.model.d_model, cfg.model.d_ff = args.d_model, 2 * args.d_model
    if args.layers is not None:
        cfg.model.num_layers = args.layers
    if args.lr is not None:
        cfg.optim.learning_rate = args.lr
    if args.dropout is not None:
        cfg.model.dropout = args.dropout
    if args.tie_marks:
        cfg.model.tie_marks = True
    if args.copy_marks:
        cfg.model.copy_marks = True
    if args.copy_prior:
        cfg.model.copy_prior = True
    if args.log_scale_max is not None:
        cfg.model.log_scale_max = args.log_scale_max
    if args.gap_ema is not None:
        cfg.model.gap_ema = tuple(args.gap_ema)
    cfg.loop.progress = not args.no_progress
    return cfg


def main(argv=None) -> None:
    setup_logging()
    ensure_importable()
    args = parse_args(argv)
    train.train_and_evaluate(config_from_args(args), args.workdir)


if __name__ == "__main__":
    main()
