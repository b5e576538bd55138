"""Chooses the REM heads of the rsa_ forecasters on ETTh1's validation split; resumable.

    python examples/forecasting/select_rsa.py            # the grid of configs.RSA_GRID
    python examples/forecasting/select_rsa.py --dry-run  # what it would run

Runs every configuration of ``configs.RSA_GRID`` with both rsa_ backbones on ETTh1 at horizon
96, seed 0, appends one record per run (``{"name", "model", "rsa_counts", "rsa_dilations",
"val_mse", "mse", "gates", ...}``) to ``--results`` (default
``results/forecasting_rsa_selection.json``), skips runs already there, and prints the
configuration with the lowest validation MSE averaged over the two backbones. Test MSE is
recorded but never used to choose.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import append_record, load_records, setup_logging  # noqa: E402
from examples.common.paths import REPO_ROOT, ensure_importable, runs_root  # noqa: E402
from examples.forecasting import configs, train  # noqa: E402

RSA_MODELS = ("rsa_aaren", "rsa_transformer")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dataset", default="ETTh1")
    p.add_argument("--horizon", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--results", default=str(REPO_ROOT / "results" / "forecasting_rsa_selection.json")
    )
    p.add_argument("--workdir-root", default=str(runs_root() / "forecasting_rsa_selection"))
    p.add_argument("--data-root", default=None, help="default: ../shared/data beside the repo")
    p.add_argument("--dry-run", action="store_true", help="list the pending runs and exit")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return p.parse_args(argv)


def choose(records: list[dict]) -> tuple[str, float] | None:
    """The grid entry with the lowest mean validation MSE over the rsa_ backbones, if complete."""
    by_name: dict[str, dict[str, float]] = {}
    for r in records:
        by_name.setdefault(r["name"], {})[r["model"]] = r["val_mse"]
    complete = {
        name: sum(v.values()) / len(v) for name, v in by_name.items() if set(v) == set(RSA_MODELS)
    }
    if not complete:
        return None
    best = min(complete, key=complete.get)
    return best, complete[best]


def main(argv=None) -> None:
    setup_logging()
    ensure_importable()
    args = parse_args(argv)
    done = {(r["name"], r["model"]) for r in load_records(args.results)}
    runs = [(n, m) for n in configs.RSA_GRID for m in RSA_MODELS if (n, m) not in done]
    logging.info("%d runs done, %d pending", len(done), len(runs))
    if args.dry_run:
        for run in runs:
            print(*run)  # the listing is the command's output
        return
    data = None
    for name, model in runs:
        counts, dilations = configs.RSA_GRID[name]
        cfg = configs.get_config(args.dataset, args.horizon, model, args.seed)
        cfg.model.rsa_counts, cfg.model.rsa_dilations = counts, dilations
        cfg.data.data_root = args.data_root
        cfg.loop.progress = not args.no_progress
        if data is None:  # the same ETTh1 windows for every run
            data = train.load_data(cfg)
        workdir = Path(args.workdir_root) / f"{name}_{model}"
        record = {"name": name, **train.train_and_evaluate(cfg, str(workdir), data=data)}
        append_record(args.results, record)
        shutil.rmtree(workdir / "checkpoints", ignore_errors=True)
    chosen = choose(load_records(args.results))
    if chosen is not None:
        print(
            f"chosen on validation: {chosen[0]} {configs.RSA_GRID[chosen[0]]}, "
            f"mean val_mse {chosen[1]:.4f}"
        )


if __name__ == "__main__":
    main()
