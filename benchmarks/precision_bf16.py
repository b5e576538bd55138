"""bfloat16 against float32: time and accuracy of the scan and of one Aaren block.

    python benchmarks/precision_bf16.py              # scan at N in {1024, 4096}, block at 1024
    python benchmarks/precision_bf16.py --quick      # N = 1024, 2 rounds

Scan: ``aj.prefix_attention`` (default method) at B=8, H=4, D=64 on float32 inputs and on
the same inputs rounded to bfloat16 (the state stays float32 inside; outputs come back in
bfloat16). Block: ``aj.AarenBlock`` (d=256, H=4, d_ff=1024, ``--tokens`` tokens per batch)
with float32 parameters, computing in float32 (``dtype=None``) or in bfloat16
(``dtype=bfloat16``).

Time: forward and forward+backward (scan: the gradient of ``sum(o * g)`` with respect to
scores and values; block: ``value_and_grad`` of a mean-square loss with respect to the
parameters and the input), jitted, compile and one warm-up excluded, float32 and bfloat16
interleaved round by round.

Accuracy: the largest absolute error of the outputs and of the gradients against

- the float32 run on the same inputs, and
- a float64 reference (``jax_enable_x64``): the scan by ``method="sequential"`` on the float64
  inputs, the block with the same parameters cast to float64; for bfloat16 also against the
  float64 result on the bfloat16-rounded inputs (the kernel's own error, input rounding
  apart).

Errors are also given relative to the reference's largest magnitude. Writes
``results/precision_bf16_<backend>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import REPO, add_shape_args, machine_info, summary, timed, write_json  # noqa: E402
from flax import nnx  # noqa: E402

import aaren_jax as aj  # noqa: E402

BF16, F32, F64 = jnp.bfloat16, jnp.float32, jnp.float64


def max_error(x, ref) -> dict:
    """Largest absolute error over a pytree, and relative to the reference's largest value."""
    errs, scales = [], []
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errs.append(float(np.max(np.abs(a - b))))
        scales.append(float(np.max(np.abs(b))))
    err, scale = max(errs), max(scales)
    return {"max_abs": float(f"{err:.3g}"), "relative_to_max": float(f"{err / scale:.3g}")}


def time_interleaved(cases: dict, rounds: int) -> dict:
    """``cases``: {name: (fn, args)}; compile, warm up, time once per round, interleaved."""
    compiled, out = {}, {}
    for name, (fn, args) in cases.items():
        start = time.perf_counter()
        compiled[name] = (jax.jit(fn).lower(*args).compile(), args)
        out[name] = {"compile_s": round(time.perf_counter() - start, 2)}
        timed(compiled[name][0], *args)  # warm-up, excluded
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (exe, args) in compiled.items():
            times[name].append(timed(exe, *args)[0])
    for name, ts in times.items():
        out[name]["ms"] = summary(ts, 1e3, 2)
        out[name]["ms_per_round"] = [round(1e3 * t, 2) for t in ts]
    for kind in ("forward", "forward_backward"):
        per_round = [
            b / f for b, f in zip(times[f"bf16_{kind}"], times[f"f32_{kind}"], strict=True)
        ]
        out[f"bf16_{kind}"]["ratio_to_f32"] = {
            "of_medians": round(
                statistics.median(times[f"bf16_{kind}"]) / statistics.median(times[f"f32_{kind}"]),
                2,
            ),
            "per_round_min": round(min(per_round), 2),
            "per_round_max": round(max(per_round), 2),
        }
    return out


def scan_case(n: int, args) -> dict:
    keys = jax.random.split(jax.random.key(n), 3)
    shape = (args.batch, args.heads, n)
    scores = jax.random.normal(keys[0], shape, F64) * 2
    values = jax.random.normal(keys[1], (*shape, args.dim), F64)
    g = jax.random.normal(keys[2], (*shape, args.dim), F64)

    def forward(s, v, method="auto"):
        return aj.prefix_attention(s, v, method=method)[0]

    def fwd_bwd(s, v, g, method="auto"):
        loss = lambda s, v: jnp.sum(forward(s, v, method).astype(g.dtype) * g)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(s, v)

    f32 = [a.astype(F32) for a in (scores, values, g)]
    b16 = [a.astype(BF16) for a in (scores, values)] + [g.astype(F32)]
    timing = time_interleaved(
        {
            "f32_forward": (forward, f32[:2]),
            "bf16_forward": (forward, b16[:2]),
            "f32_forward_backward": (fwd_bwd, f32),
            "bf16_forward_backward": (fwd_bwd, b16),
        },
        args.rounds,
    )

    def run(inputs, method="auto"):
        fn = jax.jit(lambda s, v, g: (forward(s, v, method), fwd_bwd(s, v, g, method)))
        return fn(*inputs)

    ref64 = run((scores, values, g), "sequential")
    rounded64 = [b16[0].astype(F64), b16[1].astype(F64), g]
    ref64_rounded = run(rounded64, "sequential")
    out32, out16 = run(f32), run(b16)
    accuracy = {}
    for name, idx in (("outputs", 0), ("gradients", 1)):
        accuracy[name] = {
            "f32_vs_f64": max_error(out32[idx], ref64[idx]),
            "bf16_vs_f32": max_error(out16[idx], out32[idx]),
            "bf16_vs_f64": max_error(out16[idx], ref64[idx]),
            "bf16_vs_f64_of_rounded_inputs": max_error(out16[idx], ref64_rounded[idx]),
        }
    return {"N": n, "time": timing, "accuracy": accuracy}


