"""A researcher's own data and safe reruns: a TSLib CSV through --csv, run folders keyed by
configuration, sweeps that leave the committed results alone, progress without a terminal."""

import dataclasses
import datetime as dt
import hashlib
import json
import logging

import numpy as np
import pytest

from examples.common.paths import REPO_ROOT
from examples.common.progress import Progress
from examples.common.runs import OMIT_DEFAULT, ConfigMismatchError, RunDir, config_hash
from examples.forecasting import data
from examples.forecasting import main as forecast_main

COLUMNS = ["HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"]  # 8 columns with "date"


def write_tslib_csv(path, rows=240, date_format="slash"):
    """An hourly TSLib CSV with dates like TSLib's exchange_rate file: ``1990/1/1 0:00``."""
    rng = np.random.default_rng(0)
    t0 = dt.datetime(1990, 1, 1)
    lines = ["date," + ",".join(COLUMNS)]
    for i in range(rows):
        t = t0 + dt.timedelta(hours=i)
        stamp = f"{t.year}/{t.month}/{t.day} {t.hour}:{t.minute:02d}"
        if date_format == "iso":
            stamp = t.strftime("%Y-%m-%d %H:%M:%S")
        vals = np.sin(i / 7 + np.arange(len(COLUMNS))) + 0.1 * rng.normal(size=len(COLUMNS))
        lines.append(stamp + "," + ",".join(f"{v:.5f}" for v in vals))
    path.write_text("\n".join(lines) + "\n")
    return path


TINY = [
    "--seq-len", "16", "--horizon", "8", "--d-model", "16", "--layers", "1",
    "--batch-size", "8", "--epochs", "1", "--steps-per-epoch", "2", "--no-progress",
]  # fmt: skip


@pytest.fixture
def quiet_main(monkeypatch):
    """main() without reconfiguring the root logger (pytest captures logs there)."""
    monkeypatch.setattr(forecast_main, "setup_logging", lambda: None)
    return forecast_main.main


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2016-07-01 00:00:00", "2016-07-01T00:00:00"),
        ("1990/1/1 0:00", "1990-01-01T00:00:00"),
        ("1990/12/31 23:05", "1990-12-31T23:05:00"),
        ("2002-01-01", "2002-01-01T00:00:00"),
        ("2020-01-01T00:10:00", "2020-01-01T00:10:00"),
    ],
)
def test_tslib_date_formats(text, expected):
    assert str(data.parse_date(text)) == expected


def test_csv_errors_name_file_row_and_column(tmp_path):
    path = write_tslib_csv(tmp_path / "series.csv", rows=10)
    lines = path.read_text().splitlines()
    bad = lines[4].split(",")
    bad[3] = "n/a"
    path.write_text("\n".join(lines[:4] + [",".join(bad)] + lines[5:]) + "\n")
    with pytest.raises(data.CSVFormatError, match=r"series.csv, row 5, column 'MUFL': 'n/a'"):
        data.read_csv(path)
    lines[6] = "1990/13/1 0:00" + lines[6][lines[6].index(",") :]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(data.CSVFormatError, match=r"row 7, column 'date'"):
        data.read_csv(path)
    write_tslib_csv(path, rows=240)
    with pytest.raises(data.CSVFormatError, match="target column 'price' not found"):
        data.load_csv(path, 16, 8, target="price")


def test_csv_split_rules_and_frequencies(tmp_path):
    path = write_tslib_csv(tmp_path / "mine.csv")
    ds = data.load_csv(path, seq_len=16, pred_len=8)
    n = 240
    assert ds.borders == ([0, int(0.7 * n) - 16, n - int(0.2 * n) - 16], [168, 192, 240])
    assert ds.columns[-1] == "OT" and ds.freq == "h" and ds.num_marks == 4
    iso = data.load_csv(write_tslib_csv(tmp_path / "iso.csv", date_format="iso"), 16, 8)
    np.testing.assert_array_equal(iso.train.marks, ds.train.marks)  # same stamps, same features
    assert data.load_csv(path, 16, 8, freq="15min").num_marks == 5  # MinuteOfHour first
    assert data.split_rule_for(tmp_path / "ETTh9.csv") == "ett_hour"
    assert data.split_rule_for(tmp_path / "ETTm9.csv") == "ett_minute"
    with pytest.raises(data.CSVFormatError, match="ett_hour"):
        data.load_csv(path, 16, 8, split="ett_hour")  # 240 rows cannot hold 20 months


