"""Sequence parallelism on 4 simulated CPU devices equals one prefix_attention, with gradients.

Jitted and eager, on explicit and Auto meshes, in and out of a ``jax.set_mesh`` context;
mesh axes that do not exist are rejected by name.

The device count must be set before JAX starts, so the check runs in a fresh interpreter.
"""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    import aaren_jax as aj
    from aaren_jax.sharding import sequence_parallel_prefix_attention

    jax.config.update("jax_numpy_rank_promotion", "raise")
    assert jax.device_count() == 4, jax.devices()
    rng = np.random.default_rng(0)
    scores = jnp.float32(rng.normal(size=(2, 3, 24)) * 5)
    values = jnp.float32(rng.normal(size=(2, 3, 24, 4)))
    mask = np.ones((2, 3, 24), bool)
    mask[0, :, :9] = False  # left padding across the first two devices
    mask[1] = rng.random((3, 24)) > 0.3
    mask = jnp.asarray(mask)
    cot = jnp.float32(rng.normal(size=values.shape))

    def loss(fn):
        return lambda s, v: jnp.sum(fn(s, v)[0] * cot) + jnp.sum(fn(s, v)[1].w)

    auto = jax.sharding.AxisType.Auto
    seq_mesh = jax.make_mesh((4,), ("seq",))  # explicit axes (the default)
    both_mesh = jax.make_mesh((2, 2), ("batch", "seq"), axis_types=(auto, auto))
    reference = lambda s, v: aj.prefix_attention(s, v, mask, method="sequential")
    expected = jax.jit(reference)(scores, values)
    expected_grad = jax.jit(jax.grad(loss(reference), (0, 1)))(scores, values)
    # the exchange is independent of the local method: two methods, two meshes
    cases = ((seq_mesh, None, "auto"), (both_mesh, "batch", "sequential"))
    for mesh, batch_axis, method in cases:
        fn = lambda s, v: sequence_parallel_prefix_attention(
            s, v, mask, mesh=mesh, axis_name="seq", batch_axis_name=batch_axis, method=method)
        got = jax.jit(fn)(scores, values)
        np.testing.assert_allclose(got[0], expected[0], atol=2e-6, rtol=1e-5)
        for a, b in zip(got[1][:3], expected[1][:3]):  # m, u, w
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)
        grads = jax.jit(jax.grad(loss(fn), (0, 1)))(scores, values)
        for a, b in zip(grads, expected_grad):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
    print("sharded equals single-device")

    # Eagerly (no jit), with the docstring's mesh (explicit axes): values and gradients.
    fn = lambda s, v: sequence_parallel_prefix_attention(s, v, mask, mesh=seq_mesh, axis_name="seq")
    got = fn(scores, values)
    np.testing.assert_allclose(got[0], expected[0], atol=2e-6, rtol=1e-5)
    grads = jax.grad(loss(fn), (0, 1))(scores, values)
    for a, b in zip(grads, expected_grad):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
    # And inside a jax.set_mesh context, on inputs sharded explicitly along time.
    P, NS = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    with jax.set_mesh(seq_mesh):
        s_sh = jax.device_put(scores, NS(seq_mesh, P(None, None, "seq")))
        v_sh = jax.device_put(values, NS(seq_mesh, P(None, None, "seq", None)))
        grads = jax.grad(loss(fn), (0, 1))(s_sh, v_sh)
    for a, b in zip(grads, expected_grad):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
    print("eager gradients equal single-device")

    # A mesh axis that is not there is named, with the mesh's axes.
    bad = (
        (dict(axis_name="time"), "axis_name='time'", seq_mesh, "('seq',)"),
        (dict(axis_name="seq", batch_axis_name="data"), "batch_axis_name='data'", both_mesh,
         "('batch', 'seq')"),
        (dict(axis_name="seq", batch_axis_name="seq"), "batch_axis_name and axis_name", both_mesh,
         "'seq'"),
    )
    for kwargs, named, mesh, axes in bad:
        try:
            sequence_parallel_prefix_attention(scores, values, mask, mesh=mesh, **kwargs)
        except ValueError as error:
            assert named in str(error) and axes in str(error), str(error)
        else:
            raise AssertionError(f"no error for {kwargs}")
    print("bad axis names rejected")
    """
)


def test_sequence_parallel_equals_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "sharded equals single-device" in result.stdout
    assert "eager gradients equal single-device" in result.stdout
    assert "bad axis names rejected" in result.stdout
