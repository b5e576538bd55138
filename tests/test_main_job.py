"""The main job (``python -m aaren_jax``) is a self-check: a table, JSON, a failing exit status."""

import json

import pytest

from aaren_jax import __main__ as main_job

ARGS = ["--length", "12", "--batch", "2", "--heads", "2"]


@pytest.mark.slow
def test_main_job_passes_and_reports(capsys):
    assert main_job.main([*ARGS, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["streaming"]["passed"]
    case = report["scan"]["case"]
    assert len(case["left_padding_per_row"]) == 2 and case["shape"]["T"] == 12
    for m in report["scan"]["methods"].values():
        assert m["passed"] and m["max_abs_error_vs_float64"] <= report["scan"]["tolerance"]
    table = main_job.format_table(report)
    assert "left padding" in table and "scores:" in table and "All checks passed" in table
    for method in main_job.METHODS:
        assert any(line.split()[:1] == [method] and "pass" in line for line in table.splitlines())
    resolved = report["scan"]["auto_resolves_to"]
    assert resolved in ("native", "blocked", "associative") and f"auto ({resolved})" in table


def test_main_job_exits_nonzero_when_a_check_fails(capsys, monkeypatch):
    case = {
        "shape": {"B": 1, "H": 1, "T": 4, "D": 2},
        "seed": 0,
        "left_padding_per_row": [1],
        "score_scale_range": [0.1, 1.0],
        "score_range": [-1.0, 1.0],
        "max_score_spread_in_a_row": 2.0,
    }
    method = {
        "max_abs_error_vs_float64": 1e-3,
        "max_abs_diff_vs_step_loop": 0.0,
        "final_readout_diff_vs_step_loop": 0.0,
        "passed": False,
        "forward_ms": 0.1,
    }
    stream = {
        "model": "Aaren(...)",
        "tokens": 4,
        "prefill_tokens": 2,
        "max_abs_diff_prefill_then_stream_vs_parallel": 0.0,
        "tolerance": 1e-4,
        "carry_bytes_after_prefill": 8,
        "carry_bytes_at_end": 8,
        "passed": True,
    }
    scan = {"case": case, "tolerance": 2e-5, "methods": {"chunked": method}}
    monkeypatch.setattr(main_job, "scan_report", lambda *a: scan)
    monkeypatch.setattr(main_job, "streaming_report", lambda *a: stream)
    assert main_job.main(ARGS) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "SOME CHECKS FAILED" in out
