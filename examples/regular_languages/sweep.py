"""Resumable sweep: language x model x seed, one JSON record per finished run.

    python examples/regular_languages/sweep.py                   # 6 languages, 4 models, seed 0
    python examples/regular_languages/sweep.py --seeds 0 1 2 --languages parity tomita5
    python examples/regular_languages/sweep.py --positional none --models transformer aaren
    python examples/regular_languages/sweep.py --dry-run
    python examples/regular_languages/sweep.py --languages d4 parity --seeds 0 1 2 \
        --models rsa_transformer rsa_aaren --selection results/regular_languages_selection.json

Records ``{"language", "model", "seed", "bin0", "bin1", "epochs", "wall_s", ...}`` are
appended to ``--results`` (default ``workdirs/regular_languages/results.json``, outside git;
the committed table is ``--results results/regular_languages.json``, which ``--table`` reads
when ``--results`` is not given); runs already there are skipped, so an
interrupted sweep resumes at the next unfinished run. Order: every (language, model) for the
first seed, then the next seed, so one seed of everything lands first. Every run uses the
same configuration (``train.Config``; the paper's protocol) unless overridden here, and an
override is recorded in each record (e.g. ``"epochs"``). A run is identified by its
language, model, seed and positional encoding (``train.DEFAULT_POSITIONAL`` unless
``--positional`` says otherwise); the main table shows the default encodings, an ablation
table the others. With ``--selection``, the RSA models run at the configuration that
``select_rsa.py`` chose on validation for their language (recorded as ``"rsa_case"``, part of
a run's identity, and tabulated apart). Several sweeps may share one results file (appends
are locked).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import append_record, load_records, record_key, setup_logging  # noqa: E402
from examples.common.paths import REPO_ROOT  # noqa: E402
from examples.common.results import results_path  # noqa: E402
from examples.regular_languages import data, select_rsa, train  # noqa: E402

KEY = ("language", "model", "seed", "positional", "rsa_case")
COMMITTED = REPO_ROOT / "results" / "regular_languages.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--languages", nargs="+", default=list(data.LANGUAGES))
    p.add_argument("--models", nargs="+", default=list(train.MODELS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument(
        "--results",
        default=None,
        help="records file; default workdirs/regular_languages/results.json (the committed "
        "table changes only with --results results/regular_languages.json)",
    )
    p.add_argument("--epochs", type=int, default=None, help="deviation from the paper's 25")
    p.add_argument("--train-size", type=int, default=None, help="deviation from the paper's")
    p.add_argument(
        "--positional",
        default=None,
        choices=train.POSITIONAL,
        help="ablation: this encoding for every model (default: train.DEFAULT_POSITIONAL)",
    )
    p.add_argument(
        "--selection",
        default=None,
        help="select_rsa.py's records: the RSA models run at their language's chosen config",
    )
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs")
    p.add_argument("--dry-run", action="store_true", help="list the pending runs and exit")
    p.add_argument("--table", action="store_true", help="print the results as Markdown and exit")
    return p.parse_args(argv)


# The RSA paper's Table 2 (bin 0, bin 1): vanilla Transformer, and RSA-Transformer Case III
# (3, 1, 1, 0, 0, 0), the head assignment our rsa_* models use.
PAPER = {
    "d2": {"transformer": (0.2, 0.2), "rsa_transformer": (1.0, 1.0)},
    "d4": {"transformer": (1.0, 0.08), "rsa_transformer": (1.0, 1.0)},
    "parity": {"transformer": (0.29, 0.0), "rsa_transformer": (0.91, 0.62)},
    "tomita3": {"transformer": (0.89, 0.11), "rsa_transformer": (1.0, 0.98)},
    "tomita5": {"transformer": (0.07, 0.0), "rsa_transformer": (0.49, 0.0)},
    "tomita6": {"transformer": (0.0, 0.0), "rsa_transformer": (0.95, 0.46)},
}


def _unique(records: list[dict]) -> list[dict]:
    """The first record of each run (two sweeps sharing a file may both finish one)."""
    seen, unique = set(), []
    for r in records:
        key = record_key(r, KEY)
        if key not in seen:
            seen.add(key)
            unique.append(r)
    return unique


def _cell(records: list[dict]) -> str:
    if not records:
        return "pending"
    b0 = sum(r["bin0"] for r in records) / len(records)
    b1 = sum(r["bin1"] for r in records) / len(records)
    return f"{b0:.2f} / {b1:.2f} (n={len(records)})"


def table(records: list[dict], models=train.MODELS) -> str:
    """Markdown: per language and model, mean exact match over seeds (n seeds), and the paper's.

    Only records with the model's default positional encoding (``train.DEFAULT_POSITIONAL``)
    and the paper's epochs and training size count here; see ``ablation_table``.
    """
    records = _unique(records)
    header = "| language | " + " | ".join(f"{m} bin0 / bin1" for m in models)
    header += " | paper Transformer | paper RSA-Transformer (III) |"
    lines = [header, "|" + "---|" * (len(models) + 3)]
    for lang in data.LANGUAGES:
        cells = [
            _cell(
                [r for r in records if r["language"] == lang and r["model"] == m and _is_default(r)]
            )
            for m in models
        ]
        paper = PAPER[lang]
        cells += [
            f"{paper[k][0]:.2f} / {paper[k][1]:.2f}" for k in ("transformer", "rsa_transformer")
        ]
        lines.append(f"| {lang} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _is_default(record: dict) -> bool:
    """Recorded with the model's default positional encoding and the paper's protocol."""
    return (
        record.get("positional") == train.DEFAULT_POSITIONAL[record["model"]]
        and record.get("epochs") == train.Config.epochs
        and record.get("train_size") == data.language_spec(record["language"]).train_size
        and record.get("rsa_case") is None
    )


def chosen_table(records: list[dict], selection: list[dict] | None = None) -> str:
    """Markdown: the RSA models at the configurations chosen on validation (``rsa_case``).

    A (language, model) run at more than one case (a later selection stage changed the
    choice) gets one entry per case, never one mean over both: the current choice of
    ``selection`` (``select_rsa.py``'s records) first when given, else in recording order.
    A choice that is ``train.Config``'s own configuration shows the default runs under
    its name.
    """
    records = _unique(records)
    models = [m for m in train.MODELS if m.startswith("rsa_")]
    lines = ["| language | " + " | ".join(f"{m}: case, bin0 / bin1" for m in models) + " |"]
    lines.append("|" + "---|" * (len(models) + 1))
    any_run = False
    for lang in data.LANGUAGES:
        cells = []
        for m in models:
            mine = [r for r in records if r["language"] == lang and r["model"] == m]
            best = selection and select_rsa.chosen(selection, lang, m)
            runs = [r for r in mine if r.get("rsa_case") is not None]
            if best and select_rsa.is_default(best):
                runs = [{**r, "rsa_case": best["name"]} for r in mine if _is_default(r)] + runs
            cases = list(dict.fromkeys(r["rsa_case"] for r in runs))
            if best and best["name"] in cases:
                cases.remove(best["name"])
                cases.insert(0, best["name"])
            entries = [f"{c}: {_cell([r for r in runs if r['rsa_case'] == c])}" for c in cases]
            cells.append("; ".join(entries) if entries else "not run")
            any_run = any_run or bool(entries)
        lines.append(f"| {lang} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if any_run else ""


def ablation_table(records: list[dict]) -> str:
    """Markdown: each (model, positional encoding) pair against the default, per language.

    Runs at a chosen RSA configuration (``rsa_case``) are ``chosen_table``'s, not ablations.
    """
    records = [r for r in _unique(records) if not _is_default(r) and r.get("rsa_case") is None]
    combos = sorted(
        {(r["model"], r["positional"]) for r in records},
        key=lambda c: (train.MODELS.index(c[0]), c[1]),
    )
    if not combos:
        return ""
    header = "| language | " + " | ".join(f"{m}, {p} positions" for m, p in combos) + " |"
    lines = [header, "|" + "---|" * (len(combos) + 1)]
    for lang in data.LANGUAGES:
        cells = [
            _cell(
                [
                    r
                    for r in records
                    if r["language"] == lang and (r["model"], r["positional"]) == combo
                ]
            )
            for combo in combos
        ]
        lines.append(f"| {lang} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pending_runs(
    args: argparse.Namespace, done: set[tuple], selection: list[dict] | None = None
) -> list[tuple]:
    """The (language, model, seed, positional, rsa_case) runs not yet recorded, seed-major.

    ``selection``: ``select_rsa.py``'s records; the RSA models then take their language's
    chosen configuration, named by ``rsa_case`` (None when the choice is ``train.Config``'s
    own: the default runs are its runs).
    """
    runs = []
    for seed in args.seeds:
        for lang in args.languages:
            for model in args.models:
                positional = args.positional or train.DEFAULT_POSITIONAL[model]
                case = None
                if selection is not None and model.startswith("rsa_"):
                    tried = {
                        r["name"]
                        for r in selection
                        if r["language"] == lang and r["model"] == model
                    }
                    if not set(select_rsa.CASES) <= tried:
                        raise SystemExit(
                            f"error: --selection has not tried every case for {lang}/{model} "
                            f"yet (tried: {sorted(tried)})"
                        )
                    choice = select_rsa.chosen(selection, lang, model)
                    case = None if select_rsa.is_default(choice) else choice["name"]
                if (lang, model, seed, positional, case) not in done:
                    runs.append((lang, model, seed, positional, case))
    return runs


def main(argv=None) -> None:
    setup_logging()
    args = parse_args(argv)
    if args.table:  # read-only: the committed table unless another file is named
        records = load_records(args.results or COMMITTED)
        print(table(records))
        selection = None if args.selection is None else load_records(args.selection)
        chosen = chosen_table(records, selection)
        if chosen:
            print("\nRSA at the configuration chosen on validation (select_rsa.py):\n")
            print(chosen)
        ablation = ablation_table(records)
        if ablation:
            print("\nAblations (not the default positional encoding, or not the paper's size):\n")
            print(ablation)
        return
    args.results = str(results_path(args.results, "regular_languages"))
    logging.info("records go to %s", args.results)
    done = {record_key(r, KEY) for r in load_records(args.results)}
    selection = None if args.selection is None else load_records(args.selection)
    runs = pending_runs(args, done, selection)
    logging.info("%d runs done, %d pending", len(done), len(runs))
    if args.dry_run:
        for run in runs:
            print(*run)
        return
    cache: dict[tuple, dict] = {}
    for n, (lang, model, seed, positional, case) in enumerate(runs):
        if args.max_runs is not None and n >= args.max_runs:
            break
        if (lang, model, seed, positional, case) in {
            record_key(r, KEY) for r in load_records(args.results)
        }:
            continue  # recorded meanwhile by another sweep sharing the file
        overrides = {"epochs": args.epochs, "train_size": args.train_size}
        if case is not None:
            overrides.update(select_rsa.overrides(select_rsa.chosen(selection, lang, model)))
        cfg = train.Config(
            language=lang,
            model=model,
            seed=seed,
            positional=positional,
            **{k: v for k, v in overrides.items() if v is not None},
        )
        if (lang, seed) not in cache:
            cache.clear()  # one language's data at a time
            cache[(lang, seed)] = data.make_datasets(lang, seed, train_size=cfg.train_size)
        record = train.train_and_evaluate(cfg, datasets=cache[(lang, seed)])
        if case is not None:
            record.update(rsa_case=case, learning_rate=cfg.learning_rate)
        append_record(args.results, record)
        logging.info(
            "recorded %s/%s/seed%d (%s positions) in %s",
            lang,
            model,
            seed,
            positional,
            args.results,
        )


if __name__ == "__main__":
    main()
