"""Helpers shared by the module tests: a jitted full pass and a parameter count."""

import functools

import jax
from flax import nnx


@functools.partial(jax.jit, static_argnums=(0, 5))
def _forward(graphdef, state, x, mask, carry, max_len):
    return nnx.merge(graphdef, state)(x, mask, carry=carry, return_carry=True, max_len=max_len)


def forward(model, x, mask=None, carry=None, max_len=None):
    """``model(x, mask, carry=carry, return_carry=True, max_len=max_len)`` under ``jax.jit``."""
    graphdef, state = nnx.split(model)
    return _forward(graphdef, state, x, mask, carry, max_len)


def count_params(module) -> int:
    """Number of scalars in the module's ``nnx.Param`` leaves."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))
