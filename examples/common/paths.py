"""Locations shared by the examples: the repository root and the shared data folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def default_data_root() -> Path:
    """The shared data folder: ``$AAREN_DATA_ROOT`` if set, else ``<repo>/../shared/data``."""
    env = os.environ.get("AAREN_DATA_ROOT")
    if env:
        return Path(env)
    return REPO_ROOT.parent / "shared" / "data"


def runs_root() -> Path:
    """Where run folders and sweep results go unless named: ``$AAREN_RUNS_ROOT`` or
    ``<repo>/workdirs`` (ignored by git)."""
    env = os.environ.get("AAREN_RUNS_ROOT")
    if env:
        return Path(env)
    return REPO_ROOT / "workdirs"


def ensure_importable() -> None:
    """Puts the repository root (and ``src/`` for an uninstalled checkout) on ``sys.path``."""
    for p in (REPO_ROOT, REPO_ROOT / "src"):
        if str(p) not in sys.path:
            sys.path.insert(0 if p == REPO_ROOT else len(sys.path), str(p))
