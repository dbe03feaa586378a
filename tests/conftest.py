import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
# The patched TRL methods' source files (trl_bandpo/training/trl_patches.py) go to a folder of this run, not ~/.cache.
os.environ.setdefault("TRL_BANDPO_PATCHED_DIR", tempfile.mkdtemp(prefix="trl-bandpo-patched-"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2 model and character tokenizer saved to a folder (TRL needs a path when `beta != 0`)."""
    from trl_bandpo.demo.tiny_model import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2")))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_SYNCING_METHODS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.fixture
def forbid_host_reads(monkeypatch):
    """Every Tensor method that reads a value on the host raises, as a host synchronisation would on CUDA."""
    import torch

    def make(name):
        def raiser(self, *args, **kwargs):
            raise AssertionError(f"band_bounds called Tensor.{name}(): a host synchronisation on GPU")

        return raiser

    for name in _SYNCING_METHODS:
        monkeypatch.setattr(torch.Tensor, name, make(name))
    yield
    monkeypatch.undo()
