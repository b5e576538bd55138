"""The scan core against an independent float64 brute force, and its numerical rules."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import aaren_jax as aj
from aaren_jax import native

METHODS = ("associative", "sequential", "chunked", "blocked", "native", "auto")


def brute_force(scores, values, mask, initial=None):
    """Softmax over every prefix, in float64 NumPy, one prefix at a time.

    ``initial`` is an optional list of (score, value) pairs that come before all tokens.
    """
    scores = np.asarray(scores, np.float64)
    values = np.asarray(values, np.float64)
    mask = np.broadcast_to(np.asarray(mask, bool), scores.shape)
    out = np.zeros(values.shape)
    for t in range(scores.shape[-1]):
        s = np.where(mask[..., : t + 1], scores[..., : t + 1], -np.inf)
        v = values[..., : t + 1, :]
        if initial is not None:
            s = np.concatenate([initial[0], s], axis=-1)
            v = np.concatenate([initial[1], v], axis=-2)
        top = s.max(axis=-1, keepdims=True)
        top = np.where(np.isneginf(top), 0.0, top)
        e = np.exp(s - top)
        den = e.sum(-1)
        num = (e[..., None] * v).sum(-2)
        out[..., t, :] = np.where(den[..., None] > 0, num / np.where(den > 0, den, 1)[..., None], 0)
    return out


def mask_kinds(rng, shape):
    """Four rows of masks: none, random, left padding, all masked. [4, *shape]"""
    length = shape[-1]
    left = np.broadcast_to(np.arange(length) >= length // 2, shape)
    return np.stack(
        [np.ones(shape, bool), rng.random(shape) > 0.4, left, np.zeros(shape, bool)], axis=0
    )


@functools.cache
def jitted(method, chunk_size=None):
    return jax.jit(
        lambda s, v, m: aj.prefix_attention(s, v, m, method=method, chunk_size=chunk_size)
    )


@functools.cache
def jitted_step():
    return jax.jit(aj.attention_step)


def step_loop(scores, values, mask):
    batch_shape, dim = scores.shape[:-1], values.shape[-1]
    state = aj.init_state(batch_shape, dim)
    outs = []
    for t in range(scores.shape[-1]):
        state, out = jitted_step()(state, scores[..., t], values[..., t, :], mask[..., t])
        outs.append(out)
    return jnp.stack(outs, axis=-2), state


@pytest.mark.parametrize("length", [1, 2, 7, 64, 257])
@pytest.mark.parametrize("method", [*METHODS, "step"])
def test_matches_float64_brute_force(method, length):
    rng = np.random.default_rng(length)
    masks = mask_kinds(rng, (3, length))  # [4, H=3, T]: every mask kind as a batch row
    scores = (rng.normal(size=masks.shape) * 4).astype(np.float32)
    values = rng.normal(size=(*masks.shape, 5)).astype(np.float32)
    expected = brute_force(scores, values, masks)
    if method == "step":
        out, final = step_loop(jnp.asarray(scores), jnp.asarray(values), jnp.asarray(masks))
    else:
        chunk = 5 if method == "chunked" else None  # 5 divides none of the lengths but 1
        out, final = jitted(method, chunk)(scores, values, masks)
    chex.assert_shape(out, (4, 3, length, 5))
    chex.assert_shape([final.m, final.u], (4, 3))
    chex.assert_shape(final.w, (4, 3, 5))
    np.testing.assert_allclose(out, expected, atol=2e-6, rtol=2e-5)
    np.testing.assert_allclose(_readout(final), expected[..., -1, :], atol=2e-6, rtol=2e-5)
    # all-masked rows are exactly zero
    assert np.all(np.asarray(out)[3] == 0)


def _readout(state):
    u = np.asarray(state.u, np.float64)
    return np.where(u[..., None] > 0, np.asarray(state.w) / np.where(u > 0, u, 1)[..., None], 0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch_shape", [(), (3,), (2, 3), (1, 3), (2, 1, 3)])
def test_leading_shapes(method, batch_shape):
    # (1, 3): the blocked kernel runs on one flat batch axis (a leading axis of size 1 was
    # a slow path of XLA's CPU code); the final state keeps the caller's batch shape.
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(*batch_shape, 11)).astype(np.float32)
    values = rng.normal(size=(*batch_shape, 11, 4)).astype(np.float32)
    mask = rng.random(scores.shape) > 0.3
    out, final = jitted(method, 4)(scores, values, mask)
    chex.assert_shape(out, (*batch_shape, 11, 4))
    chex.assert_shape(final.w, (*batch_shape, 4))
    chex.assert_shape((final.m, final.u), batch_shape)
    np.testing.assert_allclose(out, brute_force(scores, values, mask), atol=2e-6, rtol=2e-5)
    np.testing.assert_allclose(aj.readout(final), out[..., -1, :], atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 13, 64])
@pytest.mark.parametrize("method", ["chunked", "auto"])
def test_chunk_sizes(method, chunk_size):
    rng = np.random.default_rng(chunk_size)
    scores = rng.normal(size=(2, 37)).astype(np.float32) * 3
    values = rng.normal(size=(2, 37, 3)).astype(np.float32)
    mask = rng.random(scores.shape) > 0.3
    out, _ = jitted(method, chunk_size)(scores, values, mask)
    np.testing.assert_allclose(out, brute_force(scores, values, mask), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("method", METHODS)
def test_step_loop_equals_parallel_carry_by_carry(method):
    rng = np.random.default_rng(2)
    scores = jnp.asarray(rng.normal(size=(2, 3, 9)) * 5, jnp.float32)
    values = jnp.asarray(rng.normal(size=(2, 3, 9, 4)), jnp.float32)
    mask = jnp.asarray(mask_kinds(rng, (9,))[[1, 2]][:, None].repeat(3, 1))
    out_loop, final_loop = step_loop(scores, values, mask)
    for t in (0, 4, 8):  # the parallel final state after t+1 tokens equals the loop's
        out, final = jitted(method)(
            scores[..., : t + 1], values[..., : t + 1, :], mask[..., : t + 1]
        )
        np.testing.assert_allclose(out, out_loop[..., : t + 1, :], atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(final.m, final_loop.m, rtol=1e-6)
    np.testing.assert_allclose(final.u, final_loop.u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final.w, final_loop.w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("split", [0, 1, 6, 13])
def test_initial_state_continues_a_prefill(method, split):
    rng = np.random.default_rng(3)
    scores = rng.normal(size=(2, 13)).astype(np.float32) * 3
    values = rng.normal(size=(2, 13, 4)).astype(np.float32)
    mask = rng.random(scores.shape) > 0.2
    full_out, full_final = jitted(method)(scores, values, mask)
    _, prefill = jitted(method)(scores[:, :split], values[:, :split], mask[:, :split])

    @jax.jit
    def resume(state, s, v, m):
        return aj.prefix_attention(s, v, m, initial_state=state, method=method)

    tail_out, tail_final = resume(prefill, scores[:, split:], values[:, split:], mask[:, split:])
    np.testing.assert_allclose(tail_out, full_out[:, split:], atol=1e-6, rtol=1e-5)
    chex.assert_trees_all_close(tail_final, full_final, atol=1e-6, rtol=1e-5)
    # and against the brute force with the prefill's tokens prepended
    initial = (np.where(mask[:, :split], scores[:, :split], -np.inf), values[:, :split])
    expected = brute_force(scores[:, split:], values[:, split:], mask[:, split:], initial)
    np.testing.assert_allclose(tail_out, expected, atol=2e-6, rtol=2e-5)


# ----------------------------------------------------------------------------------------
# The operator


_summarise = jax.jit(lambda s, v, m: aj.prefix_attention(s, v, m, method="sequential")[1])
_combine = jax.jit(aj.combine)


def _random_state(seed, dim=3):
    """The state of 1 to 4 tokens with scores of magnitude 0.1 to 1000."""
    rng = np.random.default_rng(seed)
    s = rng.normal(size=4) * 10 ** rng.uniform(-1, 3)
    v = rng.normal(size=(4, dim))
    mask = np.arange(4) < rng.integers(1, 5)
    return _summarise(jnp.float32(s), jnp.float32(v), mask)


seeds = st.integers(0, 2**32 - 1)


def _ratio(state):
    return np.asarray(state.w) / np.asarray(state.u)


@settings(max_examples=200, deadline=None)
@given(seeds, seeds, seeds)
def test_combine_is_associative(sa, sb, sc):
    a, b, c = _random_state(sa), _random_state(sb), _random_state(sc)
    left = _combine(_combine(a, b), c)
    right = _combine(a, _combine(b, c))
    np.testing.assert_array_equal(left.m, right.m)
    np.testing.assert_allclose(left.u, right.u, rtol=1e-5)
    np.testing.assert_allclose(left.w, right.w, rtol=1e-5, atol=1e-5 * float(left.u))


@settings(max_examples=200, deadline=None)
@given(seeds)
def test_combine_identity(seed):
    a = _random_state(seed)
    identity = aj.init_state((), a.w.shape[-1])
    for merged in (_combine(identity, a), _combine(a, identity)):
        chex.assert_trees_all_equal(merged, a)
    chex.assert_trees_all_equal(_combine(identity, identity), identity)


@settings(max_examples=200, deadline=None)
@given(seeds, st.floats(-1e3, 1e3, allow_nan=False))
def test_combine_ratio_invariant_to_common_shift(seed, shift):
    rng = np.random.default_rng(seed)
    s = rng.normal(size=(2, 4)) * 5
    v = jnp.float32(rng.normal(size=(2, 4, 3)))
    mask = np.ones(4, bool)
    states = [_summarise(jnp.float32(s[i]), v[i], mask) for i in range(2)]
    shifted = [_summarise(jnp.float32(s[i] + shift), v[i], mask) for i in range(2)]
    merged, merged_shifted = _combine(*states), _combine(*shifted)
    np.testing.assert_allclose(_ratio(merged), _ratio(merged_shifted), rtol=2e-4, atol=2e-4)


def test_combine_broadcasts():
    a = aj.init_state((4, 1), 3)
    b = aj.attention_step(aj.init_state((1, 2), 3), jnp.zeros((1, 2)), jnp.ones((1, 2, 3)))[0]
    merged = aj.combine(a, b)
    chex.assert_shape(merged.w, (4, 2, 3))
    np.testing.assert_allclose(merged.w, 1.0)


# ----------------------------------------------------------------------------------------
# Hostile inputs


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", ["huge_positive", "huge_negative", "far_apart", "alternating"])
def test_huge_scores(method, case):
    rng = np.random.default_rng(4)
    length = 19
    if case == "huge_positive":
        scores = 1e4 + rng.normal(size=length)
    elif case == "huge_negative":
        scores = -1e4 + rng.normal(size=length)
    elif case == "far_apart":
        scores = np.where(np.arange(length) % 3 == 0, 1e4, -1e4) + rng.normal(size=length)
    else:
        scores = np.where(np.arange(length) % 2 == 0, -1e4, 0.0) * np.arange(length)
    scores = scores.astype(np.float32)[None]
    values = rng.normal(size=(1, length, 3)).astype(np.float32)
    mask = np.ones_like(scores, bool)
    out, final = jitted(method, 4)(scores, values, mask)
    np.testing.assert_allclose(out, brute_force(scores, values, mask), atol=1e-5, rtol=1e-5)
    chex.assert_tree_all_finite((out, final.u, final.w))
    grads = _grad(method)(jnp.asarray(scores), jnp.asarray(values), jnp.asarray(mask))
    chex.assert_tree_all_finite(grads)


@functools.cache
def _grad(method):
    def loss(s, v, m):
        out, final = aj.prefix_attention(s, v, m, method=method, chunk_size=4)
        return jnp.sum(jnp.sin(out)) + jnp.sum(final.w) / jnp.maximum(jnp.sum(final.u), 1.0)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("method", METHODS)
def test_masked_tokens_get_zero_gradient_and_empty_rows_are_finite(method):
    rng = np.random.default_rng(5)
    masks = mask_kinds(rng, (10,))  # none, random, left padding, all masked
    scores = jnp.asarray(rng.normal(size=masks.shape) * 3, jnp.float32)
    values = jnp.asarray(rng.normal(size=(*masks.shape, 3)), jnp.float32)
    d_scores, d_values = _grad(method)(scores, values, jnp.asarray(masks))
    chex.assert_tree_all_finite((d_scores, d_values))
    assert np.all(np.asarray(d_scores)[~masks] == 0)
    assert np.all(np.asarray(d_values)[~masks] == 0)
    assert np.any(np.asarray(d_values)[masks] != 0)
    out, final = jitted(method)(scores, values, jnp.asarray(masks))
    assert np.all(np.asarray(out)[3] == 0) and float(final.u[3]) == 0.0


@pytest.mark.parametrize("method", METHODS)
def test_bfloat16_inputs_keep_float32_state(method):
    rng = np.random.default_rng(6)
    scores = jnp.asarray(rng.normal(size=(2, 3, 40)) * 4, jnp.bfloat16)
    values = jnp.asarray(rng.normal(size=(2, 3, 40, 8)), jnp.bfloat16)
    mask = jnp.asarray(rng.random((2, 3, 40)) > 0.2)
    out, final = jitted(method)(scores, values, mask)
    assert out.dtype == jnp.bfloat16
    assert final.m.dtype == final.u.dtype == final.w.dtype == jnp.float32
    expected = brute_force(np.float32(scores), np.float32(values), mask)
    # only the output's rounding to bfloat16 (8 bits of mantissa) is left
    np.testing.assert_allclose(np.float32(out), expected, atol=1e-2, rtol=1e-2)
    chex.assert_tree_all_finite(_grad(method)(scores, values, mask))


def test_float64_inputs_keep_float64_state():
    with jax.enable_x64(True):
        rng = np.random.default_rng(7)
        scores = jnp.asarray(rng.normal(size=(2, 9)) * 30, jnp.float64)
        values = jnp.asarray(rng.normal(size=(2, 9, 3)), jnp.float64)
        mask = jnp.ones((2, 9), bool)
        for method in METHODS:
            run = jax.jit(functools.partial(aj.prefix_attention, method=method, chunk_size=4))
            out, final = run(scores, values, mask)
            assert out.dtype == final.u.dtype == jnp.float64
            np.testing.assert_allclose(out, brute_force(scores, values, mask), atol=1e-12)


# ----------------------------------------------------------------------------------------
# Gradients


def _dense_reference(scores, values, mask):
    """Masked softmax over each prefix as a dense T x T matrix: independent of the scan."""
    length = scores.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    mask = jnp.broadcast_to(mask, scores.shape)
    allowed = causal.reshape((1,) * (scores.ndim - 1) + causal.shape) & mask[..., None, :]
    logits = jnp.where(allowed, scores[..., None, :], -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    top = jnp.where(jnp.isneginf(top), 0.0, top)
    e = jnp.where(allowed, jnp.exp(jnp.where(allowed, logits - top, 0.0)), 0.0)
    den = e.sum(-1, keepdims=True)
    return jnp.where(den > 0, (e @ values) / jnp.where(den > 0, den, 1.0), 0.0)


def _gradients_and_float64(scores_np, values_np, mask, method, chunk_size):
    """Gradients of ``sum(outputs * cot)`` with respect to scores and values: the method's
    in float32, and the dense softmax's in float64."""
    cot = np.random.default_rng(0).normal(size=values_np.shape)

    def loss(fn, s, v):
        return jnp.sum(fn(s, v) * cot)

    with jax.enable_x64(True):
        expected = jax.grad(
            functools.partial(loss, lambda s, v: _dense_reference(s, v, mask)), (0, 1)
        )(jnp.float64(scores_np), jnp.float64(values_np))
    forward = functools.partial(
        aj.prefix_attention, mask=mask, method=method, chunk_size=chunk_size
    )
    got = jax.jit(jax.grad(functools.partial(loss, lambda s, v: forward(s, v)[0]), (0, 1)))(
        jnp.float32(scores_np), jnp.float32(values_np)
    )
    return got, tuple(np.asarray(e) for e in expected)


