"""Sequence parallelism: prefix attention with the time axis split across devices (SPEC 3).

Each device holds a contiguous slice of time. It reduces its slice to one total state (one
pass, no scan), the totals are exchanged with ``all_gather``, each device combines the
totals of the devices before it (an exclusive prefix, O(devices) tiny combines), and runs
its local scan from that state with ``prefix_attention(..., initial_state=...)``. The
result equals one ``prefix_attention`` over the whole sequence; only ``3 + D`` numbers per
query and device cross the interconnect. Batches split on another mesh axis with
``NamedSharding`` as usual; multi-host runs use the same code after ``jax.distributed``.

Shape notation: ``...`` leading axes, ``T`` time (split across devices), ``D`` value size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from aaren_jax.scan import (
    AttentionState,
    accumulation_dtype,
    combine,
    init_state,
    prefix_attention,
)

Array = jax.Array


def _total(scores: Array, values: Array, mask: Array) -> AttentionState:
    """The state of a whole slice in one reduction: (max s, sum e^(s-max), sum e^(s-max) v)."""
    masked = jnp.where(mask, scores, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(masked, axis=-1))
    ref = jnp.where(jnp.isneginf(m), 0.0, m)
    weights = jnp.exp(masked - ref[..., None])  # exactly 0 where masked
    return AttentionState(m, weights.sum(-1), jnp.einsum("...t,...td->...d", weights, values))


def _check_axis(mesh: Mesh, name, argument: str) -> None:
    """Raises ValueError unless ``name`` is one of the mesh's axis names."""
    if name not in mesh.axis_names:
        raise ValueError(
            f"{argument}={name!r} is not an axis of the mesh; its axes are {mesh.axis_names}"
        )


def _mesh_for_context(mesh: Mesh) -> Mesh:
    """``mesh`` with Auto axes unless the caller works under an explicit-axes mesh context.

    ``jax.make_mesh`` makes explicit axes by default. Outside a ``jax.set_mesh`` context,
    values typed with explicit shardings escape to the caller, and eager ``jax.grad`` of
    them fails (its cotangent seed is built with no mesh to place it on). With Auto axes
    the same devices and layout give ordinary arrays; under an explicit context the mesh
    is kept and the inputs are resharded explicitly.
    """
    context = jax.sharding.get_abstract_mesh()
    explicit_context = any(t == AxisType.Explicit for t in context.axis_types)
    if explicit_context or all(t != AxisType.Explicit for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


@functools.partial(
    jax.jit, static_argnames=("mesh", "axis_name", "batch_axis_name", "method", "chunk_size")
)
def _sharded(scores, values, mask, *, mesh, axis_name, batch_axis_name, method, chunk_size):
    """The ``shard_map`` itself, jitted (the mesh and names are static).

    Eager calls and their gradients then run as one compiled program each, not op by op
    inside ``shard_map`` (an eager gradient took minutes on 4 simulated CPU devices).
    """
    num_shards = mesh.shape[axis_name]
    batch_ndim = scores.ndim - 1
    lead = (batch_axis_name,) + (None,) * (batch_ndim - 1) if batch_ndim else ()
    time_spec = PartitionSpec(*lead, axis_name)
    value_spec = PartitionSpec(*lead, axis_name, None)
    state_spec = AttentionState(
        PartitionSpec(*lead), PartitionSpec(*lead), PartitionSpec(*lead, None)
    )

    def local(s, v, m):
        totals = jax.lax.all_gather(_total(s, v, m), axis_name)  # [P, ...] on every device
        index = jax.lax.axis_index(axis_name)
        identity = init_state(s.shape[:-1], v.shape[-1], totals.u.dtype)
        before, everything = identity, identity
        for shard in range(num_shards):  # P is small and static: a short unrolled fold
            total = jax.tree.map(lambda x, shard=shard: x[shard], totals)
            everything = combine(everything, total)
            keep = shard < index
            before = jax.tree.map(
                lambda x, y, keep=keep: jnp.where(keep, x, y), combine(before, total), before
            )
        outputs, _ = prefix_attention(
            s, v, m, initial_state=before, method=method, chunk_size=chunk_size
        )
        return outputs, everything

    shard_mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(time_spec, value_spec, time_spec),
        out_specs=(value_spec, state_spec),
        check_vma=False,
    )
    inputs = (scores, values, mask)
    specs = (time_spec, value_spec, time_spec)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        # Explicit meshes do not reshard implicitly: place the slices where shard_map wants them.
        inputs = tuple(
            jax.reshard(x, NamedSharding(mesh, spec)) for x, spec in zip(inputs, specs, strict=True)
        )
    return shard_mapped(*inputs)


