"""Chooses each language's RSA configuration on a validation split; resumable.

    python examples/regular_languages/select_rsa.py --languages d4 parity      # the paper's cases
    python examples/regular_languages/select_rsa.py --stage 2 --languages d4   # mu_init and lr
    python examples/regular_languages/select_rsa.py --show                     # the choices

The validation split is the training strings of the longest fifth of the training lengths
(``data.validation_lengths``: 42-50 for Parity and Tomita, 82-100 for D_n), held out of
training; bin 1 is never used. ``--validation-fraction 0.5`` holds out the upper half
instead (27-50, 52-100), so that validation asks for about bin 1's 2x extrapolation; each
fraction keeps its own ``--results`` file. Stage 1 tries the RSA paper's Table 2 cases I-IV (the
dilated heads of II and IV dilated by 2); stage 2 varies ``mu_init``, the learning rate and
(beyond the paper) the regular heads' initial ``|eta|`` around each (language, model)'s
stage-1 choice. Runs are seed 0 (``--seeds`` adds more; a
seed draws the data, the parameters and the batch order) at the paper's protocol otherwise.
One record per run (``{"language", "model", "name", "seed", "val", "bin0", "bin1",
"rsa_counts", "rsa_dilations", "mu_init", "learning_rate", ...}``) goes to ``--results``
(default ``results/regular_languages_selection.json``); runs already there are skipped.
The choice per (language, model) is the highest mean validation exact match over a
configuration's seeds, among the configurations run with the most seeds (a 3-seed mean is
not ranked against one seed's luck); ties go to the earlier entry (Case III, the a-priori
default, first). bin0 and bin1 are recorded but never used to choose. ``sweep.py
--selection`` then runs the chosen configurations.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import append_record, load_records, setup_logging  # noqa: E402
from examples.common.paths import REPO_ROOT  # noqa: E402
from examples.regular_languages import data, train  # noqa: E402

RSA_MODELS = ("rsa_transformer", "rsa_aaren")
DEFAULT_RESULTS = REPO_ROOT / "results" / "regular_languages_selection.json"
# Stage 1: the RSA paper's Table 2 cases; Case III (our a-priori default) first, so it wins ties.
CASES = {
    "III": {"rsa_counts": (3, 1, 1, 0, 0, 0), "rsa_dilations": ()},
    "I": {"rsa_counts": (5, 0, 0, 0, 0, 0), "rsa_dilations": ()},
    "II": {"rsa_counts": (3, 0, 0, 2, 0, 0), "rsa_dilations": (2, 2)},
    "IV": {"rsa_counts": (3, 0, 0, 0, 1, 1), "rsa_dilations": (2, 2)},
}
# Stage 2: one change at a time around the stage-1 choice.
VARIATIONS = {
    "mu0": {"mu_init": 0.0},
    "mu2": {"mu_init": 2.0},
    "lr0.0025": {"learning_rate": 0.0025},
    "lr0.01": {"learning_rate": 0.01},
    # beyond the paper: regular heads that start near a counter (|lambda| 0.987-0.998)
    "eta2.5-3.5": {"eta_range": (2.5, 3.5)},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--languages", nargs="+", default=list(data.LANGUAGES))
    p.add_argument("--models", nargs="+", default=list(RSA_MODELS), choices=RSA_MODELS)
    p.add_argument("--stage", type=int, default=1, choices=(1, 2))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument(
        "--validation-fraction",
        type=float,
        default=data.DEFAULT_VALIDATION_FRACTION,
        help="share of the training lengths held out, longest first (0.5: about bin 1's 2x); "
        "one value per --results file",
    )
    p.add_argument("--results", default=str(DEFAULT_RESULTS))
    p.add_argument("--dry-run", action="store_true", help="list the pending runs and exit")
    p.add_argument("--show", action="store_true", help="print the choices and exit")
    return p.parse_args(argv)


def chosen(records: list[dict], language: str, model: str) -> dict | None:
    """The chosen configuration of (language, model), if any has run.

    Returns the configuration's first record with ``val`` replaced by the mean over its
    seeds and ``seeds`` added. Only the configurations run with the most seeds compete;
    among them the highest mean wins, the earliest in the grid on ties.
    """
    vals: dict[str, dict[int, float]] = {}
    first: dict[str, dict] = {}
    for r in records:
        if r["language"] == language and r["model"] == model:
            vals.setdefault(r["name"], {})[r["seed"]] = r["val"]
            first.setdefault(r["name"], r)
    if not vals:
        return None
    most = max(len(seeds) for seeds in vals.values())
    ranked = sorted((n for n in vals if len(vals[n]) == most), key=_grid_position)
    best = max(ranked, key=lambda n: sum(vals[n].values()) / most)  # max keeps the first
    return {**first[best], "val": sum(vals[best].values()) / most, "seeds": sorted(vals[best])}


def _grid_position(name: str) -> tuple:
    """Stage-1 cases in their order, then their stage-2 variations."""
    case, _, variation = name.partition("+")
    return bool(variation), list(CASES).index(case), variation and list(VARIATIONS).index(variation)


def overrides(record: dict) -> dict:
    """The ``train.Config`` fields that a selection record fixes."""
    return {
        "rsa_counts": tuple(record["rsa_counts"]),
        "rsa_dilations": tuple(record["rsa_dilations"]),
        "mu_init": record["mu_init"],
        "learning_rate": record["learning_rate"],
        # records from before the option have the paper's range
        "eta_range": tuple(record.get("eta_range") or train.Config.eta_range),
    }


def is_default(record: dict) -> bool:
    """Whether a selection record's configuration is ``train.Config``'s own (Case III, ``mu_init``
    1, learning rate 0.005, ``eta_range`` (1, 2)): the sweep's default runs are then that
    choice's runs."""
    defaults = train.Config(language=record["language"], model=record["model"])
    return all(getattr(defaults, k) == v for k, v in overrides(record).items())


