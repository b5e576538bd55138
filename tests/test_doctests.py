"""Runs the docstrings' ``Example:`` blocks of the public modules as doctests.

Each module's examples run in the module's own namespace (as ``python -m doctest`` would)
plus ``jax``, ``jnp``, ``np``, ``nnx``, ``aj`` and the public names of ``aaren_jax`` (as
after ``from aaren_jax import *``), under the suite's strict mode. Examples are
small: a few tokens, a width of 16.
"""

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aaren_jax as aj

MODULES = [
    "aaren_jax.scan",
    "aaren_jax.attention",
    "aaren_jax.blocks",
    "aaren_jax.models",
    "aaren_jax.deploy",
    "aaren_jax.sharding",
    "aaren_jax.rem_config",
    "aaren_jax.rem_matrix",
    "aaren_jax.rem_recurrence",
]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _tests(name):
    module = importlib.import_module(name)
    extra = {name: getattr(aj, name) for name in aj.__all__}
    extra.update(jax=jax, jnp=jnp, np=np, nnx=nnx, aj=aj)
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(module, name, extraglobs=extra) if t.examples]


def test_every_public_example_is_found():
    """Every public module with an example contributes at least one doctest."""
    found = {t.name.split(".")[1] for name in MODULES for t in _tests(name)}
    assert {"scan", "attention", "blocks", "models", "deploy", "sharding"} <= found


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    failures = []
    for test in _tests(name):
        result = runner.run(test, out=failures.append)
        assert result.attempted > 0
    assert not failures, "".join(failures)
