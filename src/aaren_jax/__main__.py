"""The main job, a self-check on generated data: ``python -m aaren_jax``.

Generates left-padded rows with scores of very different magnitudes, runs every method of
``prefix_attention`` on them and checks each against an independent float64 brute force
(softmax over every prefix) and against a Python loop of ``attention_step``, with a stated
float32 tolerance; then builds a small ``Aaren`` and checks that a prefill followed by
token-by-token streaming equals one parallel pass while the carry keeps its size. Prints a
table (``--json``: one JSON report) and exits with status 1 if any check fails.
``--length``, ``--batch`` and ``--heads`` change the generated shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import aaren_jax as aj

METHODS = ("auto", "blocked", "associative", "sequential", "chunked")
# float32 tolerances (absolute, values are O(1)): about 40x the round-off seen on CPU at the
# default shape. Checks run at "highest" matmul precision, so that GPUs (TF32) and TPUs
# (bfloat16 passes) are held to the same float32 standard.
SCAN_TOL = 2e-5
MODEL_TOL = 1e-4


def _brute_force(scores, values, mask):
    """Softmax over each prefix in float64, one prefix at a time."""
    scores = np.where(mask, np.asarray(scores, np.float64), -np.inf)
    values = np.asarray(values, np.float64)
    out = np.zeros(values.shape)
    for t in range(scores.shape[-1]):
        s = scores[..., : t + 1]
        top = np.max(s, axis=-1, keepdims=True)
        top = np.where(np.isneginf(top), 0.0, top)
        e = np.exp(s - top)
        den = e.sum(-1)[..., None]
        num = np.einsum("...t,...td->...d", e, values[..., : t + 1, :])
        out[..., t, :] = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
    return out


def _median_ms(fn, *args, repeats=5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def generated_case(batch, heads, length, dim=32, seed=0):
    """Scores [B, H, T], values [B, H, T, D], mask [B, H, T] and a description of them."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-1, 3, size=(batch, heads, 1))  # scores up to ~1e3
    scores = np.float32(rng.normal(size=(batch, heads, length)) * scale)
    values = np.float32(rng.normal(size=(batch, heads, length, dim)))
    starts = rng.integers(0, max(length // 2, 1), size=(batch, 1, 1))  # left padding per row
    mask = np.broadcast_to(np.arange(length) >= starts, scores.shape)
    real = scores[mask]
    spread = [np.ptp(scores[b, h][mask[b, h]]) for b in range(batch) for h in range(heads)]
    description = {
        "shape": {"B": batch, "H": heads, "T": length, "D": dim},
        "dtype": "float32",
        "seed": seed,
        "left_padding_per_row": [int(s) for s in starts.ravel()],
        "score_scale_range": [float(scale.min()), float(scale.max())],
        "score_range": [float(real.min()), float(real.max())],
        "max_score_spread_in_a_row": float(max(spread)),
    }
    return jnp.asarray(scores), jnp.asarray(values), jnp.asarray(mask), description


def scan_report(batch, heads, length, dim=32):
    """Every ``prefix_attention`` method against float64 and the step loop, with timings."""
    scores, values, mask, case = generated_case(batch, heads, length, dim)
    reference = _brute_force(scores, values, np.asarray(mask))

    step = jax.jit(aj.attention_step)
    state = aj.init_state((batch, heads), dim)
    loop_outputs = []
    for t in range(length):
        state, out = step(state, scores[..., t], values[..., t, :], mask[..., t])
        loop_outputs.append(out)
    loop_outputs = jnp.stack(loop_outputs, axis=-2)

    auto = aj.resolve_method("auto", length)
    report = {"case": case, "tolerance": SCAN_TOL, "auto_resolves_to": auto, "methods": {}}
    for method in METHODS:
        fn = jax.jit(lambda s, v, m, method=method: aj.prefix_attention(s, v, m, method=method))
        outputs, final = fn(scores, values, mask)
        err64 = float(np.max(np.abs(np.asarray(outputs, np.float64) - reference)))
        err_loop = float(jnp.max(jnp.abs(outputs - loop_outputs)))
        err_final = float(
            jnp.max(jnp.abs(final.w / final.u[..., None] - state.w / state.u[..., None]))
        )
        finite = bool(jnp.all(jnp.isfinite(outputs)))
        report["methods"][method] = {
            "max_abs_error_vs_float64": err64,
            "max_abs_diff_vs_step_loop": err_loop,
            "final_readout_diff_vs_step_loop": err_final,
            "finite": finite,
            "passed": finite and max(err64, err_loop, err_final) <= SCAN_TOL,
            "forward_ms": _median_ms(fn, scores, values, mask),
        }
    return report


def streaming_report(length):
    """Prefill half the sequence, stream the rest token by token, compare with one pass."""
    model = aj.Aaren(2, 32, 4, 64, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, length, 32))
    start = time.perf_counter()
    parallel = model(x)
    split = length // 2
    prefill, carry = model(x[:, :split], carry=None, return_carry=True)
    carry_bytes_after_prefill = sum(a.nbytes for a in jax.tree.leaves(carry))
    carry, streamed = aj.stream(model, carry, x[:, split:])
    outputs = jnp.concatenate([prefill, streamed], axis=1)
    diff = float(jnp.max(jnp.abs(outputs - parallel)))
    carry_bytes_at_end = sum(a.nbytes for a in jax.tree.leaves(carry))
    return {
        "model": "Aaren(num_layers=2, d_model=32, num_heads=4, d_ff=64)",
        "tokens": length,
        "prefill_tokens": split,
        "max_abs_diff_prefill_then_stream_vs_parallel": diff,
        "tolerance": MODEL_TOL,
        "carry_bytes_after_prefill": carry_bytes_after_prefill,
        "carry_bytes_at_end": carry_bytes_at_end,
        "passed": diff <= MODEL_TOL and carry_bytes_at_end == carry_bytes_after_prefill,
        "seconds": time.perf_counter() - start,
    }


def format_table(report) -> str:
    """The report as a short human-readable table."""
    scan, stream = report["scan"], report["streaming"]
    case = scan["case"]
    shape = case["shape"]
    pad = case["left_padding_per_row"]
    lo, hi = case["score_range"]
    s_lo, s_hi = case["score_scale_range"]
    lines = [
        f"aaren_jax self-check on {report['backend']} "
        f"(jax {jax.__version__}, matmul precision: highest)",
        "",
        f"Generated case: B={shape['B']} rows x H={shape['H']} heads x T={shape['T']} tokens, "
        f"D={shape['D']}, float32, seed {case['seed']}.",
        f"  left padding: {min(pad)}-{max(pad)} masked steps per row ({', '.join(map(str, pad))})",
        f"  scores: normal x a scale from {s_lo:.2g} to {s_hi:.2g} per (row, head); "
        f"range [{lo:.3g}, {hi:.3g}], up to {case['max_score_spread_in_a_row']:.3g} apart "
        "within a row",
        "",
        "prefix_attention methods against a float64 brute force and a loop of attention_step:",
    ]
    header = ("method", "vs float64", "vs step loop", "tolerance", "check", "time")
    rows = [header]
    for name, m in scan["methods"].items():
        loop = max(m["max_abs_diff_vs_step_loop"], m["final_readout_diff_vs_step_loop"])
        rows.append(
            (
                f"auto ({scan['auto_resolves_to']})" if name == "auto" else name,
                f"{m['max_abs_error_vs_float64']:.1e}",
                f"{loop:.1e}",
                f"{scan['tolerance']:.0e}",
                "pass" if m["passed"] else "FAIL",
                f"{m['forward_ms']:.2f} ms",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, r in enumerate(rows):
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    lines += [
        "",
        f"{stream['model']}: prefill {stream['prefill_tokens']} tokens, then stream "
        f"{stream['tokens'] - stream['prefill_tokens']} one at a time, against one parallel pass:",
        f"  max |difference| {stream['max_abs_diff_prefill_then_stream_vs_parallel']:.1e} "
        f"(tolerance {stream['tolerance']:.0e}); carry {stream['carry_bytes_after_prefill']} "
        f"bytes after prefill, {stream['carry_bytes_at_end']} at the end: "
        + ("pass" if stream["passed"] else "FAIL"),
        "",
        ("All checks passed" if report["passed"] else "SOME CHECKS FAILED")
        + f" in {report['seconds']:.1f} s (times: median of 5 jitted calls, compilation "
        "excluded). --json for the full report.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--json", action="store_true", help="print one JSON report")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with jax.default_matmul_precision("highest"):
        scan = scan_report(args.batch, args.heads, args.length)
        streaming = streaming_report(args.length)
    report = {
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "scan": scan,
        "streaming": streaming,
        "passed": all(m["passed"] for m in scan["methods"].values()) and streaming["passed"],
        "seconds": time.perf_counter() - start,
    }
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
