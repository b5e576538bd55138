"""Data parallelism for the examples: the batch sharded over a mesh of all devices.

Parameters, optimiser state and the model's other state are replicated on every device; each
batch is split along its first axis over the mesh's ``"data"`` axis. The jitted training step
is unchanged: XLA sees the shardings of its inputs and inserts the all-reduce of the
gradients, so a step on N devices computes what the step on one device computes, to float32
round-off (the sums are grouped differently).

Several hosts: call ``jax.distributed.initialize()`` first (see the examples' README); the
mesh then spans every process's devices, every process computes the same global batch from
the seed, and ``shard_batch`` hands each device its rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"


def data_mesh(devices: list | None = None) -> Mesh | None:
    """A 1-D ``("data",)`` mesh over ``devices`` (default: all devices); None for one device."""
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) <= 1:
        return None
    return jax.make_mesh(
        (len(devices),), (DATA_AXIS,), axis_types=(AxisType.Auto,), devices=devices
    )


def replicate(tree: Any, mesh: Mesh | None) -> Any:
    """Places every array of ``tree`` on all devices of ``mesh`` (unchanged if None).

    With several processes each one must hold the same values (same seed, same restored
    checkpoint); each fills its own devices.
    """
    if mesh is None:
        return tree
    sharding = NamedSharding(mesh, PartitionSpec())
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: _replicate_global(x, sharding), tree)


def _replicate_global(x: Any, sharding: NamedSharding) -> jax.Array:
    """``device_put`` cannot reach other processes' devices: build the global array instead."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _replicate_global(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_batch(batch: Mapping[str, Any], mesh: Mesh | None) -> dict[str, Any]:
    """Splits every array of ``batch`` along its first axis over the mesh's data axis.

    Built with ``jax.make_array_from_callback`` from the full host batch, so the same code
    serves several processes: each one fills only the rows of its own devices. Scalars are
    replicated.

    Raises:
      ValueError: when a batch's leading size is not a multiple of the number of devices.
    """
    if mesh is None:
        return dict(batch)
    sharding = NamedSharding(mesh, PartitionSpec(DATA_AXIS))
    out = {}
    for name, x in batch.items():
        x = np.asarray(x)
        if x.ndim == 0:  # a scalar setting, not examples: every device gets it
            out[name] = replicate(x, mesh)
            continue
        if x.shape[0] % mesh.size:
            raise ValueError(
                f"batch {name!r} has {x.shape[0]} rows, not a multiple of the {mesh.size} "
                "devices it is sharded over: choose a batch size divisible by them"
            )
        out[name] = jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx])
    return out


def add_distributed_args(parser) -> None:
    """``--coordinator``, ``--num-processes``, ``--process-id``: one run over several hosts."""
    g = parser.add_argument_group("several hosts (jax.distributed)")
    g.add_argument(
        "--coordinator", default=None, help="host:port of process 0; starts jax.distributed"
    )
    g.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    g.add_argument("--process-id", type=int, default=None, help="this process, 0 .. N-1")


def initialize_distributed(args) -> None:
    """Starts ``jax.distributed`` when ``args.coordinator`` is set (before any device use).

    On CPU hosts the cross-process collectives go through gloo. Every process runs the same
    command with its own ``--process-id``; process 0 writes the run folder's files.
    """
    if getattr(args, "coordinator", None) is None:
        return
    # CPU devices need gloo for cross-process collectives; GPUs and TPUs ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
