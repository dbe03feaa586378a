"""vLLM generation on CPU: the trainer's weights pushed into vLLM's CPU build, which TRL's push cannot reach.

TRL pushes the current weights into the engine before each generation. On vLLM's CPU build neither of its ways runs:
colocated, ``load_weights`` fails (vLLM-CPU repacks each linear layer's weight for its GEMM kernels after loading and
drops the parameter TRL writes to); to a server, the NCCL weight-transfer group needs CUDA. `CpuVLLMGeneration`, which
the trainers use instead of TRL's `VLLMGeneration` when they train on CPU, pushes through vLLM's own
``reload_weights`` (checkpoint-format weights, repacked as at load), fed with the parameters as TRL walks them (TRL's
names, PEFT adapters merged): in-process when colocated; to a server (on the same machine) as a safetensors file that
the server's worker extension `CpuWeightReload` reloads, called through vLLM's dev-mode ``/collective_rpc``
(``trl-bandpo vllm-serve`` starts a server with it). A tied output layer shares the embedding's weight, which the
reload writes, but not its repacked GEMM copy, which is rebuilt after each reload.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from unittest import mock

import torch
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

#: The name the worker extension's reload method is called by through ``/collective_rpc``.
RELOAD_METHOD = "trl_bandpo_reload_weights"


def reload_weights(model_runner, weights=None, weights_path: str | None = None) -> None:
    """vLLM's ``reload_weights`` on a CPU model runner (from `weights`, ``(name, tensor)`` pairs, or the safetensors in
    `weights_path`), then the output layer's GEMM copy rebuilt (`refresh_tied_lm_head`; harmless when untied)."""
    model_runner.reload_weights(weights_iterator=weights, weights_path=weights_path)
    refresh_tied_lm_head(model_runner.get_model())


def refresh_tied_lm_head(model) -> None:
    """The CPU GEMM copy of `model`'s output layer rebuilt from its weight (the embedding's, when tied)."""
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)


class CpuWeightReload:
    """vLLM worker extension (``--worker-extension-cls trl_bandpo.training.vllm_cpu.CpuWeightReload``): the server's
    half of `CpuVLLMGeneration`'s push."""

    def trl_bandpo_reload_weights(self, weights_path: str | None = None) -> bool:
        if weights_path is not None:  # None: the trainer's probe at set-up
            reload_weights(self.model_runner, weights_path=weights_path)
        return True


class CpuVLLMGeneration(VLLMGeneration):
    """TRL's `VLLMGeneration` with a weight push that runs on CPU (see the module)."""

    def _init_vllm(self):
        if self.mode != "server":  # eager and float32: vLLM-CPU's defaults compile the model and run it in bfloat16
            from trl.generation import vllm_generation

            engine = functools.partial(vllm_generation.LLM, enforce_eager=True, dtype="float32")
            with mock.patch.object(vllm_generation, "LLM", engine):
                return super()._init_vllm()
        with mock.patch.object(VLLMClient, "init_communicator", lambda client, device=None: None):  # no NCCL group
            super()._init_vllm()
        if self.accelerator.is_main_process:
            self._call_server(None)  # fails now if the server cannot reload weights

    def _call_server(self, weights_path: str | None) -> None:
        client = self.vllm_client
        response = client.session.post(
            f"{client.base_url}/collective_rpc",
            json={"method": RELOAD_METHOD, "kwargs": {"weights_path": weights_path}},
        )
        if response.status_code != 200:
            raise RuntimeError(
                f"the vLLM server at {client.base_url} cannot take the trainer's weights on CPU (HTTP "
                f"{response.status_code}: {response.text[:200]}): start it with `trl-bandpo vllm-serve MODEL ...`, "
                "which runs vLLM's server in development mode with trl-bandpo's worker extension (docs/vllm.md)"
            )

    def sync_weights(self):
        weights = ((name, param.detach().clone().contiguous()) for name, param in self._iter_named_params())
        if self.mode == "colocate":
            reload_weights(self.llm.llm_engine.model_executor.driver_worker.model_runner, weights=list(weights))
            self.llm.reset_prefix_cache()
        elif self.accelerator.is_main_process:
            from safetensors.torch import save_file

            with tempfile.TemporaryDirectory(prefix="trl-bandpo-weights-") as folder:
                save_file(dict(weights), os.path.join(folder, "model.safetensors"))
                self._call_server(folder)
            self.vllm_client.reset_prefix_cache()
        else:
            for _ in weights:  # take part in the gathers of sharded parameters
                pass


@contextlib.contextmanager
def vllm_generation_for(args):
    """While a trainer is built: TRL's `VLLMGeneration` replaced by `CpuVLLMGeneration` when `args` train with vLLM
    on CPU (unless something else already stands where GRPOTrainer looks it up)."""
    from trl.trainer import grpo_trainer

    on_cpu = getattr(args, "use_cpu", False) or not torch.cuda.is_available()
    if not (getattr(args, "use_vllm", False) and on_cpu and grpo_trainer.VLLMGeneration is VLLMGeneration):
        yield
        return
    with mock.patch.object(grpo_trainer, "VLLMGeneration", CpuVLLMGeneration):
        yield