@pytest.mark.parametrize("method", METHODS)
def test_gradients_match_float64_dense_softmax(method):
    rng = np.random.default_rng(8)
    masks = mask_kinds(rng, (12,))
    scores_np = rng.normal(size=masks.shape) * 3
    values_np = rng.normal(size=(*masks.shape, 4))
    got, expected = _gradients_and_float64(scores_np, values_np, masks, method, 5)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("offset", [1e4, -1e4])
def test_gradients_at_huge_scores_match_float64(method, offset):
    # Scores near +-1e4 with a spread of ~30: a float32 log-normaliser log(sum exp) is off
    # by up to 1e-3 there, and weights taken as exp(s - log_norm) with it. 37 tokens span
    # several blocks (and a padded one) of the blocked kernel's tangent.
    rng = np.random.default_rng(11)
    scores_np = np.float32(offset + rng.normal(size=(3, 37)) * 30)
    values_np = np.float32(rng.normal(size=(3, 37, 4)))
    mask = np.ones(scores_np.shape, bool)
    got, expected = _gradients_and_float64(scores_np, values_np, mask, method, 8)
    for g, e in zip(got, expected, strict=True):
        # every method is within 1.6e-5 of the largest entry; weights from the rounded
        # log-normaliser were 2e-4 off (the blocked kernel's tangent at 81f8cb9)
        assert np.abs(np.asarray(g, np.float64) - e).max() < 5e-5 * np.abs(e).max()


