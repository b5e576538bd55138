"""Which part of a seed decides whether a run learns a language: the data or the training?

    python examples/regular_languages/seed_factors.py --language parity --model rsa_transformer
    python examples/regular_languages/seed_factors.py --show

A run's ``seed`` draws its training strings (``data.make_datasets``) and also its parameters
and batch order (``train.Config.seed``). This crosses the two: every ``(data_seed, seed)``
pair of ``--seeds``, on ``select_rsa.py``'s validation split (the longest fifth of the
training lengths held out), at ``--case`` of the RSA paper and the paper's protocol
otherwise. A language learned along a row (one draw of the data, any initialisation) is
decided by the data; along a column, by the initialisation and batch order. One record per
run (``{"language", "model", "case", "data_seed", "seed", "val", "bin0", "bin1", ...}``) goes
to ``--results`` (default ``results/regular_languages_seed_factors.json``); runs already
there are skipped.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import append_record, load_records, setup_logging  # noqa: E402
from examples.common.paths import REPO_ROOT  # noqa: E402
from examples.regular_languages import data, select_rsa, train  # noqa: E402

DEFAULT_RESULTS = REPO_ROOT / "results" / "regular_languages_seed_factors.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--language", default="parity", choices=data.LANGUAGES)
    p.add_argument("--model", default="rsa_transformer", choices=select_rsa.RSA_MODELS)
    p.add_argument("--case", default="III", choices=list(select_rsa.CASES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--results", default=str(DEFAULT_RESULTS))
    p.add_argument("--show", action="store_true", help="print the grids and exit")
    return p.parse_args(argv)


def grid(records: list[dict], language: str, model: str, case: str) -> str:
    """Markdown: validation exact match, rows the data seed, columns the training seed."""
    mine = {
        (r["data_seed"], r["seed"]): r
        for r in records
        if (r["language"], r["model"], r["case"]) == (language, model, case)
    }
    data_seeds = sorted({d for d, _ in mine})
    seeds = sorted({s for _, s in mine})
    lines = ["| data seed \\ training seed | " + " | ".join(map(str, seeds)) + " |"]
    lines.append("|" + "---|" * (len(seeds) + 1))
    for d in data_seeds:
        cells = [f"{mine[d, s]['val']:.3f}" if (d, s) in mine else "-" for s in seeds]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    setup_logging()
    args = parse_args(argv)
    records = load_records(args.results)
    if args.show:
        for key in dict.fromkeys((r["language"], r["model"], r["case"]) for r in records):
            print(f"\n{' / '.join(key)} (validation exact match)\n\n{grid(records, *key)}")
        return
    done = {
        (r["data_seed"], r["seed"])
        for r in records
        if (r["language"], r["model"], r["case"]) == (args.language, args.model, args.case)
    }
    for data_seed in args.seeds:
        datasets = data.make_datasets(args.language, data_seed, validation=True)
        for seed in args.seeds:
            if (data_seed, seed) in done:
                continue
            cfg = train.Config(
                language=args.language, model=args.model, seed=seed, **select_rsa.CASES[args.case]
            )
            record = train.train_and_evaluate(cfg, datasets=datasets)
            record.update(case=args.case, data_seed=data_seed, learning_rate=cfg.learning_rate)
            append_record(args.results, record)
            logging.info(
                "%s/%s/%s data seed %d, seed %d: val %.4f",
                args.language, args.model, args.case, data_seed, seed, record["val"],
            )  # fmt: skip


if __name__ == "__main__":
    main()
