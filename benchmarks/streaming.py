"""Streams tokens one at a time through Aaren and the KV-cache Transformer (paper, Figure 5).

    python benchmarks/streaming.py                  # 4 layers, d=256, H=4, d_ff=1024, up to 16384
    python benchmarks/streaming.py --quick          # a smoke run, up to 1024 tokens

Batch 1, float32, one token per call of the pure jitted step of ``aaren_jax.make_step_fn``
(donated carry), each call timed alone with ``block_until_ready``. For each checkpoint ``t``
the carry is first brought to ``t`` tokens quickly (Aaren: ``aaren_jax.stream``, one
``lax.scan`` per 256 tokens; Transformer: a jitted chunked prefill into its cache), then
``--steps`` single steps are timed from copies of that carry (``t .. t + steps - 1``).

The Transformer is measured three ways:

* ``transformer`` (the fair baseline): the library's step (``make_step_fn``) with a cache of
  capacity ``t + steps`` at checkpoint ``t`` (re-allocated per checkpoint, "bucketed"), so a
  step reads the filled part of the cache plus at most ``steps`` empty slots: O(t) per layer;
* ``transformer_fixed_capacity``: the library's step with one cache of capacity
  ``max_len + steps`` for the whole stream (``Transformer.init_carry(1, max_len=...)``),
  which a step reads whole at any t;
* ``transformer_bh_cache`` (a cross-check of the baseline's cost): the same model's step
  written here with ``[B*H, C, D]`` caches of capacity ``t + steps``, updated in place and
  read once per layer; checked equal to the library's step in value. The library's step
  should cost the same (before a fix in ``attention.py`` it copied the whole cache several
  times per step at batch 1 and was 10-20x slower).

Aaren's steps are timed interleaved with a "bare matmul floor": the same token through the
K, V, O projections and the MLP of the 4 layers as plain jitted matmuls on the model's own
kernels (no bias, norm, activation or attention update), called the same way (weights as
arguments). The Transformer is timed in separate blocks: its caches (up to 128 MiB) would
evict Aaren's weights from the CPU caches if interleaved.

Cumulative time to stream ``t`` tokens integrates the median per-token latency over the
checkpoints (piecewise linear, constant before the first checkpoint). Aaren's real
``lax.scan`` streaming time (no per-token dispatch) is reported too.

Writes ``results/streaming_<backend>.json`` (also printed) and ``.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _common import REPO, machine_info, repeat, summary, timed, tree_bytes, write_json
from flax import nnx

import aaren_jax as aj
from aaren_jax.attention import KVCache

SCAN_CHUNK = 256  # tokens per lax.scan call when bringing Aaren's carry to a checkpoint
PREFILL_CHUNK = 512  # tokens per prefill call of the Transformer


def make_prefill(model):
    """A jitted ``prefill(carry, x) -> carry`` (eval mode, carry donated)."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)

    @functools.partial(jax.jit, donate_argnums=1)
    def prefill(leaves, carry, x):
        module = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        module.eval()
        _, carry = module(x, carry=carry, return_carry=True)
        return carry

    return lambda carry, x: prefill(leaves, carry, x)


def make_floor(model: aj.Aaren):
    """The bare matmul floor of one Aaren step, on the model's own kernels."""
    weights = [
        (
            b.attention.k_proj.kernel[...],
            b.attention.v_proj.kernel[...],
            b.attention.o_proj.kernel[...],
            b.mlp_in.kernel[...],
            b.mlp_out.kernel[...],
        )
        for b in model.blocks
    ]

    @jax.jit
    def floor(weights, x):
        for wk, wv, wo, w1, w2 in weights:
            x = x + (x @ wk + x @ wv) @ wo
            x = x + (x @ w1) @ w2
        return x

    return lambda x: floor(weights, x)


def residual(block: aj.Block, x, attend):
    """``aj.Block``'s residual structure (eval mode) around ``attend(h) -> (out, cache)``."""
    pre = block.norm == "pre"
    h, cache = attend(block.norm1(x) if pre else x)
    x = x + h if pre else block.norm1(x + h)
    h = block.mlp_out(block.activation(block.mlp_in(block.norm2(x) if pre else x)))
    return (x + h if pre else block.norm2(x + h)), cache


