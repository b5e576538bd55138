"""Orbax checkpoints of a training state: an array pytree plus JSON metadata, resumable."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


class CheckpointIO:
    """A thin wrapper over ``ocp.CheckpointManager`` with the ``args`` API.

    Each checkpoint has two items: ``state`` (arrays: parameters, optimiser state, best
    parameters; ``StandardSave``) and ``meta`` (JSON: step, epoch, early-stopping counters,
    history). Restoring needs an abstract ``state`` tree (``jax.ShapeDtypeStruct`` leaves, e.g.
    from ``nnx.eval_shape`` and ``jax.eval_shape(tx.init, ...)``).

    Attributes:
      manager: the underlying ``ocp.CheckpointManager``.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int = 2):
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            # synchronous: the training loop donates its buffers to the next step, so an
            # asynchronous save could read memory that is being overwritten
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
            ),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Saves ``state`` and ``meta`` under ``step`` (a no-op if that step exists)."""
        if step in self.manager.all_steps():
            return
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
        )

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores ``(state, meta)`` at ``step`` (default: latest) into ``abstract_state``."""
        step = self.latest_step() if step is None else step
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        return restored.state, restored.meta

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
