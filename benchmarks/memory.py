"""Peak memory of forward+backward: every ``prefix_attention`` method and one block of each kind.

    python benchmarks/memory.py                    # N in {4096, 16384}
    python benchmarks/memory.py --lengths 1024     # a quicker look

Cases: ``prefix_attention`` with each method (``blocked``, ``associative``, ``sequential``,
``chunked``) at B=8, H=4, D=64, the gradient of ``sum(outputs * g)`` with respect to scores
and values; one Aaren block and one Transformer block (d=256, H=4, d_ff=1024, batch
``--block-batch``), ``jax.value_and_grad`` of a mean-square loss with respect to the
parameters and the input (as ``benchmarks/training.py`` times it). All float32, jitted.

Each case runs in a fresh subprocess, which reports two figures:

- compiled: the executable's ``memory_analysis()``: temp + argument + output bytes (what XLA
  plans to hold at once; ``alias`` bytes are reported apart);
- measured: the peak resident set growth of the first call, ``VmHWM`` after the call minus
  ``VmRSS`` before it, with the high-water mark reset just before the call (``echo 5 >
  /proc/self/clear_refs``; where that is refused, the mark left by the compile may hide part
  of it, and the JSON says so). Inputs already exist before the call; the outputs it returns
  count in the growth.

Both are set against the bytes of the inputs, of the forward outputs and of the gradients.
A case whose compiled plan would take over half of the memory available is not run (its
compiled figure is still reported, with the reason). Writes ``results/memory_<backend>.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from _common import REPO, add_shape_args, machine_info, tree_bytes, write_json

METHODS = ("native", "blocked", "associative", "sequential", "chunked")
BLOCKS = ("aaren_block", "transformer_block")
MiB = 2**20


def proc_status_kib(field: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def available_bytes() -> int | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable"):
            return int(line.split()[1]) * 1024
    return None


def reset_high_water_mark() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def build_case(case: str, n: int, args):
    """``(fn, inputs, sizes)``: a jittable ``fn(*inputs)`` and the bytes it is set against."""
    import aaren_jax as aj

    keys = jax.random.split(jax.random.key(n), 3)
    if case in METHODS:
        shape = (args.batch, args.heads, n)
        scores = jax.random.normal(keys[0], shape) * 2
        values = jax.random.normal(keys[1], (*shape, args.dim))
        g = jax.random.normal(keys[2], (*shape, args.dim))

        def loss(s, v, g):
            return jnp.sum(aj.prefix_attention(s, v, method=case)[0] * g)

        inputs = (scores, values, g)
        sizes = {
            "inputs": tree_bytes(inputs),
            "forward_outputs": tree_bytes(values),  # o has the values' shape
            "gradients": tree_bytes((scores, values)),
        }
        return jax.grad(loss, argnums=(0, 1)), inputs, sizes

    from flax import nnx

    cls = aj.AarenBlock if case == "aaren_block" else aj.TransformerBlock
    block = cls(args.d_model, args.heads, args.d_ff, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    x = jax.random.normal(keys[0], (args.block_batch, n, args.d_model))
    target = jax.random.normal(keys[1], x.shape)

    def loss(params, x, target):
        y = nnx.merge(graphdef, params, rest)(x)
        return jnp.mean(jnp.square(y - target))

    inputs = (params, x, target)
    sizes = {
        "inputs": tree_bytes(inputs),
        "forward_outputs": tree_bytes(x),
        "gradients": tree_bytes((params, x)),
    }
    return jax.value_and_grad(loss, argnums=(0, 1)), inputs, sizes


def run_case(case: str, n: int, args) -> dict:
    """Runs in the child process: compiled plan, then the measured peak of the first call."""
    fn, inputs, sizes = build_case(case, n, args)
    inputs = jax.block_until_ready(inputs)
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*inputs).compile()
    compile_s = time.perf_counter() - start
    ma = compiled.memory_analysis()
    plan = {
        "temp": int(ma.temp_size_in_bytes),
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
    }
    plan["temp_argument_output"] = plan["temp"] + plan["argument"] + plan["output"]
    row = {
        "case": case,
        "N": n,
        "compile_s": round(compile_s, 2),
        "sizes_bytes": sizes,
        "compiled_bytes": plan,
    }
    free = available_bytes()
    if free is not None and plan["temp_argument_output"] > free / 2:
        row["measured"] = (
            f"skipped: the compiled plan ({plan['temp_argument_output'] / 2**30:.1f} GiB) "
            f"would take over half of the {free / 2**30:.1f} GiB available"
        )
        return row
    rss_before = proc_status_kib("VmRSS")
    reset = reset_high_water_mark()
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*inputs))
    seconds = time.perf_counter() - start
    hwm = proc_status_kib("VmHWM")
    del out
    row["measured"] = {
        "peak_rss_growth_bytes": (hwm - rss_before) * 1024,
        "rss_before_bytes": rss_before * 1024,
        "high_water_mark_reset": reset,
        "first_call_s": round(seconds, 3),
    }
    return row


def in_subprocess(case: str, n: int, args) -> dict:
    cmd = [sys.executable, __file__, "--child", case, str(n), *child_options(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"case": case, "N": n, "error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_options(args) -> list[str]:
    names = ("batch", "heads", "dim", "d_model", "d_ff", "block_batch")
    return [x for name in names for x in ("--" + name.replace("_", "-"), str(getattr(args, name)))]


def ratios(row: dict) -> None:
    """Adds each figure over the bytes of inputs + forward outputs + gradients."""
    sizes = row["sizes_bytes"]
    base = sizes["inputs"] + sizes["forward_outputs"] + sizes["gradients"]
    row["io_bytes"] = base
    row["compiled_over_io"] = round(row["compiled_bytes"]["temp_argument_output"] / base, 2)
    row["compiled_temp_mib"] = round(row["compiled_bytes"]["temp"] / MiB, 1)
    if isinstance(row.get("measured"), dict):
        growth = row["measured"]["peak_rss_growth_bytes"]
        row["measured_growth_mib"] = round(growth / MiB, 1)
        # the inputs existed before the call: growth is set against outputs + gradients + temp
        row["measured_growth_over_io"] = round(growth / base, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--cases", nargs="+", default=[*METHODS, *BLOCKS])
    add_shape_args(parser)
    parser.add_argument("--block-batch", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_case(args.child[0], int(args.child[1]), args)))
        return

    started = time.perf_counter()
    rows = []
    for n in sorted(args.lengths):
        for case in args.cases:
            row = in_subprocess(case, n, args)
            if "error" not in row:
                ratios(row)
            rows.append(row)
            brief = {k: row.get(k) for k in ("compiled_temp_mib", "measured_growth_mib", "error")}
            print(f"{case} N={n}: {brief}", file=sys.stderr, flush=True)
    result = {
        "benchmark": "memory",
        "config": {
            "scan": {"B": args.batch, "H": args.heads, "D": args.dim},
            "block": {
                "d_model": args.d_model,
                "heads": args.heads,
                "d_ff": args.d_ff,
                "B": args.block_batch,
            },
            "dtype": "float32",
            "lengths": sorted(args.lengths),
        },
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),
        "method": "forward+backward, jitted, one fresh subprocess per case; compiled = "
        "memory_analysis() temp + argument + output bytes; measured = VmHWM after the first "
        "call minus VmRSS before it (high-water mark reset just before the call); io = bytes of "
        "inputs + forward outputs + gradients",
        "results": rows,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    write_json(args.out or REPO / "results" / f"memory_{jax.default_backend()}.json", result)


if __name__ == "__main__":
    main()
