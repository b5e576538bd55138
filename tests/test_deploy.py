"""Deployment helpers: the compiled step, the lax.scan streamer, the jax.export artifact."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aaren_jax as aj

D_MODEL, HEADS, D_FF = 16, 2, 32
B, T = 2, 6
KINDS = ("aaren", "transformer")


def make_model(kind: str, **kwargs):
    cls = aj.Aaren if kind == "aaren" else aj.Transformer
    return cls(2, D_MODEL, HEADS, D_FF, rngs=nnx.Rngs(0, dropout=1), **kwargs)


def inputs(seed: int, shape=(B, T, D_MODEL)):
    return jax.random.normal(jax.random.key(seed), shape)


@pytest.mark.parametrize("kind", KINDS)
def test_export_round_trip_equals_model_step(kind):
    model = make_model(kind)
    x = inputs(0)
    mask = jnp.array([[False, True, True, True, True, True], [True] * T])
    blob = aj.export_step(model, B, max_len=T)
    assert isinstance(blob, bytes)
    loaded = aj.load_step(blob)  # uses no model code from here on

    carry = loaded.init_carry()
    ref_carry = model.init_carry(B, max_len=T)
    chex.assert_trees_all_equal(carry, tuple(jax.tree.leaves(ref_carry)))
    for t in range(T):
        carry, y_t = loaded.step(carry, x[:, t], mask[:, t])
        ref_carry, ref_y = model.step(ref_carry, x[:, t], mask[:, t])
        chex.assert_trees_all_close(y_t, ref_y, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(carry, tuple(jax.tree.leaves(ref_carry)), atol=1e-5, rtol=1e-5)

    if kind == "transformer":
        with pytest.raises(ValueError, match=f"capacity {T}, position {T}"):
            loaded.step(carry, x[:, 0])
    with pytest.raises(ValueError, match="x_t must have shape"):
        loaded.step(loaded.init_carry(), x)


def test_load_rejects_foreign_bytes():
    with pytest.raises(ValueError, match="not an aaren_jax step artifact"):
        aj.load_step(b"not an artifact")


@pytest.mark.parametrize("kind", KINDS)
def test_step_fn_is_eval_mode_and_matches_parallel(kind):
    model = make_model(kind, dropout=0.5)
    model.train()  # the helpers run in eval mode whatever the model's mode
    step_fn, state = aj.make_step_fn(model)
    x = inputs(1)
    model.eval()
    y = model(x)
    carry = model.init_carry(B, max_len=T)
    for t in range(T):
        previous = carry
        carry, y_t = step_fn(state, carry, x[:, t])
        chex.assert_trees_all_close(y_t, y[:, t], atol=1e-5, rtol=1e-5)
    assert jax.tree.leaves(previous)[0].is_deleted()  # the carry was donated
    carry_s, ys = aj.stream(model, model.init_carry(B, max_len=T), x)
    chex.assert_trees_all_close(ys, y, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(carry_s, carry, atol=1e-5, rtol=1e-5)
    # An nnx.State is accepted too.
    _, y_0 = step_fn(nnx.state(model), model.init_carry(B, max_len=T), x[:, 0])
    np.testing.assert_allclose(y_0, y[:, 0], atol=1e-5, rtol=1e-5)
