"""REMs (RSA, Huang et al. 2023): matrix form against closed formulas, recurrent form
against the matrix form, truncation at K, gradients, bad inputs."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from aaren_jax import rem

# All six types, dilations 2, 3, 2 (T = 13 is a multiple of none).
MIXED = rem.REMConfig((2, 1, 1, 1, 1, 1), dilations=(2, 3, 2))
MIXED_PARAMS = {
    "eta": np.array([-1.3, 0.8, 2.0]),
    "nu": np.array([0.5, 1.5, -0.4, 2.5]),
    "theta": np.array([0.3, np.pi / 4, 2.0, -1.1]),
}


def _params(p, dtype=np.float32):
    return {k: jnp.asarray(v, dtype) for k, v in p.items()}


def _ref_f(kind, params, n):
    """Closed formulas in float64: lambda^n, gamma^n cos(n theta), gamma^n sin(n theta)."""
    n = np.asarray(n, np.float64)
    if kind == "regular":
        return np.tanh(np.float64(params["eta"])) ** n
    gamma = 1.0 / (1.0 + np.exp(-np.float64(params["nu"])))
    trig = np.cos if kind == "cyclic_cos" else np.sin
    return gamma**n * trig(n * np.float64(params["theta"]))


def _ref_matrix(kind, params, q_len, k_len, q_offset=0, dilation=1, max_power=200, causal=True):
    lag = (q_offset + np.arange(q_len))[:, None] - np.arange(k_len)[None, :]
    if not causal:
        lag = np.abs(lag)
    power = lag // dilation
    valid = (lag >= 1) & (lag % dilation == 0) & (power <= max_power)
    return np.where(valid, _ref_f(kind, params, np.maximum(power, 1)), 0.0)


def _head_params(config, params, h):
    kind, i = config.head_kinds[h], config.head_param_index[h]
    if kind == "regular":
        return kind, {"eta": params["eta"][i]}
    return kind, {"nu": params["nu"][i], "theta": params["theta"][i]}


def _ref_matrices(config, params, q_len, k_len, q_offset=0, causal=True):
    return np.stack(
        [
            _ref_matrix(
                *_head_params(config, params, h),
                q_len,
                k_len,
                q_offset,
                config.head_dilations[h],
                config.max_power,
                causal,
            )
            for h in range(config.num_heads)
        ]
    )


def _ref_apply(config, params, values, mask):
    """The REM over the compacted sequence of present tokens, in float64. [B, H, T, D]"""
    values = np.asarray(values, np.float64)
    out = np.zeros_like(values)
    for b in range(values.shape[0]):
        idx = np.nonzero(mask[b])[0]
        p = _ref_matrices(config, params, len(idx), len(idx))
        out[b][:, idx] = np.einsum("hij,hjd->hid", p, values[b][:, idx])
    return out


# ---------------------------------------------------------------------------- matrix form

_matrices = jax.jit(
    rem.rem_matrices, static_argnums=(0, 2, 3), static_argnames=("q_offset", "causal")
)


KIND_PARAMS = {
    "regular": {"eta": np.array([-2.0, -0.3, 0.0, 0.7, 2.5])},
    "cyclic_cos": {"nu": np.array([-1.0, 0.5, 2.0]), "theta": np.array([0.3, np.pi / 4, 2.0])},
}
KIND_PARAMS["cyclic_sin"] = KIND_PARAMS["cyclic_cos"]


@pytest.mark.parametrize("kind", rem.KINDS)
@pytest.mark.parametrize("dilation", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("max_power", [3, 200])
def test_rem_matrix_matches_closed_forms(kind, dilation, causal, max_power):
    params = KIND_PARAMS[kind]
    got = rem.rem_matrix(
        kind, _params(params), 12, 12, dilation=dilation, max_power=max_power, causal=causal
    )
    chex.assert_shape(got, (len(next(iter(params.values()))), 12, 12))
    for i in range(got.shape[0]):
        single = {k: v[i] for k, v in params.items()}
        want = _ref_matrix(kind, single, 12, 12, 0, dilation, max_power, causal)
        np.testing.assert_allclose(got[i], want, rtol=2e-5, atol=1e-7)
    if causal:
        assert (np.triu(np.asarray(got)) == 0).all()  # strictly lower triangular
    else:
        np.testing.assert_array_equal(got, np.swapaxes(got, -1, -2))  # P + P^T


def test_rem_matrix_scalar_params_and_example():
    p = rem.rem_matrix("regular", {"eta": jnp.arctanh(0.5)}, 3, 3)
    np.testing.assert_allclose(p, [[0, 0, 0], [0.5, 0, 0], [0.25, 0.5, 0]], rtol=1e-6)
    p = rem.rem_matrix("cyclic_sin", {"nu": jnp.array([1.0, 2.0]), "theta": 0.5}, 4, 4)
    chex.assert_shape(p, (2, 4, 4))


@pytest.mark.parametrize("causal", [True, False])
def test_non_square_is_a_block_of_the_square(causal):
    params = _params(MIXED_PARAMS)
    square = _matrices(MIXED, params, 16, 16, causal=causal)
    want = _ref_matrices(MIXED, MIXED_PARAMS, 16, 16, 0, causal)
    np.testing.assert_allclose(square, want, rtol=2e-5, atol=1e-7)
    for offset, q_len, k_len in [(0, 16, 9), (5, 3, 16), (15, 1, 16)]:
        block = _matrices(MIXED, params, q_len, k_len, q_offset=offset, causal=causal)
        np.testing.assert_array_equal(block, square[:, offset : offset + q_len, :k_len])
    # Queries before the keys (a negative offset) follow the same lag rule.
    block = _matrices(MIXED, params, 3, 8, q_offset=-2, causal=causal)
    want = _ref_matrices(MIXED, MIXED_PARAMS, 3, 8, -2, causal)
    np.testing.assert_allclose(block, want, rtol=2e-5, atol=1e-7)


def test_kv_cache_step_with_traced_offset():
    params = _params(MIXED_PARAMS)
    square = rem.rem_matrices(MIXED, params, 16, 16)
    step = jax.jit(lambda t: rem.rem_matrices(MIXED, params, 1, 16, q_offset=t))
    for t in (0, 4, 15):
        np.testing.assert_allclose(step(jnp.int32(t)), square[:, t : t + 1], rtol=1e-6, atol=1e-7)


def test_rem_matrices_heads_follow_the_config():
    params = _params(MIXED_PARAMS)
    mats = _matrices(MIXED, params, 16, 16)
    chex.assert_shape(mats, (7, 16, 16))
    for h in (1, 5):  # a regular head, a dilated cos head
        kind, p = _head_params(MIXED, params, h)
        one = rem.rem_matrix(kind, p, 16, 16, dilation=MIXED.head_dilations[h])
        np.testing.assert_allclose(mats[h], one, rtol=1e-6, atol=1e-8)
    assert MIXED.head_kinds[4] == "regular" and MIXED.head_dilations[4:] == (2, 3, 2)


# ------------------------------------------------------------------------- recurrent form


def _masks(kind, batch, length, rng):
    if kind == "none":
        return None
    if kind == "holes":
        m = rng.random((batch, length)) < 0.6
        m[0] = True
        m[-1, :] = False  # an all-absent row
        return m
    starts = np.array([0, 4, length - 1])[:batch]  # left padding
    return np.arange(length)[None, :] >= starts[:, None]


@functools.partial(jax.jit, static_argnames=("method",))
def _apply(params, values, mask, method):
    return rem.rem_apply(MIXED, params, values, mask, method=method)


@pytest.mark.parametrize("mask_kind", ["none", "holes", "left"])
def test_recurrent_form_equals_matrix_form(mask_kind):
    rng = np.random.default_rng(0)
    values = rng.normal(size=(3, MIXED.num_heads, 13, 4)).astype(np.float32)
    mask = _masks(mask_kind, 3, 13, rng)
    params = _params(MIXED_PARAMS)
    want = _ref_apply(MIXED, MIXED_PARAMS, values, np.ones((3, 13), bool) if mask is None else mask)
    assoc, s_assoc = _apply(params, values, mask, "associative")
    seq, s_seq = _apply(params, values, mask, "sequential")
    np.testing.assert_allclose(assoc, want, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(seq, want, rtol=1e-5, atol=2e-6)
    chex.assert_trees_all_close(s_assoc, s_seq, rtol=1e-5, atol=2e-6)
    if mask_kind == "left":  # contiguous padding: the matrix form with padded keys zeroed
        p = rem.rem_matrices(MIXED, params, 13, 13)
        masked = np.einsum("hij,bhjd->bhid", p, values * mask[:, None, :, None])
        np.testing.assert_allclose(assoc, masked * mask[:, None, :, None], rtol=1e-5, atol=2e-6)


def test_step_loop_and_prefill_then_continue():
    rng = np.random.default_rng(1)
    values = rng.normal(size=(3, MIXED.num_heads, 13, 4)).astype(np.float32)
    mask = _masks("holes", 3, 13, rng)
    params = _params(MIXED_PARAMS)
    full, final = _apply(params, values, mask, "associative")
    step = jax.jit(functools.partial(rem.rem_step, MIXED))
    state = rem.init_rem_state(MIXED, (3,), 4)
    for t in range(13):
        state, out = step(params, state, values[:, :, t], mask[:, t])
        np.testing.assert_allclose(out, full[:, :, t], rtol=1e-5, atol=2e-6)
        if t == 4:
            mid = state
    chex.assert_trees_all_close(state, final, rtol=1e-5, atol=2e-6)
    # Prefill 5 tokens (here by steps), then the other 8 in parallel from the carried state
    # (the phases of the dilated rings carry over).
    second, last = jax.jit(lambda p, v, m, s: rem.rem_apply(MIXED, p, v, m, initial_state=s))(
        params, values[:, :, 5:], mask[:, 5:], mid
    )
    np.testing.assert_allclose(second, full[:, :, 5:], rtol=1e-5, atol=2e-6)
    chex.assert_trees_all_close(last, final, rtol=1e-5, atol=2e-6)
    np.testing.assert_array_equal(final.phase, mask.sum(-1) % MIXED.phase_modulus)


def test_bidirectional_equals_unmasked_rem():
    rng = np.random.default_rng(2)
    cfg = rem.REMConfig((1, 0, 1, 0, 0, 0))
    params = rem.init_rem_params(cfg)
    values = rng.normal(size=(2, 2, 9, 3)).astype(np.float32)
    got = jax.jit(functools.partial(rem.rem_apply_bidirectional, cfg))(params, values)
    p = rem.rem_matrices(cfg, params, 9, 9, causal=False)
    np.testing.assert_allclose(got, np.einsum("hij,bhjd->bhid", p, values), rtol=1e-5, atol=2e-6)


def test_truncation_difference_beyond_k():
    """The matrix form drops powers above K; the recurrence keeps them: the difference is
    exactly the sum of the truncated terms."""
    k = 6
    cfg = rem.REMConfig((0, 0, 0, 1, 1, 0), dilations=2, max_power=k)  # one scan group
    raw = {"eta": np.array([3.0]), "nu": np.array([5.0]), "theta": np.array([0.2])}
    params = _params(raw)  # lambda = 0.995, gamma = 0.993: slow decay
    t_len = 40  # > p K
    values = np.random.default_rng(3).normal(size=(1, 2, t_len, 2)).astype(np.float32)
    rec, _ = jax.jit(functools.partial(rem.rem_apply, cfg))(params, values)
    mat = np.einsum("hij,bhjd->bhid", _matrices(cfg, params, t_len, t_len), values)
    truncated = np.zeros_like(values, np.float64)
    for h in range(2):
        kind, p = _head_params(cfg, raw, h)
        d = cfg.head_dilations[h]
        for t in range(t_len):
            for m in range(k + 1, t // d + 1):
                truncated[0, h, t] += _ref_f(kind, p, m) * values[0, h, t - m * d]
    assert np.abs(truncated).max() > 0.5  # the difference is real
    np.testing.assert_allclose(rec - mat, truncated, rtol=1e-4, atol=1e-5)
    # Where the lag never exceeds p K the two forms agree.
    for h, d in enumerate(cfg.head_dilations):
        np.testing.assert_allclose(rec[:, h, : d * k + 1], mat[:, h, : d * k + 1], atol=1e-5)


def test_truncation_at_default_k():
    cfg = rem.REMConfig((1, 0, 0, 0, 0, 0))  # K = 200
    params = _params({"eta": [3.0], "nu": [], "theta": []})
    values = np.ones((1, 1, 230, 1), np.float32)
    rec, _ = jax.jit(functools.partial(rem.rem_apply, cfg))(params, values)
    mat = _matrices(cfg, params, 230, 230)[0] @ values[0, 0]
    lam = np.tanh(3.0)
    t = np.arange(230)
    tail = np.where(t > 200, (lam**201 - lam ** (t + 1)) / (1 - lam), 0.0)  # sum_{201..t}
    np.testing.assert_allclose(rec[0, 0, :, 0] - mat[:, 0], tail, rtol=2e-3, atol=2e-4)


def test_bf16_values_accumulate_in_float32():
    cfg = rem.REMConfig((1, 1, 0, 0, 0, 0))
    params = rem.init_rem_params(cfg)
    values = np.random.default_rng(4).normal(size=(2, 2, 7, 3)).astype(np.float32)
    values16 = jnp.asarray(values, jnp.bfloat16)
    out16, state = jax.jit(functools.partial(rem.rem_apply, cfg))(params, values16)
    assert out16.dtype == jnp.bfloat16 and state.ring.dtype == jnp.float32
    want = _ref_apply(cfg, params, np.asarray(values16, np.float32), np.ones((2, 7), bool))
    np.testing.assert_allclose(out16.astype(np.float32), want, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------ gradients


def test_gradients_check_numerically():
    with jax.enable_x64(True):
        weights = np.random.default_rng(5).normal(size=(7, 9, 9))

        @jax.jit
        def matrix_loss(eta, nu, theta):
            p = rem.rem_matrices(MIXED, {"eta": eta, "nu": nu, "theta": theta}, 9, 9)
            return jnp.sum(p * weights)

        args = tuple(jnp.asarray(MIXED_PARAMS[k], jnp.float64) for k in ("eta", "nu", "theta"))
        check_grads(matrix_loss, args, order=1, modes=("rev",), eps=1e-5)

        cfg = rem.REMConfig((1, 0, 1, 0, 0, 1), dilations=2)
        values = jnp.asarray(np.random.default_rng(6).normal(size=(1, 3, 9, 2)))

        def recurrent_loss(eta, nu, theta):
            out, _ = rem.rem_apply(cfg, {"eta": eta, "nu": nu, "theta": theta}, values)
            return jnp.sum(out * weights[None, :3, :, :2])

        args = (args[0][:1], args[1][:2], args[2][:2])
        check_grads(jax.jit(recurrent_loss), args, order=1, modes=("rev",), eps=1e-5)


def test_gradients_finite_at_lambda_zero_and_extremes():
    @jax.jit
    def entries(eta):
        return rem.rem_matrix("regular", {"eta": eta}, 5, 5)

    jac = jax.jit(jax.jacrev(entries))(jnp.float32(0.0))  # d tanh(eta)^l / d eta at 0: 1 if l = 1
    np.testing.assert_allclose(jac, np.eye(5, k=-1), atol=1e-7)
    for kind in ("cyclic_cos", "cyclic_sin"):
        g = jax.jit(
            jax.grad(
                lambda n, t, kind=kind: jnp.sum(rem.rem_matrix(kind, {"nu": n, "theta": t}, 6, 6)),
                argnums=(0, 1),
            )
        )(jnp.array([-40.0, 0.0, 40.0]), jnp.array([0.7, 0.0, -3.0]))
        chex.assert_tree_all_finite(g)
    g = jax.jit(jax.grad(lambda e: jnp.sum(rem.rem_matrix("regular", {"eta": e}, 6, 6))))(
        jnp.array([-30.0, -1e-8, 1e-8, 30.0])
    )
    chex.assert_tree_all_finite(g)


# ------------------------------------------------------------------- config, init, errors


def test_config_and_paper_initialisation():
    cfg = rem.REMConfig((3, 1, 1, 2, 1, 1), dilations=(24, 48, 24, 48))
    assert cfg.num_heads == 9 and cfg.num_regular == 5 and cfg.num_cyclic == 4
    assert cfg.head_types == (1, 1, 1, 2, 3, 4, 4, 5, 6)
    assert cfg.head_dilations == (1, 1, 1, 1, 1, 24, 48, 24, 48)
    assert cfg.ring_size == 48 and cfg.phase_modulus == 48
    p = rem.init_rem_params(cfg, jax.random.key(0))
    p2 = rem.init_rem_params(cfg)
    chex.assert_trees_all_equal(p, p2)  # deterministic, as in the paper
    eta = np.asarray(p["eta"])
    assert eta.shape == (5,) and ((np.abs(eta) >= 1) & (np.abs(eta) <= 2)).all()
    assert (eta[:3] > 0).any() and (eta[:3] < 0).any()  # both signs among regular heads
    assert ((p["nu"] >= 1) & (p["nu"] <= 2)).all()
    np.testing.assert_allclose(p["theta"], np.pi / 4)
    assert rem.REMConfig((5, 0, 0, 0, 0, 0)).mu_init == 1.0
    hash(cfg)  # a static jit argument


BAD_CONFIGS = [
    (dict(counts=(1, 0, 0)), ValueError, "6 ints"),
    (dict(counts=(0, 0, 0, 0, 0, 0)), ValueError, "positive sum"),
    (dict(counts=(1.0, 0, 0, 0, 0, 0)), TypeError, "int"),
    (dict(counts=(0, 0, 0, 2, 0, 0), dilations=(2,)), ValueError, "dilated heads"),
    (dict(counts=(0, 0, 0, 1, 0, 0), dilations=0), ValueError, ">= 1"),
    (dict(max_power=0), ValueError, "max_power"),
    (dict(mu_init=4.0), ValueError, "mu_init"),
    (dict(eta_range=(0.0, 1.0)), ValueError, "eta_range"),
    (dict(eta_range=(2.0, 1.0)), ValueError, "eta_range"),
    (dict(eta_range=(1.0, float("nan"))), ValueError, "eta_range"),
    (dict(eta_range=(1.0,)), ValueError, "eta_range"),
    (dict(eta_range=(1.0, 2.0, 3.0)), ValueError, "eta_range"),
    (dict(eta_range=None), ValueError, "eta_range"),
    (dict(eta_range="12"), ValueError, "eta_range"),
]


def test_eta_range_sets_the_initial_memories():
    # the paper's (1, 2) by default; a wider range moves every regular head, types 1 and 4,
    # keeping the alternating signs, and leaves the cyclical heads alone
    counts = (3, 1, 0, 2, 0, 0)
    default = rem.init_rem_params(rem.REMConfig(counts, dilations=2))
    np.testing.assert_allclose(default["eta"], [1.0, -1.5, 2.0, 1.5, -1.5])
    cfg = rem.REMConfig(counts, dilations=2, eta_range=[2.5, 3.5])
    assert cfg.eta_range == (2.5, 3.5) and cfg == rem.REMConfig(counts, 2, eta_range=(2.5, 3.5))
    p = rem.init_rem_params(cfg)
    np.testing.assert_allclose(p["eta"], [2.5, -3.0, 3.5, 3.0, -3.0])
    chex.assert_trees_all_equal(p["nu"], default["nu"])
    lam = np.tanh(np.asarray(p["eta"], np.float64))
    assert (np.abs(lam) > 0.98).all()


@pytest.mark.parametrize("kwargs,error,match", BAD_CONFIGS)
def test_bad_configs(kwargs, error, match):
    with pytest.raises(error, match=match):
        rem.REMConfig(**kwargs)


def test_bad_inputs():
    cfg = rem.REMConfig((1, 1, 0, 0, 0, 0))
    params = rem.init_rem_params(cfg)
    with pytest.raises(ValueError, match="kind"):
        rem.rem_matrix("exponential", {"eta": 1.0}, 3, 3)
    with pytest.raises(ValueError, match="lack"):
        rem.rem_matrix("cyclic_cos", {"nu": 1.0}, 3, 3)
    with pytest.raises(ValueError, match="q_len"):
        rem.rem_matrix("regular", {"eta": 1.0}, -1, 3)
    with pytest.raises(ValueError, match="dilation"):
        rem.rem_matrix("regular", {"eta": 1.0}, 3, 3, dilation=0)
    with pytest.raises(TypeError, match="q_offset"):
        rem.rem_matrix("regular", {"eta": 1.0}, 3, 3, q_offset=1.5)
    with pytest.raises(ValueError, match=r"params\['eta'\] has shape"):
        rem.rem_matrices(cfg, {**params, "eta": jnp.zeros(2)}, 3, 3)
    with pytest.raises(ValueError, match="H = 3 heads"):
        rem.rem_apply(cfg, params, jnp.zeros((1, 3, 4, 2)))
    with pytest.raises(ValueError, match=r"\[\.\.\., H, T, D\]"):
        rem.rem_apply(cfg, params, jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="mask must have shape"):
        rem.rem_apply(cfg, params, jnp.zeros((1, 2, 4, 2)), jnp.ones((1, 5), bool))
    with pytest.raises(TypeError, match="boolean"):
        rem.rem_apply(cfg, params, jnp.zeros((1, 2, 4, 2)), jnp.ones((1, 4)))
    with pytest.raises(ValueError, match="method"):
        rem.rem_apply(cfg, params, jnp.zeros((1, 2, 4, 2)), method="chunked")
    with pytest.raises(ValueError, match="state has ring"):
        rem.rem_step(cfg, params, rem.init_rem_state(cfg, (2,), 3), jnp.zeros((1, 2, 3)))
    with pytest.raises(TypeError, match="REMConfig"):
        rem.rem_matrices((1, 0, 0, 0, 0, 0), params, 3, 3)


def test_empty_sequence_returns_the_initial_state():
    cfg = rem.REMConfig((1, 0, 0, 1, 0, 0), dilations=2)
    state = rem.init_rem_state(cfg, (2,), 3)
    out, final = rem.rem_apply(
        cfg, rem.init_rem_params(cfg), jnp.zeros((2, 2, 0, 3)), None, initial_state=state
    )
    chex.assert_shape(out, (2, 2, 0, 3))
    chex.assert_trees_all_equal(final, state)