@pytest.mark.parametrize("method", METHODS)
def test_final_state_and_initial_state_gradients(method):
    """Gradients through the carried state, which prefill-then-continue training uses."""
    rng = np.random.default_rng(9)
    s1, s2 = rng.normal(size=(2, 5)) * 2, rng.normal(size=(2, 7)) * 2
    v1, v2 = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 7, 3))
    cot = rng.normal(size=(2, 7, 3))
    w_cot = rng.normal(size=(2, 3))

    def two_calls(a, b, c, d, m):
        _, state = aj.prefix_attention(a, c, method=m, chunk_size=3)
        out, final = aj.prefix_attention(b, d, initial_state=state, method=m, chunk_size=3)
        return jnp.sum(out * cot) + jnp.sum(final.w / final.u[..., None] * w_cot)

    def one_call(a, b, c, d):
        out = _dense_reference(jnp.concatenate([a, b], -1), jnp.concatenate([c, d], -2), True)
        return jnp.sum(out[..., 5:, :] * cot) + jnp.sum(out[..., -1, :] * w_cot)

    with jax.enable_x64(True):
        args64 = tuple(jnp.float64(x) for x in (s1, s2, v1, v2))
        expected = jax.grad(one_call, (0, 1, 2, 3))(*args64)
    args32 = tuple(jnp.float32(x) for x in (s1, s2, v1, v2))
    got = jax.jit(jax.grad(two_calls, (0, 1, 2, 3)), static_argnums=4)(*args32, method)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, np.asarray(e), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.slow
