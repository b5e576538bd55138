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
    """Places every array of ``tree`` on all devices of ``mesh`` (unchanged if None)."""
    if mesh is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def shard_batch(batch: Mapping[str, Any], mesh: Mesh | None) -> dict[str, Any]:
    """Splits every array of ``batch`` along its first axis over the mesh's data axis.

    Built with ``jax.make_array_from_callback`` from the full host batch, so the same code
    serves several processes: each one fills only the rows of its own devices.

    Raises:
      ValueError: when a batch's leading size is not a multiple of the number of devices.
    """
    if mesh is None:
        return dict(batch)
    sharding = NamedSharding(mesh, PartitionSpec(DATA_AXIS))
    out = {}
    for name, x in batch.items():
        x = np.asarray(x)
        if x.shape[0] % mesh.size:
            raise ValueError(
                f"batch {name!r} has {x.shape[0]} rows, not a multiple of the {mesh.size} "
                "devices it is sharded over: choose a batch size divisible by them"
            )
        out[name] = jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx])
    return out
