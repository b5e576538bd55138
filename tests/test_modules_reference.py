"""The attention layers against float64 NumPy written from the paper's equations.

Aaren (paper Sec. 3.3, SPEC 1.4): q = W_q q0 + b_q, K = X W_k + b_k, V = X W_v + b_v, per head
o_t = softmax over i <= t (masked) of <q_h, k_i,h> / sqrt(D), applied to v_i,h; y = O W_o + b_o.
The baseline: the same with q_t = x_t W_q + b_q and causal masked softmax over keys.
Only the public API is imported.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import aaren_jax as aj


def _linear(layer, x):
    return x @ np.asarray(layer.kernel[...], np.float64) + np.asarray(layer.bias[...], np.float64)


def _softmax_rows(logits, allowed):
    logits = np.where(allowed, logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    top = np.where(np.isneginf(top), 0.0, top)
    e = np.where(allowed, np.exp(logits - top), 0.0)
    den = e.sum(-1, keepdims=True)
    return np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)


def _heads(x, num_heads):
    batch, length, width = x.shape
    return x.reshape(batch, length, num_heads, width // num_heads).transpose(0, 2, 1, 3)


def _reference(layer, x, mask, learned_query, causal=True):
    # A masked token's content is ignored (garbage there never leaks): the layer sees 0.
    x = np.where(mask[..., None], np.asarray(x, np.float64), 0.0)
    batch, length, width = x.shape
    num_heads = layer.num_heads
    head_dim = width // num_heads
    k = _heads(_linear(layer.k_proj, x), num_heads)  # [B, H, T, D]
    v = _heads(_linear(layer.v_proj, x), num_heads)
    if learned_query:
        q = _linear(layer.q_proj, np.asarray(layer.q0[...], np.float64)[None])  # [1, d]
        q = np.broadcast_to(q.reshape(1, num_heads, 1, head_dim), (batch, num_heads, 1, head_dim))
        logits = np.broadcast_to(q @ k.transpose(0, 1, 3, 2), (batch, num_heads, length, length))
    else:
        q = _heads(_linear(layer.q_proj, x), num_heads)
        logits = q @ k.transpose(0, 1, 3, 2)
    logits = logits / np.sqrt(head_dim)
    order = np.tril(np.ones((length, length), bool)) if causal else np.ones((length, length), bool)
    allowed = order[None, None] & mask[:, None, None, :]
    out = _softmax_rows(logits, allowed) @ v  # [B, H, T, D]
    out = out.transpose(0, 2, 1, 3).reshape(batch, length, width)
    return _linear(layer.o_proj, out)


@pytest.mark.parametrize("learned_query", [True, False])
def test_attention_layers_match_float64_equations(learned_query):
    cls = aj.AarenAttention if learned_query else aj.CausalSelfAttention
    layer = cls(16, 4, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 9, 16)).astype(np.float32)
    mask = np.ones((3, 9), bool)
    mask[1, :4] = False  # left padding
    mask[2] = rng.random(9) > 0.3
    got = jax.jit(lambda x, m: layer(x, mask=m))(x, mask)
    expected = _reference(layer, x, mask, learned_query)
    valid = mask.cumsum(-1) > 0  # positions after the first valid token
    np.testing.assert_allclose(np.asarray(got)[valid], expected[valid], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("learned_query", [True, False])
def test_bidirectional_layers_match_float64_full_softmax(learned_query):
    """causal=False: every position attends over every valid token of the sequence; NaN at
    masked tokens changes nothing; all-masked rows give the output bias."""
    cls = aj.AarenAttention if learned_query else aj.CausalSelfAttention
    layer = cls(16, 4, causal=False, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 9, 16)).astype(np.float32)
    mask = np.ones((4, 9), bool)
    mask[1, :4] = False  # left padding
    mask[2] = rng.random(9) > 0.3
    mask[3] = False  # nothing to attend
    garbage = np.where(mask[..., None], x, np.nan).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, m: layer(x, mask=m))(garbage, mask))
    expected = _reference(layer, x, mask, learned_query, causal=False)
    np.testing.assert_allclose(got[mask], expected[mask], atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(got[3], np.broadcast_to(layer.o_proj.bias[...], (9, 16)))
    if learned_query:  # one query: the same attention output at every position of a row
        np.testing.assert_allclose(got[0], np.broadcast_to(got[0, :1], (9, 16)), rtol=1e-6)
    causal = cls(16, 4, rngs=nnx.Rngs(3))
    assert not np.allclose(np.asarray(causal(x, mask=mask))[0, 0], got[0, 0])


@pytest.mark.parametrize("model", [aj.Aaren, aj.Transformer])
def test_bidirectional_stack_is_permutation_equivariant_and_cannot_stream(model):
    """Without positions, a bidirectional stack's output follows a permutation of its
    tokens (a causal one's does not); it has no carry, and says so."""
    net = model(2, 8, 2, 16, causal=False, rngs=nnx.Rngs(0))
    x = np.random.default_rng(1).normal(size=(2, 6, 8)).astype(np.float32)
    perm = np.array([3, 0, 5, 1, 4, 2])
    y = np.asarray(net(x))
    np.testing.assert_allclose(np.asarray(net(x[:, perm])), y[:, perm], atol=2e-5, rtol=1e-5)
    grads = jax.jit(jax.grad(lambda x: net(x).sum()))(x)
    assert np.all(np.isfinite(grads))
    with pytest.raises(ValueError, match="causal=False"):
        net(x, return_carry=True)
    with pytest.raises(ValueError, match="causal=False"):
        net.init_carry(2, max_len=8)
    with pytest.raises(ValueError, match="causal=False"):
        net.step(None, x[:, 0])
    with pytest.raises(ValueError, match="rsa needs causal=True"):
        model(1, 8, 2, 16, causal=False, rsa=aj.REMConfig((1, 0, 0, 0, 0, 0)), rngs=nnx.Rngs(0))


def _rem_reference(rsa, mask):
    """Masked REMs of counts (3, 1, 1, 0, 0, 0) from the closed forms. [B, H, T, T]

    Lags count present tokens only: a padding token is absent from the recurrence (SPEC
    1.6), and its own row and column are 0.
    """
    rank = np.cumsum(mask, axis=-1) - 1
    lag = rank[:, :, None] - rank[:, None, :]
    lag = np.where(mask[:, :, None] & mask[:, None, :], lag, 0)
    j = np.where(lag > 0, lag, 0).astype(np.float64)
    lam = np.tanh(np.asarray(rsa.eta[...], np.float64))
    gamma = 1 / (1 + np.exp(-np.asarray(rsa.nu[...], np.float64)))
    theta = np.asarray(rsa.theta[...], np.float64)
    mats = [lam[h] ** j for h in range(3)]
    mats.append(gamma[0] ** j * np.cos(j * theta[0]))
    mats.append(gamma[1] ** j * np.sin(j * theta[1]))
    return np.stack(mats, axis=1) * (lag > 0)[:, None]


def test_rsa_transformer_matches_float64_equations():
    """RSA eq. (4) per head: [(1 - sigmoid(mu)) softmax(QK^T / sqrt(D) + M) + sigmoid(mu) P] V,
    with P the masked REM over the present tokens (a padding token is absent from the lags)."""
    layer = aj.CausalSelfAttention(20, 5, rsa=aj.REMConfig((3, 1, 1, 0, 0, 0)), rngs=nnx.Rngs(1))
    layer.rsa.mu[...] = 0.3  # a gate away from its initial value
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 8, 20)).astype(np.float32)
    mask = np.ones((3, 8), bool)
    mask[1, :3] = False  # left padding
    mask[2] = rng.random(8) > 0.3
    got = np.asarray(jax.jit(lambda x, m: layer(x, mask=m))(x, mask))

    x64 = np.where(mask[..., None], np.asarray(x, np.float64), 0.0)
    q, k, v = (_heads(_linear(p, x64), 5) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    allowed = np.tril(np.ones((8, 8), bool))[None, None] & mask[:, None, None, :]
    probs = _softmax_rows(q @ k.transpose(0, 1, 3, 2) / np.sqrt(4), allowed)
    gate = 1 / (1 + np.exp(-0.3))
    rem = _rem_reference(layer.rsa, mask)
    out = ((1 - gate) * probs + gate * rem) @ v
    expected = _linear(layer.o_proj, out.transpose(0, 2, 1, 3).reshape(3, 8, 20))
    valid = mask.cumsum(-1) > 0
    np.testing.assert_allclose(got[valid], expected[valid], atol=2e-5, rtol=1e-4)
    # Rows before the first valid token attend nothing: exactly the output bias.
    bias = np.asarray(layer.o_proj.bias[...])
    np.testing.assert_array_equal(got[1, :3], np.broadcast_to(bias, (3, 20)))

    # Valid outputs get exactly zero gradient from padded tokens (softmax and REM paths).
    grad = jax.jit(jax.grad(lambda x: (layer(x, mask=mask) * mask[..., None]).sum()))(x)
    assert np.all(np.asarray(grad)[~mask] == 0) and np.all(np.isfinite(grad))
