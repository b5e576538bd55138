"""Streaming precision: a million tokens one by one through a small Aaren, against float64.

The streamed outputs of a float32 model (``aj.stream``, blocks of ``--block`` tokens)
are compared with the same model, weights cast to float64, run over the same tokens in
float64 (the parallel pass, block by block from its carry: float64 round-off is ~1e-16).
Two float32 carries are streamed: the library's compensated carry (``init_carry``: Kahan
terms for ``u`` and ``w``) and a plain ``(m, u, w)`` carry, whose one rounding per token
drifts. The relative error is ``max |y32 - y64| / max |y64|`` over the block that ends at
each checkpoint. The per-token cost of the two carries is timed interleaved, in one run:
through ``aj.stream`` on this small model, and through ``make_step_fn``'s step on the
streaming benchmark's model (4 layers, d = 256, batch 1).

    python benchmarks/streaming_precision.py            # 10^6 tokens, ~5 min on 2 cores
    python benchmarks/streaming_precision.py --tokens 100000 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import REPO, machine_info, repeat, summary, write_json
from flax import nnx

import aaren_jax as aj

LAYERS, D_MODEL, HEADS, D_FF = 2, 32, 4, 64


def plain(carry: aj.AarenCarry) -> aj.AarenCarry:
    """The same carry without its compensation terms: one rounding per token."""
    return aj.AarenCarry(tuple(aj.AttentionState(s.m, s.u, s.w) for s in carry.layers))


def tokens(seed: int, start: int, count: int, dtype) -> jax.Array:
    """Block ``start // count`` of the stream, reproducible on its own. [1, count, d]"""
    key = jax.random.fold_in(jax.random.key(seed), start)
    return jax.random.normal(key, (1, count, D_MODEL), jnp.float32).astype(dtype)


def step_cost(rounds: int, steps: int = 50) -> dict:
    """Per-token time of ``make_step_fn``'s step on the streaming benchmark's model (4 layers,
    d = 256, H = 4, d_ff = 1024, batch 1), compensated against plain carry, interleaved."""
    model = aj.Aaren(4, 256, 4, 1024, rngs=nnx.Rngs(0))
    step_fn, state = aj.make_step_fn(model)
    x = jnp.ones((1, 256))
    fresh = {
        "compensated": lambda: model.init_carry(1),
        "plain": lambda: plain(model.init_carry(1)),
    }
    carries = {name: make() for name, make in fresh.items()}
    times = {name: [] for name in fresh}
    for round_ in range(rounds + 1):
        for name in fresh:
            carry = carries[name]
            start = time.perf_counter()
            for _ in range(steps):
                carry, y = step_fn(state, carry, x)
            jax.block_until_ready(y)
            if round_:  # the first round compiles and warms up
                times[name].append((time.perf_counter() - start) / steps)
            carries[name] = carry
    out = {name: summary(t, scale=1e6) for name, t in times.items()}
    out["compensated_over_plain_median"] = round(
        out["compensated"]["median"] / out["plain"]["median"], 3
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--block", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--out", default=str(REPO / "results" / "streaming_precision_cpu.json"))
    args = parser.parse_args()
    info = machine_info()
    model = aj.Aaren(LAYERS, D_MODEL, HEADS, D_FF, rngs=nnx.Rngs(0))
    model.eval()
    checkpoints = {10**k for k in range(4, 7) if 10**k <= args.tokens} | {args.tokens}

    with jax.enable_x64(True):
        model64 = aj.Aaren(LAYERS, D_MODEL, HEADS, D_FF, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        model64.eval()
        params64 = jax.tree.map(lambda a: a.astype(jnp.float64), nnx.state(model, nnx.Param))
        nnx.update(model64, params64)
        graphdef64, state64 = nnx.split(model64)
        parallel64 = jax.jit(
            lambda s, c, x: nnx.merge(graphdef64, s)(x, carry=c, return_carry=True)
        )
        carry64 = model64.init_carry(1)

    carries = {"compensated": model.init_carry(1), "plain": plain(model.init_carry(1))}
    errors = {name: [] for name in carries}
    start_time = time.perf_counter()
    for start in range(0, args.tokens, args.block):
        x = tokens(0, start, args.block, jnp.float32)
        outputs = {}
        for name, carry in carries.items():
            carries[name], outputs[name] = aj.stream(model, carry, x)
        with jax.enable_x64(True):
            y64, carry64 = parallel64(state64, carry64, x.astype(jnp.float64))
            y64 = np.asarray(y64)
        seen = start + args.block
        if seen in checkpoints:
            scale = np.abs(y64).max()
            for name, y in outputs.items():
                error = float(np.abs(np.asarray(y, np.float64) - y64).max() / scale)
                errors[name].append({"tokens": seen, "relative_error": error})
            print(
                f"{seen} tokens: "
                + ", ".join(f"{n} {e[-1]['relative_error']:.2e}" for n, e in errors.items()),
                flush=True,
            )

    # Per-token cost of the two carries, interleaved rounds of one block each.
    x = tokens(1, 0, args.block, jnp.float32)
    times = {name: [] for name in carries}
    for _ in range(args.rounds):
        for name in carries:
            carry = carries[name]
            times[name] += repeat(lambda c=carry: aj.stream(model, c, x), 1, warmup=1)
    per_token_us = {name: summary(t, scale=1e6 / args.block) for name, t in times.items()}
    step_us = step_cost(args.rounds)
    write_json(
        args.out,
        {
            "benchmark": "streaming_precision",
            "command": "python benchmarks/streaming_precision.py "
            + f"--tokens {args.tokens} --block {args.block} --rounds {args.rounds}",
            "model": {"layers": LAYERS, "d_model": D_MODEL, "heads": HEADS, "d_ff": D_FF},
            "reference": "the same weights in float64, parallel pass block by block",
            "machine": info,
            "relative_error": errors,
            "per_token_us": per_token_us,
            "compensated_over_plain_median": round(
                per_token_us["compensated"]["median"] / per_token_us["plain"]["median"], 3
            ),
            "step_fn_us_streaming_model": step_us,
            "wall_s": round(time.perf_counter() - start_time, 1),
        },
    )


if __name__ == "__main__":
    main()
