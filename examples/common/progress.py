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
    for noisy in ("absl", "orbax", "jax", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def stderr_is_terminal() -> bool:
    """Whether stderr is an interactive terminal (else progress goes to plain log lines)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """Progress over training steps: a tqdm bar on a terminal, plain log lines otherwise.

    On a terminal the bar's postfix shows loss and tokens per second. When stderr is a file
    or a pipe, a bar would be redrawn into the same lines as the log, so each update is one
    ``logging`` line (``desc step k/total loss ... tok/s ...``) instead.

    Attributes:
      bar: the tqdm bar (disabled when ``enabled`` is False or stderr is not a terminal).
      log_lines: whether updates are written as log lines.
    """

    def __init__(
        self,
        total: int,
        initial: int,
        desc: str,
        enabled: bool = True,
        terminal: bool | None = None,
    ):
        terminal = stderr_is_terminal() if terminal is None else terminal
        self.bar = tqdm(
            total=total, initial=initial, desc=desc, disable=not (enabled and terminal), leave=False
        )
        self.log_lines = enabled and not terminal
        self._desc, self._total, self._n = desc, total, initial
        self._t0 = time.perf_counter()
        self._tokens = 0

    def update(self, n_steps: int, loss: float, tokens: int, **extra) -> None:
        """Advances by ``n_steps`` steps that saw ``tokens`` tokens; shows ``loss``, ``extra``."""
        self._tokens += tokens
        self._n += n_steps
        dt = max(time.perf_counter() - self._t0, 1e-9)
        self.bar.update(n_steps)
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{self._tokens / dt:.0f}", **extra)
        if self.log_lines:
            more = "".join(f" {k} {v}" for k, v in extra.items())
            logging.info(
                "%s step %d/%d loss %.4f tok/s %.0f%s",
                self._desc,
                self._n,
                self._total,
                loss,
                self._tokens / dt,
                more,
            )

    def close(self) -> None:
        self.bar.close()
