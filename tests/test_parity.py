"""The parity tool on hand-made curves, and Chapter 16's layouts against one process: losses and gradient norms."""

import json

import pytest

from scalebook import labs, parity
from scalebook.comm import launch


def test_report_names_the_first_step_beyond_the_tolerance():
    reference = [4.0, 3.0, 2.0, 1.0]
    report = parity.compare_losses(
        {"single": reference, "close": [4.0, 3.0001, 2.0, 1.00005], "off": [4.0, 3.0, 2.1, 1.3]}, tolerance=1e-4
    )
    assert report["close"].passed and report["close"].max_deviation == pytest.approx(5e-5)
    off = report["off"]
    assert not off.passed and off.first_divergent_step == 2
    assert off.max_deviation == pytest.approx(0.3) and off.worst_step == 3
    assert not report.passed
    assert "FAIL  off: max deviation 3.0e-01 at step 3, first exceeds the tolerance at step 2" in str(report)
    # A layout within the tolerance shows no digits of its deviation (rounding, which differs between CPUs).
    assert "pass  close: max deviation < 0.0001 at every step" in str(report)


def test_reference_can_be_named():
    report = parity.compare_losses({"a": [1.0, 2.0], "b": [1.0, 2.0]}, reference="b")
    assert report.reference == "b" and report["a"].max_deviation == 0.0


@pytest.mark.parametrize(
    "losses, kwargs, message",
    [
        ({"a": [1.0]}, {}, "at least two"),
        ({"a": [1.0, 2.0], "b": [1.0]}, {}, "same number of steps"),
        ({"a": [1.0], "b": [float("nan")]}, {}, "NaN"),
        ({"a": [1.0], "b": [1.0]}, {"reference": "c"}, "reference 'c'"),
        ({"a": [1.0], "b": [1.0]}, {"tolerance": 0}, "tolerance"),
    ],
)
def test_bad_input_raises_one_value_error(losses, kwargs, message):
    with pytest.raises(ValueError, match=message):
        parity.compare_losses(losses, **kwargs)


def test_command_line_reads_json_and_plain_files(tmp_path, capsys):
    (tmp_path / "ref.txt").write_text("4.0\n3.0\n")
    (tmp_path / "run.json").write_text(json.dumps([4.0, 3.5]))
    assert parity.main([str(tmp_path / "ref.txt"), str(tmp_path / "run.json")]) == 1
    assert "first exceeds the tolerance at step 1" in capsys.readouterr().out
    (tmp_path / "same.json").write_text(json.dumps([4.0, 3.0]))
    assert parity.main([str(tmp_path / "ref.txt"), str(tmp_path / "same.json")]) == 0


def test_gradient_norms_catch_the_missing_average_that_the_losses_hide():
    results = launch(labs.parity_lab, 2, steps=4, timeout=120)[0]
    summed, untied = "dp2 broken: gradients summed, not averaged", "pp2 broken: tied embedding not synced"
    # fp32 reductions in another order: ~1e-7 relative over a few steps (1.6e-6 measured for tp2's norms).
    losses = parity.compare_losses(results["losses"], reference="single", tolerance=1e-5)
    norms = parity.compare_losses(results["grad_norms"], reference="single", tolerance=1e-5, quantity="gradient norm")
    assert [p.layout for p in losses.layouts if p.passed] == ["dp2", "tp2", "pp2", summed]
    assert [p.layout for p in norms.layouts if p.passed] == ["dp2", "tp2", "pp2"]
    # Summing over d = 2 ranks doubles every gradient: AdamW divides the factor out of its update, so the
    # losses stay within 1e-5 (2e-6 measured), but the norm is twice the reference's from step 0.
    assert norms[summed].first_divergent_step == 0
    assert norms[summed].deviations[0] == pytest.approx(1.0, rel=1e-5)
    # The unsynced tied embedding changes the first stage's gradient at once (its norm at step 0) and the
    # losses from step 1 on (step 0's loss is computed before any update).
    assert norms[untied].first_divergent_step == 0 and losses[untied].first_divergent_step == 1
    assert str(norms).startswith("gradient norm parity against 'single'")
