"""Smoke test of examples/regular_languages: one training step of each model on a tiny config."""

import argparse
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples.regular_languages import data, seed_factors, select_rsa, sweep, train


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
    assert record["positional"] == train.DEFAULT_POSITIONAL[model]
    if model.startswith("rsa_"):
        assert len(record["gates"]) == 1 and record["rsa_counts"] == [3, 1, 1, 0, 0, 0]
    json.dumps(record)  # a record is plain JSON


def test_learning_rate_halves_every_five_epochs():
    sched = train.make_schedule(train.Config(), steps_per_epoch=10)
    assert sched(0) == pytest.approx(0.005) and sched(49) == pytest.approx(0.005)
    assert sched(50) == pytest.approx(0.0025) and sched(249) == pytest.approx(0.005 / 16)


def test_sweep_skips_done_runs():
    args = argparse.Namespace(
        languages=["parity", "d2"], models=["aaren", "rsa_aaren"], seeds=[0, 1], positional=None
    )
    done = {
        ("parity", "aaren", 0, "sinusoidal", None),
        ("parity", "rsa_aaren", 0, "sinusoidal", None),
    }
    runs = sweep.pending_runs(args, done)
    # rsa_aaren's default is no absolute positions: its sinusoidal record does not count.
    assert len(runs) == 7 and ("parity", "aaren", 0, "sinusoidal", None) not in runs
    assert ("parity", "rsa_aaren", 0, "none", None) in runs
    assert [r[2] for r in runs[:3]] == [0, 0, 0]  # seed-major: one seed of everything first
    ablation = sweep.pending_runs(argparse.Namespace(**{**vars(args), "positional": "none"}), done)
    assert ("parity", "aaren", 0, "none", None) in ablation and len(ablation) == 8


def _selection_record(language, model, name, val, seed=0):
    fields = select_rsa.CASES[name]
    return dict(
        language=language, model=model, name=name, seed=seed, val=val, mu_init=1.0,
        learning_rate=0.005,
        rsa_counts=list(fields["rsa_counts"]), rsa_dilations=list(fields["rsa_dilations"]),
    )  # fmt: skip


def test_selection_chooses_on_validation_and_the_sweep_runs_the_choice():
    records = [
        _selection_record("d4", "rsa_aaren", "III", 0.90),
        _selection_record("d4", "rsa_aaren", "I", 0.80),
        _selection_record("d4", "rsa_aaren", "II", 0.95),
        _selection_record("d4", "rsa_aaren", "IV", 0.95),  # a tie: the earlier case wins
        _selection_record("d4", "rsa_transformer", "I", 0.80),
        _selection_record("d4", "rsa_transformer", "III", 0.80),  # a tie: III comes first
    ]
    assert select_rsa.chosen(records, "d4", "rsa_aaren")["name"] == "II"
    assert select_rsa.chosen(records, "d4", "rsa_transformer")["name"] == "III"
    assert select_rsa.chosen(records, "parity", "rsa_aaren") is None
    stage2 = select_rsa.candidates(records, "d4", "rsa_aaren", stage=2)
    assert stage2["II+mu0"] == {
        "rsa_counts": (3, 0, 0, 2, 0, 0), "rsa_dilations": (2, 2), "mu_init": 0.0,
        "learning_rate": 0.005, "eta_range": (1.0, 2.0),
    }  # fmt: skip
    assert stage2["II+eta2.5-3.5"]["eta_range"] == (2.5, 3.5)
    assert len(stage2) == len(select_rsa.VARIATIONS)
    # the choice reaches the REMs that train builds
    rem = train.Config(model="rsa_aaren", **stage2["II+eta2.5-3.5"]).rem_config()
    assert rem.eta_range == (2.5, 3.5) and rem.counts == (3, 0, 0, 2, 0, 0)
    # a stage-2 variation that beats its case becomes the choice
    records.append({**_selection_record("d4", "rsa_aaren", "II", 0.99), "name": "II+lr0.01"})
    assert select_rsa.chosen(records, "d4", "rsa_aaren")["name"] == "II+lr0.01"

    args = argparse.Namespace(
        languages=["d4"], models=["aaren", "rsa_aaren"], seeds=[0], positional=None
    )
    done = {("d4", "rsa_aaren", 0, "none", None)}  # a Case III run: not the chosen one
    runs = sweep.pending_runs(args, done, records)
    assert runs == [
        ("d4", "aaren", 0, "sinusoidal", None),
        ("d4", "rsa_aaren", 0, "none", "II+lr0.01"),
    ]
    parity = argparse.Namespace(**{**vars(args), "languages": ["parity"]})
    with pytest.raises(SystemExit, match="parity/rsa_aaren"):
        sweep.pending_runs(parity, set(), records)
    with pytest.raises(SystemExit, match="not tried every case for d4/rsa_aaren"):
        sweep.pending_runs(args, done, records[1:])  # Case III missing: no choice yet
    # more seeds of the cases: only configurations with the most seeds compete, on their mean
    for seed, (val_iii, val_ii) in enumerate([(0.80, 0.10), (0.70, 0.20)], start=1):
        records.append(_selection_record("d4", "rsa_aaren", "III", val_iii, seed))
        records.append(_selection_record("d4", "rsa_aaren", "II", val_ii, seed))
    best = select_rsa.chosen(records, "d4", "rsa_aaren")
    assert (best["name"], best["seeds"]) == ("III", [0, 1, 2])
    assert best["val"] == pytest.approx((0.90 + 0.80 + 0.70) / 3)  # II: (0.95 + 0.1 + 0.2) / 3
    # Case III at the default mu_init and learning rate is train.Config's own configuration:
    # the default run is its run, not one to repeat under the case's name
    assert select_rsa.is_default(best) and not select_rsa.is_default(records[3])
    assert not select_rsa.is_default({**best, "eta_range": [2.5, 3.5]})
    assert sweep.pending_runs(args, done, records) == [("d4", "aaren", 0, "sinusoidal", None)]


