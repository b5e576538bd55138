"""Trains and tests one forecaster on a TSLib dataset or on any TSLib-format CSV.

    python examples/forecasting/main.py --dataset ETTh1 --horizon 96
    python examples/forecasting/main.py --csv my_series.csv --target OT --freq h

Every run has a folder (``--workdir``, or one per configuration under ``workdirs/forecasting``)
holding its configuration, ``result.json`` and ``loss.png``; an interrupted run resumes
there, a finished one returns its stored result, another configuration is refused unless
``--overwrite``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import setup_logging  # noqa: E402
from examples.common.parallel import add_distributed_args, initialize_distributed  # noqa: E402
from examples.common.paths import ensure_importable  # noqa: E402
from examples.common.runs import ConfigMismatchError, default_run_dir  # noqa: E402
from examples.forecasting import configs, data, train  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_argument_group("data")
    src.add_argument(
        "--dataset", default=None, help="ETTh1 (default), ETTh2, ETTm1, ETTm2, weather, illness"
    )
    src.add_argument("--csv", default=None, help="any TSLib-format CSV: a 'date' column first")
    src.add_argument("--target", default="OT", help="target column of the CSV (moved last)")
    src.add_argument(
        "--freq",
        default=None,
        help="time features: s, t (minutes), h, d, b, w, m or e.g. 15min; "
        "default: inferred from the dates",
    )
    src.add_argument(
        "--split",
        default="auto",
        choices=data.SPLITS,
        help="auto: ETT's 12/4/4 months if the file name starts with ETTh/ETTm, else 70/10/20",
    )
    src.add_argument("--data-root", default=None, help="default: ../shared/data beside the repo")
    src.add_argument("--seq-len", type=int, default=None, help="input length L (default 96)")
    src.add_argument("--horizon", type=int, default=96, help="forecast length P")
    m = p.add_argument_group("model and training")
    m.add_argument("--model", default="aaren", choices=configs.MODELS)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--epochs", type=int, default=None, help="override max epochs")
    m.add_argument("--steps-per-epoch", type=int, default=None, help="override the 250-step cap")
    m.add_argument("--max-steps", type=int, default=None, help="stop (resumably) after N steps")
    m.add_argument("--d-model", type=int, default=None, help="override the model width")
    m.add_argument("--layers", type=int, default=None, help="override the number of blocks")
    m.add_argument("--lr", type=float, default=None, help="override the peak learning rate")
    m.add_argument("--batch-size", type=int, default=None)
    m.add_argument("--embedding", choices=["linear", "conv"], default=None)
    r = p.add_argument_group("run folder")
    r.add_argument(
        "--workdir",
        default=None,
        help="run folder (config, checkpoints, result.json, loss.png); default: one per "
        "configuration under workdirs/forecasting/runs",
    )
    r.add_argument("--overwrite", action="store_true", help="discard the run in --workdir")
    r.add_argument(
        "--keep-checkpoints", action="store_true", help="keep checkpoints once the run finished"
    )
    r.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_distributed_args(p)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> configs.Config:
    if args.csv and args.dataset:
        raise SystemExit("error: pass either --dataset or --csv, not both")
    dataset = Path(args.csv).stem if args.csv else (args.dataset or "ETTh1")
    cfg = configs.get_config(dataset, args.horizon, args.model, args.seed)
    cfg.data.data_root = args.data_root
    if args.csv:
        if not Path(args.csv).is_file():
            raise SystemExit(f"error: --csv {args.csv}: no such file")
        cfg.data.csv = str(Path(args.csv).resolve())
        cfg.data.csv_sha256 = data.sha256_file(cfg.data.csv)
        cfg.data.split = args.split
    cfg.data.target = args.target
    cfg.data.freq = args.freq
    if args.seq_len is not None:
        cfg.data.seq_len = args.seq_len
    if args.epochs is not None:
        cfg.loop.max_epochs = args.epochs
    if args.steps_per_epoch is not None:
        cfg.loop.steps_per_epoch = args.steps_per_epoch
    if args.max_steps is not None:
        cfg.loop.max_steps = args.max_steps
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


def main(argv=None) -> dict:
    setup_logging()
    ensure_importable()
    args = parse_args(argv)
    initialize_distributed(args)
    cfg = config_from_args(args)
    name = f"{cfg.data.dataset}_{cfg.data.pred_len}_{cfg.model.backbone}_{cfg.loop.seed}"
    workdir = args.workdir or str(default_run_dir("forecasting", name, cfg))
    logging.info("run folder %s", workdir)
    try:
        return train.train_and_evaluate(
            cfg, workdir, overwrite=args.overwrite, keep_checkpoints=args.keep_checkpoints
        )
    except (ConfigMismatchError, data.CSVFormatError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
