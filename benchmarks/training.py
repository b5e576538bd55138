"""Training throughput: forward+backward tokens per second of one Aaren and one Transformer block.

    python benchmarks/training.py                 # d=256, H=4, d_ff=1024, N in {256 .. 16384}
    python benchmarks/training.py --quick         # N in {256, 1024}, fewer repeats

Each configuration keeps the tokens per batch constant (``--tokens``, default 16384:
``B = tokens // N``), so tokens per second compare directly across lengths. One training
step is ``jax.value_and_grad`` of a mean-square loss with respect to the block's parameters
(the input's gradient too, as a block inside a stack needs it), jitted, in float32; the
compile is excluded and timed apart, one warm-up call excluded, then min and median of the
repeats, each timed step after an untimed one of the same kind.

A floor is measured in the same run: the same block with the attention's mixing replaced by
the identity (``FloorBlock``: LayerNorms, the Aaren attention's k, v and o projections, the
MLP; no scan, no scores; the matmul work any block of this shape must do; computed on the
tokens as one [B * N, d] matrix, as the blocks compute it). The floor, Aaren
and the Transformer are interleaved at each N, round by round (same noise), and each kind's
tokens/s is reported as a fraction of the floor's, per round (min, median, max over rounds)
and from the medians. The Transformer has one more projection (q) than the floor.

A configuration whose projected step time exceeds ``--budget`` seconds (projected from the
previous N: a Transformer's attention cost per batch grows like ``B N^2 = tokens * N``), or
whose score matrices would not fit in memory, is recorded as ``"skipped: <reason>"``.

Also: the compile time of ``jax.jit(value_and_grad)`` for a 4-layer model of each kind.
Writes ``results/training_<backend>.json`` (also printed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from _common import REPO, machine_info, summary, timed, write_json
from flax import nnx

import aaren_jax as aj
from aaren_jax.attention import per_token


class FloorBlock(nnx.Module):
    """An Aaren block with the attention's mixing replaced by the identity.

    ``x + o(v(LN1 x) + k(LN1 x))`` then ``x + MLP(LN2 x)``: the block's norms, the Aaren
    attention's three projections (k's output is added so that it is not dead code) and its
    MLP, built from an ``AarenBlock``'s own parts.
    """

    def __init__(self, block: aj.AarenBlock):
        self.norm1, self.norm2 = block.norm1, block.norm2
        attention = block.attention
        self.k_proj, self.v_proj, self.o_proj = attention.k_proj, attention.v_proj, attention.o_proj
        self.mlp_in, self.mlp_out, self.activation = block.mlp_in, block.mlp_out, block.activation

    def __call__(self, x):
        # token by token as one [tokens, d] matrix, as the blocks compute (``per_token``)
        return per_token(self._tokens, x)

    def _tokens(self, x):
        h = self.norm1(x)
        x = x + self.o_proj(self.v_proj(h) + self.k_proj(h))
        return x + self.mlp_out(self.activation(self.mlp_in(self.norm2(x))))


def make_floor(d: int, h: int, f: int, *, rngs: nnx.Rngs) -> FloorBlock:
    return FloorBlock(aj.AarenBlock(d, h, f, rngs=rngs))


def make_train_step(module: nnx.Module):
    """``(step, params)``: jitted ``step(params, x, target) -> (loss, (grad_params, grad_x))``."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # rest: RNG state

    def loss_fn(params, x, target):
        y = nnx.merge(graphdef, params, rest)(x)
        return jnp.mean(jnp.square(y - target))

    return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1))), params


def compile_seconds(module: nnx.Module, x, target) -> float:
    step, params = make_train_step(module)
    start = time.perf_counter()
    step.lower(params, x, target).compile()
    return time.perf_counter() - start


