"""RSA's cost: parameter overhead, and streaming cost of RSA-Aaren against plain Aaren.

    python benchmarks/rsa_streaming.py > results/rsa_streaming_cpu.json

For each configuration: parameters of Aaren, RSA-Aaren, Transformer, RSA-Transformer;
the carry's bytes (batch 1) for Aaren and RSA-Aaren (constant in the number of tokens
seen, checked after streaming); and the per-token time of the pure jitted step
(``aaren_jax.make_step_fn``), median over repeats of ``--tokens`` calls after a warm-up.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import machine_info  # noqa: E402
from flax import nnx  # noqa: E402

import aaren_jax as aj  # noqa: E402

CONFIGS = {
    # The regular-language setting (RSA paper App. E.2): 3 layers, 5 heads, width 20.
    "regular_languages": dict(
        layers=3, d=20, heads=5, d_ff=40, rsa=aj.REMConfig((3, 1, 1, 0, 0, 0))
    ),
    # Same, with dilated cyclical heads (dilation 8): the carry grows to O(p).
    "regular_languages_dilated8": dict(
        layers=3, d=20, heads=5, d_ff=40, rsa=aj.REMConfig((3, 0, 0, 0, 1, 1), dilations=8)
    ),
    # The forecasting example's stack with the REM heads chosen on ETTh1's validation split
    # (examples/forecasting/configs.py): cyclical heads, two of them dilated by a day.
    "forecasting": dict(
        layers=2,
        d=64,
        heads=4,
        d_ff=128,
        rsa=aj.REMConfig((0, 1, 1, 0, 1, 1), dilations=(24, 24)),
    ),
    # A mid-size stack with every REM type.
    "d256_h8": dict(
        layers=4,
        d=256,
        heads=8,
        d_ff=1024,
        rsa=aj.REMConfig((2, 1, 1, 2, 1, 1), dilations=(4, 4, 8, 8)),
    ),
}


def count_params(model) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def carry_bytes(carry) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(carry))


def time_steps(models: dict, batch: int, tokens: int, repeats: int) -> dict:
    """Per-token step time of each model, repeats interleaved so all see the same noise."""
    runs = {}
    for kind, model in models.items():
        step_fn, state = aj.make_step_fn(model)
        carry = model.init_carry(batch, max_len=tokens * (repeats + 1) + 8)
        x = jax.random.normal(jax.random.key(0), (tokens, batch, model.d_model))
        for t in range(8):  # compile and warm up
            carry, y = step_fn(state, carry, x[t])
        y.block_until_ready()
        runs[kind] = [step_fn, state, carry, x, []]
    for _ in range(repeats):
        for run in runs.values():
            step_fn, state, carry, x, per_token = run
            t0 = time.perf_counter()
            for t in range(tokens):
                carry, y = step_fn(state, carry, x[t])
            y.block_until_ready()
            per_token.append((time.perf_counter() - t0) / tokens)
            run[2] = carry
    return {
        kind: {
            "median_us": 1e6 * statistics.median(run[4]),
            "min_us": 1e6 * min(run[4]),
            "carry_bytes_after": carry_bytes(run[2]),
        }
        for kind, run in runs.items()
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=200, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS))
    args = p.parse_args(argv)
    out = {
        "machine": machine_info(),
        "command": "python benchmarks/rsa_streaming.py " + " ".join(sys.argv[1:]),
        "batch": args.batch,
        "tokens_per_repeat": args.tokens,
        "repeats": args.repeats,
        "configs": {},
    }
    for name in args.configs:
        c = CONFIGS[name]
        rsa = c["rsa"]
        shape = (c["layers"], c["d"], c["heads"], c["d_ff"])
        models = {
            "aaren": aj.Aaren(*shape, rngs=nnx.Rngs(0)),
            "rsa_aaren": aj.Aaren(*shape, rsa=rsa, rngs=nnx.Rngs(0)),
            "transformer": aj.Transformer(*shape, rngs=nnx.Rngs(0)),
            "rsa_transformer": aj.Transformer(*shape, rsa=rsa, rngs=nnx.Rngs(0)),
        }
        params = {k: count_params(m) for k, m in models.items()}
        per_layer = 1 + rsa.num_regular + 2 * rsa.num_cyclic
        entry = {
            "layers": c["layers"],
            "d_model": c["d"],
            "heads": c["heads"],
            "d_ff": c["d_ff"],
            "rsa_counts": list(rsa.counts),
            "rsa_dilations": list(rsa.dilations),
            "params": params,
            "rsa_overhead_params": params["rsa_aaren"] - params["aaren"],
            "rsa_overhead_formula": c["layers"] * per_layer,
            "rsa_overhead_fraction": (params["rsa_aaren"] - params["aaren"]) / params["aaren"],
            "carry_bytes": {
                "aaren": carry_bytes(models["aaren"].init_carry(args.batch)),
                "rsa_aaren": carry_bytes(models["rsa_aaren"].init_carry(args.batch)),
            },
            "step": {},
        }
        assert entry["rsa_overhead_params"] == entry["rsa_overhead_formula"]
        assert params["rsa_transformer"] - params["transformer"] == entry["rsa_overhead_formula"]
        timed = {k: models[k] for k in ("aaren", "rsa_aaren")}
        entry["step"] = time_steps(timed, args.batch, args.tokens, args.repeats)
        for kind in timed:  # constant memory: the carry keeps its size after streaming
            assert entry["step"][kind]["carry_bytes_after"] == entry["carry_bytes"][kind]
        entry["rsa_aaren_step_ratio"] = (
            entry["step"]["rsa_aaren"]["median_us"] / entry["step"]["aaren"]["median_us"]
        )
        out["configs"][name] = entry
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing anything
    main()