def test_check_grads_second_order(method):
    rng = np.random.default_rng(10)
    mask = jnp.asarray([True, False, True, True, True, False, True])

    def f(s, v):
        return aj.prefix_attention(s, v, mask, method=method, chunk_size=3)[0]

    # "blocked" differentiates by its custom JVP in both modes, to second order.
    with jax.enable_x64(True):
        args = (jnp.float64(rng.normal(size=(2, 7))), jnp.float64(rng.normal(size=(2, 7, 3))))
        check_grads(jax.jit(f), args, order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("kernel", ["blocked", "native"])
def test_blocked_derivatives_with_an_initial_state_and_garbage_at_masked_tokens(kernel):
    """Forward and reverse mode of the blocked kernel against the sequential scan's autodiff,
    through the initial state and with NaN at masked tokens (their tangents are ignored)."""
    rng = np.random.default_rng(11)
    mask = jnp.asarray(rng.random((2, 70)) > 0.3)
    init = aj.attention_step(aj.init_state((2,), 3), jnp.ones(2), jnp.ones((2, 3)))[0]

    def f(method):
        def run(s, v, u0, w0):
            s, v = jnp.where(mask, s, jnp.nan), jnp.where(mask[..., None], v, jnp.nan)
            start = init._replace(u=u0, w=w0)
            out, final = aj.prefix_attention(
                s, v, mask, initial_state=start, method=method, chunk_size=8
            )
            return jnp.sum(jnp.sin(out)) + jnp.sum(final.w * final.u[..., None])

        return run

    args = (
        jnp.asarray(rng.normal(size=(2, 70)), jnp.float32),
        jnp.asarray(rng.normal(size=(2, 70, 3)), jnp.float32),
        init.u,
        init.w,
    )
    tangents = tuple(jnp.ones_like(a) for a in args)
    for mode in (jax.grad, jax.jacfwd):
        got = jax.jit(mode(f(kernel), argnums=(0, 1, 2, 3)))(*args)
        want = jax.jit(mode(f("sequential"), argnums=(0, 1, 2, 3)))(*args)
        for g, w in zip(got, want, strict=True):
            assert np.all(np.isfinite(g))
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
    jvp = jax.jit(lambda method: jax.jvp(f(method), args, tangents)[1], static_argnums=0)
    np.testing.assert_allclose(jvp(kernel), jvp("sequential"), rtol=2e-5)


# ----------------------------------------------------------------------------------------
# Errors


def test_errors_name_the_argument_and_shapes():
    s, v = jnp.zeros((2, 5)), jnp.zeros((2, 5, 3))
    with pytest.raises(ValueError, match=r"values of shape \(2, 6, 3\).*\(2, 5\)"):
        aj.prefix_attention(s, jnp.zeros((2, 6, 3)))
    with pytest.raises(ValueError, match=r"mask of shape \(2, 4\).*\(2, 5\)"):
        aj.prefix_attention(s, v, jnp.ones((2, 4), bool))
    with pytest.raises(TypeError, match="mask must be boolean"):
        aj.prefix_attention(s, v, jnp.ones((2, 5), jnp.int32))
    with pytest.raises(TypeError, match="scores must have a floating dtype"):
        aj.prefix_attention(jnp.zeros((2, 5), jnp.int32), v)
    with pytest.raises(TypeError, match="values must have a floating dtype"):
        aj.prefix_attention(s, jnp.zeros((2, 5, 3), jnp.int32))
    with pytest.raises(ValueError, match="'blocked', 'associative', 'sequential', 'chunked'"):
        aj.prefix_attention(s, v, method="fast")
    with pytest.raises(ValueError, match="chunk_size"):
        aj.prefix_attention(s, v, method="chunked", chunk_size=0)
    with pytest.raises(ValueError, match=r"initial_state.w has shape \(2, 4\).*\(2, 3\)"):
        aj.prefix_attention(s, v, initial_state=aj.init_state((2,), 4))
    with pytest.raises(ValueError, match=r"initial_state.m has shape \(3,\).*\(2,\)"):
        aj.prefix_attention(s, v, initial_state=aj.init_state((3,), 3))
    with pytest.raises(ValueError, match=r"score of shape \(2,\).*\(3, 3\)"):
        aj.attention_step(aj.init_state((2,), 3), jnp.zeros(2), jnp.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"state.w has shape \(2, 4\)"):
        aj.attention_step(aj.init_state((2,), 4), jnp.zeros(2), jnp.zeros((2, 3)))


def test_empty_sequence_returns_the_initial_state():
    state = aj.attention_step(aj.init_state((2,), 3), jnp.ones(2), jnp.ones((2, 3)))[0]
    out, final = aj.prefix_attention(jnp.zeros((2, 0)), jnp.zeros((2, 0, 3)), initial_state=state)
    chex.assert_shape(out, (2, 0, 3))
    chex.assert_trees_all_equal(final, state)


# ----------------------------------------------------------------------------------------
# Bad data: NaN is never hidden, masked garbage never leaks, long streams do not drift


def _run(method, scores, values, mask):
    if method == "step":
        return step_loop(scores, values, mask)
    return jitted(method, 3)(scores, values, mask)


@pytest.mark.parametrize("method", [*METHODS, "step"])
@pytest.mark.parametrize("bad", ["nan_score", "inf_score", "nan_value"])
def test_non_finite_attended_token_poisons_every_later_output(method, bad):
    rng = np.random.default_rng(20)
    scores = rng.normal(size=(2, 9)).astype(np.float32)
    values = rng.normal(size=(2, 9, 3)).astype(np.float32)
    if bad == "nan_score":
        scores[:, 4] = np.nan
    elif bad == "inf_score":
        scores[:, 4] = np.inf
    else:
        values[:, 4, 1] = np.nan
    mask = np.ones(scores.shape, bool)
    out, final = _run(method, jnp.asarray(scores), jnp.asarray(values), jnp.asarray(mask))
    out = np.asarray(out)
    # float64 softmax says: exact before the bad token, NaN from it on (inf - inf = nan)
    np.testing.assert_allclose(
        out[:, :4], brute_force(scores[:, :4], values[:, :4], mask[:, :4]), atol=2e-6, rtol=2e-5
    )
    if bad == "nan_value":  # only the poisoned channel turns NaN
        assert np.all(np.isnan(out[:, 4:, 1])) and np.all(np.isfinite(out[:, 4:, [0, 2]]))
    else:
        assert np.all(np.isnan(out[:, 4:]))
    assert np.all(np.isnan(aj.readout(final))[:, 1])


def test_nan_query_propagates_like_softmax():
    scores = jnp.full((5,), jnp.nan)
    out, _ = aj.prefix_attention(scores, jnp.ones((5, 2)))
    assert np.all(np.isnan(np.asarray(out)))
    np.testing.assert_array_equal(np.isnan(jax.nn.softmax(scores)), np.ones(5, bool))


@pytest.mark.parametrize("method", [*METHODS, "step"])
def test_garbage_at_masked_tokens_changes_no_output_and_no_gradient(method):
    rng = np.random.default_rng(21)
    mask = np.array([[True, False, True, True, False, True, True], [False] * 3 + [True] * 4])
    scores = rng.normal(size=mask.shape).astype(np.float32)
    values = rng.normal(size=(*mask.shape, 3)).astype(np.float32)
    clean_s, clean_v = np.where(mask, scores, 0), np.where(mask[..., None], values, 0)
    dirty_s = np.where(mask, scores, np.array([np.nan, np.inf, -np.inf])[np.arange(7) % 3])
    dirty_v = np.where(mask[..., None], values, np.nan)
    args = [
        tuple(jnp.asarray(x) for x in pair) for pair in ((clean_s, clean_v), (dirty_s, dirty_v))
    ]
    outs = [_run(method, s, v, jnp.asarray(mask))[0] for s, v in args]
    chex.assert_trees_all_equal(outs[0], outs[1])
    chex.assert_tree_all_finite(outs[1])
    if method != "step":
        grads = [_grad(method)(s, v, jnp.asarray(mask)) for s, v in args]
        chex.assert_trees_all_equal(grads[0], grads[1])


def _stream_error(state, scores, values):
    """Max relative error of the streamed output against float64, after every block."""
    run = jax.jit(lambda c, s, v: jax.lax.scan(lambda c, x: aj.attention_step(c, *x), c, (s, v)))
    s64, v64 = np.float64(scores), np.float64(values)
    errors = []
    for start in range(0, scores.shape[0], 5000):
        block = slice(start, start + 5000)
        state, _ = run(state, jnp.asarray(scores[block]), jnp.asarray(values[block]))
        e = np.exp(s64[: block.stop] - s64[: block.stop].max(0))
        expected = (e[..., None] * v64[: block.stop]).sum(0) / e.sum(0)[..., None]
        got = np.asarray(aj.readout(state), np.float64)
        errors.append(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))
    return np.array(errors)