def available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per batch, B * N")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--slow-repeats", type=int, default=2, help="rounds when a warm-up step took over 5 s"
    )
    parser.add_argument("--budget", type=float, default=60.0, help="max seconds per step")
    parser.add_argument("--compile-layers", type=int, default=4)
    parser.add_argument("--compile-length", type=int, default=1024)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.repeats = [256, 1024], 2
    backend = jax.default_backend()
    out = args.out or REPO / "results" / f"training_{backend}.json"
    started = time.perf_counter()
    d, h, f = args.d_model, args.heads, args.d_ff
    kinds = {"floor": make_floor, "aaren": aj.AarenBlock, "transformer": aj.TransformerBlock}

    rows, last_seconds = [], {}
    for n in sorted(args.lengths):
        batch = max(1, args.tokens // n)
        tokens = batch * n
        key = jax.random.key(n)
        x = jax.random.normal(key, (batch, n, d))
        target = jax.random.normal(jax.random.fold_in(key, 1), (batch, n, d))
        row = {"N": n, "B": batch, "tokens_per_batch": tokens}
        steps = {}
        for kind, cls in kinds.items():
            reason = None
            if kind == "transformer":
                # Forward and backward keep a few [B, H, N, N] float32 score matrices alive.
                score_bytes = 4 * batch * h * n * n
                free = available_bytes()
                if free is not None and 4 * score_bytes > free / 2:
                    reason = (
                        f"skipped: 4 score matrices of {score_bytes / 2**30:.1f} GiB "
                        f"would take over half of the {free / 2**30:.1f} GiB available"
                    )
            if reason is None and kind in last_seconds:
                prev_n, prev_s = last_seconds[kind]
                growth = n / prev_n if kind == "transformer" else 1.0
                projected = prev_s * growth
                if projected > args.budget:
                    reason = (
                        f"skipped: projected {projected:.0f} s per step (from "
                        f"{prev_s:.1f} s at N={prev_n}) exceeds the budget of {args.budget:.0f} s"
                    )
            if reason is not None:
                row[kind] = reason
                continue
            module = cls(d, h, f, rngs=nnx.Rngs(0))
            step, params = make_train_step(module)
            compile_start = time.perf_counter()
            compiled = step.lower(params, x, target).compile()
            compile_s = time.perf_counter() - compile_start
            first, _ = timed(compiled, params, x, target)  # warm-up, excluded
            steps[kind] = (compiled, params)
            row[kind] = {"compile_s": round(compile_s, 2), "warmup_s": round(first, 3), "times": []}
            last_seconds[kind] = (n, first)
        # Interleave the kinds round by round, so that all see the same noise; fewer rounds
        # of slow steps.
        slow = any(row[k]["warmup_s"] > 5 for k in steps)
        row["repeats"] = min(args.slow_repeats, args.repeats) if slow else args.repeats
        for _ in range(row["repeats"]):
            for kind, (compiled, params) in steps.items():
                # an untimed step first, so that this kind is not charged for the previous
                # kind's freed buffers (after the Transformer's score matrices the floor's
                # step at N = 4,096 took 1.3x its own time on a 2-core AMD EPYC)
                jax.block_until_ready(compiled(params, x, target))
                row[kind]["times"].append(timed(compiled, params, x, target)[0])
        floor_times = row["floor"]["times"] if "floor" in steps else None
        for kind in steps:
            times = row[kind].pop("times")
            row[kind]["step_ms"] = summary(times, 1e3, 1)
            row[kind]["step_ms_per_round"] = [round(1e3 * t, 1) for t in times]
            row[kind]["tokens_per_s"] = {
                "max": round(tokens / min(times)),
                "median": round(tokens / statistics.median(times)),
            }
            if floor_times is not None and kind != "floor":
                # same round, same noise: floor time / kind time = kind tokens/s / floor's
                per_round = [f / t for f, t in zip(floor_times, times, strict=True)]
                row[kind]["fraction_of_floor"] = {
                    "of_medians": round(
                        statistics.median(floor_times) / statistics.median(times), 3
                    ),
                    "per_round_min": round(min(per_round), 3),
                    "per_round_median": round(statistics.median(per_round), 3),
                    "per_round_max": round(max(per_round), 3),
                }
            last_seconds[kind] = (n, min(times))
        if all(isinstance(row[k], dict) for k in ("aaren", "transformer")):
            row["aaren_speedup_median"] = round(
                row["transformer"]["step_ms"]["median"] / row["aaren"]["step_ms"]["median"], 2
            )
        rows.append(row)
        fractions = {
            k: row[k]["fraction_of_floor"]["of_medians"]
            for k in ("aaren", "transformer")
            if isinstance(row[k], dict) and "fraction_of_floor" in row[k]
        }
        print(f"N={n} B={batch}: fraction of the floor's tokens/s {fractions}", flush=True)
        del steps

    # Compile time of a whole model's forward+backward.
    n = args.compile_length
    batch = max(1, args.tokens // n)
    x = jnp.zeros((batch, n, d))
    compile_rows = {}
    models = {
        "aaren": lambda: aj.Aaren(args.compile_layers, d, h, f, rngs=nnx.Rngs(0)),
        "transformer": lambda: aj.Transformer(args.compile_layers, d, h, f, rngs=nnx.Rngs(0)),
        # For reference: Aaren with the plain lax.scan method instead of "auto".
        "aaren_sequential": lambda: aj.Aaren(
            args.compile_layers, d, h, f, method="sequential", rngs=nnx.Rngs(0)
        ),
    }
    for kind, build in models.items():
        compile_rows[kind] = round(compile_seconds(build(), x, x), 2)

    result = {
        "benchmark": "training",
        "config": {
            "d_model": d,
            "heads": h,
            "d_ff": f,
            "dtype": "float32",
            "tokens_per_batch": args.tokens,
            "repeats": args.repeats,
            "slow_repeats": args.slow_repeats,
            "budget_s_per_step": args.budget,
            "aaren_method": "auto",
            "lengths": sorted(args.lengths),
        },
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),
        "method": "one block, jax.jit(jax.value_and_grad(mean((block(x) - target)^2)) w.r.t. "
        "params and x); compile and one warm-up excluded; floor, aaren, transformer "
        "interleaved round by round; min and median; fraction_of_floor = floor step time / "
        "kind step time (= kind tokens/s / floor tokens/s), per round and of the medians",
        "floor": "FloorBlock: the Aaren block's LayerNorms, k, v, o projections and MLP, "
        "mixing replaced by the identity (o(v(h) + k(h))), on the tokens as one [B * N, d] "
        "matrix",
        "blocks": rows,
        "compile_s_fwd_bwd": {
            "layers": args.compile_layers,
            "N": n,
            "B": batch,
            **compile_rows,
            "target": "<= 5 s",
        },
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    write_json(out, result)


if __name__ == "__main__":
    main()
