"""RSA in the models (Huang et al., ICLR 2023; SPEC 1.6): RSA-Transformer and RSA-Aaren.

Equivalences: the parallel pass against a loop of ``step`` (output by output, final carry),
prefill then stream against one pass, left padding against the tokens alone, gate 0 against
the plain model with the same weights. Gradients of ``mu``, ``eta``, ``nu``, ``theta`` are
checked numerically in float64. The parameter overhead is asserted exactly. Tiny shapes.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

import aaren_jax as aj
from tests.helpers import count_params, forward

# Every REM type: regular, cos, sin, and dilated versions (dilations 2 and 3).
CFG = aj.REMConfig((1, 1, 1, 1, 1, 1), dilations=(2, 3, 2))
D_MODEL, HEADS, D_FF = 12, 6, 16
B, T = 2, 7
KINDS = ("aaren", "transformer")
NAMES = ("mu", "eta", "nu", "theta")
LEFT_PAD = np.array([[False, False, True, True, True, True, True], [True] * T])


def build(kind: str, rsa=CFG, num_layers: int = 2, seed: int = 0, **kwargs):
    cls = aj.Aaren if kind == "aaren" else aj.Transformer
    return cls(num_layers, D_MODEL, HEADS, D_FF, rsa=rsa, rngs=nnx.Rngs(seed), **kwargs)


@functools.cache
def get_model(kind: str):
    """One RSA model per kind, shared (never mutated); its gate starts at mu = 1."""
    model = build(kind)
    # Move the REM parameters off their symmetric initialisation so that every head
    # differs, and the gate to an interior value.
    for i, block in enumerate(model.blocks):
        rsa = block.attention.rsa
        rsa.mu[...] = jnp.asarray(0.3 - 0.5 * i)
        rsa.eta[...] = rsa.eta[...] * 0.7
        rsa.theta[...] = rsa.theta[...] + jnp.arange(rsa.theta.shape[0]) * 0.2
    return model


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, carry, x_t, mask_t):
    return nnx.merge(graphdef, state).step(carry, x_t, mask_t)


def step_loop(model, carry, x, mask=None):
    """A Python loop of ``model.step`` (each step jitted), outputs stacked on time."""
    graphdef, state = nnx.split(model)
    ys = []
    for t in range(x.shape[1]):
        carry, y_t = _step(graphdef, state, carry, x[:, t], None if mask is None else mask[:, t])
        ys.append(y_t)
    return jnp.stack(ys, axis=1), carry


def inputs(seed: int, shape=(B, T, D_MODEL), dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def assert_close(a, b, tol=2e-5):
    chex.assert_trees_all_close(a, b, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_parallel_equals_step_loop(kind, masked):
    model = get_model(kind)
    x = inputs(0)
    mask = jnp.asarray(LEFT_PAD) if masked else None
    y, carry = forward(model, x, mask, max_len=T)  # Transformer: a cache of exactly T slots
    ys, carry_s = step_loop(model, model.init_carry(B, max_len=T), x, mask)
    assert_close(ys, y)
    assert type(carry_s) is type(carry)
    assert_close(carry_s, carry)
    if kind == "aaren":
        assert isinstance(carry.layers[0], aj.RSAState)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_stream_equals_full_pass(kind):
    model = get_model(kind)
    x = inputs(1)
    y_full, _ = forward(model, x, carry=model.init_carry(B, max_len=T))
    split = 4
    y_pre, carry = forward(model, x[:, :split], carry=model.init_carry(B, max_len=T))
    ys, _ = step_loop(model, carry, x[:, split:])
    assert_close(jnp.concatenate([y_pre, ys], axis=1), y_full)
    # A second prefill block continues the first one too.
    y_pre2, _ = forward(model, x[:, split:], carry=carry)
    assert_close(y_pre2, y_full[:, split:])


@pytest.mark.parametrize("kind", KINDS)
def test_left_padding_equals_tokens_alone(kind):
    # Lags between real tokens are unchanged by left padding (Transformer: padded REM
    # columns are zeroed; Aaren: the recurrence skips padding), so real outputs match.
    model = get_model(kind)
    x = inputs(2)
    y_pad, _ = forward(model, x, jnp.asarray(LEFT_PAD))
    y_alone, _ = forward(model, x[:1, 2:])
    assert_close(y_pad[:1, 2:], y_alone)


@pytest.mark.parametrize("kind", KINDS)
def test_gate_zero_equals_plain_model(kind):
    plain = build(kind, rsa=None, seed=3)
    rsa = build(kind, seed=3)
    nnx.update(rsa, nnx.state(plain))  # same weights everywhere the plain model has them
    for block in rsa.blocks:
        block.attention.rsa.mu[...] = jnp.asarray(-jnp.inf)
    x = inputs(3)
    mask = jnp.asarray(LEFT_PAD)
    y_plain, _ = forward(plain, x, mask)
    y_rsa, _ = forward(rsa, x, mask)
    assert_close(y_rsa, y_plain)
    ys, _ = step_loop(rsa, rsa.init_carry(B, max_len=T), x, mask)
    assert_close(ys, y_plain)


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_overhead_is_exact(kind):
    # Per layer: the gate mu, one eta per regular head (k1 + k4), nu and theta per
    # cyclical head (2 (k2 + k3 + k5 + k6)).
    for cfg, per_layer in (
        (CFG, 1 + 2 + 2 * 4),
        (aj.REMConfig((3, 1, 1, 0, 0, 0)), 1 + 3 + 2 * 2),
        (aj.REMConfig((5, 0, 0, 0, 0, 0)), 1 + 5),
    ):
        heads = cfg.num_heads
        cls = aj.Aaren if kind == "aaren" else aj.Transformer
        plain = nnx.eval_shape(lambda cls=cls, h=heads: cls(3, 10 * h, h, 8, rngs=nnx.Rngs(0)))
        rsa = nnx.eval_shape(
            lambda cls=cls, h=heads, c=cfg: cls(3, 10 * h, h, 8, rsa=c, rngs=nnx.Rngs(0))
        )
        assert count_params(rsa) - count_params(plain) == 3 * per_layer


@pytest.mark.parametrize("kind", KINDS)
def test_initialisation_follows_the_paper(kind):
    model = build(kind, rsa=aj.REMConfig((2, 1, 1, 2, 0, 0), dilations=2, mu_init=-1.0), seed=0)
    model_h = model.blocks[0].attention.rsa
    assert float(model_h.mu[...]) == -1.0
    eta = np.asarray(model_h.eta[...])
    assert np.all((np.abs(eta) >= 1) & (np.abs(eta) <= 2)) and (eta > 0).any() and (eta < 0).any()
    nu = np.asarray(model_h.nu[...])
    assert np.all((nu >= 1) & (nu <= 2))
    np.testing.assert_allclose(model_h.theta[...], np.pi / 4)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_match_finite_differences_float64(kind):
    with jax.enable_x64(True):
        model = build(kind, num_layers=1, param_dtype=jnp.float64, seed=4)
        graphdef, rsa_state, rest = nnx.split(model, nnx.PathContains("rsa"), ...)
        with_path, treedef = jax.tree_util.tree_flatten_with_path(rsa_state)
        keys = [[str(getattr(k, "key", getattr(k, "name", k))) for k in p] for p, _ in with_path]
        names = [next(n for n in NAMES if n in path) for path in keys]
        x = inputs(4, dtype=jnp.float64)
        mask = jnp.asarray(LEFT_PAD)
        w = inputs(5, dtype=jnp.float64)
        rsa = model.blocks[0].attention.rsa
        start = (
            jnp.asarray(0.4, jnp.float64),
            rsa.eta[...] * 0.8,
            rsa.nu[...] - 0.3,
            rsa.theta[...] + 0.1 * jnp.arange(rsa.theta.shape[0]),
        )

        def loss(mu, eta, nu, theta):
            values = dict(zip(NAMES, (mu, eta, nu, theta), strict=True))
            new = jax.tree.unflatten(treedef, [values[n] for n in names])
            m = nnx.merge(graphdef, new, rest)
            y = m(x, mask)
            _, y_t = m.step(m.init_carry(B, max_len=T), x[:, 0], mask[:, 0])
            return jnp.sum(y * w) + jnp.sum(y_t * w[:, 0])

        loss = jax.jit(loss)
        grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*start)
        chex.assert_tree_all_finite(grads)
        assert all(float(jnp.abs(g).max()) > 0 for g in grads)
        check_grads(loss, start, order=1, modes=("rev",), atol=1e-5, rtol=1e-5)


def test_rsa_aaren_carry_is_constant_size():
    model = get_model("aaren")
    carry = model.init_carry(B)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(carry))
    _, carry = step_loop(model, carry, inputs(7, (B, 3 * T, D_MODEL)))
    assert sum(x.nbytes for x in jax.tree.leaves(carry)) == nbytes
    # The REM ring holds max dilation (3) slots per head: O(p), not O(t).
    assert carry.layers[0].rem.ring.shape == (B, HEADS, 3, 2, D_MODEL // HEADS)


@pytest.mark.parametrize("kind", KINDS)
def test_deploy_helpers_accept_rsa_carries(kind):
    model = get_model(kind)
    x = inputs(6)
    y, _ = forward(model, x, carry=model.init_carry(B, max_len=T))
    step_fn, state = aj.make_step_fn(model)
    carry = model.init_carry(B, max_len=T)
    for t in range(T):
        carry, y_t = step_fn(state, carry, x[:, t])
        assert_close(y_t, y[:, t])
    _, ys = aj.stream(model, model.init_carry(B, max_len=T), x)
    assert_close(ys, y)
    loaded = aj.load_step(aj.export_step(model, B, max_len=T))
    flat = loaded.init_carry()
    flat, y_0 = loaded.step(flat, x[:, 0])
    assert_close(y_0, y[:, 0])


def test_rsa_config_must_match_heads():
    with pytest.raises(ValueError, match="num_heads=4"):
        aj.Transformer(1, 8, 4, 8, rsa=aj.REMConfig((3, 0, 0, 0, 0, 0)), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="REMConfig"):
        aj.Aaren(1, 8, 2, 8, rsa=(2, 0, 0, 0, 0, 0), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kind", KINDS)
def test_absent_rem_families_have_no_parameters_and_checkpoint_with_orbax(kind, tmp_path):
    import orbax.checkpoint as ocp

    # regular heads only: no cyclical head, so no nu or theta (Orbax refuses zero-size arrays)
    model = build(kind, rsa=aj.REMConfig((3, 0, 0, 3, 0, 0), dilations=2), seed=1)
    rsa = model.blocks[0].attention.rsa
    assert rsa.nu is None and rsa.theta is None and rsa.eta[...].shape == (6,)
    assert rsa.params()["nu"].shape == rsa.params()["theta"].shape == (0,)
    state = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", state)
    other = build(kind, rsa=aj.REMConfig((3, 0, 0, 3, 0, 0), dilations=2), seed=2)
    nnx.update(other, restored)
    x = jax.random.normal(jax.random.key(0), (B, T, D_MODEL))
    np.testing.assert_array_equal(other(x), model(x))
