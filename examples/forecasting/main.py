"""Trains and tests one forecaster: ``python examples/forecasting/main.py --dataset ETTh1``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import setup_logging  # noqa: E402
from examples.common.paths import ensure_importable  # noqa: E402
from examples.forecasting import configs, train  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--dataset", default="ETTh1", help="ETTh1, ETTh2, ETTm1, ETTm2, weather, illness"
    )
    p.add_argument("--horizon", type=int, default=96, help="forecast length P")
    p.add_argument("--model", default="aaren", choices=["aaren", "transformer"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-root", default=None, help="default: ../shared/data beside the repo")
    p.add_argument("--workdir", default=None, help="checkpoints and result.json (resumable)")
    p.add_argument("--epochs", type=int, default=None, help="override max epochs")
    p.add_argument("--d-model", type=int, default=None, help="override the model width")
    p.add_argument("--layers", type=int, default=None, help="override the number of blocks")
    p.add_argument("--lr", type=float, default=None, help="override the peak learning rate")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--embedding", choices=["linear", "conv"], default=None)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> configs.Config:
    cfg = configs.get_config(args.dataset, args.horizon, args.model, args.seed)
    cfg.data.data_root = args.data_root
    if args.epochs is not None:
        cfg.loop.max_epochs = args.epochs
    if args.d_model is not None:
        cfg.model.d_model, cfg.model.d_ff = args.d_model, 2 * args.d_model
    if args.layers is not None:
        cfg.model.num_layers = args.layers
    if args.lr is not None:
        cfg.optim.learning_rate = args.lr
    if args.batch_size is not None:
        cfg.loop.batch_size = args.batch_size
    if args.embedding is not None:
        cfg.model.value_embedding = args.embedding
    cfg.loop.progress = not args.no_progress
    return cfg


def main(argv=None) -> None:
    setup_logging()
    ensure_importable()
    args = parse_args(argv)
    train.train_and_evaluate(config_from_args(args), args.workdir)


if __name__ == "__main__":
    main()
