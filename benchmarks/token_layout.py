"""Per-token work over [B, T, d] against the same tokens as one [B * T, d] matrix; prints JSON.

    python benchmarks/token_layout.py                 # d=256, d_ff=1024, 16,384 tokens
    python benchmarks/token_layout.py --rounds 3 --tokens 4096

A projection, a LayerNorm and an MLP act on each token alone, so ``[B, T, d]`` and its
reshape to ``[B * T, d]`` are the same work. XLA's CPU code for them is not the same: this
times both layouts, interleaved round by round (``_common.interleaved``), forward and
forward+backward (``value_and_grad`` of a mean square with respect to the parameters and
the input), at B x T = 64 x 256, 4 x 4,096 and 1 x 16,384 (``--tokens`` in all). The
blocks compute their per-token parts in the flat layout (``aaren_jax.attention.per_token``)
because of what this measures. Writes ``results/token_layout_<backend>.json``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from _common import REPO, interleaved, machine_info, write_json
from flax import nnx

from aaren_jax.attention import per_token


def modules(d: int, d_ff: int) -> dict:
    rngs = nnx.Rngs(0)
    mlp_in, mlp_out = nnx.Linear(d, d_ff, rngs=rngs), nnx.Linear(d_ff, d, rngs=rngs)
    return {
        "linear": nnx.Linear(d, d_ff, rngs=rngs),
        "layernorm": nnx.LayerNorm(d, rngs=rngs),
        "mlp": lambda x: mlp_out(nnx.gelu(mlp_in(x))),
    }


def layouts(module, x: jax.Array) -> dict:
    """``interleaved``'s table: the module over ``x`` as given and over its tokens."""
    graphdef, params = nnx.split(module) if isinstance(module, nnx.Module) else (None, None)
    table = {}
    for layout, apply in (("batched", lambda f, x: f(x)), ("per_token", per_token)):
        if graphdef is None:  # a function of its closed-over modules

            def forward(x, apply=apply):
                return apply(module, x)

            def gradient(x, target, forward=forward):
                loss = lambda x: jnp.mean(jnp.square(forward(x) - target))  # noqa: E731
                return jax.value_and_grad(loss)(x)

            args = (x,)
        else:

            def forward(p, x, apply=apply):
                return apply(nnx.merge(graphdef, p), x)

            def gradient(p, x, target, forward=forward):
                loss = lambda p, x: jnp.mean(jnp.square(forward(p, x) - target))  # noqa: E731
                return jax.value_and_grad(loss, argnums=(0, 1))(p, x)

            args = (params, x)
        target = jnp.zeros(jax.eval_shape(forward, *args).shape, x.dtype)
        table[layout] = (forward, gradient, args, target)
    return table


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=16384, help="B * T")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 4096, 16384], help="T")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    record = {
        "benchmark": "token_layout",
        "command": "python benchmarks/token_layout.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(),
        "shape": {"d": args.d_model, "d_ff": args.d_ff, "tokens": args.tokens},
        "results": [],
    }
    for length in args.lengths:
        batch = max(1, args.tokens // length)
        x = jax.random.normal(jax.random.key(length), (batch, length, args.d_model))
        for name, module in modules(args.d_model, args.d_ff).items():
            timings = interleaved(layouts(module, x), args.rounds)
            row = {"module": name, "B": batch, "T": length, **timings}
            record["results"].append(row)
            print(
                name,
                batch,
                length,
                {k: v["ratio_to_batched"]["of_medians"] for k, v in timings["per_token"].items()},
                file=sys.stderr,
            )
    out = args.out or REPO / "results" / f"token_layout_{jax.default_backend()}.json"
    write_json(out, record)
    return record


if __name__ == "__main__":
    main()
