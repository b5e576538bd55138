"""Packaging: the version comes from the installed metadata; the package declares its types."""

import re
from pathlib import Path

import aaren_jax as aj


def test_version_matches_pyproject():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1)
    assert aj.__version__ == declared


def test_package_ships_py_typed():
    assert (Path(aj.__file__).parent / "py.typed").is_file()
