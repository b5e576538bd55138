"""Trains and tests one model on one language: ``python examples/regular_languages/main.py``.

    python examples/regular_languages/main.py --language parity --model rsa_transformer
    python examples/regular_languages/main.py --language d2 --model rsa_aaren --epochs 5

Prints the run's record as JSON (exact-match accuracy on bin 0 and bin 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import setup_logging  # noqa: E402
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
    p.add_argument("--workdir", default=None, help="accepted for the examples' CLI shape")
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


def main(argv=None) -> None:
    setup_logging()
    args = parse_args(argv)
    record = train.train_and_evaluate(config_from_args(args), args.workdir)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
