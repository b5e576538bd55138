"""Sequence parallelism on 4 simulated CPU devices equals one prefix_attention, with gradients.

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
        for a, b in zip(got[1], expected[1]):
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)
        grads = jax.jit(jax.grad(loss(fn), (0, 1)))(scores, values)
        for a, b in zip(grads, expected_grad):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
    print("sharded equals single-device")
    """
)


def test_sequence_parallel_equals_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "sharded equals single-device" in result.stdout
