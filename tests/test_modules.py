"""Flax NNX modules: Aaren and the Transformer baseline (SPEC 1.4, 1.5, 2.2).

Equivalence is the heart: the parallel pass against a Python loop of ``step`` (output by
output and carry by carry), prefill-then-stream against one pass, left padding against
the same tokens alone, causality by value. Tiny shapes; compiled functions are shared.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aaren_jax as aj
from tests.helpers import count_params, forward

D_MODEL, HEADS, D_FF = 16, 2, 32
B, T = 2, 8
KINDS = ("aaren", "transformer")
TOL = {"float32": 1e-5, "bfloat16": 5e-2}


@functools.cache
def get_model(kind: str, num_layers: int, dtype: str = "float32", norm: str = "pre"):
    """One model per configuration, shared by the tests (they never mutate it)."""
    cls = aj.Aaren if kind == "aaren" else aj.Transformer
    return cls(
        num_layers,
        D_MODEL,
        HEADS,
        D_FF,
        norm=norm,
        dtype=jnp.dtype(dtype),
        rngs=nnx.Rngs(num_layers),
    )


@functools.cache
def get_step_fn(kind: str, num_layers: int, dtype: str = "float32", norm: str = "pre"):
    return aj.make_step_fn(get_model(kind, num_layers, dtype, norm))


def inputs(seed: int, shape=(B, T, D_MODEL), dtype="float32"):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def assert_close(a, b, dtype="float32"):
    tol = TOL[dtype]
    chex.assert_trees_all_close(a, b, atol=tol, rtol=tol)


def assert_carries_close(a, b, dtype="float32"):
    """Carry by carry, field by field; boolean and integer fields exactly."""
    assert type(a) is type(b)
    assert len(a.layers) == len(b.layers)
    for layer_a, layer_b in zip(a.layers, b.layers, strict=True):
        assert type(layer_a) is type(layer_b)
        for name, x, y in zip(layer_a._fields, layer_a, layer_b, strict=True):
            assert x.shape == y.shape and x.dtype == y.dtype, name
            if jnp.issubdtype(x.dtype, jnp.floating):
                tol = TOL[dtype] if x.dtype == jnp.bfloat16 else 1e-5
                np.testing.assert_allclose(
                    np.asarray(x, np.float32), np.asarray(y, np.float32), atol=tol, rtol=tol
                )
            else:
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


# ----------------------------------------------------------------------------------------
# Parameters


def test_param_counts_binding():
    # eval_shape: the binding counts without allocating 3M parameters twice.
    aaren = nnx.eval_shape(lambda: aj.AarenBlock(512, 8, 2048, rngs=nnx.Rngs(0)))
    base = nnx.eval_shape(lambda: aj.TransformerBlock(512, 8, 2048, rngs=nnx.Rngs(0)))
    assert count_params(aaren) == 3_152_896
    assert count_params(base) == 3_152_384


def test_aaren_has_d_more_params_per_layer():
    assert count_params(get_model("aaren", 3)) - count_params(get_model("transformer", 3)) == (
        3 * D_MODEL
    )


# ----------------------------------------------------------------------------------------
# Equivalence


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_parallel_equals_step_loop(kind, num_layers, dtype):
    model = get_model(kind, num_layers, dtype)
    step_fn, state = get_step_fn(kind, num_layers, dtype)
    x = inputs(1, dtype=dtype)
    y, carry = forward(model, x, max_len=T)
    assert y.dtype == jnp.dtype(dtype)
    chex.assert_tree_all_finite(y)

    loop_carry = model.init_carry(B, max_len=T)
    for t in range(T):
        loop_carry, y_t = step_fn(state, loop_carry, x[:, t])
        assert_close(y_t, y[:, t], dtype)
    assert_carries_close(loop_carry, carry, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_stream_equals_full_pass(kind, num_layers, dtype):
    model = get_model(kind, num_layers, dtype)
    x = inputs(2, dtype=dtype)
    y_full, carry_full = forward(model, x, max_len=T)
    # Prefill continuing a carry (a KV cache bigger than the prefill), then stream.
    carry = model.init_carry(B, max_len=T)
    y_a, carry = forward(model, x[:, :4], carry=carry)
    carry, y_b = aj.stream(model, carry, x[:, 4:])
    assert_close(jnp.concatenate([y_a, y_b], axis=1), y_full, dtype)
    assert_carries_close(carry, carry_full, dtype)


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_left_padding_equals_tokens_alone(kind, num_layers):
    model = get_model(kind, num_layers)
    pad = 3
    alone = inputs(3, (1, T - pad, D_MODEL))
    # Huge padding values: any leak into the valid tokens would show.
    padded = jnp.concatenate([jnp.full((1, pad, D_MODEL), 1e3), alone], axis=1)
    x = jnp.concatenate([padded, inputs(4, (1, T, D_MODEL))], axis=0)
    mask = jnp.stack([jnp.arange(T) >= pad, jnp.ones(T, bool)])

    y_alone, _ = forward(model, alone)
    y_other, _ = forward(model, x)  # row 1 has no padding: its output must not change
    y, _ = forward(model, x, mask)
    chex.assert_tree_all_finite(y)
    assert_close(y[0, pad:], y_alone[0])
    assert_close(y[1], y_other[1])

    # The same through the streaming path, with a per-token mask.
    _, ys = aj.stream(model, model.init_carry(B, max_len=T), x, mask)
    assert_close(ys[0, pad:], y_alone[0])
    assert_close(ys[1], y_other[1])


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_causality(kind, num_layers):
    model = get_model(kind, num_layers)
    x = inputs(5)
    cut = 4
    changed = x.at[:, cut + 1 :].set(inputs(6)[:, cut + 1 :])
    y, _ = forward(model, x)
    y_changed, _ = forward(model, changed)
    np.testing.assert_allclose(y_changed[:, : cut + 1], y[:, : cut + 1], atol=1e-6, rtol=1e-6)
    assert float(jnp.min(jnp.max(jnp.abs(y_changed[:, cut + 1 :] - y[:, cut + 1 :]), -1))) > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_post_norm_without_final_norm(kind):
    cls = aj.Aaren if kind == "aaren" else aj.Transformer
    model = cls(2, D_MODEL, HEADS, D_FF, norm="post", final_norm=False, rngs=nnx.Rngs(7))
    assert model.final_norm is None
    x = inputs(7)
    y, carry = forward(model, x, max_len=T)
    carry_s, ys = aj.stream(model, model.init_carry(B, max_len=T), x)
    assert_close(ys, y)
    assert_carries_close(carry_s, carry)


@pytest.mark.parametrize(
    "cls", [aj.AarenAttention, aj.CausalSelfAttention, aj.AarenBlock, aj.TransformerBlock]
)
def test_layers_alone_share_the_interface(cls):
    args = (D_MODEL, HEADS) if "Attention" in cls.__name__ else (D_MODEL, HEADS, D_FF)
    layer = cls(*args, rngs=nnx.Rngs(0))
    x = inputs(8)

    @nnx.jit
    def run(layer, x):  # one compilation: full pass, prefill, then steps
        y = layer(x)
        y_a, carry = layer(x[:, :5], carry=layer.init_carry(B, max_len=T), return_carry=True)
        ys = [y_a]
        for t in range(5, T):
            carry, y_t = layer.step(carry, x[:, t])
            ys.append(y_t[:, None])
        return y, jnp.concatenate(ys, axis=1)

    y, y_streamed = run(layer, x)
    assert_close(y_streamed, y)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_finite_with_left_padding(kind):
    model = get_model(kind, 1)
    x = inputs(15)
    mask = jnp.arange(T)[None, :] >= jnp.array([[3], [0]])  # row 0 starts with 3 pads

    @nnx.jit
    def grads(model, x):
        def loss(model, x):
            y = model(x, mask)
            return jnp.sum(jnp.where(mask[..., None], y, 0.0) ** 2)

        return nnx.grad(loss, argnums=(0, 1))(model, x)

    g_params, g_x = grads(model, x)
    chex.assert_tree_all_finite((g_params, g_x))
    # Padding tokens influence nothing, so they get exactly zero gradient.
    np.testing.assert_array_equal(np.asarray(g_x[0, :3]), 0.0)
    assert float(jnp.max(jnp.abs(g_x[0, 3:]))) > 0.0


# ----------------------------------------------------------------------------------------
# Streaming state


def test_aaren_carry_bytes_do_not_grow():
    model = get_model("aaren", 1)
    carry0 = model.init_carry(1)
    short, _ = aj.stream(model, carry0, inputs(9, (1, 10, D_MODEL)))
    long, ys = aj.stream(model, carry0, inputs(10, (1, 10_000, D_MODEL)))
    chex.assert_tree_all_finite((long, ys))
    chex.assert_trees_all_equal_shapes_and_dtypes(short, long)
    nbytes = lambda c: sum(x.nbytes for x in jax.tree.leaves(c))
    assert nbytes(short) == nbytes(long) == nbytes(carry0)


def test_bf16_compute_keeps_float32_state():
    model = get_model("aaren", 1, "bfloat16")
    state = model.init_carry(B).layers[0]
    assert all(x.dtype == jnp.float32 for x in state)
    _, carry = forward(model, inputs(1, dtype="bfloat16"))
    assert all(x.dtype == jnp.float32 for x in carry.layers[0])


def test_kv_cache_past_capacity_raises():
    model = get_model("transformer", 1)
    x = inputs(11)
    carry = model.init_carry(B, max_len=4)
    _, carry = forward(model, x[:, :4], carry=carry)
    assert int(carry.layers[0].length) == 4
    with pytest.raises(ValueError, match="capacity 4, position 4"):
        model.step(carry, x[:, 4])  # eager
    step_fn, state = get_step_fn("transformer", 1)
    with pytest.raises(ValueError, match="capacity 4, position 4"):
        step_fn(state, carry, x[:, 4])  # the compiled helper checks on the host
    with pytest.raises(ValueError, match="capacity 4, position 0"):
        aj.stream(model, model.init_carry(B, max_len=4), x)
    with pytest.raises(ValueError, match="capacity 4, position 0"):
        model(x, carry=model.init_carry(B, max_len=4), return_carry=True)
    with pytest.raises(ValueError, match="max_len"):
        model.init_carry(B)


def test_prefill_without_carry_leaves_room_to_step():
    model = get_model("transformer", 1)
    x = inputs(12, (B, 6, D_MODEL))
    y_full, _ = forward(model, x)
    _, carry = forward(model, x[:, :5])  # no carry: a cache of capacity 2 T = 10
    cache = carry.layers[0]
    assert cache.capacity == 10 and int(cache.length) == 5
    assert cache.k.shape == (B, HEADS, 10, D_MODEL // HEADS)  # [B, H, C, D]: no transpose
    carry, y_t = model.step(carry, x[:, 5])
    assert_close(y_t, y_full[:, 5])
    _, carry = forward(model, x[:, :5], max_len=5)  # the room is an argument
    assert carry.layers[0].capacity == 5
    with pytest.raises(ValueError, match="max_len=4 cannot hold the T = 5 tokens"):
        forward(model, x[:, :5], max_len=4)


# ----------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize("kind", KINDS)
def test_bad_inputs_raise_clear_errors(kind):
    model = get_model(kind, 1)
    x = inputs(13)
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, d\]"):
        model(x[0])
    with pytest.raises(ValueError, match="d_model=16"):
        model(x[..., :8])
    with pytest.raises(TypeError, match="floating"):
        model(jnp.ones((B, T, D_MODEL), jnp.int32))
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 8\)"):
        model(x, jnp.ones((B, T - 1), bool))
    with pytest.raises(TypeError, match="boolean"):
        model(x, jnp.ones((B, T), jnp.int32))
    carry = model.init_carry(B, max_len=T)
    with pytest.raises(ValueError, match=r"x_t must have shape \[B, d\]"):
        model.step(carry, x)
    with pytest.raises(ValueError, match=r"mask_t must have shape \(2,\)"):
        model.step(carry, x[:, 0], jnp.ones((B, 1), bool))
    with pytest.raises(ValueError, match="batch size 3"):
        model.step(model.init_carry(3, max_len=T), x[:, 0])
    with pytest.raises(TypeError, match="carry must be"):
        model.step(tuple(carry), x[:, 0])
    with pytest.raises(ValueError, match="layer states"):
        get_model(kind, 3)(x, carry=carry)


def test_bad_configurations_raise():
    with pytest.raises(ValueError, match="not divisible"):
        aj.Aaren(1, 10, 3, 16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="norm"):
        aj.Transformer(1, 16, 2, 16, norm="middle", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_layers"):
        aj.Aaren(0, 16, 2, 16, rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------------------
# Dropout


def test_dropout_follows_train_and_eval():
    # Dropout lives in the block code both models share: one model suffices.
    model = aj.Aaren(1, D_MODEL, HEADS, D_FF, dropout=0.5, rngs=nnx.Rngs(0, dropout=1))
    x = inputs(14)
    call = nnx.jit(lambda m, x: m(x))
    model.train()
    y1, y2 = call(model, x), call(model, x)
    assert float(jnp.max(jnp.abs(y1 - y2))) > 1e-3  # a fresh mask per call
    model.eval()
    y3, y4 = call(model, x), call(model, x)
    np.testing.assert_array_equal(np.asarray(y3), np.asarray(y4))
    assert float(jnp.max(jnp.abs(y1 - y3))) > 1e-3


def test_decode_step_updates_the_kv_cache_in_place():
    """No copy of a [B, H, C, D] cache in the compiled step (a copy per step made decoding
    at batch 1 20x slower at C = 16384): the write must come after the reads."""
    model = aj.Transformer(2, D_MODEL, HEADS, D_FF, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    carry = model.init_carry(1, max_len=37)

    def step(state, carry, x_t):
        return nnx.merge(graphdef, state).step(carry, x_t)

    compiled = jax.jit(step, donate_argnums=1).lower(state, carry, jnp.ones((1, D_MODEL)))
    hlo = compiled.compile().as_text()
    cache_shape = f"f32[1,{HEADS},37,{D_MODEL // HEADS}]"
    copies = [line for line in hlo.splitlines() if cache_shape in line and " copy(" in line]
    assert not copies, copies


@pytest.mark.parametrize("shape", [(2, 5, 8), (1, 7, 8), (5, 8), (1, 1, 8)])
def test_per_token_is_the_function_on_every_token(key, shape):
    from aaren_jax.attention import per_token

    linear = nnx.Linear(8, 3, rngs=nnx.Rngs(0))
    norm = nnx.LayerNorm(8, rngs=nnx.Rngs(0))
    x = jax.random.normal(key, shape)
    got = per_token(lambda t: linear(norm(t)), x)
    assert got.shape == (*shape[:-1], 3)  # the output width may differ from the input's
    np.testing.assert_allclose(got, linear(norm(x)), rtol=1e-5, atol=1e-6)
