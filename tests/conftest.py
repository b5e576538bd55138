"""Strict mode for the whole suite: rank promotion raises, warnings are errors (pyproject)."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def key():
    """A fresh PRNG key per test."""
    return jax.random.key(0)