def test_compensated_state_streams_without_drift():
    rng = np.random.default_rng(22)
    scores = (rng.normal(size=(40_000, 4)) * 2).astype(np.float32)
    values = (rng.normal(size=(40_000, 4, 3)) + 1).astype(np.float32)
    plain = _stream_error(aj.init_state((4,), 3), scores, values)
    kept = _stream_error(aj.init_state((4,), 3, compensated=True), scores, values)
    assert np.all(kept < 5e-7), kept
    assert plain[-1] > 4 * kept[-1], (plain, kept)  # the plain float32 sum does drift


@pytest.mark.parametrize("method", METHODS)
def test_compensated_initial_state_is_continued_by_every_method(method):
    rng = np.random.default_rng(23)
    s1, s2 = (jnp.asarray(rng.normal(size=(2, n)), jnp.float32) for n in (5, 70))
    v1, v2 = (jnp.asarray(rng.normal(size=(2, n, 3)), jnp.float32) for n in (5, 70))
    _, state = aj.prefix_attention(s1, v1, initial_state=aj.init_state((2,), 3, compensated=True))
    assert state.compensated
    # jitted: one compilation for the whole call, not one per operation
    run = jax.jit(functools.partial(aj.prefix_attention, method=method))
    out, final = run(s2, v2, initial_state=state)
    assert final.compensated
    expected = brute_force(
        s2, v2, np.ones(s2.shape, bool), initial=(np.asarray(s1), np.asarray(v1))
    )
    np.testing.assert_allclose(out, expected, atol=2e-6, rtol=2e-5)
    np.testing.assert_allclose(aj.readout(final), expected[:, -1], atol=2e-6, rtol=2e-5)


