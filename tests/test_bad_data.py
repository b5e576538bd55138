"""Honest numerics under bad data, through the public API (issue: NaN never hidden, padding
never leaks, overflow never silent, errors at the call that received the bad argument)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aaren_jax as aj

B, T, D_MODEL, HEADS, D_FF = 2, 7, 16, 2, 32
KINDS = ("aaren", "transformer")


def make(kind, rsa=None, layers=2, seed=0, **options):
    cls = aj.Aaren if kind == "aaren" else aj.Transformer
    return cls(layers, D_MODEL, HEADS, D_FF, rsa=rsa, rngs=nnx.Rngs(seed), **options)


def inputs(seed=0, length=T):
    return jax.random.normal(jax.random.key(seed), (B, length, D_MODEL))


@pytest.mark.parametrize("kind", KINDS)
def test_nan_input_poisons_its_token_and_later_ones_only(kind):
    model = make(kind)
    x = inputs()
    clean = jax.jit(lambda x: model(x))(x)
    y = np.asarray(jax.jit(lambda x: model(x))(x.at[0, 3, 5].set(jnp.nan)))
    # as a float64 softmax says: outputs before token 3 unchanged, NaN from it on
    np.testing.assert_array_equal(y[0, :3], np.asarray(clean)[0, :3])
    assert np.all(np.isnan(y[0, 3:]))
    np.testing.assert_array_equal(y[1], np.asarray(clean)[1])  # the other row is untouched


def test_nan_query_parameter_makes_every_output_nan():
    model = make("aaren")
    model.blocks[0].attention.q0[...] = model.blocks[0].attention.q0[...].at[0].set(jnp.nan)
    assert np.all(np.isnan(np.asarray(model(inputs()))))
    carry, y_t = model.step(model.init_carry(B), inputs()[:, 0])
    assert np.all(np.isnan(np.asarray(y_t)))


def _loss_and_grads(model, mask):
    """``x -> (loss, y, grads)``, compiled once for every ``x`` of one shape."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x):
        y = nnx.merge(graphdef, params, rest)(x, mask)
        return jnp.sum(jnp.where(mask[..., None], jnp.sin(y), 0.0)), y

    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))

    def run(x):
        (value, y), grads = value_and_grad(params, x)
        return value, y, grads

    return run


CASES = [("aaren", m) for m in ("auto", "blocked", "associative", "sequential", "chunked")]
CASES += [("transformer", "auto"), ("rsa_aaren", "auto"), ("rsa_transformer", "auto")]


@pytest.mark.parametrize(("kind", "method"), CASES)
def test_garbage_at_masked_tokens_changes_no_valid_output_and_no_gradient(kind, method):
    rsa = aj.REMConfig((1, 1, 0, 0, 0, 0)) if kind.startswith("rsa") else None
    options = {"method": method, "chunk_size": 3} if kind == "aaren" else {}
    model = make(kind.removeprefix("rsa_"), rsa=rsa, **options)
    mask = np.ones((B, T), bool)
    mask[0, 2], mask[1, :3], mask[1, 5] = False, False, False  # a hole, left padding, a hole
    x = inputs(1)
    clean = jnp.where(mask[..., None], x, 0.0)
    garbage = jnp.asarray(np.array([np.nan, np.inf, -np.inf, 1e30])[np.arange(T) % 4])
    dirty = jnp.where(mask[..., None], x, garbage[None, :, None])
    run = _loss_and_grads(model, jnp.asarray(mask))
    loss_clean, y_clean, g_clean = run(clean)
    loss_dirty, y_dirty, g_dirty = run(dirty)
    np.testing.assert_array_equal(np.asarray(y_dirty)[mask], np.asarray(y_clean)[mask])
    assert float(loss_dirty) == float(loss_clean)
    chex.assert_trees_all_equal(g_dirty, g_clean)
    chex.assert_tree_all_finite(g_dirty)