def block_case(n: int, args) -> dict:
    batch = max(1, args.tokens // n)
    key = jax.random.key(n)
    x = jax.random.normal(key, (batch, n, args.d_model), F32)
    target = jax.random.normal(jax.random.fold_in(key, 1), x.shape, F32)

    def build(dtype, param_dtype=F32):
        block = aj.AarenBlock(
            args.d_model,
            args.heads,
            args.d_ff,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=nnx.Rngs(0),
        )
        return nnx.split(block, nnx.Param, ...)

    graph32, params, rest32 = build(None)
    graph16, _, rest16 = build(BF16)
    graph64, _, rest64 = build(F64, F64)
    params64 = jax.tree.map(lambda p: p.astype(F64), params)

    def make(graphdef, rest):
        def forward(params, x):
            return nnx.merge(graphdef, params, rest)(x)

        def fwd_bwd(params, x, target):
            def loss(params, x):
                y = forward(params, x).astype(target.dtype)
                return jnp.mean(jnp.square(y - target))

            return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

        return forward, fwd_bwd

    fwd32, bwd32 = make(graph32, rest32)
    fwd16, bwd16 = make(graph16, rest16)
    fwd64, bwd64 = make(graph64, rest64)
    timing = time_interleaved(
        {
            "f32_forward": (fwd32, (params, x)),
            "bf16_forward": (fwd16, (params, x)),
            "f32_forward_backward": (bwd32, (params, x, target)),
            "bf16_forward_backward": (bwd16, (params, x, target)),
        },
        args.rounds,
    )
    x64, t64 = x.astype(F64), target.astype(F64)
    y64, (_, g64) = jax.jit(fwd64)(params64, x64), jax.jit(bwd64)(params64, x64, t64)
    y32, (_, g32) = jax.jit(fwd32)(params, x), jax.jit(bwd32)(params, x, target)
    y16, (_, g16) = jax.jit(fwd16)(params, x), jax.jit(bwd16)(params, x, target)
    accuracy = {}
    for name, (a16, a32, a64) in (("outputs", (y16, y32, y64)), ("gradients", (g16, g32, g64))):
        accuracy[name] = {
            "f32_vs_f64": max_error(a32, a64),
            "bf16_vs_f32": max_error(a16, a32),
            "bf16_vs_f64": max_error(a16, a64),
        }
    return {"N": n, "B": batch, "time": timing, "accuracy": accuracy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--block-lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--rounds", type=int, default=5)
    add_shape_args(parser)
    parser.add_argument("--tokens", type=int, default=4096, help="block tokens per batch")
    parser.add_argument("--quick", action="store_true", help="N = 1024, 2 rounds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.block_lengths, args.rounds = [1024], [1024], 2
    started = time.perf_counter()
    scan_rows = []
    for n in args.lengths:
        scan_rows.append(scan_case(n, args))
        print(f"scan N={n} done", file=sys.stderr, flush=True)
    block_rows = []
    for n in args.block_lengths:
        block_rows.append(block_case(n, args))
        print(f"block N={n} done", file=sys.stderr, flush=True)
    result = {
        "benchmark": "precision_bf16",
        "config": {
            "scan": {"B": args.batch, "H": args.heads, "D": args.dim, "method": "auto"},
            "block": {
                "d_model": args.d_model,
                "heads": args.heads,
                "d_ff": args.d_ff,
                "param_dtype": "float32",
                "tokens_per_batch": args.tokens,
            },
            "rounds": args.rounds,
        },
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),
        "method": "float32 and bfloat16 interleaved round by round; errors: max |x - ref| over "
        "all outputs (and all gradients), relative_to_max = that / max |ref|; float64 "
        "references with jax_enable_x64 (scan: method='sequential')",
        "scan": scan_rows,
        "block": block_rows,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    out = args.out or REPO / "results" / f"precision_bf16_{jax.default_backend()}.json"
    write_json(out, result)


if __name__ == "__main__":
    main()