def test_csv_trains_end_to_end_and_reruns_are_keyed_by_config(tmp_path, quiet_main):
    csv_path = write_tslib_csv(tmp_path / "my_series.csv")
    workdir = tmp_path / "run"
    args = ["--csv", str(csv_path), "--target", "OT", "--freq", "h", *TINY]
    first = quiet_main([*args, "--workdir", str(workdir)])
    assert first["dataset"] == "my_series" and first["steps"] == 2
    assert np.isfinite(first["mse"]) and np.isfinite(first["mae"])
    for name in ("config.json", "result.json", "loss.png"):
        assert (workdir / name).exists(), name
    assert not (workdir / "checkpoints").exists()  # finished: dropped without --keep-checkpoints
    summary = json.loads((workdir / "result.json").read_text())
    assert summary["finished"] and summary["record"] == first

    # A changed learning rate in the same folder is refused, naming the difference ...
    with pytest.raises(SystemExit, match=r"optim.learning_rate: 0.001 \(saved\) -> 0.01"):
        quiet_main([*args, "--workdir", str(workdir), "--lr", "0.01"])
    assert json.loads((workdir / "result.json").read_text())["record"] == first  # untouched
    # ... and --overwrite trains afresh: new numbers, the new configuration recorded.
    fresh = quiet_main([*args, "--workdir", str(workdir), "--lr", "0.01", "--overwrite"])
    assert fresh["mse"] != first["mse"]
    saved = json.loads((workdir / "result.json").read_text())
    assert saved["config"]["optim"]["learning_rate"] == 0.01 and saved["record"] == fresh
    # The identical configuration returns the stored run: wall_s is not re-evaluation time.
    again = quiet_main([*args, "--workdir", str(workdir), "--lr", "0.01"])
    assert again == fresh
    # An edited file under the same name is another run, not this one.
    csv_path.write_text(csv_path.read_text().replace(",0.", ",1.", 3))
    with pytest.raises(SystemExit, match=r"data.csv_sha256"):
        quiet_main([*args, "--workdir", str(workdir), "--lr", "0.01"])


def test_default_run_folder_per_configuration(tmp_path, monkeypatch, quiet_main):
    from examples.common import loop

    bars = []

    class RecordingProgress(Progress):
        def __init__(self, total, initial, desc, enabled=True, terminal=None):
            bars.append((desc, initial, total))
            super().__init__(total, initial, desc, enabled, terminal)

    monkeypatch.setattr(loop, "Progress", RecordingProgress)
    monkeypatch.setenv("AAREN_RUNS_ROOT", str(tmp_path / "runs"))
    csv_path = write_tslib_csv(tmp_path / "series.csv")
    args = ["--csv", str(csv_path), *TINY]  # the configuration above: compiled already
    record = quiet_main([*args, "--max-steps", "1"])  # 1 of 2 steps: unfinished
    assert bars == [("series-8-aaren epoch 1/1", 0, 1)]  # a bar per epoch, capped by max_steps
    (folder,) = (tmp_path / "runs" / "forecasting" / "runs").iterdir()
    assert folder.name.startswith("series_8_aaren_0-")
    summary = json.loads((folder / "result.json").read_text())
    assert summary["record"] == record and not summary["finished"]
    assert (folder / "checkpoints").exists()  # unfinished: kept for resumption
    resumed = quiet_main(args)  # the same configuration carries on in the same folder
    assert resumed["steps"] == 2 and resumed["epochs"] == 1
    assert bars[-1] == ("series-8-aaren epoch 1/1", 1, 2)  # resumed mid-epoch
    assert not (folder / "checkpoints").exists()  # finished now
    other = quiet_main([*args, "--seed", "1", "--keep-checkpoints"])  # another folder
    assert len(list((tmp_path / "runs" / "forecasting" / "runs").iterdir())) == 2
    assert other["mse"] != resumed["mse"]
    assert list((tmp_path / "runs" / "forecasting" / "runs").glob("series_8_aaren_1-*/checkpoints"))


def test_run_dir_ignores_display_settings_and_refuses_unknown_runs(tmp_path):
    cfg = {"loop": {"progress": True, "batch_size": 8}, "optim": {"learning_rate": 1e-3}}
    RunDir(tmp_path / "a", cfg)
    quiet = {**cfg, "loop": {"progress": False, "batch_size": 8}}
    RunDir(tmp_path / "a", quiet)  # display settings do not make another run
    assert config_hash(cfg) == config_hash(quiet)
    with pytest.raises(ConfigMismatchError, match="loop.batch_size: 8 \\(saved\\) -> 16"):
        RunDir(tmp_path / "a", {**cfg, "loop": {"progress": True, "batch_size": 16}})
    (tmp_path / "legacy" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigMismatchError, match="without config.json"):
        RunDir(tmp_path / "legacy", cfg)
    RunDir(tmp_path / "legacy", cfg, overwrite=True)
    assert not (tmp_path / "legacy" / "checkpoints").exists()


def test_evaluation_settings_are_not_part_of_the_run(tmp_path):
    cfg = {"loop": {"batch_size": 8}, "eval": {"episodes": 10, "seed": 1000}}
    RunDir(tmp_path / "a", cfg)
    other = {**cfg, "eval": {"episodes": 100, "seed": 7, "stream": False}}
    RunDir(tmp_path / "a", other)  # the same trained model, evaluated otherwise
    assert config_hash(cfg) == config_hash(other)
    # only the section: a key that merely starts with "eval" still counts
    assert config_hash({**cfg, "evaluator": 1}) != config_hash({**cfg, "evaluator": 2})