def test_auto_resolves_to_named_methods():
    assert aj.resolve_method("auto", 1, "cpu") == "single"
    # the compiled scan builds wherever CI runs (gcc): a failed build would fail here
    assert aj.resolve_method("auto", 2, "cpu") == "native"
    assert aj.resolve_method("auto", 16, "cpu") == "native"
    assert aj.resolve_method("auto", 4096, "cpu") == "native"
    assert aj.resolve_method("auto", 4096, "gpu") == "associative"
    assert aj.resolve_method("chunked", 4096) == "chunked"
    assert aj.resolve_method("blocked", 1) == "single"  # one token: one combine, any method
    with pytest.raises(ValueError, match='"single" takes one token'):
        aj.prefix_attention(jnp.zeros(3), jnp.zeros((3, 2)), method="single")


def test_auto_runs_blocked_where_the_compiled_scan_cannot_be_built(monkeypatch):
    monkeypatch.setattr(native, "_load", lambda: "no C++ compiler found (set CXX)")
    native._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert aj.resolve_method("auto", 64, "cpu") == "blocked"
    assert aj.resolve_method("auto", 8, "cpu") == "associative"
    with pytest.raises(RuntimeError, match='"native" is not available: no C'):
        aj.prefix_attention(jnp.zeros(32), jnp.zeros((32, 2)), method="native")
    monkeypatch.setattr(native, "_load", lambda: "disabled by AAREN_JAX_NATIVE=0")
    assert aj.resolve_method("auto", 64, "cpu") == "blocked"  # disabled: no warning


