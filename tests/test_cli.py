"""The `trl-bandpo` command: the bounds table and dispatch."""

import subprocess
import sys

import pytest

from trl_bandpo.cli import main


def test_bounds_table_prints_reference_values(capsys):
    main(["bounds", "--divergence", "kl", "--radius", "0.05", "--p", "0.08", "0.5"])
    out = capsys.readouterr().out
    # KL Band, delta = 0.05: the reference values of tests/test_band.py
    assert "| 0.08 | 0.2616958435 | 2.410553794 |" in out
    assert "| 0.5 | 0.6915156698 | 1.30848433 |" in out


def test_bounds_rejects_bad_radius(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bounds", "--radius", "-1"])
    assert exc.value.code == 2
    assert "radius" in capsys.readouterr().err


def test_unknown_command_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "trl_bandpo.cli", "frobnicate"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "unknown command" in result.stderr


def test_help_lists_commands(capsys):
    main([])
    out = capsys.readouterr().out
    for command in ("demo", "bounds", "train", "eval"):
        assert command in out