def test_tables_separate_default_runs_from_ablations():
    def rec(model, positional, bin1, epochs=25):
        size = data.language_spec("d2").train_size
        return dict(
            language="d2", model=model, seed=0, bin0=1.0, bin1=bin1, positional=positional,
            epochs=epochs, train_size=size,
        )  # fmt: skip

    records = [
        rec("rsa_transformer", "none", 1.0),
        rec("rsa_transformer", "sinusoidal", 0.1),
        rec("transformer", "sinusoidal", 0.5, epochs=3),  # not the paper's epochs
        rec("rsa_transformer", "none", 0.0),  # a second record of the first run: ignored
    ]
    main_row = next(line for line in sweep.table(records).splitlines() if line.startswith("| d2"))
    assert "1.00 / 1.00 (n=1)" in main_row and "0.10" not in main_row
    assert main_row.split("|")[2].strip() == "pending"  # the 3-epoch transformer run
    ablation = sweep.ablation_table(records)
    assert "rsa_transformer, sinusoidal positions" in ablation and "1.00 / 0.10 (n=1)" in ablation
    assert sweep.chosen_table(records) == ""
    chosen = {**rec("rsa_transformer", "none", 0.7), "rsa_case": "IV"}
    assert "IV: 1.00 / 0.70 (n=1)" in sweep.chosen_table([*records, chosen])
    assert sweep.ablation_table([*records, chosen]) == ablation  # a chosen run: not an ablation
    # a later stage changed the choice: one entry per case, the current choice first
    rechosen = {**rec("rsa_transformer", "none", 0.9), "rsa_case": "IV+mu0"}
    select = [
        _selection_record("d2", "rsa_transformer", "IV", 0.5),
        {**_selection_record("d2", "rsa_transformer", "IV", 0.8), "name": "IV+mu0", "mu_init": 0.0},
    ]

    def d2_cell(*args):
        return next(ln for ln in sweep.chosen_table(*args).splitlines() if ln.startswith("| d2"))

    cell = d2_cell([*records, chosen, rechosen], select)
    assert "IV+mu0: 1.00 / 0.90 (n=1); IV: 1.00 / 0.70 (n=1)" in cell
    cell = d2_cell([*records, chosen, rechosen])
    assert "IV: 1.00 / 0.70 (n=1); IV+mu0: 1.00 / 0.90 (n=1)" in cell
    # Case III chosen: the default runs (rsa_case None, default positions) under its name
    select.append(_selection_record("d2", "rsa_transformer", "III", 0.9))
    select[1]["val"] = 0.0
    cell = d2_cell([*records, chosen, rechosen], select)
    assert "| III: 1.00 / 1.00 (n=1); IV: 1.00 / 0.70 (n=1); IV+mu0" in cell
    d2_row = next(line for line in sweep.table([chosen]).splitlines() if line.startswith("| d2"))
    assert d2_row.count("pending") == len(train.MODELS)  # not a Case III run