def test_compiled_scan_builds_into_an_empty_cache(tmp_path, monkeypatch):
    # what a fresh machine does on its first call: compile the shipped source
    monkeypatch.setenv("AAREN_JAX_CACHE", str(tmp_path))
    compiler = native.shutil.which("c++") or native.shutil.which("g++")
    library = native._library_path(compiler)
    assert library.parent == tmp_path and not library.exists()
    native._build(compiler, library)
    assert library.stat().st_size > 0
    native._build(compiler, library)  # built once: a second call finds it
    assert [p.name for p in tmp_path.glob("*.so")] == [library.name]


def test_compiled_scan_is_cached_per_kind_of_cpu(tmp_path, monkeypatch):
    """Two CPUs with one model name ("AMD EPYC") but other vector widths get other
    libraries: an -march=native build for AVX-512 would not run on the AVX2 machine."""
    zen4 = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    zen4 += "flags\t\t: fpu sse2 avx2 avx512f\nprocessor\t: 1\ncpu family\t: 25\n"
    zen3 = "cpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: sse2 avx avx2\n"
    assert native.cpu_kind(zen4) == "family 25, model 17, AVX-512"
    assert native.cpu_kind(zen3) == "family 25, model 1, AVX2"
    assert native.cpu_kind("") == "not known"
    monkeypatch.setenv("AAREN_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "cpu_model", lambda: "AMD EPYC")
    paths = []
    for text in (zen4, zen3, zen4):
        monkeypatch.setattr(native, "_cpuinfo", lambda text=text: text)
        paths.append(native._library_path("c++"))
    assert paths[0] != paths[1] and paths[0] == paths[2]


def test_compiled_backward_is_the_transpose_of_the_tangent():
    """The compiled backward pass against the transpose of the blocked kernel's tangent (XLA,
    by JAX), for every cotangent it takes: outputs, ``du / u``, the final state; with masks
    (random, left padding, all masked), a -inf score, and initial states seen and empty."""
    rng = np.random.default_rng(41)
    rows, length, dim = 5, 37, 3
    mask = rng.random((rows, length)) > 0.3
    mask[3], mask[4, :20] = False, False
    scores = np.where(mask, rng.normal(size=(rows, length)) * 4, -np.inf)
    scores[2, 5] = -np.inf  # attended, with weight 0
    values = np.where(mask[..., None], rng.normal(size=(rows, length, dim)), 0)
    init_m = np.array([0.5, -np.inf, 2.0, -np.inf, 1.0])
    init_u = np.array([1.5, 0.0, 0.7, 0.0, 2.0])
    init_w = np.where(init_u[:, None] > 0, rng.normal(size=(rows, dim)), 0)
    f32 = lambda *xs: [jnp.asarray(x, jnp.float32) for x in xs]  # noqa: E731
    scores, counts, values, init_m, init_u, init_w = f32(
        scores, mask, values, init_m, init_u, init_w
    )
    outputs, ref, u, *_ = native.prefix_scan(scores, counts, values, init_m, init_u, init_w)
    cotangents = f32(
        rng.normal(size=(rows, length, dim)),
        rng.normal(size=(rows, length)),
        rng.normal(size=rows),
        rng.normal(size=(rows, dim)),
    )
    args = (scores, counts, values, outputs, ref, u, init_m, *cotangents)
    got = native.prefix_scan_backward(*args)
    want = aj.scan._backward_reference(*args)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and np.all(np.isfinite(g))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(np.abs(w).max()))
    d_scores, d_values, d_init_u, d_init_w = got
    assert np.all(d_scores[3] == 0) and np.all(d_values[3] == 0)  # all masked: no gradient
    assert np.all(d_scores[~mask] == 0)
    assert d_init_u[1] == 0 and np.all(d_init_w[1] == 0)  # the empty initial state


def test_compiled_gradient_under_vmap_is_the_per_example_gradient():
    rng = np.random.default_rng(42)
    scores = jnp.asarray(rng.normal(size=(3, 2, 40)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(3, 2, 40, 4)), jnp.float32)
    mask = jnp.asarray(rng.random((3, 2, 40)) > 0.2)

    def loss(s, v, m):
        return jnp.sum(jnp.sin(aj.prefix_attention(s, v, m, method="native")[0]))

    grad = jax.grad(loss, argnums=(0, 1))
    batched = jax.jit(jax.vmap(grad))(scores, values, mask)
    for i in range(3):
        one = grad(scores[i], values[i], mask[i])
        for b, o in zip(batched, one, strict=True):
            np.testing.assert_allclose(b[i], o, rtol=1e-6, atol=1e-7)
    hlo = jax.jit(jax.vmap(grad)).lower(scores, values, mask).as_text()
    assert "aaren_prefix_scan_backward" in hlo  # the compiled backward, batched as rows


