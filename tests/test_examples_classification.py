"""Classification example: the .ts reader on the shared UEA files, and a training step."""

import numpy as np
import pytest

from examples.common.paths import default_data_root  # noqa: E402

DATA = default_data_root()
UEA = DATA / "UEA"
needs_data = pytest.mark.skipif(not UEA.exists(), reason="../shared/data is absent")

from examples.classification import configs, data, train  # noqa: E402


@needs_data
@pytest.mark.parametrize(
    "name, n_train, n_test, dims, classes, min_len, max_len",
    [
        ("JapaneseVowels", 270, 370, 12, 9, 7, 29),
        ("Handwriting", 150, 850, 3, 26, 152, 152),
    ],
)
def test_read_ts_counts(name, n_train, n_test, dims, classes, min_len, max_len):
    tr = data.read_ts(UEA / name / f"{name}_TRAIN.ts")
    te = data.read_ts(UEA / name / f"{name}_TEST.ts")
    assert (len(tr.series), len(te.series)) == (n_train, n_test)
    assert len(tr.labels) == n_train and len(te.labels) == n_test
    assert tr.num_dims == dims and te.num_dims == dims
    assert len(tr.class_names) == classes
    assert set(tr.labels) == set(tr.class_names)
    lengths = np.concatenate([tr.lengths, te.lengths])
    assert (lengths.min(), lengths.max()) == (min_len, max_len)
    assert not any(np.isnan(s).any() for s in tr.series)


@needs_data
def test_japanese_vowels_first_case_and_padding():
    tr = data.read_ts(UEA / "JapaneseVowels" / "JapaneseVowels_TRAIN.ts")
    assert tr.labels[0] == "1"
    assert tr.series[0].shape == (20, 12)
    assert tr.series[0][0, 0] == pytest.approx(1.860936)
    assert tr.series[0][0, 1] == pytest.approx(-0.207383)
    ds = data.load_dataset("JapaneseVowels")
    assert len(ds.train) + len(ds.val) == 270 and len(ds.test) == 370
    assert ds.train.x.shape[1:] == (29, 12) and ds.num_classes == 9
    lengths = ds.train.mask.sum(1)
    assert (
        lengths.min() >= 7
        and ds.train.mask[np.arange(len(lengths)), lengths - 1].any() is not False
    )
    # masks are prefixes and padding is zero
    for i in range(len(ds.train)):
        assert ds.train.mask[i, : lengths[i]].all() and not ds.train.mask[i, lengths[i] :].any()
        assert not ds.train.x[i, lengths[i] :].any()
    # normalisation fitted on the training cases
    real = ds.train.x[ds.train.mask]
    np.testing.assert_allclose(real.mean(0), 0.0, atol=1e-4)
    np.testing.assert_allclose(real.std(0), 1.0, atol=1e-3)
    # the hold-out is stratified: every class appears in both parts
    assert set(ds.val.y) == set(ds.train.y) == set(range(9))


def test_read_ts_missing_values_and_timestamps(tmp_path):
    text = """# a comment
@problemName Toy
@timeStamps false
@missing true
@univariate false
@dimensions 2
@equalLength false
@classLabel true a b
@data
1.0,?,3.0:4.0,5.0,NaN:a
1.5,2.5:0.5:b
"""
    path = tmp_path / "toy.ts"
    path.write_text(text)
    f = data.read_ts(path)
    assert f.labels == ["a", "b"] and f.class_names == ["a", "b"]
    assert f.series[0].shape == (3, 2) and np.isnan(f.series[0][1, 0])
    assert np.isnan(f.series[0][2, 1])
    assert f.series[1].shape == (2, 2) and np.isnan(f.series[1][1, 1])  # shorter dimension
    ts = text.replace("@timeStamps false", "@timeStamps true").replace(
        "1.5,2.5:0.5:b", "(0,1.5),(1,2.5):(0,0.5):b"
    )
    path.write_text(ts)
    np.testing.assert_array_equal(data.read_ts(path).series[1][:, 0], [1.5, 2.5])
    path.write_text(text.replace("@classLabel true a b", "@classLabel true a"))
    with pytest.raises(ValueError, match="not declared"):
        data.read_ts(path)


@needs_data
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backbone", ["aaren", "transformer"])
def test_one_training_step(backbone, causal, tmp_path):
    cfg = configs.tiny_config("JapaneseVowels", backbone)
    cfg.loop.max_steps = 1
    cfg.model.causal = causal
    record = train.train_and_evaluate(cfg, str(tmp_path))
    assert record["steps"] == 1 and record["model"] == backbone
    assert record["causal"] is causal
    assert 0.0 <= record["accuracy"] <= 100.0
    assert (tmp_path / "result.json").exists()


@needs_data
def test_sweep_is_resumable(tmp_path):
    from examples.classification import sweep

    results = tmp_path / "results.json"
    args = ["--datasets", "JapaneseVowels", "--models", "aaren", "--seeds", "0", "1"]
    args += ["--results", str(results)]
    done = {("JapaneseVowels", "aaren", 0, True)}
    assert sweep.pending_runs(sweep.parse_args(args), done) == [("JapaneseVowels", "aaren", 1)]
    # a causal record does not count for the bidirectional run
    both = [("JapaneseVowels", "aaren", 0), ("JapaneseVowels", "aaren", 1)]
    assert sweep.pending_runs(sweep.parse_args([*args, "--bidirectional"]), done) == both
