"""Forecasting example: TSLib loader on the shared CSVs, a training step, exact resumption."""

import dataclasses
import io

import jax
import numpy as np
import pytest

from examples.common.paths import default_data_root  # noqa: E402

DATA = default_data_root()
pytestmark = pytest.mark.skipif(
    not (DATA / "ETT" / "ETTh1.csv").exists(), reason="../shared/data is absent"
)

from examples.common import fit  # noqa: E402
from examples.forecasting import configs, data, train  # noqa: E402


@pytest.fixture(scope="module")
def etth1():
    return data.load_dataset("ETTh1", seq_len=96, pred_len=96)


def test_etth1_borders_shapes_and_known_value(etth1):
    table = data.read_csv(DATA / "ETT" / "ETTh1.csv")
    assert table.columns == ["HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"]
    assert table.values.shape == (17420, 7)
    assert table.values[0, 0] == pytest.approx(5.827)  # first HUFL, before scaling
    assert str(table.dates[0]) == "2016-07-01T00:00:00"
    b1, b2 = etth1.borders
    assert b1 == [0, 12 * 30 * 24 - 96, 16 * 30 * 24 - 96]
    assert b2 == [12 * 30 * 24, 16 * 30 * 24, 20 * 30 * 24]
    # TSLib's window counts: len(data_x) - seq_len - pred_len + 1
    assert (len(etth1.train), len(etth1.val), len(etth1.test)) == (8449, 2785, 2785)
    batch = etth1.train.batch(np.array([0, 5]))
    assert batch["x"].shape == (2, 96, 7) and batch["y"].shape == (2, 96, 7)
    assert batch["x_mark"].shape == (2, 96, 4) and batch["y_mark"].shape == (2, 96, 4)
    # the target starts right after the input
    np.testing.assert_array_equal(batch["y"][1, 0], etth1.train.data[5 + 96])
    # the first validation target is the first row after the training border
    scaled = (table.values - etth1.mean) / etth1.std
    np.testing.assert_allclose(etth1.val.batch(np.array([0]))["y"][0, 0], scaled[8640], rtol=1e-5)


