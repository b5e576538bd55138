"""Why a language falls short: learned REMs and gates, and where the errors are.

    python examples/regular_languages/analyze.py --language parity --model rsa_transformer
    python examples/regular_languages/analyze.py --language d4 --model rsa_aaren --seed 1 \
        --out results/regular_languages_analysis.json

Trains one run exactly as ``main.py`` does (same arguments), then reports, as the RSA
paper's Figure 11 looks at them:

* per layer, the gate ``sigmoid(mu)``, each regular head's ``lambda = tanh(eta)`` and each
  cyclical head's ``gamma = sigmoid(nu)`` and ``theta``;
* per test bin, exact match by string length (buckets of 10), and the first wrong position
  of each failed string (its quantiles, and the share of failures whose first error is
  within 10 positions of the string's end or beyond the training lengths).

The record (``{"language", "model", "seed", "bin0", "bin1", "rems", "by_length",
"first_error", ...}``) is printed and, with ``--out``, appended to that JSON list.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402
import numpy as np  # noqa: E402

from examples.common import append_record, setup_logging  # noqa: E402
from examples.regular_languages import data, train  # noqa: E402
from examples.regular_languages import main as cli  # noqa: E402


def rem_parameters(model: train.LanguageModel) -> list[dict]:
    """Per layer: the gate and each head's REM parameters, in head order (``REMConfig``)."""
    layers = []
    for block in model.backbone.blocks:
        rsa = block.attention.rsa
        counts = rsa.config.counts
        params = rsa.params()
        lam = np.tanh(np.asarray(params["eta"], np.float64))
        gamma = 1 / (1 + np.exp(-np.asarray(params["nu"], np.float64)))
        theta = np.asarray(params["theta"], np.float64)
        layers.append(
            {
                "gate": float(rsa.gate()),
                "counts": list(counts),
                "dilations": list(rsa.config.dilations),
                "lambda": [round(float(x), 4) for x in lam],
                "gamma": [round(float(x), 4) for x in gamma],
                "theta": [round(float(x), 4) for x in theta],
            }
        )
    return layers


def predictions(model: train.LanguageModel, split: data.Split, batch_size: int = 500):
    """Per position, whether every symbol is right. [N, T] bool (True on padding)"""
    apply = jax.jit(lambda t, m: model(t, m))
    rows = []
    for start in range(0, len(split.tokens), batch_size):
        t, m = split.tokens[start : start + batch_size], split.mask[start : start + batch_size]
        y = split.targets[start : start + batch_size]
        logits = np.asarray(apply(t, m))
        rows.append(np.all((logits > 0) == (y > 0.5), axis=-1) | ~m)
    return np.concatenate(rows)


def error_profile(right: np.ndarray, lengths: np.ndarray, train_max: int) -> dict:
    """Exact match by length bucket, and where failed strings first go wrong."""
    exact = right.all(axis=1)
    buckets = {}
    for lo in range(0, int(lengths.max()) + 1, 10):
        sel = (lengths >= lo) & (lengths < lo + 10)
        if sel.any():
            buckets[f"{lo}-{lo + 9}"] = {"n": int(sel.sum()), "exact": float(exact[sel].mean())}
    failed = ~exact
    profile = {"by_length": buckets, "exact": float(exact.mean())}
    if failed.any():
        first = np.argmax(~right[failed], axis=1) + 1  # 1-based position of the first error
        to_end = lengths[failed] - first
        profile["first_error"] = {
            "failures": int(failed.sum()),
            "quantiles_10_50_90": [float(q) for q in np.quantile(first, [0.1, 0.5, 0.9])],
            "share_within_10_of_the_end": float(np.mean(to_end < 10)),
            "share_beyond_training_lengths": float(np.mean(first > train_max)),
        }
    return profile


def main(argv=None) -> dict:
    setup_logging()
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--out", default=None, help="append the record to this JSON list")
    own, rest = p.parse_known_args(argv)
    cfg = cli.config_from_args(cli.parse_args(rest))
    datasets = data.make_datasets(
        cfg.language, cfg.seed, train_size=cfg.train_size, test_size=cfg.test_size
    )
    trained: list = []
    record = train.train_and_evaluate(cfg, datasets=datasets, model_out=trained)
    model = trained[0]
    train_max = data.language_spec(cfg.language).train_lengths[1]
    for split in ("bin0", "bin1"):
        right = predictions(model, datasets[split])
        record[split + "_profile"] = error_profile(right, datasets[split].lengths, train_max)
    if cfg.model.startswith("rsa_"):
        record["rems"] = rem_parameters(model)
    print(json.dumps(record, indent=1))
    if own.out:
        append_record(own.out, record)
    return record


if __name__ == "__main__":
    main()