def make_bh_step(model: aj.Transformer):
    """The Transformer's one-token step at batch 1 with ``[H, C, D]`` caches (in place).

    Same parameters and math as ``model.step`` (pre- or post-norm blocks, masked softmax over
    the filled slots); ``step(caches, pos, x_t) -> (caches, y_t)``, caches donated.
    """
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)

    @functools.partial(jax.jit, donate_argnums=1)
    def step(leaves, caches, pos, x):
        module = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        module.eval()
        new = []
        for block, (k_cache, v_cache) in zip(module.blocks, caches, strict=True):
            att = block.attention
            heads, head_dim = att.num_heads, att.head_dim
            capacity = k_cache.shape[1]

            def attend(
                h,
                att=att,
                k_cache=k_cache,
                v_cache=v_cache,
                heads=heads,
                head_dim=head_dim,
                capacity=capacity,
            ):
                q = att.q_proj(h).reshape(heads, 1, head_dim) / jnp.sqrt(head_dim)
                k = att.k_proj(h).reshape(heads, 1, head_dim)
                v = att.v_proj(h).reshape(heads, 1, head_dim)
                k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, pos, 0))
                v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, pos, 0))
                valid = (jnp.arange(capacity) <= pos)[None, None, :]
                s = jnp.einsum("htd,hsd->hts", q, k_cache)
                s = jnp.where(valid, s, -jnp.inf)
                w = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
                out = jnp.einsum("hts,hsd->htd", w, v_cache) / jnp.sum(w, -1, keepdims=True)
                return att.o_proj(out.reshape(1, heads * head_dim)), (k_cache, v_cache)

            x, cache = residual(block, x, attend)
            new.append(cache)
        final = module.final_norm
        return tuple(new), pos + 1, final(x) if final is not None else x

    return lambda caches, pos, x: step(leaves, caches, pos, x)


def bh_caches(carry: aj.TransformerCarry, capacity: int):
    """The library caches (batch 1), cut or padded to ``capacity``, as ``[H, C, D]`` pairs."""
    resized = resize_cache(carry, capacity)
    return tuple((c.k[0], c.v[0]) for c in resized.layers)


def resize_cache(carry: aj.TransformerCarry, capacity: int) -> aj.TransformerCarry:
    """A copy of ``carry`` with every cache cut or zero-padded to ``capacity`` slots."""

    def one(c: KVCache) -> KVCache:
        extra = capacity - c.capacity
        if extra <= 0:  # jnp.copy: a full slice may return the same (donatable) buffer
            cut = (slice(None), slice(None), slice(0, capacity))
            return KVCache(
                jnp.copy(c.k[cut]),
                jnp.copy(c.v[cut]),
                jnp.copy(c.valid[:, :capacity]),
                jnp.copy(c.length),
            )
        pad4 = ((0, 0), (0, 0), (0, extra), (0, 0))
        return KVCache(
            jnp.pad(c.k, pad4),
            jnp.pad(c.v, pad4),
            jnp.pad(c.valid, ((0, 0), (0, extra))),
            jnp.copy(c.length),
        )

    return aj.TransformerCarry(tuple(one(c) for c in carry.layers))


def copy_tree(tree):
    return jax.tree.map(jnp.copy, tree)


def integrate(ts: list[int], per_token_s: list[float]) -> list[float]:
    """Cumulative seconds to stream ``t`` tokens for each checkpoint ``t``.

    Latency is taken constant on [0, ts[0]] and linear between checkpoints.
    """
    total, prev_t, prev_l, out = 0.0, 0, per_token_s[0], []
    for t, lat in zip(ts, per_token_s, strict=True):
        total += (t - prev_t) * 0.5 * (prev_l + lat)
        prev_t, prev_l = t, lat
        out.append(total)
    return out


