"""Resumable sweep: dataset x model x seed, one JSON record per finished run.

    python examples/classification/sweep.py              # JapaneseVowels, Handwriting; 5 seeds
    python examples/classification/sweep.py --datasets JapaneseVowels --seeds 0 --dry-run

Records ``{"dataset", "model", "seed", "accuracy", "wall_s", ...}`` (accuracy in %) are
appended to ``--results`` (default ``workdirs/classification/results.json``, outside git; the
committed table is ``--results results/classification.json``); runs already there are
skipped, and an interrupted run resumes from its checkpoint in ``--workdir-root``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.classification import configs, data, train  # noqa: E402
from examples.common import append_record, load_records, record_key, setup_logging  # noqa: E402
from examples.common.paths import ensure_importable, runs_root  # noqa: E402
from examples.common.results import results_path  # noqa: E402
from examples.common.runs import config_hash  # noqa: E402

KEY = ("dataset", "model", "seed", "causal")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--datasets", nargs="+", default=list(data.DATASETS))
    p.add_argument("--models", nargs="+", default=["aaren", "transformer"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--bidirectional", action="store_true", help="run the models with causal=False")
    p.add_argument(
        "--results",
        default=None,
        help="records file; default workdirs/classification/results.json (the committed tables "
        "change only with --results results/classification.json)",
    )
    p.add_argument(
        "--workdir-root",
        default=str(runs_root() / "classification"),
        help="per-run checkpoints (deleted once the run's record is written)",
    )
    p.add_argument("--data-root", default=None, help="default: ../shared/data beside the repo")
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs")
    p.add_argument("--dry-run", action="store_true", help="list the pending runs and exit")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return p.parse_args(argv)


def pending_runs(args: argparse.Namespace, done: set[tuple]) -> list[tuple]:
    """The (dataset, model, seed) runs not yet recorded, in sweep order."""
    causal = not args.bidirectional
    return [
        (ds, model, seed)
        for ds in args.datasets
        for model in args.models
        for seed in args.seeds
        if (ds, model, seed, causal) not in done
    ]


def main(argv=None) -> None:
    setup_logging()
    ensure_importable()
    args = parse_args(argv)
    args.results = str(results_path(args.results, "classification"))
    logging.info("records go to %s", args.results)
    # records from before the option existed are causal runs
    done = {record_key({"causal": True, **r}, KEY) for r in load_records(args.results)}
    runs = pending_runs(args, done)
    logging.info("%d runs done, %d pending", len(done), len(runs))
    if args.dry_run:
        for run in runs:
            print(*run)  # the listing is the command's output
        return
    cache: dict[str, data.ClassificationData] = {}
    for n, (ds, model, seed) in enumerate(runs):
        if args.max_runs is not None and n >= args.max_runs:
            break
        cfg = configs.get_config(ds, model, seed)
        cfg.data.data_root = args.data_root
        cfg.loop.progress = not args.no_progress
        cfg.model.causal = not args.bidirectional
        if ds not in cache:
            cache.clear()
            dc = cfg.data
            cache[ds] = data.load_dataset(ds, dc.data_root, dc.val_fraction, dc.split_seed)
        # one folder per configuration: a changed default never meets an old run
        direction = "" if cfg.model.causal else "_bidirectional"
        workdir = Path(args.workdir_root) / f"{ds}_{model}{direction}_{seed}-{config_hash(cfg)}"
        record = train.train_and_evaluate(cfg, str(workdir), data=cache[ds])
        append_record(args.results, record)
        shutil.rmtree(workdir / "checkpoints", ignore_errors=True)


if __name__ == "__main__":
    main()
