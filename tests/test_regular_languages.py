"""Smoke test of examples/regular_languages: one training step of each model on a tiny config."""

import argparse
import json

import numpy as np
import pytest

from examples.regular_languages import data, sweep, train


@pytest.fixture(scope="module")
def tiny_data():
    return data.make_datasets("tomita3", seed=0, train_size=8, test_size=4)


@pytest.mark.parametrize("model", train.MODELS)
def test_one_training_step(model, tiny_data):
    cfg = train.Config(
        language="tomita3",
        model=model,
        num_layers=1,
        d_model=10,
        num_heads=5,
        d_ff=10,
        epochs=1,
        batch_size=8,
        eval_batch_size=4,
        train_size=8,
        test_size=4,
    )
    record = train.train_and_evaluate(cfg, datasets=tiny_data)
    assert {"language", "model", "seed", "bin0", "bin1"} <= set(record)
    assert 0.0 <= record["bin0"] <= 1.0 and 0.0 <= record["bin1"] <= 1.0
    assert np.isfinite(record["train_loss"])
    assert record["epochs"] == 1 and record["train_size"] == 8
    if model.startswith("rsa_"):
        assert len(record["gates"]) == 1 and record["rsa_counts"] == [3, 1, 1, 0, 0, 0]
    json.dumps(record)  # a record is plain JSON


def test_learning_rate_halves_every_five_epochs():
    sched = train.make_schedule(train.Config(), steps_per_epoch=10)
    assert sched(0) == pytest.approx(0.005) and sched(49) == pytest.approx(0.005)
    assert sched(50) == pytest.approx(0.0025) and sched(249) == pytest.approx(0.005 / 16)


def test_sweep_skips_done_runs():
    args = argparse.Namespace(
        languages=["parity", "d2"], models=["aaren", "rsa_aaren"], seeds=[0, 1]
    )
    done = {("parity", "aaren", 0)}
    runs = sweep.pending_runs(args, done)
    assert len(runs) == 7 and ("parity", "aaren", 0) not in runs
    assert [r[2] for r in runs[:3]] == [0, 0, 0]  # seed-major: one seed of everything first


def test_sinusoidal_encoding_any_length():
    pe = np.asarray(train.sinusoidal_encoding(200, 20))
    assert pe.shape == (200, 20) and np.allclose(pe[0, 1::2], 1.0)
