"""Deployment helpers: the compiled step, the lax.scan streamer, the jax.export artifact."""

import json
import re
import struct

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


class RunningMean(nnx.Module):
    """A module with ``step`` and a one-argument ``init_carry`` but no ``d_model``."""

    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.proj = nnx.Linear(width, width, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def init_carry(self, batch_size):
        width = self.proj.in_features
        return (jnp.zeros((batch_size, width)), jnp.zeros((batch_size, 1)))

    def step(self, carry, x_t, mask_t=None):
        total, count = carry
        keep = jnp.ones(x_t.shape[:1], bool) if mask_t is None else mask_t
        total = total + jnp.where(keep[:, None], self.drop(self.proj(x_t)), 0.0)
        count = count + keep[:, None]
        return (total, count), total / jnp.maximum(count, 1.0)


def loop_of_steps(model, carry, x, mask):
    ys = []
    for t in range(x.shape[1]):
        carry, y_t = model.step(carry, x[:, t], mask[:, t])
        ys.append(y_t)
    return carry, jnp.stack(ys, axis=1)


def test_helpers_take_any_module_with_step():
    width = 5
    model = RunningMean(width, rngs=nnx.Rngs(0, dropout=1))
    assert not hasattr(model, "d_model")
    x = inputs(2, (B, T, width))
    mask = jnp.array([[True, False, True, True, False, True], [True] * T])
    model.eval()
    ref_carry, ref_y = loop_of_steps(model, model.init_carry(B), x, mask)
    model.train()  # the helpers run in eval mode all the same

    step_fn, state = aj.make_step_fn(model)
    carry = model.init_carry(B)
    for t in range(T):
        carry, y_t = step_fn(state, carry, x[:, t], mask[:, t])
        chex.assert_trees_all_close(y_t, ref_y[:, t], atol=1e-6, rtol=1e-6)
    chex.assert_trees_all_close(carry, ref_carry, atol=1e-6, rtol=1e-6)

    carry_s, ys = aj.stream(model, model.init_carry(B), x, mask)
    chex.assert_trees_all_close(ys, ref_y, atol=1e-6, rtol=1e-6)
    chex.assert_trees_all_close(carry_s, ref_carry, atol=1e-6, rtol=1e-6)

    loaded = aj.load_step(aj.export_step(model, B, d_model=width))
    carry = loaded.init_carry()
    for t in range(T):
        carry, y_t = loaded.step(carry, x[:, t], mask[:, t])
        chex.assert_trees_all_close(y_t, ref_y[:, t], atol=1e-6, rtol=1e-6)

    # The width comes from the input: its rank is still checked, and named.
    with pytest.raises(ValueError, match="x_t must have shape"):
        step_fn(state, model.init_carry(B), x)
    with pytest.raises(ValueError, match="xs must have shape"):
        aj.stream(model, model.init_carry(B), x[:, 0])
    with pytest.raises(ValueError, match="no d_model attribute, pass d_model="):
        aj.export_step(model, B)
    with pytest.raises(TypeError, match="make_step_fn needs a module with step"):
        aj.make_step_fn(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("kind", KINDS)
def test_helpers_are_eval_mode_and_leave_the_model_in_train_mode(kind):
    model = make_model(kind, dropout=0.5)
    x = inputs(3)
    model.eval()
    y_eval = model(x)
    model.train()
    y_train = model(x)
    assert not np.allclose(y_train, y_eval, atol=1e-3)  # dropout is on in train mode

    step_fn, state = aj.make_step_fn(model)
    _, y_0 = step_fn(state, model.init_carry(B, max_len=T), x[:, 0])
    _, ys = aj.stream(model, model.init_carry(B, max_len=T), x)
    loaded = aj.load_step(aj.export_step(model, B, max_len=T))
    _, y_0_loaded = loaded.step(loaded.init_carry(), x[:, 0])
    chex.assert_trees_all_close(y_0, y_eval[:, 0], atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(ys, y_eval, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(y_0_loaded, y_eval[:, 0], atol=1e-5, rtol=1e-5)
    # The caller's model is still in train mode: dropout still changes its outputs.
    assert not np.allclose(model(x), y_eval, atol=1e-3)


@pytest.fixture(scope="module")
def artifact():
    """A Transformer artifact (it has KV caches) and its model."""
    model = make_model("transformer")
    return model, aj.export_step(model, B, max_len=T)


def test_load_step_reads_a_path(artifact, tmp_path):
    model, blob = artifact
    file = tmp_path / "step.aaren"
    file.write_bytes(blob)
    x = inputs(4)
    _, expected = model.step(model.init_carry(B, max_len=T), x[:, 0])
    for source in (file, str(file), bytearray(blob)):
        loaded = aj.load_step(source)
        _, y_t = loaded.step(loaded.init_carry(), x[:, 0])
        chex.assert_trees_all_close(y_t, expected, atol=1e-5, rtol=1e-5)

    missing = tmp_path / "missing.aaren"
    with pytest.raises(ValueError, match="cannot read .* from path .*missing.aaren"):
        aj.load_step(str(missing))
    with pytest.raises(ValueError, match="cannot read .* from path .*missing.aaren"):
        aj.load_step(missing)
    with pytest.raises(ValueError, match=f"cannot read .* from path '{re.escape(str(tmp_path))}'"):
        aj.load_step(tmp_path)  # a directory
    with pytest.raises(TypeError, match="bytes or a path .* got int"):
        aj.load_step(3)
    with pytest.raises(ValueError, match="not an aaren_jax step artifact .*'.*foreign.aaren'"):
        (tmp_path / "foreign.aaren").write_bytes(b"something else")
        aj.load_step(tmp_path / "foreign.aaren")


def test_truncated_or_corrupt_artifacts_raise_value_error(artifact, tmp_path):
    _, blob = artifact
    header_at = len(b"AARENJAX-STEP\x00")
    cuts = (header_at + 3, header_at + 8, header_at + 20, len(blob) // 2, len(blob) - 1)
    for cut in cuts:
        with pytest.raises(ValueError, match=r"^corrupt aaren_jax step artifact: truncated"):
            aj.load_step(blob[:cut])
    with pytest.raises(ValueError, match="corrupt .*: 3 unexpected byte"):
        aj.load_step(blob + b"abc")
    flipped = bytearray(blob)
    flipped[-100] ^= 0xFF  # inside the init function
    with pytest.raises(ValueError, match="corrupt .*: the exported functions do not match"):
        aj.load_step(bytes(flipped))
    flipped = bytearray(blob)
    flipped[header_at + 8] ^= 0xFF  # the header's first byte
    with pytest.raises(ValueError, match="corrupt .*: unreadable header"):
        aj.load_step(bytes(flipped))
    file = tmp_path / "cut.aaren"
    file.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match=r"corrupt aaren_jax step artifact \(file .*cut.aaren"):
        aj.load_step(file)


def test_export_step_validates_its_arguments():
    model = make_model("aaren")
    with pytest.raises(ValueError, match="unknown platform 'tpu9'"):
        aj.export_step(model, B, platforms=("tpu9",))
    with pytest.raises(ValueError, match="unknown platform 'gpu'"):
        aj.export_step(model, B, platforms=["cpu", "gpu"])
    with pytest.raises(TypeError, match="platforms must be a tuple .* got the string 'cpu'"):
        aj.export_step(model, B, platforms="cpu")
    with pytest.raises(ValueError, match="platforms must name at least one"):
        aj.export_step(model, B, platforms=())
    with pytest.raises(ValueError, match="platforms must not repeat"):
        aj.export_step(model, B, platforms=("cpu", "cpu"))
    for bad in (2.5, "2", True, None):
        with pytest.raises(TypeError, match="batch_size must be a positive int"):
            aj.export_step(model, bad)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"batch_size must be a positive int, got {bad}"):
            aj.export_step(model, bad)
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        aj.export_step(model, B, dtype=jnp.int32)
    with pytest.raises(ValueError, match="d_model=8 contradicts model.d_model=16"):
        aj.export_step(model, B, d_model=8)

    # Known platforms pass, and the artifact still runs here.
    loaded = aj.load_step(aj.export_step(model, np.int64(B), platforms=("cpu", "tpu")))
    x = inputs(5)
    _, expected = model.step(model.init_carry(B), x[:, 0])
    _, y_t = loaded.step(loaded.init_carry(), x[:, 0])
    chex.assert_trees_all_close(y_t, expected, atol=1e-5, rtol=1e-5)


def test_step_state_or_carry_of_another_model_is_named():
    model, other = make_model("aaren"), aj.Aaren(1, D_MODEL, HEADS, D_FF, rngs=nnx.Rngs(0))
    wider = aj.Aaren(2, D_MODEL, HEADS, 2 * D_FF, rngs=nnx.Rngs(0))
    step_fn, state = aj.make_step_fn(model)
    _, other_state = aj.make_step_fn(other)
    _, wider_state = aj.make_step_fn(wider)
    x_t = inputs(6)[:, 0]
    n, m = len(state), len(other_state)
    assert n != m and len(wider_state) == n
    carry = model.init_carry(B)
    with pytest.raises(ValueError, match=rf"state .* expected {n} arrays .* got {m} arrays"):
        step_fn(other_state, carry, x_t)
    with pytest.raises(ValueError, match=r"first difference: state\[\d+\] has shape"):
        step_fn(wider_state, carry, x_t)
    step_fn(state, carry, x_t)  # the carry survived the rejected calls: not donated

    loaded = aj.load_step(aj.export_step(model, B))
    other_loaded = aj.load_step(aj.export_step(other, B))
    n, m = len(loaded.init_carry()), len(other_loaded.init_carry())
    with pytest.raises(ValueError, match=rf"carry .* expected {n} arrays .* got {m} arrays"):
        loaded.step(other_loaded.init_carry(), x_t)
    wrong_batch = aj.load_step(aj.export_step(model, B + 1)).init_carry()
    with pytest.raises(
        ValueError, match=r"carry does not match .*first difference: carry\[0\] has shape"
    ):
        loaded.step(wrong_batch, x_t)
    with pytest.raises(ValueError, match="mask_t must be boolean of shape"):
        loaded.step(loaded.init_carry(), x_t, jnp.ones((B,), jnp.int32))
    # The model's own carry pytree is accepted: its leaves are the artifact's carry.
    _, y_t = loaded.step(model.init_carry(B), x_t)
    _, expected = model.step(model.init_carry(B), x_t)
    chex.assert_trees_all_close(y_t, expected, atol=1e-5, rtol=1e-5)


def test_format_version_1_artifacts_still_load(artifact):
    """Version 1 had no digest in its header; the parts are otherwise the same."""
    model, blob = artifact
    magic = b"AARENJAX-STEP\x00"
    parts, pos = [], len(magic)
    while pos < len(blob):
        (size,) = struct.unpack_from("<Q", blob, pos)
        parts.append(blob[pos + 8 : pos + 8 + size])
        pos += 8 + size
    meta = json.loads(parts[0])
    assert meta.pop("version") == 2 and len(meta.pop("sha256")) == 2
    parts[0] = json.dumps({"version": 1, **meta}).encode()
    loaded = aj.load_step(magic + b"".join(struct.pack("<Q", len(p)) + p for p in parts))
    x = inputs(7)
    _, expected = model.step(model.init_carry(B, max_len=T), x[:, 0])
    _, y_t = loaded.step(loaded.init_carry(), x[:, 0])
    chex.assert_trees_all_close(y_t, expected, atol=1e-5, rtol=1e-5)
    parts[0] = json.dumps({"version": 9, **meta}).encode()
    with pytest.raises(ValueError, match="unsupported aaren_jax step artifact version 9"):
        aj.load_step(magic + b"".join(struct.pack("<Q", len(p)) + p for p in parts))
