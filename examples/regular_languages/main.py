"""Trains and tests one model on one language: ``python examples/regular_languages/main.py``.

    python examples/regular_languages/main.py --language parity --model rsa_transformer
    python examples/regular_languages/main.py --language d2 --model rsa_aaren --epochs 5

Prints the run's record as JSON (exact-match accuracy on bin 0 and bin 1) and keeps it in a
run folder (``--workdir``, or one per configuration under ``workdirs/regular_languages/runs``):
``config.json``, ``result.json`` and ``loss.png``. Runs are short and not checkpointed; the same
configuration again returns the stored result, another one in the same folder is refused
unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import setup_logging  # noqa: E402
from examples.common.parallel import add_distributed_args, initialize_distributed  # noqa: E402
from examples.common.runs import ConfigMismatchError, RunDir, default_run_dir  # noqa: E402
from examples.regular_languages import data, train  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--language", default="parity", choices=data.LANGUAGES)
    p.add_argument("--model", default="transformer", choices=train.MODELS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=None, help="override the paper's 25")
    p.add_argument("--train-size", type=int, default=None, help="override the paper's size")
    p.add_argument("--test-size", type=int, default=None, help="override the paper's size")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--rsa-counts", type=int, nargs=6, default=None, help="k1 .. k6")
    p.add_argument("--rsa-dilations", type=int, nargs="*", default=None)
    p.add_argument("--mu-init", type=float, default=None)
    p.add_argument("--positional", default=None, choices=train.POSITIONAL)
    p.add_argument(
        "--workdir",
        default=None,
        help="run folder (config, result.json, loss.png); default: one per configuration "
        "under workdirs/regular_languages/runs",
    )
    p.add_argument("--overwrite", action="store_true", help="discard the run in --workdir")
    add_distributed_args(p)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> train.Config:
    overrides = {
        "epochs": args.epochs,
        "train_size": args.train_size,
        "test_size": args.test_size,
        "batch_size": args.batch_size,
        "rsa_counts": None if args.rsa_counts is None else tuple(args.rsa_counts),
        "rsa_dilations": None if args.rsa_dilations is None else tuple(args.rsa_dilations),
        "mu_init": args.mu_init,
        "positional": args.positional,
    }
    return train.Config(
        language=args.language,
        model=args.model,
        seed=args.seed,
        **{k: v for k, v in overrides.items() if v is not None},
    )


def main(argv=None) -> dict:
    setup_logging()
    args = parse_args(argv)
    initialize_distributed(args)
    cfg = config_from_args(args)
    name = f"{cfg.language}_{cfg.model}_{cfg.seed}"
    workdir = args.workdir or default_run_dir("regular_languages", name, cfg)
    logging.info("run folder %s", workdir)
    try:
        run = RunDir(workdir, cfg, overwrite=args.overwrite)
    except ConfigMismatchError as e:
        raise SystemExit(f"error: {e}") from None
    stored = run.finished_result()
    if stored is not None:
        logging.info(
            "%s: this configuration already finished there (--overwrite to rerun)", workdir
        )
        record = stored["record"]
    else:
        history: list[dict] = []
        record = train.train_and_evaluate(cfg, history_out=history)
        run.write_result(record, history, finished=True)
    print(json.dumps(record, indent=1))  # the record is the command's output
    return record


if __name__ == "__main__":
    main()