def sequence_parallel_prefix_attention(
    scores: Array,
    values: Array,
    mask: Array | None = None,
    *,
    mesh: Mesh,
    axis_name: str,
    batch_axis_name: str | None = None,
    method: str = "auto",
    chunk_size: int | None = None,
) -> tuple[Array, AttentionState]:
    """``prefix_attention`` with time split over the mesh axis ``axis_name``.

    Works eagerly and under ``jax.jit``, with gradients, on meshes with explicit axes (the
    ``jax.make_mesh`` default) or Auto axes, inside a ``jax.set_mesh`` context or not.

    Args:
      scores: per-token scores. [..., T]
      values: per-token values. [..., T, D]
      mask: True where a token is attended; default all. [..., T]
      mesh: the device mesh.
      axis_name: mesh axis that splits time; T must be divisible by its size.
      batch_axis_name: optional mesh axis that splits the first leading axis.
      method: the local scan's method (see ``prefix_attention``).
      chunk_size: the local scan's block size.

    Returns:
      ``(outputs [..., T, D], final_state)`` as ``prefix_attention`` gives them; the final
      state covers the whole sequence and is replicated over ``axis_name``.

    Raises:
      ValueError: ``axis_name`` or ``batch_axis_name`` not an axis of ``mesh`` (or both the
        same), T not divisible by the axis size, or a batch axis on unbatched inputs.

    Example:
      >>> s, v = jnp.zeros((2, 8)), jnp.ones((2, 8, 4))  # T = 8: a multiple of the devices
      >>> mesh = jax.make_mesh((jax.device_count(),), ("seq",))
      >>> out, state = sequence_parallel_prefix_attention(s, v, mesh=mesh, axis_name="seq")
      >>> def loss(s):
      ...     return sequence_parallel_prefix_attention(s, v, mesh=mesh, axis_name="seq")[0].sum()
      >>> grads = jax.grad(loss)(s)  # eagerly or under jax.jit
      >>> out.shape, grads.shape
      ((2, 8, 4), (2, 8))
    """
    scores, values = jnp.asarray(scores), jnp.asarray(values)
    if values.shape[:-1] != scores.shape:
        raise ValueError(
            f"values of shape {values.shape} must be scores' shape {scores.shape} plus a "
            "value axis D: [..., T, D]"
        )
    mask = jnp.ones(scores.shape, bool) if mask is None else jnp.broadcast_to(mask, scores.shape)
    _check_axis(mesh, axis_name, "axis_name")
    if batch_axis_name is not None:
        _check_axis(mesh, batch_axis_name, "batch_axis_name")
        if batch_axis_name == axis_name:
            raise ValueError(
                f"batch_axis_name and axis_name must be different mesh axes, both are {axis_name!r}"
            )
    num_shards = mesh.shape[axis_name]
    if scores.shape[-1] % num_shards:
        raise ValueError(
            f"the time axis of scores {scores.shape} must be divisible by the {num_shards} "
            f"devices of mesh axis {axis_name!r}"
        )
    if batch_axis_name is not None and scores.ndim == 1:
        raise ValueError("batch_axis_name needs scores with a leading batch axis")
    accumulate = accumulation_dtype(scores.dtype, values.dtype)
    outputs, final = _sharded(
        scores.astype(accumulate),
        values.astype(accumulate),
        mask,
        mesh=_mesh_for_context(mesh),
        axis_name=axis_name,
        batch_axis_name=batch_axis_name,
        method=method,
        chunk_size=chunk_size,
    )
    return outputs.astype(values.dtype), final
