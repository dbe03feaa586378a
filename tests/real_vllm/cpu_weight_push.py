"""TEST FIXTURE: the asynchronous trainers' weight push on CPU. Test code only: not in the package.

TRL's asynchronous trainer pushes its weights through a `WeightTransferProtocol`, NCCL only in TRL, and asynchronous
training on CPU is no product feature. `CpuWeightTransfer` is that protocol over the package's CPU push
(`trl_bandpo.training.vllm_cpu`): the weights saved as safetensors, reloaded by the server's worker extension
(`RELOAD_METHOD` of `CpuWeightReload`, which ``trl-bandpo vllm-serve`` installs, through vLLM's dev-mode
``/collective_rpc``). The tests that train through it check that the server holds the trained weights
(`vllm_tier.assert_engine_holds`).
"""

from __future__ import annotations

import os
import tempfile

from trl_bandpo.training.vllm_cpu import RELOAD_METHOD

__all__ = ["CpuWeightTransfer"]


class CpuWeightTransfer:
    """STAND-IN for TRL's asynchronous weight transfer (`trl.experimental.async_grpo.WeightTransferClient`, NCCL only),
    passed to an async trainer as its ``weight_transfer`` (TRL's `WeightTransferProtocol`).

    It drives the server as TRL's client does: ``/pause`` (keeping in-flight requests), the weights, ``/resume``.
    The weights travel as TRL's async trainer streams them (its names, adapters merged) into a safetensors file that
    the server's worker extension reloads (`RELOAD_METHOD`), then the prefix cache is reset.

    Where the server labels its weights (vLLM's dev-mode ``/update_weight_version`` and ``/weight_info``, in 0.31 and
    0.32), each push labels the new weights, before ``/resume``, with the model version TRL's trainer publishes after
    it (its ``model_version`` counts the pushes: 1 after the push at train begin), so that the engine's version is the
    one the rollout worker tags its samples with, and on vLLM 0.32, which reports per token the version that sampled
    it, every token sampled from then on carries it (`labels_versions`).
    """

    def __init__(self, base_url: str):
        self.base_url = base_url.rstrip("/")
        self.pushes = 0
        self.labels_versions = False  # set by init_weight_transfer: does the server report weight versions?

    def _post(self, path: str, **kwargs) -> None:
        import requests

        response = requests.post(f"{self.base_url}{path}", timeout=120, **kwargs)
        if response.status_code != 200:
            raise RuntimeError(f"POST {path} failed: {response.status_code} {response.text}")

    def init_weight_transfer(self) -> None:
        import requests

        assert requests.get(f"{self.base_url}/health", timeout=10).status_code == 200
        self.labels_versions = requests.get(f"{self.base_url}/weight_info", timeout=10).status_code == 200

    def pause(self) -> None:
        self._post("/pause", params={"mode": "keep"})

    def send_weights(self, iterator) -> None:
        from safetensors.torch import save_file

        weights = {name: tensor.detach().clone().contiguous() for name, tensor in iterator}
        with tempfile.TemporaryDirectory(prefix="trl-bandpo-async-push-") as folder:
            save_file(weights, os.path.join(folder, "model.safetensors"))
            self._post("/collective_rpc", json={"method": RELOAD_METHOD, "kwargs": {"weights_path": folder}})
        self._post("/reset_prefix_cache")
        self.pushes += 1
        if self.labels_versions:
            self._post("/update_weight_version", json={"new_version": str(self.pushes)})

    def resume(self) -> None:
        self._post("/resume")

    def destroy(self) -> None:
        pass