def test_transformer_overflow_under_a_trace_gives_nan_never_a_plausible_number():
    model = make("transformer", layers=1)
    x = inputs(2, length=6)
    carry = model.init_carry(B, max_len=4)

    @jax.jit
    def run(carry, xs):
        return jax.lax.scan(lambda c, x_t: model.step(c, x_t), carry, jnp.swapaxes(xs, 0, 1))

    carry, ys = run(carry, x)
    ys = np.asarray(ys)  # [T, B, d]
    assert np.all(np.isfinite(ys[:4])) and np.all(np.isnan(ys[4:]))
    assert int(carry.layers[0].length) == 6
    # a prefill that does not fit after 2 tokens, under jit
    half_full, _ = run(model.init_carry(B, max_len=4), x[:, :2])
    y = jax.jit(lambda c, x: model(x, carry=c))(half_full, x[:, 2:5])
    assert np.all(np.isnan(np.asarray(y)))
    with pytest.raises(ValueError, match="capacity 4, cannot write T = 6"):  # static: always
        jax.jit(lambda c, x: model(x, carry=c))(model.init_carry(B, max_len=4), x)
    with pytest.raises(ValueError, match="capacity 4, position 4"):  # eager: an error
        model.step(run(model.init_carry(B, max_len=4), x[:, :4])[0], x[:, 4])


@pytest.mark.parametrize("kind", KINDS)
def test_late_errors_are_raised_at_the_call_naming_the_argument(kind):
    model = make(kind)
    with pytest.raises(ValueError, match="batch_size must be >= 0"):
        model.init_carry(-1, max_len=4)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        model.init_carry(2.5, max_len=4)
    other = make("transformer" if kind == "aaren" else "aaren")
    with pytest.raises(TypeError, match="carry must be a"):
        model.step(other.init_carry(B, max_len=4), inputs()[:, 0])
    wider = (aj.Aaren if kind == "aaren" else aj.Transformer)(2, 32, 4, D_FF, rngs=nnx.Rngs(0))
    with pytest.raises((TypeError, ValueError), match="carry"):
        model.step(wider.init_carry(B, max_len=4), inputs()[:, 0])


def test_bad_constructor_arguments_raise_at_construction():
    with pytest.raises(ValueError, match="method must be one of"):
        aj.Aaren(1, D_MODEL, HEADS, D_FF, method="bogus", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="chunk_size"):
        aj.AarenAttention(D_MODEL, HEADS, chunk_size=0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="max_len must be an int"):
        make("transformer").init_carry(B, max_len=2.5)


@pytest.mark.slow
def test_hessian_with_default_arguments_matches_sequential():
    # on CPU "auto" resolves to the compiled scan: its custom JVP, its compiled backward pass
    # and, for the second order, that pass's derivatives in XLA
    x = jax.random.normal(jax.random.key(3), (1, 64, 4))

    def loss(method):
        model = aj.Aaren(1, 4, 2, 8, method=method, rngs=nnx.Rngs(4))
        return lambda x: jnp.sum(jnp.sin(model(x)))

    h_default = jax.jit(jax.hessian(loss("auto")))(x)  # forward over reverse mode
    h_sequential = jax.jit(jax.hessian(loss("sequential")))(x)
    np.testing.assert_allclose(h_default, h_sequential, atol=1e-5, rtol=1e-4)
    assert np.abs(np.asarray(h_default)).max() > 0
    tangent = jnp.ones_like(x)
    _, jvp_default = jax.jit(lambda x, t: jax.jvp(loss("auto"), (x,), (t,)))(x, tangent)
    _, jvp_sequential = jax.jit(lambda x, t: jax.jvp(loss("sequential"), (x,), (t,)))(x, tangent)
    np.testing.assert_allclose(jvp_default, jvp_sequential, rtol=1e-4)


def test_aaren_and_transformer_rsa_agree_where_their_rems_coincide():
    """With the gate at 1 both layers output o_proj(P V): the same REM recurrence, also with
    gappy masks and beyond K = 3 (no truncation in either)."""
    rsa = aj.REMConfig((1, 1, 1, 1, 0, 0), dilations=2, max_power=3)
    layers = [
        cls(D_MODEL, 4, rsa=rsa, rngs=nnx.Rngs(5))
        for cls in (aj.AarenAttention, aj.CausalSelfAttention)
    ]
    for layer in layers:
        layer.rsa.mu[...] = jnp.asarray(40.0)  # sigmoid(40) == 1 in float32
    for name in ("v_proj", "o_proj"):  # the REM path reads only these
        chex.assert_trees_all_equal(
            nnx.state(getattr(layers[0], name)), nnx.state(getattr(layers[1], name))
        )
    x = inputs(6, length=12)
    mask = jnp.asarray(np.random.default_rng(0).random((B, 12)) > 0.3)
    y_aaren, y_transformer = (layer(x, mask) for layer in layers)
    np.testing.assert_allclose(y_aaren, y_transformer, atol=1e-5)
