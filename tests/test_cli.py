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


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--p", "2", "-1"], "argument --p: '2' is not a probability in (0, 1]"),
        (["--p", "0.5", "0"], "argument --p: '0' is not a probability in (0, 1]"),
        (["--p", "nan"], "argument --p: 'nan' is not a probability"),
        (["--radius", "inf"], "argument --radius: the radius delta must be a finite number > 0, got 'inf'"),
        (["--radius", "0"], "argument --radius:"),
        (["--upper-max", "0.5"], "argument --upper-max: the cap on the upper bound must be a number >= 1, got '0.5'"),
        (["--upper-max", "nan"], "argument --upper-max:"),
    ],
)
def test_bounds_rejects_values_outside_their_domain_naming_the_flag(capsys, args, needle):
    with pytest.raises(SystemExit) as exc:
        main(["bounds", *args])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert needle in captured.err and "|" not in captured.out


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(capsys, flag):
    import trl_bandpo

    main([flag])  # returns: exit status 0
    assert capsys.readouterr().out.strip() == f"trl-bandpo {trl_bandpo.__version__}"


def test_version_from_the_console_entry():
    import trl_bandpo

    result = subprocess.run(
        [sys.executable, "-m", "trl_bandpo.cli", "--version"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == f"trl-bandpo {trl_bandpo.__version__}"
