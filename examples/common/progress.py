"""Progress reporting: logging setup and a tqdm bar showing step, loss and throughput."""

from __future__ import annotations

import logging
import sys
import time

from tqdm.auto import tqdm


def setup_logging(level: int = logging.INFO) -> None:
    """Plain ``time level message`` log lines on stderr (idempotent)."""
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(message)s",
        stream=sys.stderr,
        force=True,  # absl (imported by Orbax) may already have configured the root logger
    )
    for noisy in ("absl", "orbax", "jax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class Progress:
    """A tqdm bar over training steps; its postfix shows loss and tokens per second.

    Attributes:
      bar: the tqdm bar (disabled when ``enabled`` is False).
    """

    def __init__(self, total: int, initial: int, desc: str, enabled: bool = True):
        self.bar = tqdm(total=total, initial=initial, desc=desc, disable=not enabled, leave=False)
        self._t0 = time.perf_counter()
        self._tokens = 0

    def update(self, n_steps: int, loss: float, tokens: int, **extra) -> None:
        """Advances by ``n_steps`` steps that saw ``tokens`` tokens; shows ``loss``, ``extra``."""
        self._tokens += tokens
        dt = max(time.perf_counter() - self._t0, 1e-9)
        self.bar.update(n_steps)
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{self._tokens / dt:.0f}", **extra)

    def close(self) -> None:
        self.bar.close()