def time_steps(step_fn, state, carry, tokens, warm_carry=None):
    """Seconds of each call of ``step_fn`` over ``tokens``, from ``carry`` (consumed)."""
    if warm_carry is not None:  # compile for this carry's shapes, untimed
        for x in tokens[:3]:
            warm_carry, _ = step_fn(state, warm_carry, x)
        jax.block_until_ready(warm_carry)
    out = []
    for x in tokens:
        dt, (carry, _) = timed(step_fn, state, carry, x)
        out.append(dt)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument(
        "--checkpoints", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192, 16384]
    )
    parser.add_argument("--steps", type=int, default=100, help="timed steps per checkpoint")
    parser.add_argument(
        "--transformer-steps", type=int, default=30, help="timed steps of the library's Transformer"
    )
    parser.add_argument("--quick", action="store_true", help="checkpoints 256 1024, 20 steps")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    args = parser.parse_args()
    if args.quick:
        args.checkpoints, args.steps, args.transformer_steps = [256, 1024], 20, 10
    if args.plot_only:
        path = args.out or REPO / "results" / f"streaming_{jax.default_backend()}.json"
        plot(json.loads(Path(path).read_text()), Path(path).with_suffix(".png"))
        return
    checkpoints = sorted(args.checkpoints)
    if any(t % SCAN_CHUNK for t in checkpoints):
        parser.error(f"checkpoints must be multiples of {SCAN_CHUNK}")
    max_len, steps = checkpoints[-1], args.steps
    backend = jax.default_backend()
    out = args.out or REPO / "results" / f"streaming_{backend}.json"
    started = time.perf_counter()

    dims = (args.layers, args.d_model, args.heads, args.d_ff)
    aaren = aj.Aaren(*dims, rngs=nnx.Rngs(0))
    transformer = aj.Transformer(*dims, rngs=nnx.Rngs(0))
    xs = jax.random.normal(jax.random.key(1), (1, max_len + steps, args.d_model))

    a_step, a_state = aj.make_step_fn(aaren)
    t_step, t_state = aj.make_step_fn(transformer)
    t_prefill = make_prefill(transformer)
    bh_step = make_bh_step(transformer)
    floor = make_floor(aaren)
    trivial = jax.jit(lambda x: x + 1)

    a_carry = aaren.init_carry(1)
    t_carry = transformer.init_carry(1, max_len=max_len + steps)  # the fixed-capacity cache
    fixed_capacity = max_len + steps
    t_prefill_seconds, position = 0.0, 0
    rows = []
    for t in checkpoints:
        # Bring both carries to t tokens (untimed for the latency figures).
        while position < t:
            chunk = xs[:, position : position + SCAN_CHUNK]
            a_carry, _ = aj.stream(aaren, a_carry, chunk)
            position += SCAN_CHUNK
        t_position = int(t_carry.layers[0].length)
        while t_position < t:
            size = min(PREFILL_CHUNK, t - t_position)
            dt, t_carry = timed(t_prefill, t_carry, xs[:, t_position : t_position + size])
            t_prefill_seconds += dt
            t_position += size
        tokens = [xs[:, t + i] for i in range(steps)]

        # Aaren interleaved with the matmul floor and a trivial jitted call.
        carry = copy_tree(a_carry)
        for x in tokens[:3]:
            carry, _ = a_step(a_state, carry, x)
            jax.block_until_ready((floor(x), trivial(x)))
        a_times, f_times, z_times = [], [], []
        for x in tokens:
            dt, (carry, _) = timed(a_step, a_state, carry, x)
            a_times.append(dt)
            f_times.append(timed(floor, x)[0])
            z_times.append(timed(trivial, x)[0])

        # The [B*H, C, D] reference (capacity t + steps), checked against the library's step.
        caches = bh_caches(t_carry, t + steps)
        warm = bh_caches(t_carry, t + steps)
        pos = jnp.asarray(t, jnp.int32)
        warm, _, y_ref = bh_step(warm, pos, tokens[0])
        _, y_lib = t_step(t_state, resize_cache(t_carry, t + steps), tokens[0])
        np.testing.assert_allclose(np.asarray(y_ref), np.asarray(y_lib), atol=2e-4, rtol=2e-4)
        del warm
        r_times = []
        for x in tokens:
            dt, (caches, pos, _) = timed(bh_step, caches, pos, x)
            r_times.append(dt)

        # The library's Transformer step: bucketed capacity t + steps, then the fixed one.
        lib_tokens = tokens[: args.transformer_steps]
        bucket = resize_cache(t_carry, t + steps)
        tb_times = time_steps(
            t_step, t_state, bucket, lib_tokens, warm_carry=resize_cache(t_carry, t + steps)
        )
        tf_times = time_steps(
            t_step, t_state, copy_tree(t_carry), lib_tokens, warm_carry=copy_tree(t_carry)
        )

        row = {
            "t": t,
            "aaren_us": summary(a_times, 1e6, 1),
            "floor_us": summary(f_times, 1e6, 1),
            "trivial_jit_us": summary(z_times, 1e6, 1),
            "transformer_us": summary(tb_times, 1e6, 1),
            "transformer_fixed_capacity_us": summary(tf_times, 1e6, 1),
            "transformer_bh_cache_us": summary(r_times, 1e6, 1),
            "aaren_carry_bytes": tree_bytes(a_carry),
            "transformer_carry_bytes_capacity_t": tree_bytes(resize_cache(t_carry, t)),
            "transformer_carry_bytes_fixed_capacity": tree_bytes(t_carry),
        }
        row["aaren_over_floor_median"] = round(
            row["aaren_us"]["median"] / row["floor_us"]["median"], 2
        )
        row["transformer_over_aaren_median"] = round(
            row["transformer_us"]["median"] / row["aaren_us"]["median"], 1
        )
        row["transformer_bh_cache_over_aaren_median"] = round(
            row["transformer_bh_cache_us"]["median"] / row["aaren_us"]["median"], 1
        )
        row["transformer_fixed_over_aaren_median"] = round(
            row["transformer_fixed_capacity_us"]["median"] / row["aaren_us"]["median"], 1
        )
        rows.append(row)
        print(
            f"t={t:6d}  aaren {row['aaren_us']['median']:8.1f} us  floor "
            f"{row['floor_us']['median']:8.1f} us  transformer "
            f"{row['transformer_us']['median']:9.1f} us  fixed "
            f"{row['transformer_fixed_capacity_us']['median']:9.1f} us  bh-cache "
            f"{row['transformer_bh_cache_us']['median']:9.1f} us",
            flush=True,
        )

    ts = [r["t"] for r in rows]

    def cumulative(key):
        return [round(s, 3) for s in integrate(ts, [r[key]["median"] * 1e-6 for r in rows])]

    # Aaren's lax.scan streaming of max_len tokens, compiled already, timed as a whole.
    whole = repeat(lambda: aj.stream(aaren, aaren.init_carry(1), xs[:, :max_len])[1], 2)
    last = rows[-1]
    result = {
        "benchmark": "streaming",
        "config": {
            "layers": args.layers,
            "d_model": args.d_model,
            "heads": args.heads,
            "d_ff": args.d_ff,
            "batch": 1,
            "dtype": "float32",
            "max_len": max_len,
            "steps_per_checkpoint": steps,
            "library_transformer_steps_per_checkpoint": args.transformer_steps,
            "transformer_fixed_capacity": fixed_capacity,
        },
        "machine": machine_info(),
        "method": {
            "per_token": "make_step_fn's jitted step (donated carry), one call per token timed "
            "with block_until_ready; min and median over steps t .. t+steps-1 from a copy of "
            "the carry at t",
            "reach_checkpoint": f"Aaren: aaren_jax.stream in chunks of {SCAN_CHUNK} tokens; "
            f"Transformer: jitted prefill in chunks of {PREFILL_CHUNK} tokens into its cache",
            "transformer": "the fair baseline: the library's step, cache capacity t + steps "
            "at checkpoint t (bucketed: re-allocated per checkpoint), so a step reads only the "
            "filled part of the cache plus at most `steps` empty slots",
            "transformer_bh_cache": "cross-check: the same model's step written in the "
            "benchmark (checked equal in value to the library's) with [B*H, C, D] caches of "
            "capacity t + steps, updated in place, each slot read once per layer",
            "transformer_fixed_capacity": f"one cache of capacity {fixed_capacity} "
            "(init_carry(1, max_len=max_len + steps)) for the whole stream; a step reads it whole",
            "floor": "K, V, O projections and MLP matmuls of the 4 layers on Aaren's kernels, "
            "one jitted function called per token like the step, interleaved with Aaren's steps",
            "cumulative": "integral of the median per-token latency over t (piecewise linear "
            "between checkpoints, constant before the first)",
        },
        "checkpoints": rows,
        "cumulative_s": {
            "t": ts,
            "aaren": cumulative("aaren_us"),
            "transformer": cumulative("transformer_us"),
            "transformer_fixed_capacity": cumulative("transformer_fixed_capacity_us"),
            "transformer_bh_cache": cumulative("transformer_bh_cache_us"),
        },
        "aaren_stream_scan": {
            "tokens": max_len,
            "seconds": summary(whole, 1.0, 3),
            "us_per_token_median": round(float(np.median(whole)) / max_len * 1e6, 1),
        },
        "transformer_prefill_seconds_to_reach_checkpoints": round(t_prefill_seconds, 2),
        "targets": {
            "aaren_over_floor_at_max_len": {
                "value_median": last["aaren_over_floor_median"],
                "value_min": round(last["aaren_us"]["min"] / last["floor_us"]["min"], 2),
                "target": "<= 2",
            },
            "aaren_carry_bytes_constant": len({r["aaren_carry_bytes"] for r in rows}) == 1,
            "transformer_over_aaren_at_max_len": {
                "baseline": "transformer (library step, cache of capacity t + steps)",
                "value_median": last["transformer_over_aaren_median"],
                "value_min": round(last["transformer_us"]["min"] / last["aaren_us"]["min"], 1),
                "bh_cache_cross_check_median": last["transformer_bh_cache_over_aaren_median"],
                "target": ">= 10",
            },
        },
        "wall_seconds": None,
    }
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    write_json(out, result)
    if not args.no_plot:
        plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    """Three panels: per-token latency, cumulative time, carry bytes, against t."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["checkpoints"]
    ts = [r["t"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 5.0))
    styles = {
        "aaren": ("Aaren", "tab:blue", "-"),
        "transformer": ("Transformer, KV cache of capacity t", "tab:red", "-"),
        "transformer_bh_cache": (
            "cross-check: hand-written [B*H, C, D] KV-cache step, capacity t",
            "tab:pink",
            ":",
        ),
        "transformer_fixed_capacity": (
            "Transformer, KV cache of fixed capacity "
            f"{result['config']['transformer_fixed_capacity']}",
            "tab:orange",
            "--",
        ),
        "floor": ("bare matmul floor (Aaren's projections and MLP)", "gray", ":"),
    }
    for key, (label, color, ls) in styles.items():
        med = [r[f"{key}_us"]["median"] / 1e3 for r in rows]
        mins = [r[f"{key}_us"]["min"] / 1e3 for r in rows]
        ax1.plot(ts, med, ls, color=color, marker="o", label=label)
        ax1.fill_between(ts, mins, med, color=color, alpha=0.12)
    ax1.set(
        xscale="log",
        yscale="log",
        xlabel="tokens seen t",
        ylabel="ms per token (median; band: min)",
    )
    ax1.set_title("Per-token latency")

    cum = result["cumulative_s"]
    for key in ("aaren", "transformer", "transformer_fixed_capacity"):
        label, color, ls = styles[key]
        ax2.plot(cum["t"], cum[key], ls, color=color, marker="o", label=label)
    ax2.set(
        xscale="log",
        yscale="log",
        xlabel="tokens streamed t",
        ylabel="seconds (integrated medians)",
        title="Cumulative time",
    )

    mib = 2**20
    ax3.plot(
        ts, [r["aaren_carry_bytes"] / mib for r in rows], "-o", color="tab:blue", label="Aaren"
    )
    ax3.plot(
        ts,
        [r["transformer_carry_bytes_capacity_t"] / mib for r in rows],
        "-o",
        color="tab:red",
    )
    ax3.plot(
        ts,
        [r["transformer_carry_bytes_fixed_capacity"] / mib for r in rows],
        "--",
        color="tab:orange",
    )
    ax3.annotate(
        f"{rows[-1]['aaren_carry_bytes']:,} B",
        (ts[-1], rows[-1]["aaren_carry_bytes"] / mib),
        textcoords="offset points",
        xytext=(-40, 8),
        fontsize=8,
    )
    ax3.annotate(
        f"{rows[-1]['transformer_carry_bytes_capacity_t'] / mib:.0f} MiB",
        (ts[-1], rows[-1]["transformer_carry_bytes_capacity_t"] / mib),
        textcoords="offset points",
        xytext=(-60, 6),
        fontsize=8,
    )
    ax3.set(
        xscale="log", yscale="log", xlabel="tokens seen t", ylabel="MiB", title="State (carry) size"
    )
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    cfg, mach = result["config"], result["machine"]
    fig.suptitle(
        f"Streaming, batch 1: {cfg['layers']} layers, d={cfg['d_model']}, H={cfg['heads']}, "
        f"d_ff={cfg['d_ff']}, float32 — {mach['cpu_model']}, {mach['cpu_count']} cores, "
        f"jax {mach['jax']} ({mach['backend']})",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
