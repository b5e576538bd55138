"""Training cost of the examples: steady-state tokens per second of their default configurations.

    python benchmarks/examples_cost.py            # forecasting (ETTh1, weather; H in {96, 720}),
                                                  # classification (2 datasets), both models
    python benchmarks/examples_cost.py --quick    # ETTh1 H=96 and JapaneseVowels only

For each configuration above, the script loads the real data (``--data-root``, default
``../shared/data``), builds the default model and optimiser exactly as the example's
``train.py`` does, and times the jitted training step that ``examples.common.fit`` runs
(forward, backward, AdamW update) on the run's batch size: the first call (trace, compile, one
step) is timed apart as ``compile_s``, one warm-up step excluded, then min and median of
``--repeats`` steps. Aaren and the Transformer are timed alternately, step by step (same
noise). Tokens per second count every position of the padded input windows (``batch x input
length``). The per-run wall time of the sweeps, which adds validation, data loading and
compiles, is in ``results/forecasting.json`` and ``results/classification.json``. The four ETT
datasets give the same shapes up to one time feature (7 channels, input 96), so ETTh1 stands
for them all; weather has 21 channels.

Writes ``results/examples_cost_<backend>.json`` (also printed).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import REPO, machine_info, summary, timed, write_json

sys.path.insert(0, str(REPO))  # the examples are a namespace package at the repository root

from examples.classification import configs as cls_configs  # noqa: E402
from examples.classification import data as cls_data  # noqa: E402
from examples.classification import train as cls_train  # noqa: E402
from examples.common import make_train_step  # noqa: E402
from examples.forecasting import configs as fc_configs  # noqa: E402
from examples.forecasting import data as fc_data  # noqa: E402
from examples.forecasting import train as fc_train  # noqa: E402

MODELS = ("aaren", "transformer")


def stepper(train):
    """``one_step(batch) -> loss``: one training step of ``train`` (a ``TrainStep``) per call."""
    step_fn, params, opt_state, rest = train
    global_step = 0

    def one_step(batch):
        nonlocal params, opt_state, global_step  # params, opt_state: donated each call
        params, opt_state, loss = step_fn(
            params, opt_state, rest, batch, jnp.asarray(global_step, jnp.uint32)
        )
        global_step += 1
        return loss

    return one_step


def measure(example: str, dataset: str, horizon, data, build, loss_fn, cfgs, tokens, repeats):
    """One row: both models on the same batch, compiled apart, then timed alternately."""
    batch_size = cfgs[MODELS[0]].loop.batch_size
    batch = data.train.batch(np.arange(batch_size))
    row = {"example": example, "dataset": dataset, "horizon": horizon}
    row.update({"batch": batch_size, "tokens_per_batch": batch_size * tokens})
    steps, compile_s, step_s = {}, {}, {m: [] for m in MODELS}
    for m in MODELS:
        steps[m] = stepper(make_train_step(build(cfgs[m], data), loss_fn, cfgs[m].optim, 0))
        compile_s[m], loss = timed(steps[m], batch)  # trace + compile + one step
        if not np.isfinite(float(loss)):
            raise FloatingPointError(f"{m}: non-finite training loss {float(loss)}")
        timed(steps[m], batch)  # warm-up
    for _ in range(repeats):
        for m in MODELS:  # alternate, so both models see the same noise
            step_s[m].append(timed(steps[m], batch)[0])
    for m in MODELS:
        ms = summary(step_s[m], scale=1e3)
        row[m] = {
            "compile_s": round(compile_s[m], 2),
            "step_ms": ms,
            "tokens_per_s_median": round(row["tokens_per_batch"] / (ms["median"] / 1e3)),
            "tokens_per_s_best": round(row["tokens_per_batch"] / (ms["min"] / 1e3)),
        }
    print(
        f"{example} {dataset} {horizon or ''}: "
        + ", ".join(f"{m} {row[m]['tokens_per_s_median']:,} tok/s" for m in MODELS),
        flush=True,
    )
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one configuration per example")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per model")
    parser.add_argument("--data-root", default=None, help="default: ../shared/data")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    fc_datasets = ("ETTh1",) if args.quick else ("ETTh1", "weather")  # ETT*: one shape
    horizons = (96,) if args.quick else (96, 720)
    cls_datasets = ("JapaneseVowels",) if args.quick else cls_data.DATASETS
    rows = []
    for ds in fc_datasets:
        for h in horizons:
            cfgs = {m: fc_configs.get_config(ds, h, m) for m in MODELS}
            seq_len = cfgs[MODELS[0]].data.seq_len
            data = fc_data.load_dataset(ds, seq_len, h, args.data_root)
            rows.append(
                measure(
                    "forecasting",
                    ds,
                    h,
                    data,
                    fc_train.build_model,
                    fc_train.loss_fn,
                    cfgs,
                    seq_len,
                    args.repeats,
                )
            )
    for ds in cls_datasets:
        cfgs = {m: cls_configs.get_config(ds, m) for m in MODELS}
        dc = cfgs[MODELS[0]].data
        data = cls_data.load_dataset(ds, args.data_root, dc.val_fraction, dc.split_seed)
        rows.append(
            measure(
                "classification",
                ds,
                None,
                data,
                cls_train.build_model,
                cls_train.loss_fn,
                cfgs,
                data.max_len,
                args.repeats,
            )
        )
    report = {
        "benchmark": "examples_cost",
        "command": "python benchmarks/examples_cost.py" + (" --quick" if args.quick else ""),
        "machine": machine_info(),
        "results": rows,
    }
    write_json(REPO / "results" / f"examples_cost_{jax.default_backend()}.json", report)


if __name__ == "__main__":
    main()