def test_an_added_option_at_its_default_keeps_earlier_runs(tmp_path):
    @dataclasses.dataclass
    class Before:
        width: int = 8

    @dataclasses.dataclass
    class After:
        width: int = 8
        gate: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)

    RunDir(tmp_path / "a", Before())
    assert config_hash(After()) == config_hash(Before())
    RunDir(tmp_path / "a", After())  # the run made before the option resumes
    assert config_hash(After(gate=True)) != config_hash(Before())
    with pytest.raises(ConfigMismatchError, match="gate: absent \\(saved\\) -> True"):
        RunDir(tmp_path / "a", After(gate=True))


def _tree_digest(folder):
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def test_sweeps_without_results_leave_committed_results_untouched(tmp_path, monkeypatch):
    from examples.classification import sweep as cls_sweep
    from examples.forecasting import sweep as fc_sweep
    from examples.regular_languages import sweep as rl_sweep

    monkeypatch.setenv("AAREN_RUNS_ROOT", str(tmp_path))
    before = _tree_digest(REPO_ROOT / "results")

    configs_seen = []

    def fake_run(cfg, workdir=None, data=None, datasets=None, **kw):  # no training here
        configs_seen.append(cfg)
        return {"wall_s": 0.0, "mse": 1.0, "accuracy": 50.0, "bin0": 1.0, "bin1": 0.5}

    for mod in (fc_sweep, cls_sweep, rl_sweep):
        monkeypatch.setattr(mod.train, "train_and_evaluate", fake_run)
    monkeypatch.setattr(fc_sweep.train, "load_data", lambda *a, **k: None)
    monkeypatch.setattr(cls_sweep.data, "load_dataset", lambda *a, **k: None)
    monkeypatch.setattr(rl_sweep.data, "make_datasets", lambda *a, **k: None)
    for mod in (fc_sweep, cls_sweep, rl_sweep):
        monkeypatch.setattr(mod, "setup_logging", lambda: None)

    fc_sweep.main(["--datasets", "ETTh1", "--horizons", "96", "--models", "aaren", "--seeds", "0"])
    cls_sweep.main(["--datasets", "JapaneseVowels", "--models", "aaren", "--seeds", "0"])
    rl_sweep.main(["--languages", "parity", "--models", "aaren", "--seeds", "0"])

    assert _tree_digest(REPO_ROOT / "results") == before
    for task in ("forecasting", "classification", "regular_languages"):
        records = json.loads((tmp_path / task / "results.json").read_text())
        assert len(records) == 1, task
    named = tmp_path / "mine.json"
    cls_sweep.main(
        ["--datasets", "X", "--models", "aaren", "--seeds", "3", "--results", str(named)]
    )
    assert len(json.loads(named.read_text())) == 1


def test_progress_writes_log_lines_without_a_terminal(caplog):
    with caplog.at_level(logging.INFO):
        bar = Progress(10, 0, "run epoch 1/3", terminal=False)
        bar.update(5, 0.25, tokens=500)
        bar.close()
    assert bar.log_lines and bar.bar.disable
    assert "run epoch 1/3 step 5/10 loss 0.2500" in caplog.text
    silent = Progress(10, 0, "x", enabled=False, terminal=False)
    assert not silent.log_lines


def test_fit_names_a_checkpoint_of_another_model(tmp_path):
    """fit used directly (no run folder): a mismatching checkpoint gets a short message."""
    import jax.numpy as jnp

    from examples.common import CheckpointIO, LoopConfig, OptimConfig, fit
    from examples.forecasting import configs, train

    io = CheckpointIO(tmp_path / "checkpoints")
    io.save(1, {"params": {"w": jnp.zeros(3)}, "opt_state": {}, "best_params": {}}, {"step": 1})
    io.close()
    cfg = configs.tiny_config()
    rng = np.random.default_rng(0)
    rows = 8 + cfg.data.seq_len + cfg.data.pred_len - 1
    split = data.WindowDataset(
        rng.normal(size=(rows, 2)).astype(np.float32),
        rng.normal(size=(rows, 4)).astype(np.float32),
        cfg.data.seq_len,
        cfg.data.pred_len,
    )
    scale = (np.zeros(2), np.ones(2))
    tiny = data.ForecastData(split, split, split, *scale, ["a", "OT"], "h", ([], []))
    with pytest.raises(ValueError, match="checkpoint of another model or optimiser"):
        fit(
            train.build_model(cfg, tiny),
            train.loss_fn,
            train.eval_fn,
            split,
            split,
            monitor="mse",
            mode="min",
            loop=LoopConfig(batch_size=8, progress=False),
            optim=OptimConfig(),
            workdir=str(tmp_path),
        )
