"""Anchors side by side, in one interleaved run: the scan against linear recurrences, blocks.

    python benchmarks/anchors.py                 # scan and blocks at N in {1024, 4096}
    python benchmarks/anchors.py --quick         # N = 1024, 2 rounds

Scan (B=8, H=4, D=64, float32), forward and forward+backward (the gradient of ``sum(y * g)``
with respect to every input):

- ``prefix_attention``: ``aj.prefix_attention(scores, values)`` with the default method;
- ``linear_associative``: the plain linear recurrence ``h_t = a_t * h_{t-1} + x_t`` over
  ``[B, H, T, D]`` by ``jax.lax.associative_scan`` (what an SSM or an RG-LRU layer's scan
  costs; it reads a gate per channel, ``a`` the values' shape, where the prefix scan reads
  one score per token);
- ``linear_sequential``: the same recurrence by ``jax.lax.scan`` over time.

Blocks (d=256, H=4, d_ff=1024, pre-norm, GELU MLP, ``--tokens`` tokens per batch:
``B = tokens // N``), forward and ``jax.value_and_grad`` of a mean-square loss with respect to
the parameters and the input:

- ``aaren``: ``aj.AarenBlock`` (default method);
- ``dot_product_attention``: the same block with q, k, v, o projections around causal
  ``jax.nn.dot_product_attention`` (the default XLA implementation on CPU: T x T scores);
- ``rg_lru``: an RG-LRU-shaped recurrent block written here (recurrentgemma's PyPI package
  would downgrade numpy and absl-py in this venv, so it is not used): a GELU gate branch and
  a recurrent branch ``x -> Linear -> RG-LRU -> * gate -> Linear``, with the RG-LRU of Griffin
  (De et al. 2024): ``r_t = sigmoid(W_a x_t)``, ``i_t = sigmoid(W_x x_t)``,
  ``a_t = sigmoid(L)^(8 r_t)``, ``h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t)`` by
  ``jax.lax.associative_scan``, in float32. Its gates are full d x d matrices (Griffin's are
  block-diagonal per head) and it has no temporal convolution.

Every variant of a group is compiled first (compile times recorded), warmed up once, then
timed once per round, the variants interleaved round by round (same noise); min, median and
the per-round ratio to the first variant (min, median, max) are reported. The machine is
shared and noisy: compare ratios within one run. Writes ``results/anchors_<backend>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
from _common import REPO, add_shape_args, interleaved, machine_info, write_json
from flax import nnx

import aaren_jax as aj

# ----------------------------------------------------------------------------------------
# Scan anchors


def linear_recurrence_associative(a, x):
    """``h_t = a_t h_{t-1} + x_t`` along axis -2 by ``lax.associative_scan``. [..., T, D]"""

    def combine(left, right):
        a_l, x_l = left
        a_r, x_r = right
        return a_l * a_r, a_r * x_l + x_r

    return jax.lax.associative_scan(combine, (a, x), axis=-2)[1]


def linear_recurrence_sequential(a, x):
    """The same recurrence by ``lax.scan`` over time. [..., T, D]"""

    def step(h, ax):
        a_t, x_t = ax
        h = a_t * h + x_t
        return h, h

    a_t, x_t = jnp.moveaxis(a, -2, 0), jnp.moveaxis(x, -2, 0)
    _, hs = jax.lax.scan(step, jnp.zeros_like(x_t[0]), (a_t, x_t))
    return jnp.moveaxis(hs, 0, -2)


def scan_variants(n: int, args):
    """``{name: (forward_fn, fwd_bwd_fn, inputs)}`` for one length."""
    keys = jax.random.split(jax.random.key(n), 5)
    shape = (args.batch, args.heads, n, args.dim)
    scores = jax.random.normal(keys[0], shape[:-1]) * 2
    values = jax.random.normal(keys[1], shape)
    g = jax.random.normal(keys[2], shape)
    gate = jax.nn.sigmoid(jax.random.normal(keys[3], shape) + 2.0)  # in (0, 1), near 0.9
    x = jax.random.normal(keys[4], shape)

    def prefix(s, v):
        return aj.prefix_attention(s, v)[0]

    def with_grad(fn):
        return jax.grad(lambda p, q, g: jnp.sum(fn(p, q) * g), argnums=(0, 1))

    return {
        "prefix_attention": (prefix, with_grad(prefix), (scores, values), g),
        "linear_associative": (
            linear_recurrence_associative,
            with_grad(linear_recurrence_associative),
            (gate, x),
            g,
        ),
        "linear_sequential": (
            linear_recurrence_sequential,
            with_grad(linear_recurrence_sequential),
            (gate, x),
            g,
        ),
    }


# ----------------------------------------------------------------------------------------
# Block anchors


class _BlockBase(nnx.Module):
    """Pre-norm block with a GELU MLP around ``self.mix`` (defined by subclasses)."""

    def __init__(self, d: int, d_ff: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp_in = nnx.Linear(d, d_ff, rngs=rngs)
        self.mlp_out = nnx.Linear(d_ff, d, rngs=rngs)

    def __call__(self, x):
        x = x + self.mix(self.norm1(x))
        return x + self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))


class DotProductAttentionBlock(_BlockBase):
    """Causal multi-head self-attention by ``jax.nn.dot_product_attention``."""

    def __init__(self, d: int, heads: int, d_ff: int, *, rngs: nnx.Rngs):
        super().__init__(d, d_ff, rngs)
        self.heads = heads
        self.q, self.k, self.v, self.o = (nnx.Linear(d, d, rngs=rngs) for _ in range(4))

    def mix(self, h):
        batch, length, d = h.shape
        split = (batch, length, self.heads, d // self.heads)  # [B, T, N, H] layout it expects
        q, k, v = (proj(h).reshape(split) for proj in (self.q, self.k, self.v))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.reshape(batch, length, d))


class RGLRUBlock(_BlockBase):
    """Griffin-style recurrent block: GELU gate branch times an RG-LRU branch."""

    def __init__(self, d: int, heads: int, d_ff: int, *, rngs: nnx.Rngs):
        del heads
        super().__init__(d, d_ff, rngs)
        self.gate_branch = nnx.Linear(d, d, rngs=rngs)
        self.x_branch = nnx.Linear(d, d, rngs=rngs)
        self.a_gate = nnx.Linear(d, d, rngs=rngs)
        self.i_gate = nnx.Linear(d, d, rngs=rngs)
        # sigmoid(L)^8 between 0.9 and 0.999 (Griffin's initialisation of a^c)
        u = jax.random.uniform(rngs.params(), (d,), minval=0.9**0.125, maxval=0.999**0.125)
        self.log_a = nnx.Param(jnp.log(u / (1 - u)))  # L with sigmoid(L) = u
        self.out = nnx.Linear(d, d, rngs=rngs)

    def mix(self, h):
        gate = nnx.gelu(self.gate_branch(h))
        x = self.x_branch(h)
        r = jax.nn.sigmoid(self.a_gate(x))
        i = jax.nn.sigmoid(self.i_gate(x))
        log_a = 8.0 * r * jax.nn.log_sigmoid(self.log_a[...])[None, None]  # [B, T, d]
        a = jnp.exp(log_a)
        scaled = jnp.sqrt(jnp.maximum(1 - jnp.exp(2 * log_a), 1e-12)) * (i * x)
        y = linear_recurrence_associative(a, scaled)
        return self.out(y * gate)


BLOCKS = {
    "aaren": aj.AarenBlock,
    "dot_product_attention": DotProductAttentionBlock,
    "rg_lru": RGLRUBlock,
}


def block_variants(n: int, args):
    batch = max(1, args.tokens // n)
    key = jax.random.key(n)
    x = jax.random.normal(key, (batch, n, args.d_model))
    target = jax.random.normal(jax.random.fold_in(key, 1), x.shape)
    variants = {}
    for name, cls in BLOCKS.items():
        block = cls(args.d_model, args.heads, args.d_ff, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(block, nnx.Param, ...)

        def forward(params, x, graphdef=graphdef, rest=rest):
            return nnx.merge(graphdef, params, rest)(x)

        def loss(params, x, target, forward=forward):
            return jnp.mean(jnp.square(forward(params, x) - target))

        variants[name] = (forward, jax.value_and_grad(loss, argnums=(0, 1)), (params, x), target)
    return batch, variants


# ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--block-lengths", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    add_shape_args(parser)
    parser.add_argument("--tokens", type=int, default=8192, help="block tokens per batch")
    parser.add_argument("--quick", action="store_true", help="N = 1024, 2 rounds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.rounds = [1024], 2
    block_lengths = args.block_lengths or args.lengths
    started = time.perf_counter()

    scan_rows = []
    for n in args.lengths:
        row = {"N": n, **interleaved(scan_variants(n, args), args.rounds)}
        scan_rows.append(row)
        print(f"scan N={n} done", file=sys.stderr, flush=True)
    block_rows = []
    for n in block_lengths:
        batch, variants = block_variants(n, args)
        row = {"N": n, "B": batch, **interleaved(variants, args.rounds)}
        block_rows.append(row)
        print(f"blocks N={n} done", file=sys.stderr, flush=True)

    result = {
        "benchmark": "anchors",
        "config": {
            "scan": {"B": args.batch, "H": args.heads, "D": args.dim, "method": "auto"},
            "block": {"d_model": args.d_model, "heads": args.heads, "d_ff": args.d_ff},
            "tokens_per_block_batch": args.tokens,
            "rounds": args.rounds,
            "dtype": "float32",
        },
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),
        "method": "jitted, compile and one warm-up excluded, variants interleaved round by "
        "round; ratios per round to the first variant of each group; forward_backward = grad "
        "of sum(y * g) (scan) or value_and_grad of a mean-square loss w.r.t. params and x "
        "(blocks)",
        "rg_lru_note": "own RG-LRU-shaped block: recurrentgemma[jax] 1.0.1 from PyPI would "
        "downgrade numpy (2.4.6 -> 2.3.5) and absl-py in this venv",
        "scan": scan_rows,
        "blocks": block_rows,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    out = args.out or REPO / "results" / f"anchors_{jax.default_backend()}.json"
    write_json(out, result)


if __name__ == "__main__":
    main()