@pytest.mark.parametrize("model", train.MODELS)
def test_left_padding_invariance_without_absolute_positions(model):
    """Without absolute positions, left padding changes no valid output (REM lags and Aaren's
    scan skip padded slots); sinusoidal positions shift with the padding, so outputs change."""
    tokens = jnp.asarray([[1, 2, 2, 1, 2, 1]])
    padded = jnp.concatenate([jnp.zeros((1, 3), tokens.dtype), tokens], axis=1)
    mask = jnp.ones(tokens.shape, bool)
    padded_mask = jnp.concatenate([jnp.zeros((1, 3), bool), mask], axis=1)
    outputs = {}
    for positional in train.POSITIONAL:
        cfg = train.Config(
            model=model, num_layers=2, d_model=10, num_heads=5, d_ff=10, positional=positional
        )
        net = train.LanguageModel(cfg, vocab_in=3, vocab_out=3, rngs=nnx.Rngs(0))
        outputs[positional] = (net(tokens, mask), net(padded, padded_mask)[:, 3:])
    np.testing.assert_allclose(*outputs["none"], rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(np.subtract(*outputs["sinusoidal"]))) > 1e-3


def test_unknown_positional_is_rejected():
    with pytest.raises(ValueError, match="positional"):
        train.LanguageModel(
            train.Config(positional="learned"), vocab_in=3, vocab_out=3, rngs=nnx.Rngs(0)
        )


@pytest.mark.slow
def test_analysis_profiles_errors_and_reads_the_rems(tiny_data):
    from examples.regular_languages import analyze

    right = np.ones((4, 12), bool)
    right[1, 5] = False  # a length-12 string wrong first at position 6
    right[3, 2] = right[3, 9] = False  # a length-11 string wrong first at position 3
    lengths = np.array([12, 12, 3, 11])
    profile = analyze.error_profile(right, lengths, train_max=5)
    assert profile["exact"] == 0.5
    assert profile["by_length"] == {
        "0-9": {"n": 1, "exact": 1.0},
        "10-19": {"n": 3, "exact": pytest.approx(1 / 3)},
    }
    first = profile["first_error"]
    assert first["failures"] == 2 and first["quantiles_10_50_90"][1] == 4.5
    assert first["share_within_10_of_the_end"] == 1.0  # 12 - 6 and 11 - 3 positions left
    assert first["share_beyond_training_lengths"] == 0.5  # position 6 > 5

    cfg = train.Config(
        language="tomita3", model="rsa_aaren", num_layers=2, d_model=10, num_heads=5, d_ff=10,
        epochs=1, batch_size=8, eval_batch_size=4, train_size=8, test_size=4,
    )  # fmt: skip
    trained = []
    record = train.train_and_evaluate(cfg, datasets=tiny_data, model_out=trained)
    rems = analyze.rem_parameters(trained[0])
    assert [layer["gate"] for layer in rems] == pytest.approx(record["gates"])
    assert len(rems[0]["lambda"]) == 3 and len(rems[0]["gamma"]) == len(rems[0]["theta"]) == 2
    assert all(-1 < x < 1 for x in rems[0]["lambda"]) and all(0 < g < 1 for g in rems[0]["gamma"])
    right = analyze.predictions(trained[0], tiny_data["bin1"])
    assert right.all(axis=1).mean() == pytest.approx(record["bin1"])


def test_seed_factors_grid_puts_data_seeds_in_rows():
    def rec(data_seed, seed, val):
        return dict(
            language="parity", model="rsa_aaren", case="II", data_seed=data_seed, seed=seed,
            val=val,
        )  # fmt: skip

    records = [rec(0, 0, 0.0), rec(0, 1, 0.25), rec(1, 0, 0.9), {**rec(1, 1, 0.5), "case": "I"}]
    assert seed_factors.grid(records, "parity", "rsa_aaren", "II").splitlines()[2:] == [
        "| 0 | 0.000 | 0.250 |",
        "| 1 | 0.900 | - |",  # the Case I run is another grid's
    ]


def test_selection_keeps_one_validation_fraction_per_results_file(tmp_path, capsys):
    results = tmp_path / "selection.json"
    results.write_text(json.dumps([_selection_record("d4", "rsa_aaren", "III", 0.9)]))
    argv = ["--results", str(results), "--languages", "d4", "--models", "rsa_aaren", "--dry-run"]
    with pytest.raises(SystemExit, match="another file for 0.5"):
        select_rsa.main([*argv, "--validation-fraction", "0.5"])
    select_rsa.main(argv)  # the file's own fraction (0.2, the default): the other cases pend
    assert capsys.readouterr().out.split("\n")[:3] == [
        "d4 rsa_aaren I seed 0", "d4 rsa_aaren II seed 0", "d4 rsa_aaren IV seed 0",
    ]  # fmt: skip
