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
    for command in ("demo", "bounds", "train", "eval", "tiny-model"):
        assert command in out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--p", "2", "-1"], "argument --p: expected a number in (0, 1], got '2'"),
        (["--p", "0.5", "0"], "argument --p: expected a number in (0, 1], got '0'"),
        (["--p", "nan"], "argument --p: expected a number in (0, 1], got 'nan'"),
        (["--radius", "inf"], "argument --radius: expected a finite number >= 1.17549e-38, got 'inf'"),
        (["--radius", "0"], "argument --radius:"),
        (["--upper-max", "0.5"], "argument --upper-max: expected None or a number >= 1, got '0.5'"),
        (["--upper-max", "nan"], "argument --upper-max:"),
        (["--relax", "1.5", "0.2"], "argument --relax: EPS_LOW must be a number in [0, 1), got 1.5"),
        (["--relax", "0.2", "x"], "argument --relax: expected a finite number >= 0, got 'x'"),
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


def test_bounds_caps_the_upper_bound_at_10_by_default_as_the_configs_do(capsys):
    """KL, delta = 0.05, p = 0.01: the Band's upper bound is 7.809846290 (docs/band-operator.md), under the cap;
    at p = 1e-4 it is 494.6038824, capped at 10 unless `--upper-max none`."""
    from trl_bandpo.training.configs import PolicyLossConfig

    assert PolicyLossConfig.band_upper_max == 10.0
    main(["bounds", "--radius", "0.05", "--p", "1e-4", "0.01"])
    out = capsys.readouterr().out
    assert "upper_max=10.0" in out and "| 0.0001 |" in out and "| 10 |" in out and "| 7.80984629 |" in out
    for spelling in ("none", "None", "null"):
        main(["bounds", "--radius", "0.05", "--upper-max", spelling, "--p", "1e-4"])
        out = capsys.readouterr().out
        assert "upper_max=None" in out and "| 494.6038824 |" in out


def test_bounds_help_states_the_default_cap(capsys):
    with pytest.raises(SystemExit):
        main(["bounds", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: 10" in text and "--upper-max none" in text


def test_tiny_model_command_writes_the_model_and_problems_and_prints_the_cpu_command(tmp_path, capsys, monkeypatch):
    import json

    from trl_bandpo.cli import tiny_model as tiny_model_cli
    from trl_bandpo.cli.tiny_model import cpu_train_command
    from trl_bandpo.demo.tiny_model import save_tiny_model

    # the warm start (tests/test_tiny_model.py checks what it reaches) stands in as a plain tiny model: the command's
    # files and output are tested here
    monkeypatch.setattr(tiny_model_cli, "save_answering_model",
                        lambda path, **kwargs: (save_tiny_model(path), {"steps": 0, "accuracy": 0.5})[1])  # fmt: skip
    main(["tiny-model", str(tmp_path / "tiny")])
    out = capsys.readouterr().out
    for name in ("config.json", "model.safetensors", "tokenizer.json", "problems.jsonl"):
        assert (tmp_path / "tiny" / name).is_file(), name
    rows = [json.loads(line) for line in (tmp_path / "tiny" / "problems.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and rows[3] == {"problem": "What is 3 + 4?", "answer": 7}
    assert out.rstrip().splitlines()[-1] == cpu_train_command(str(tmp_path / "tiny"))
    assert "--model_name_or_path " + str(tmp_path / "tiny") in out and "--max_completion_length 32" in out


def test_tiny_model_refuses_a_file_as_its_folder(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["tiny-model", str(target)])
    assert exc.value.code == 2 and "exists and is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("args, named", [(["--foo"], "--foo"), (["extra"], "extra"), (["-x", "1"], "-x 1")])
def test_patched_source_rejects_unknown_arguments_naming_them(capsys, args, named):
    with pytest.raises(SystemExit) as exc:
        main(["patched-source", *args])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert f"trl-bandpo patched-source: error: unrecognized arguments: {named}" in captured.err
    assert captured.out == ""


def test_patched_source_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["patched-source", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: trl-bandpo patched-source") and "docs/upgrading-trl.md" in out