def candidates(records: list[dict], language: str, model: str, stage: int) -> dict[str, dict]:
    """The named configurations of a stage (stage 2 needs the stage-1 choice)."""
    if stage == 1:
        return CASES
    best = chosen([r for r in records if r["name"] in CASES], language, model)
    if best is None:
        return {}
    return {f"{best['name']}+{k}": {**overrides(best), **v} for k, v in VARIATIONS.items()}


def main(argv=None) -> None:
    setup_logging()
    args = parse_args(argv)
    records = load_records(args.results)
    if args.show:
        for lang in args.languages:
            for model in args.models:
                best = chosen(records, lang, model)
                if best is not None:
                    seeds = f"seeds {best['seeds']}"
                    print(
                        lang, model, best["name"], f"val {best['val']:.4f}", seeds, overrides(best)
                    )
        return
    # records from before the option have the default fraction
    fractions = {r.get("validation_fraction", data.DEFAULT_VALIDATION_FRACTION) for r in records}
    if fractions - {args.validation_fraction}:
        raise SystemExit(
            f"error: {args.results} holds choices made with validation_fraction "
            f"{sorted(fractions)}; give --results another file for {args.validation_fraction}"
        )
    done = {(r["language"], r["model"], r["name"], r["seed"]) for r in records}
    runs = [
        (lang, model, name, seed, fields)
        for lang in args.languages
        for seed in args.seeds
        for model in args.models
        for name, fields in candidates(records, lang, model, args.stage).items()
        if (lang, model, name, seed) not in done
    ]
    logging.info("%d runs pending", len(runs))
    if args.dry_run:
        for lang, model, name, seed, _ in runs:
            print(lang, model, name, f"seed {seed}")
        return
    cache: dict[tuple[str, int], dict] = {}
    for lang, model, name, seed, fields in runs:
        if (lang, seed) not in cache:
            cache.clear()
            cache[(lang, seed)] = data.make_datasets(
                lang, seed, validation=True, validation_fraction=args.validation_fraction
            )
        cfg = train.Config(language=lang, model=model, seed=seed, **fields)
        record = train.train_and_evaluate(cfg, datasets=cache[(lang, seed)])
        record.update(
            name=name,
            learning_rate=cfg.learning_rate,
            validation_fraction=args.validation_fraction,
        )
        append_record(args.results, record)
        logging.info("%s/%s/%s/seed%d val %.4f", lang, model, name, seed, record["val"])


if __name__ == "__main__":
    main()