def test_scaler_is_fitted_on_train_rows_only(etth1):
    table = data.read_csv(DATA / "ETT" / "ETTh1.csv")
    train_rows = table.values[: 12 * 30 * 24]
    np.testing.assert_allclose(etth1.mean, train_rows.mean(0))
    np.testing.assert_allclose(etth1.std, train_rows.std(0))
    np.testing.assert_allclose(etth1.train.data.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(etth1.train.data.std(0), 1.0, atol=1e-4)
    assert not np.allclose(table.values[:17280].mean(0), train_rows.mean(0))  # it matters


def test_time_features_tslib_timef(etth1):
    # 2016-07-01 00:00 was a Friday, the 183rd day of a leap year
    expected = [0 / 23 - 0.5, 4 / 6 - 0.5, 0 / 30 - 0.5, 182 / 365 - 0.5]
    np.testing.assert_allclose(etth1.train.marks[0], expected, rtol=1e-6)
    assert etth1.freq == "h"
    assert np.all(np.abs(etth1.train.marks) <= 0.5 + 1e-6)


def test_ettm_and_custom_borders():
    m1 = data.load_dataset("ETTm1", 96, 96)
    assert m1.borders == ([0, 34560 - 96, 46080 - 96], [34560, 46080, 57600])
    assert m1.freq == "t" and m1.num_marks == 5  # MinuteOfHour first
    assert (len(m1.train), len(m1.val), len(m1.test)) == (34369, 11425, 11425)
    ili = data.load_dataset("illness", 36, 24)
    n = 966
    n_train, n_test = int(n * 0.7), int(n * 0.2)
    assert ili.borders == (
        [0, n_train - 36, n - n_test - 36],
        [n_train, n - n_test, n],
    )
    assert ili.columns[-1] == "OT" and len(ili.test) == 170


def test_download_ett_verifies_checksum(tmp_path, monkeypatch):
    payload = (DATA / "ETT" / "ETTh1.csv").read_bytes()
    assert data.sha256_file(DATA / "ETT" / "ETTh1.csv") == data.ETT_SHA256["ETTh1"]
    urls = []

    def fake_urlopen(url, timeout=None):
        urls.append(url)
        return io.BytesIO(payload)

    monkeypatch.setattr(data.urllib.request, "urlopen", fake_urlopen)
    (path,) = data.download_ett(tmp_path, names=("ETTh1",))
    assert urls == [data.ETT_URL.format(commit=data.ETT_COMMIT, name="ETTh1")]
    assert data.read_csv(path).values.shape == (17420, 7)
    payload = b"date,OT\n2016-07-01 00:00:00,1.0\n"
    with pytest.raises(ValueError, match="sha256"):
        data.download_ett(tmp_path / "bad", names=("ETTh2",))
    assert not list((tmp_path / "bad" / "ETT").iterdir())


def _tiny_data(cfg, n_train=40, n_eval=24):
    """ETTh1 cut to a few windows per split so that epochs take a handful of steps."""
    full = data.load_dataset("ETTh1", cfg.data.seq_len, cfg.data.pred_len)
    extra = cfg.data.seq_len + cfg.data.pred_len - 1

    def cut(ds, n):
        return dataclasses.replace(ds, data=ds.data[: n + extra], marks=ds.marks[: n + extra])

    return dataclasses.replace(
        full, train=cut(full.train, n_train), val=cut(full.val, n_eval), test=cut(full.test, n_eval)
    )


@pytest.mark.parametrize("backbone", configs.MODELS)
def test_one_training_step(backbone, tmp_path):
    cfg = configs.tiny_config(backbone=backbone)
    cfg.loop.max_steps = 1
    record = train.train_and_evaluate(cfg, str(tmp_path), data=_tiny_data(cfg))
    assert record["steps"] == 1 and record["model"] == backbone
    assert np.isfinite(record["mse"]) and np.isfinite(record["mae"])
    assert (tmp_path / "result.json").exists()
    if backbone.startswith("rsa_"):
        assert record["rsa_counts"] == list(cfg.model.rsa_counts)
        assert len(record["gates"]) == cfg.model.num_layers
        # one step of lr <= 1e-3 moves mu = 1 a little: the gate stays near sigmoid(1)
        assert all(abs(g - 0.7311) < 0.01 for g in record["gates"]), record["gates"]
    else:
        assert "gates" not in record


def test_resume_is_exact(tmp_path):
    cfg = configs.tiny_config(backbone="aaren")
    cfg.model.dropout = 0.1  # dropout keys must be reproduced too
    tiny = _tiny_data(cfg)  # 5 steps per epoch at batch 8, 3 epochs (compiled by the smoke test)

    def run(max_steps, workdir):
        loop = dataclasses.replace(cfg.loop, max_steps=max_steps)
        return fit(
            train.build_model(cfg, tiny),
            train.loss_fn,
            train.eval_fn,
            tiny.train,
            tiny.val,
            monitor="mse",
            mode="min",
            loop=loop,
            optim=cfg.optim,
            workdir=workdir,
        )

    full = run(12, None)
    first = run(7, str(tmp_path))  # stops mid-epoch 2 and checkpoints
    assert first.step == 7
    resumed = run(12, str(tmp_path))
    assert resumed.step == 12
    jax.tree.map(np.testing.assert_array_equal, resumed.params, full.params)
    assert resumed.best_metric == full.best_metric
    assert [h["val_mse"] for h in resumed.history] == [h["val_mse"] for h in full.history]


def test_sweep_skips_recorded_runs(tmp_path):
    from examples.common import append_record
    from examples.forecasting import sweep

    results = tmp_path / "forecasting.json"
    append_record(results, {"dataset": "illness", "horizon": 24, "model": "aaren", "seed": 0})
    args = sweep.parse_args(
        ["--datasets", "illness", "--models", "aaren", "--seeds", "0", "--results", str(results)]
    )
    done = {("illness", 24, "aaren", 0)}
    assert sweep.pending_runs(args, done) == [("illness", h, "aaren", 0) for h in (36, 48, 60)]


def test_conv_embedding_is_causal_and_hashable():
    from flax import nnx

    from examples.forecasting.model import Forecaster

    cfg = configs.tiny_config(backbone="transformer").model
    cfg = dataclasses.replace(cfg, value_embedding="conv", instance_norm=False, dropout=0.0)
    model = Forecaster(cfg, num_channels=3, num_marks=2, seq_len=6, pred_len=2, rngs=nnx.Rngs(0))
    hash(nnx.split(model)[0])  # the jitted steps take the graph definition as a static argument
    x = np.random.default_rng(0).normal(size=(1, 6, 3)).astype(np.float32)
    y = x.copy()
    y[:, -1] += 1.0  # changing the last input must not change earlier embeddings
    ex, ey = model.value_embed(x), model.value_embed(y)
    np.testing.assert_allclose(ex[:, :-1], ey[:, :-1])
    assert not np.allclose(ex[:, -1], ey[:, -1])
