"""Strict mode for the whole suite: rank promotion raises, warnings are errors (pyproject)."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_collection_modifyitems(items):
    """Tests marked slow first, the rest in their order: with ``-n auto`` the run then ends
    on short tests, not on a long one that one worker started last (longest first, the
    greedy schedule)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def key():
    """A fresh PRNG key per test."""
    return jax.random.key(0)
