"""The README's results table from the sweep's records: ``python
examples/offline_rl/report.py results/offline_rl.json``.

One row per (environment, dataset): the D4RL-normalised score of the Decision Transformer and
of Decision Aaren (windowed, as trained; and streamed over the whole episode), mean ± standard
deviation over seeds (with one seed: over its evaluation episodes), our own normalised score
(random = 0, our expert SAC policy = 100), and the milliseconds per environment step of each
evaluation; and the issue's target per cell, for Aaren's window and stream: its mean score
within one standard deviation of the Transformer's (over seeds) or above, with the number of
seeds on which it is ahead (both over the seeds both models recorded, 2 or more), and the
count of cells that meet it under the table, then the CPUs the records were made on.
``--target data_best``: the same for the evaluations conditioned on the dataset's best
episode return instead of CORL's target. ``--per-seed``: every seed's score instead, both
targets, one row per cell and target, then each run's held-out action fit (the README's
per-seed tables). ``--manifest``: the
generated data instead (the generator's ``manifest.json``): per environment the behaviour
policies' returns and the datasets' sizes and mean returns, D4RL-normalised and
own-normalised. ``--against BASELINE``: the records' seeds paired with the same runs in
another results file (e.g. the K = 60 grid against K = 20), per dataset: how many pairs
score higher, and both means. ``--summary FILE ...``: one row per results file, its
settings and the cells that meet the target at both targets (the README's map of the grids).
``--noise``: per cell, the spread over seeds beside one run's evaluation error, and the share
of the seeds' variance that evaluation accounts for (whether more episodes or more seeds would
narrow a cell's spread).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import load_records  # noqa: E402
from examples.offline_rl.configs import D4RL_REF, DATASETS, ENV_IDS  # noqa: E402
from examples.offline_rl.evaluate import normalised  # noqa: E402

COLUMNS = (("transformer", "window"), ("aaren", "window"), ("aaren", "stream"))
HEADER = "Decision Transformer | Decision Aaren (window) | Decision Aaren (stream)"
TARGET_NAMES = {"corl": "CORL's target", "data_best": "the data's best return"}


def _cell(values, episode_std=None) -> str:
    """mean ± std over seeds (n seeds); with one seed, ± the std over its episodes."""
    v = np.asarray([x for x in values if x is not None], float)
    if not len(v):
        return "-"
    if len(v) == 1 and episode_std is not None:
        return f"{v[0]:.1f} (1 seed; ± {episode_std:.1f} over episodes)"
    return f"{v.mean():.1f} ± {v.std():.1f} ({len(v)} seeds)"


def _mean(values) -> str:
    v = [x for x in values if x is not None]
    return f"{np.mean(v):.1f}" if v else "-"


def _by_column(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """One cell's records split into the table's columns (model, evaluation)."""
    return {c: [r for r in rows if (r["model"], r.get("eval", "window")) == c] for c in COLUMNS}


def shared_seeds(transformer: list[dict], aaren: list[dict]) -> set[int]:
    """The seeds both sides recorded: a sweep in progress can hold a seed on one side only."""
    return {r["seed"] for r in transformer} & {r["seed"] for r in aaren}


def verdict(transformer: list[dict], aaren: list[dict]) -> bool | None:
    """Whether Aaren's records meet the issue's target against the Transformer's: mean score
    at least the Transformer's mean minus its standard deviation over seeds (population),
    both over the seeds both sides recorded; None with fewer than 2 such seeds."""
    seeds = shared_seeds(transformer, aaren)
    if len(seeds) < 2:
        return None
    t = np.asarray([r["score"] for r in transformer if r["seed"] in seeds])
    a = [r["score"] for r in aaren if r["seed"] in seeds]
    return bool(np.mean(a) >= t.mean() - t.std())


def _judged(transformer: list[dict], aaren: list[dict], ahead: bool = False) -> str:
    """The verdict in words, naming the seeds it leaves out for lack of a pair and, with
    ``ahead``, the paired seeds on which Aaren scores above the Transformer."""
    met = verdict(transformer, aaren)
    if met is None:
        return "-"
    seeds = shared_seeds(transformer, aaren)
    unpaired = sorted({r["seed"] for r in transformer + aaren} - seeds)
    notes = [f"without seed {', '.join(map(str, unpaired))}"] if unpaired else []
    if ahead:
        by_seed = {r["seed"]: r["score"] for r in transformer}
        paired = [r for r in aaren if r["seed"] in seeds]
        notes.append(f"ahead {sum(r['score'] > by_seed[r['seed']] for r in paired)}/{len(paired)}")
    return ("met" if met else "not met") + (f" ({', '.join(notes)})" if notes else "")


def table(records: list[dict], target: str = "corl") -> str:
    """A Markdown table of the records conditioned on ``target`` (``"corl"``: CORL's target
    return; ``"data_best"``: the dataset's best episode return; see the module docstring)."""
    records = [r for r in records if r.get("target", "corl") == target]
    lines = [
        f"| env | dataset | {HEADER} | own-normalised DT / DA / DA stream | ms per env step "
        "DT / DA / DA stream | target: DA / DA stream |",
        "|---|---|---|---|---|---|---|---|",
    ]
    met = {c: [] for c in COLUMNS[1:]}
    for env in ENV_IDS:
        for ds in DATASETS:
            rows = [r for r in records if r["env"] == env and r["dataset"] == ds]
            if not rows:
                continue
            by = _by_column(rows)
            scores = [
                _cell([r["score"] for r in by[c]], by[c][0]["score_std"] if by[c] else None)
                for c in COLUMNS
            ]
            own = " / ".join(_mean([r.get("score_own") for r in by[c]]) for c in COLUMNS)
            ms = " / ".join(
                f"{np.mean([r['ms_per_env_step'] for r in by[c]]):.1f}" if by[c] else "-"
                for c in COLUMNS
            )
            dt = by[COLUMNS[0]]
            verdicts = " / ".join(_judged(dt, by[c], ahead=True) for c in COLUMNS[1:])
            for c in COLUMNS[1:]:
                met[c].append(verdict(dt, by[c]))
            lines.append(
                f"| {env} | {ds} | " + " | ".join(scores) + f" | {own} | {ms} | {verdicts} |"
            )
    lines.append("")
    for (_, mode), cells in met.items():
        judged = [m for m in cells if m is not None]
        lines.append(
            f"Decision Aaren ({mode}) meets the target in {sum(judged)} of {len(judged)} cells "
            f"with 2 or more seeds per model ({len(cells)} cells recorded)."
        )
    lines.append(machines(records))
    return "\n".join(lines)


def _seeds_cell(rows: list[dict], seeds: list[int]) -> str:
    """Each seed's score in ``seeds`` order ("-" where a seed is missing), then mean ± std."""
    by_seed = {r["seed"]: r["score"] for r in rows}
    if not by_seed:
        return "-"
    listed = " / ".join(f"{by_seed[s]:.1f}" if s in by_seed else "-" for s in seeds)
    v = np.asarray(list(by_seed.values()))
    return listed if len(v) == 1 else f"{listed}: {v.mean():.1f} ± {v.std():.1f}"


def per_seed_table(records: list[dict]) -> str:
    """A Markdown table of every seed's score, per (environment, dataset) and target: the
    Transformer, Aaren's window and its stream, with the target's verdict for both."""
    seeds = sorted({r["seed"] for r in records})
    lines = [
        f"Seeds {' / '.join(map(str, seeds))}, then mean ± std over the seeds recorded "
        "(D4RL-normalised, each the mean over its evaluation episodes); each verdict over "
        "the seeds both models recorded.",
        "",
        "| cell | target | Decision Transformer | Aaren window | Aaren stream "
        "| verdict (window / stream) |",
        "|---|---|---|---|---|---|",
    ]
    for env in ENV_IDS:
        for ds in DATASETS:
            for target in ("corl", "data_best"):
                rows = [
                    r
                    for r in records
                    if (r["env"], r["dataset"], r.get("target", "corl")) == (env, ds, target)
                ]
                if not rows:
                    continue
                by = _by_column(rows)
                judged = " / ".join(_judged(by[COLUMNS[0]], by[c]) for c in COLUMNS[1:])
                cells = " | ".join(_seeds_cell(by[c], seeds) for c in COLUMNS)
                name = "CORL" if target == "corl" else "data best"
                lines.append(f"| {env} {ds} | {name} | {cells} | {judged} |")
    return "\n".join(lines + ["", fit_table(records, seeds)])


def _settings(records: list[dict]) -> str:
    """The training settings the records share (or the values they span)."""
    parts = []
    for field, name in (("context_steps", "K"), ("train_steps", "updates"),
                        ("eval_episodes", "episodes")):  # fmt: skip
        values = sorted({r[field] for r in records if r.get(field) is not None})
        parts.append(f"{name} {', '.join(map(str, values)) or 'not recorded'}")
    heads = sorted({"RSA" if r.get("rsa") else "softmax" for r in records})
    return ", ".join([*parts, " and ".join(heads)])


def summary_table(files: dict[str, list[dict]]) -> str:
    """A Markdown table with one row per results file: its settings, runs, and the cells
    meeting the target (window / stream) among those with 2 seeds or more per model, at
    CORL's target and at the data's best return, then the cells not met at CORL's."""
    lines = [
        "| results | settings | runs | cells met at CORL's target (window / stream) "
        "| at the data's best return | not met at CORL's (window / stream) |",
        "|---|---|---|---|---|---|",
    ]
    for path, records in files.items():
        runs = {(r["env"], r["dataset"], r["model"], r["seed"]) for r in records}
        counts, missed = {}, {c: [] for c in COLUMNS[1:]}
        for target in ("corl", "data_best"):
            met = {c: [] for c in COLUMNS[1:]}
            for env in ENV_IDS:
                for ds in DATASETS:
                    rows = [r for r in records if (r["env"], r["dataset"],
                            r.get("target", "corl")) == (env, ds, target)]  # fmt: skip
                    by = _by_column(rows)
                    for c in COLUMNS[1:]:
                        v = verdict(by[COLUMNS[0]], by[c])
                        if v is not None:
                            met[c].append(v)
                        if v is False and target == "corl":
                            missed[c].append(f"{env} {ds}")
            counts[target] = " / ".join(f"{sum(m)} of {len(m)}" for m in met.values())
        not_met = " / ".join(", ".join(m) or "none" for m in missed.values())
        lines.append(f"| `{path}` | {_settings(records)} | {len(runs)} | {counts['corl']} "
                     f"| {counts['data_best']} | {not_met} |")  # fmt: skip
    return "\n".join(lines)


def fit_table(records: list[dict], seeds: list[int]) -> str:
    """A Markdown table of each run's held-out action fit (``fit_mse``, one per trained
    model, whatever its evaluations), per seed, for both backbones."""
    lines = [
        f"Held-out action fit (fit_mse), seeds {' / '.join(map(str, seeds))}:",
        "",
        "| cell | Decision Transformer | Decision Aaren | Aaren lower on |",
        "|---|---|---|---|",
    ]
    for env in ENV_IDS:
        for ds in DATASETS:
            fits = {
                model: {
                    r["seed"]: r["fit_mse"]
                    for r in records
                    if (r["env"], r["dataset"], r["model"]) == (env, ds, model) and "fit_mse" in r
                }
                for model in ("transformer", "aaren")
            }
            if not any(fits.values()):
                continue
            cells = " | ".join(
                " / ".join(f"{f[s]:.4f}" if s in f else "-" for s in seeds) for f in fits.values()
            )
            paired = [s for s in seeds if s in fits["transformer"] and s in fits["aaren"]]
            lower = sum(fits["aaren"][s] < fits["transformer"][s] for s in paired)
            lines.append(f"| {env} {ds} | {cells} | {lower} of {len(paired)} seeds |")
    return "\n".join(lines)


def noise_table(records: list[dict], target: str = "corl") -> str:
    """A Markdown table, per cell and column at ``target``, of where the spread over seeds
    comes from: the standard deviation of the score over seeds (unbiased, n - 1), one run's
    evaluation error (the standard error of its mean over its episodes, ``score_std`` /
    sqrt(episodes - 1), root-mean-square over the seeds), and the share of the seeds' variance
    that this error accounts for. Near 100%, more evaluation episodes narrow the spread; near
    0%, only more seeds do (a share above 100% is the estimate's own noise)."""
    lines = [
        f"At {TARGET_NAMES[target]}: "
        "the sd over seeds (n - 1) / one run's evaluation standard error: the share of the "
        "seeds' variance it accounts for.",
        "",
        f"| cell | {HEADER} |",
        "|---|---|---|---|",
    ]
    records = [r for r in records if r.get("target", "corl") == target]
    for env in ENV_IDS:
        for ds in DATASETS:
            by = _by_column([r for r in records if (r["env"], r["dataset"]) == (env, ds)])
            if not any(by.values()):
                continue
            cells = []
            for rows in by.values():
                if len(rows) < 2:
                    cells.append("-")
                    continue
                sd = np.std([r["score"] for r in rows], ddof=1)
                episodes = [r.get("eval_episodes") for r in rows]
                if None in episodes:  # not a count to guess: the error is unknown
                    cells.append(f"{sd:.1f} / no episode count recorded ({len(rows)} seeds)")
                    continue
                if min(episodes) < 2:  # one episode's spread estimates nothing
                    cells.append(f"{sd:.1f} / no error from 1 episode ({len(rows)} seeds)")
                    continue
                se = np.sqrt(np.mean([r["score_std"] ** 2 / (n - 1)
                                      for r, n in zip(rows, episodes, strict=True)]))  # fmt: skip
                share = f"{100 * se**2 / sd**2:.0f}%" if sd > 0 else "-"
                cells.append(f"{sd:.1f} / {se:.1f}: {share} ({len(rows)} seeds)")
            lines.append(f"| {env} {ds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_key(r: dict) -> tuple:
    return r["env"], r["dataset"], r["model"], r.get("eval", "window"), r["seed"]


def comparison_table(records: list[dict], baseline: list[dict], target: str = "corl") -> str:
    """A Markdown table of ``records`` against ``baseline``, paired on the same environment,
    dataset, model, evaluation and seed at ``target``: per dataset (over the environments)
    and in all, for each column, the pairs higher in ``records`` and both means."""
    base = {_run_key(r): r["score"] for r in baseline if r.get("target", "corl") == target}
    pairs = [
        (r, base[_run_key(r)])
        for r in records
        if r.get("target", "corl") == target and _run_key(r) in base
    ]
    lines = [
        "Seed pairs higher than the baseline, then the mean: baseline -> these records.",
        "",
        f"| dataset | {HEADER} |",
        "|---|---|---|---|",
    ]
    for name, datasets in [*((ds, (ds,)) for ds in DATASETS), ("all", DATASETS)]:
        cells = []
        for column in COLUMNS:
            p = [
                (r["score"], b)
                for r, b in pairs
                if r["dataset"] in datasets and (r["model"], r.get("eval", "window")) == column
            ]
            if not p:
                cells.append("-")
                continue
            now, then = np.asarray(p).T
            cells.append(
                f"{int((now > then).sum())} of {len(p)}: {then.mean():.1f} -> {now.mean():.1f}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine(record: dict) -> str:
    """The machine a record was made on: its CPU (with its kind where recorded: one model
    name covers CPUs of other generations), and its accelerator if the model ran on one
    (records from before ``device`` was recorded ran on the CPU)."""
    name = record.get("cpu_model", "not recorded")
    if "cpu_kind" in record:
        name = f"{name} ({record['cpu_kind']})"
    device = record.get("device", "cpu")
    return name if device == "cpu" else f"{name} + {device}"


def machines(records: list[dict]) -> str:
    """Which machines the records were made on, with counts: per-step times compare only
    within one machine."""
    counts = Counter(machine(r) for r in records)
    listed = ", ".join(f"{name} ({n})" for name, n in sorted(counts.items()))
    return f"Records by machine (ms per env step compares only within one): {listed}."


def _data_row(name, transitions, episodes, ret: float, ref, own) -> str:
    return (
        f"| {name} | {transitions} | {episodes} | {ret:.1f} | {float(normalised(ret, ref)):.1f} "
        f"| {float(normalised(ret, own)):.1f} |"
    )


def data_table(manifest: dict) -> str:
    """Markdown tables of the generated data, one per environment in ``manifest``."""
    out = []
    for env in [e for e in ENV_IDS if e in manifest]:
        m = manifest[env]
        refs = D4RL_REF[env], (m["random_policy_return"], m["expert_policy_return"])
        n_eval = m["config"]["eval_episodes"]
        drawn_on = m.get("machine")  # not recorded before 2026-11-28
        where = ""
        if drawn_on:  # the CPU's kind is recorded from 2026-11-29
            kind = f" ({drawn_on['cpu_kind']})" if "cpu_kind" in drawn_on else ""
            where = f"; drawn on {drawn_on['cpu_model']}{kind}, MuJoCo {drawn_on['mujoco']}"
        lines = [
            f"{env} ({m['env_id']}; SAC for {m['config']['sac_steps']:,} environment steps, "
            f"{m['sac_wall_s'] / 60:.1f} min{where})",
            "",
            f"| {env} | transitions | episodes | mean return | D4RL-normalised | own-normalised |",
            "|---|---|---|---|---|---|",
            _data_row("random policy", "-", n_eval, refs[1][0], *refs),
            _data_row(
                f"medium policy (snapshot at {m['medium_step']:,} steps)",
                "-",
                n_eval,
                m["medium_policy_return"],
                *refs,
            ),
            _data_row(
                f"expert policy (snapshot at {m['expert_step']:,} steps)",
                "-",
                n_eval,
                refs[1][1],
                *refs,
            ),
        ]
        for name in DATASETS:
            d = m["datasets"][name]
            lines.append(_data_row(name, f"{d['transitions']:,}", f"{d['episodes']:,}",
                                   d["mean_return"], *refs))  # fmt: skip
        out.append("\n".join(lines))
    return "\n\n".join(out)


SWEEP_FIELDS = ("env", "dataset", "model", "seed", "score", "score_std", "ms_per_env_step")


def sweep_records(path: str) -> list[dict]:
    """The records of a sweep's results file, or a ValueError naming the file, the first
    record lacking a field the tables read, and the command that made it (the drift and
    conditioning studies write records of their own, with their own command)."""
    try:
        records = load_records(path)
    except ValueError as e:  # e.g. generate.py's manifest, which --manifest reads
        raise ValueError(f"{e}; a generator's manifest.json is read with --manifest") from None
    for i, r in enumerate(records):
        missing = [f for f in SWEEP_FIELDS if f not in r]
        if missing:
            made_by = f", made by: {r['command']}" if "command" in r else ""
            raise ValueError(
                f"{path} holds no sweep records: record {i} lacks {', '.join(missing)}"
                f"{made_by} (report.py reads sweep.py's records)"
            )
    return records


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results", nargs="?", default="results/offline_rl.json")
    p.add_argument("--target", default="corl", choices=["corl", "data_best"],
                   help="the return conditioned on: CORL's, or the dataset's best")  # fmt: skip
    p.add_argument("--per-seed", action="store_true",
                   help="every seed's score, both targets, instead of the summary")  # fmt: skip
    p.add_argument("--manifest", default=None, help="print the generated data's tables instead")
    p.add_argument("--against", default=None,
                   help="pair the seeds with this results file's instead")  # fmt: skip
    p.add_argument("--summary", nargs="+", default=None, metavar="RESULTS",
                   help="one row per results file: the cells that meet the target")  # fmt: skip
    p.add_argument("--noise", action="store_true",
                   help="the spread over seeds against one run's evaluation error")  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="only these seeds (default: all recorded)")  # fmt: skip
    args = p.parse_args(argv)
    if args.manifest:
        print(data_table(json.loads(Path(args.manifest).read_text())))  # the command's output
        return
    if args.summary:
        print(summary_table({path: sweep_records(path) for path in args.summary}))
        return
    records = sweep_records(args.results)
    if args.seeds is not None:
        records = [r for r in records if r["seed"] in args.seeds]
    if args.against:
        print(comparison_table(records, sweep_records(args.against), args.target))
        return
    if args.noise:
        print(noise_table(records, args.target))  # the table is the command's output
        return
    if args.per_seed:
        print(per_seed_table(records))  # the table is the command's output
        return
    print(table(records, args.target))  # the table is the command's output


if __name__ == "__main__":
    main()
