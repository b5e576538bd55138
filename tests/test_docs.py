"""The API documentation covers the public API, and builds with warnings as errors.

CI builds the site in ``.ci/run`` (the ``docs`` extra); here the build runs only where
mkdocs and mkdocstrings are installed.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import aaren_jax as aj

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_has_a_page():
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs" / "api").glob("*.md")))
    documented = set(re.findall(r"^::: aaren_jax\.(\w+)\s*$", text, flags=re.M))
    missing = sorted(set(aj.__all__) - documented)
    assert not missing, f"public names with no '::: aaren_jax.NAME' in docs/api/*.md: {missing}"


def test_docs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "api" / "scan" / "index.html").is_file()
