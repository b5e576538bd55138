"""The main job on an embedded default: ``python -m aaren_jax``.

Runs every method of ``prefix_attention`` on generated data (left-padded rows, scores of
very different magnitudes), checks them against a float64 brute force and against a loop of
``attention_step``, times them, then builds a small ``Aaren`` and shows that a prefill followed
by token-by-token streaming equals one parallel pass while its carry stays the same size.
Prints one JSON report. ``--length``, ``--batch`` and ``--heads`` change the generated shape.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import aaren_jax as aj

METHODS = ("auto", "associative", "sequential", "chunked")


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


def scan_report(batch, heads, length, dim=32):
    rng = np.random.default_rng(0)
    scale = 10.0 ** rng.uniform(-1, 3, size=(batch, heads, 1))  # scores up to ~1e3
    scores = jnp.float32(rng.normal(size=(batch, heads, length)) * scale)
    values = jnp.float32(rng.normal(size=(batch, heads, length, dim)))
    starts = rng.integers(0, length // 2, size=(batch, 1, 1))  # left padding per row
    mask = jnp.asarray(np.arange(length) >= starts)
    mask = jnp.broadcast_to(mask, scores.shape)
    reference = _brute_force(scores, values, np.asarray(mask))

    step = jax.jit(aj.attention_step)
    state = aj.init_state((batch, heads), dim)
    loop_outputs = []
    for t in range(length):
        state, out = step(state, scores[..., t], values[..., t, :], mask[..., t])
        loop_outputs.append(out)
    loop_outputs = jnp.stack(loop_outputs, axis=-2)

    report = {"shape": {"B": batch, "H": heads, "T": length, "D": dim}, "methods": {}}
    for method in METHODS:
        fn = jax.jit(lambda s, v, m, method=method: aj.prefix_attention(s, v, m, method=method))
        outputs, final = fn(scores, values, mask)
        report["methods"][method] = {
            "max_abs_error_vs_float64": float(np.max(np.abs(np.asarray(outputs) - reference))),
            "max_abs_diff_vs_step_loop": float(jnp.max(jnp.abs(outputs - loop_outputs))),
            "final_readout_diff_vs_step_loop": float(
                jnp.max(jnp.abs(final.w / final.u[..., None] - state.w / state.u[..., None]))
            ),
            "forward_ms": _median_ms(fn, scores, values, mask),
        }
    return report


def streaming_report(length):
    model = aj.Aaren(2, 32, 4, 64, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, length, 32))
    parallel = model(x)
    split = length // 2
    prefill, carry = model(x[:, :split], carry=None, return_carry=True)
    carry_bytes_after_prefill = sum(a.nbytes for a in jax.tree.leaves(carry))
    carry, streamed = aj.stream(model, carry, x[:, split:])
    outputs = jnp.concatenate([prefill, streamed], axis=1)
    return {
        "model": "Aaren(num_layers=2, d_model=32, num_heads=4, d_ff=64)",
        "tokens": length,
        "max_abs_diff_prefill_then_stream_vs_parallel": float(jnp.max(jnp.abs(outputs - parallel))),
        "carry_bytes_after_prefill": carry_bytes_after_prefill,
        "carry_bytes_at_end": sum(a.nbytes for a in jax.tree.leaves(carry)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    args = parser.parse_args()
    report = {
        "backend": jax.default_backend(),
        "scan": scan_report(args.batch, args.heads, args.length),
        "streaming": streaming_report(args.length),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