@pytest.mark.parametrize("method", METHODS)
def test_one_token_keeps_compensation_whatever_the_method(method):
    # A layer's step runs its method on one token: with "blocked" the error terms used to be
    # folded in and zeroed at every token, so a long stream drifted again.
    rng = np.random.default_rng(24)
    state = aj.init_state((3,), 2, compensated=True)
    expected = state
    for _ in range(50):
        s = jnp.asarray(rng.normal(size=(3, 1)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(3, 1, 2)), jnp.float32)
        _, state = aj.prefix_attention(s, v, initial_state=state, method=method)
        expected = aj.combine(expected, aj.AttentionState(s[:, 0], jnp.ones(3), v[:, 0]))
    chex.assert_trees_all_equal(state, expected)
    assert np.any(np.asarray(state.w_err) != 0)


# ----------------------------------------------------------------------------------------
# The blocked kernel and the compiled scan on a long sequence: many blocks, runs of masked
# tokens across block boundaries, hostile values far from the start; few and small cases.

LONG = 2085  # no block size near the default divides it: padding


@pytest.mark.parametrize("kernel", ["blocked", "native"])
@pytest.mark.parametrize("case", ["random", "huge_far_apart", "nan_score", "nan_value"])
def test_blocked_long_sequence_matches_float64_brute_force(case, kernel):
    rng = np.random.default_rng(31)
    scores = rng.normal(size=(4, LONG)).astype(np.float32)
    values = rng.normal(size=(4, LONG, 3)).astype(np.float32)
    mask = mask_kinds(rng, (LONG,))  # none, random, left padding, all masked
    mask[1, 700:900] = False  # a masked run across several blocks
    if case == "huge_far_apart":  # scores 1e3 apart inside one block: weights underflow
        scores = scores * 1e3
    bad = 1000
    if case == "nan_score":
        scores[:, bad] = np.nan
    elif case == "nan_value":
        values[:, bad, 1] = np.nan
    scores[~mask], values[~mask] = np.inf, np.nan  # garbage where masked: ignored
    out, final = jax.jit(lambda s, v, m: aj.prefix_attention(s, v, m, method=kernel))(
        scores, values, mask
    )
    out = np.asarray(out)
    attended = mask[:, bad]
    want = brute_force(
        np.where(mask, scores, 0)[:, :bad],
        np.where(mask[..., None], values, 0)[:, :bad],
        mask[:, :bad],
    )
    np.testing.assert_allclose(out[:, :bad], want, atol=2e-6, rtol=2e-5)
    if case in ("random", "huge_far_apart"):
        want = brute_force(np.where(mask, scores, 0), np.where(mask[..., None], values, 0), mask)
        np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-5)
        np.testing.assert_allclose(aj.readout(final), want[:, -1], atol=2e-6, rtol=2e-5)
    elif case == "nan_score":  # NaN from the bad token on, in rows that attend it
        assert np.all(np.isnan(out[attended, bad:]))
    else:  # only the poisoned channel
        assert np.all(np.isnan(out[attended, bad:, 1]))
        assert np.all(np.isfinite(out[attended, bad:][..., [0, 2]]))
    assert np.all(out[3] == 0)  # the all-masked row


@pytest.mark.parametrize("kernel", ["blocked", "native"])
def test_blocked_long_sequence_derivatives_and_initial_state(kernel):
    rng = np.random.default_rng(32)
    init = aj.init_state((2,), 3)
    init = init._replace(m=jnp.array([1.0, -jnp.inf]), u=jnp.array([2.0, 0.0]))
    init = init._replace(w=jnp.asarray(rng.normal(size=(2, 3)), jnp.float32))
    mask = jnp.asarray(rng.random((2, LONG)) > 0.3)

    def f(method):
        def run(s, v):
            out, final = aj.prefix_attention(s, v, mask, initial_state=init, method=method)
            return jnp.sum(jnp.sin(out)) + jnp.sum(final.w)

        return jax.jit(run)

    args = (
        jnp.asarray(rng.normal(size=(2, LONG)), jnp.float32) * 3,
        jnp.asarray(rng.normal(size=(2, LONG, 3)), jnp.float32),
    )
    np.testing.assert_allclose(f(kernel)(*args), f("sequential")(*args), rtol=1e-5)
    got = jax.grad(f(kernel), argnums=(0, 1))(*args)
    want = jax.grad(f("sequential"), argnums=(0, 1))(*args)
    for g, w in zip(got, want, strict=True):
        # float32 sums over 2,000 tokens: errors relative to the gradient's scale
        scale = float(np.abs(w).max())
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6 * scale)
    tangents = tuple(jnp.ones_like(a) for a in args)
    got = jax.jvp(f(kernel), args, tangents)[1]
    np.testing.assert_allclose(got, jax.jvp(f("sequential"), args, tangents)[1], rtol=2e-4)


@pytest.mark.parametrize("kernel", ["blocked", "native"])
def test_blocked_long_sequence_bfloat16_inputs(kernel):
    rng = np.random.default_rng(33)
    scores = jnp.asarray(rng.normal(size=(2, LONG)), jnp.bfloat16)
    values = jnp.asarray(rng.normal(size=(2, LONG, 64)), jnp.bfloat16)
    out, final = aj.prefix_attention(scores, values, method=kernel)
    assert out.dtype == jnp.bfloat16 and final.w.dtype == jnp.float32
    want = brute_force(np.asarray(scores, np.float32), np.asarray(values, np.float32), True)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=1e-2, rtol=1e-2)
