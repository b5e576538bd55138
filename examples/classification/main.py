"""Trains and tests one UEA classifier (Aaren or Transformer backbone).

    python examples/classification/main.py --dataset JapaneseVowels --workdir /tmp/jv

Every run has a folder (``--workdir``, or one per configuration under
``workdirs/classification``) holding its configuration, checkpoints (every epoch by
default), ``result.json`` and ``loss.png``; an interrupted run resumes there, a finished one
returns its stored result, another configuration is refused unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.classification import configs, train  # noqa: E402
from examples.common import setup_logging  # noqa: E402
from examples.common.parallel import add_distributed_args, initialize_distributed  # noqa: E402
from examples.common.paths import ensure_importable  # noqa: E402
from examples.common.runs import ConfigMismatchError, default_run_dir  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dataset", default="JapaneseVowels", help="a folder of <data-root>/UEA")
    p.add_argument("--model", default="aaren", choices=["aaren", "transformer"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-root", default=None, help="default: ../shared/data beside the repo")
    p.add_argument(
        "--workdir",
        default=None,
        help="run folder (config, checkpoints, result.json, loss.png); default: one per "
        "configuration under workdirs/classification/runs",
    )
    p.add_argument("--overwrite", action="store_true", help="discard the run in --workdir")
    p.add_argument(
        "--keep-checkpoints", action="store_true", help="keep checkpoints once the run finished"
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=None, help="epochs between checkpoints (1)"
    )
    p.add_argument("--max-steps", type=int, default=None, help="stop (resumably) after N steps")
    p.add_argument("--epochs", type=int, default=None, help="override max epochs")
    p.add_argument("--pooling", choices=["last", "mean"], default=None)
    p.add_argument(
        "--bidirectional", action="store_true", help="causal=False: every position sees the series"
    )
    p.add_argument("--d-model", type=int, default=None, help="override the model width")
    p.add_argument("--layers", type=int, default=None, help="override the number of blocks")
    p.add_argument("--lr", type=float, default=None, help="override the peak learning rate")
    p.add_argument("--monitor", choices=["nll", "accuracy"], default=None)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_distributed_args(p)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> configs.Config:
    cfg = configs.get_config(args.dataset, args.model, args.seed)
    cfg.data.data_root = args.data_root
    if args.epochs is not None:
        cfg.loop.max_epochs = args.epochs
    if args.pooling is not None:
        cfg.model.pooling = args.pooling
    cfg.model.causal = not args.bidirectional
    if args.d_model is not None:
        cfg.model.d_model, cfg.model.d_ff = args.d_model, 2 * args.d_model
    if args.layers is not None:
        cfg.model.num_layers = args.layers
    if args.lr is not None:
        cfg.optim.learning_rate = args.lr
    if args.monitor is not None:
        cfg.monitor = args.monitor
    if args.checkpoint_every is not None:
        cfg.loop.checkpoint_every = args.checkpoint_every
    if args.max_steps is not None:
        cfg.loop.max_steps = args.max_steps
    cfg.loop.progress = not args.no_progress
    return cfg


def main(argv=None) -> dict:
    setup_logging()
    ensure_importable()
    args = parse_args(argv)
    initialize_distributed(args)
    cfg = config_from_args(args)
    direction = "" if cfg.model.causal else "_bidirectional"
    name = f"{cfg.data.dataset}_{cfg.model.backbone}{direction}_{cfg.loop.seed}"
    workdir = args.workdir or str(default_run_dir("classification", name, cfg))
    logging.info("run folder %s", workdir)
    try:
        return train.train_and_evaluate(
            cfg, workdir, overwrite=args.overwrite, keep_checkpoints=args.keep_checkpoints
        )
    except ConfigMismatchError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
