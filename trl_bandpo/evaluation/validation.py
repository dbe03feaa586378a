r"""Validation during training: mean@k and pass@k of the current policy on held-out benchmarks every few steps.

`ValidationCallback` samples the current policy every `every_steps` optimizer steps (as the BandPO authors' verl
runs do with ``trainer.test_freq``), scores the samples with a named scorer (`trl_bandpo.evaluation.scorers`) and
logs ``val/<benchmark>/mean@<n>``, ``val/<benchmark>/pass@<k>`` and ``val/<benchmark>/best@<k>`` through the
trainer's logging. It reuses the trainer's vLLM engine when it can (else ``generate``), shards the problems over the
processes and sums their correct counts, and seeds its sampling inside ``torch.random.fork_rng`` (the trainer's
random state is untouched). docs/evaluation.md ("Validation during training") describes it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from transformers import TrainerCallback

from .generation import regroup, render_prompt
from .scorers import score, scorers_for
from .settings import ValidationSettings
from .summary import average_metrics


def _vllm_engine(trainer) -> str | None:
    """The mode, "colocate" or "server", when the trainer's vLLM engine can be reused for validation, else None."""
    engine = getattr(trainer, "vllm_generation", None)
    if not getattr(trainer, "use_vllm", False) or engine is None:
        return None
    return engine.mode if engine.mode in ("server", "colocate") else None


class ValidationCallback(TrainerCallback):
    r"""Sample the current policy on validation benchmarks every `every_steps` optimizer steps and log mean@k.

    Args:
        settings (`ValidationSettings`, or the benchmarks):
            The settings; or, instead, the benchmarks (registry names, local files or ``name=path`` entries, or a
            mapping name -> Dataset/path, see `trl_bandpo.data.load_eval_benchmarks`) with the other settings as
            keywords.
        trainer (`transformers.Trainer`, *optional*):
            Attach to this trainer at once (see `attach`).
        **kwargs:
            `ValidationSettings` fields (``every_steps=5``, ``num_samples=32``, ``scorer="math_verify"``, ...;
            ``backend="auto"``: the trainer's vLLM engine when it can be reused, else ``generate``). Given with
            `settings`, they override it.

    Every setting is checked (`ValidationSettings`) and the benchmarks are loaded when the callback is built: a bad
    value raises ValueError naming the setting as the settings name it (a recipe field for a recipe's), the value
    and what is allowed.
    """

    def __init__(self, settings: ValidationSettings | Any = None, *, trainer=None, **kwargs: Any):
        from . import load_benchmarks

        if not isinstance(settings, ValidationSettings):
            settings = ValidationSettings(**kwargs if settings is None else {"benchmarks": settings, **kwargs})
        elif kwargs:
            settings = dataclasses.replace(settings, **kwargs)
        self.settings = s = settings
        if not s.benchmarks:
            raise ValueError(f"{s.name('benchmarks')} must name at least one benchmark, got {s.benchmarks!r}")
        try:
            loaded = load_benchmarks(s.benchmarks, max_problems=s.max_problems, prompt_template=s.prompt_template)
        except (ValueError, ConnectionError) as err:
            raise type(err)(f"{s.name('benchmarks')}: {err}") from None
        self.scorers = scorers_for(s.scorer, list(loaded), s.name("scorer"))
        self.problems = {bench: (list(d["prompt"]), list(d["solution"])) for bench, d in loaded.items()}
        self.trainer, self.engine, self.last_step = None, None, None
        if trainer is not None:
            self.attach(trainer)

    def attach(self, trainer) -> ValidationCallback:
        """Give the callback its trainer and register it there (``trainer.add_callback``) if it is not yet.

        Raises:
            ValueError: ``backend="vllm"`` while the trainer has no vLLM engine (``use_vllm=False``).
        """
        if not callable(getattr(trainer, "add_callback", None)) or not hasattr(trainer, "callback_handler"):
            raise ValueError(
                f"trainer must be a transformers Trainer (such as BandPOTrainer) to attach to, got {trainer!r}"
            )
        engine = _vllm_engine(trainer)
        if self.settings.backend == "vllm" and engine is None:
            raise ValueError(
                "backend='vllm' needs the trainer's vLLM engine (use_vllm=True, server or colocate mode); use "
                f"backend='auto' or 'transformers' (use_vllm={getattr(trainer, 'use_vllm', False)})"
            )
        self.engine = None if self.settings.backend == "transformers" else engine
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise RuntimeError(
                "ValidationCallback is not attached to a trainer: call callback.attach(trainer) after building the "
                "trainer (or pass trainer=... to ValidationCallback)"
            )
        if self.settings.at_start:
            self.validate()

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        due = step % self.settings.every_steps == 0 or (self.settings.at_end and step == state.max_steps)
        if due and step != self.last_step:
            should_log = control.should_log  # logging resets it: keep the trainer's own log of this step
            self.validate()
            control.should_log = should_log
        return control

    def validate(self) -> dict[str, float]:
        """Sample, score and log now; returns the logged metrics (the same on every process)."""
        import torch
        from transformers import Trainer

        trainer = self.trainer
        started = time.time()
        step = trainer.state.global_step
        device = trainer.accelerator.device
        devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the trainer's generators are restored afterwards
            counts = self._correct_counts(step)
        logs: dict[str, float] = {}
        for bench, per_problem in counts.items():
            metrics = average_metrics(per_problem, self.settings.num_samples, self.settings.ks)
            logs |= {f"val/{bench}/{key}": value for key, value in metrics.items()}
        logs["val/seconds"] = round(time.time() - started, 3)
        self.last_step = step
        Trainer.log(trainer, dict(logs))  # the base logger: log_history and report_to, not the GRPO metric buffers
        return logs

    def _correct_counts(self, step: int) -> dict[str, list[int]]:
        """Per-problem correct counts of every benchmark, summed over the processes."""
        import torch

        accelerator, s = self.trainer.accelerator, self.settings
        world, rank = accelerator.num_processes, accelerator.process_index
        # Colocated vLLM with tensor parallelism: the ranks of a group share one engine, so they take the same
        # problems and seed, and only the group's first rank counts the answers.
        tp = self.trainer.vllm_generation.tensor_parallel_size if self.engine == "colocate" else 1
        group, groups_count, counting = rank // tp, world // tp, rank % tp == 0
        items = [(bench, *row) for bench, problems in self.problems.items() for row in zip(*problems)]
        mine = [i for i in range(len(items)) if (0 if self.engine == "server" else i % groups_count) == group]
        prompts = [items[index][1] for index in mine]  # items: (benchmark, prompt, solution)
        seed = (s.seed + 1_000_003 * step + 7_919 * group) % 2**32
        torch.manual_seed(seed)
        if self.engine is None:
            per_call = max(1, s.batch_size // (1 if s.temperature == 0 else s.num_samples))
            calls = math.ceil(math.ceil(len(items) / world) / per_call)  # the same on every process
            completions = self._generate(prompts, per_call, calls, items[0][1])
        else:
            completions = self._vllm_generate(prompts, seed)
        counts = torch.zeros(len(items), dtype=torch.long, device=accelerator.device)
        by_bench: dict[str, list[tuple[int, list[str]]]] = {}
        for index, samples in zip(mine, completions, strict=True):
            if counting:
                by_bench.setdefault(items[index][0], []).append((index, samples))
        for bench, rows in by_bench.items():
            flat = [text for _, samples in rows for text in samples]
            golds = [items[index][2] for index, samples in rows for _ in samples]
            flags = score(self.scorers[bench], flat, golds, timeout_s=s.timeout_s)
            for (index, _), marks in zip(rows, regroup(flags, s.num_samples, s.num_samples)):
                counts[index] = sum(marks)
        totals = accelerator.reduce(counts, reduction="sum").tolist() if world > 1 else counts.tolist()
        result: dict[str, list[int]] = {bench: [] for bench in self.problems}
        for (bench, *_), total in zip(items, totals, strict=True):
            result[bench].append(int(total))
        return result

    def _tokenizer(self):
        processing_class = self.trainer.processing_class
        return getattr(processing_class, "tokenizer", processing_class)

    def _texts(self, prompts: list[Any]) -> list[str]:
        template_kwargs = getattr(self.trainer, "chat_template_kwargs", None) or {}
        return [render_prompt(self._tokenizer(), prompt, **template_kwargs) for prompt in prompts]

    def _generate(self, prompts: list[Any], per_call: int, calls: int, filler: Any) -> list[list[str]]:
        """`num_samples` completions per prompt with ``generate`` on the trainer's model, in exactly `calls` calls
        (padded with `filler`, whose completions are dropped, so that sharded models run in step)."""
        import torch
        from transformers import GenerationConfig
        from trl.distributed import DistributedBackend
        from trl.models import unwrap_model_for_generation

        trainer, tokenizer, s = self.trainer, self._tokenizer(), self.settings
        eos = getattr(trainer, "eos_token_ids", None) or tokenizer.eos_token_id
        greedy = s.temperature == 0  # greedy: decode once, repeat
        per_prompt = 1 if greedy else s.num_samples
        config = GenerationConfig(
            max_new_tokens=s.max_new_tokens, do_sample=not greedy, num_return_sequences=per_prompt,
            temperature=None if greedy else s.temperature, top_p=None if greedy else s.top_p,
            top_k=None if greedy else (s.top_k or 0), repetition_penalty=1.0, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos, disable_compile=True,
        )  # fmt: skip
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        was_training = model.training
        groups: list[list[str]] = []
        try:
            with (
                unwrap_model_for_generation(
                    trainer.model_wrapped,
                    trainer.accelerator,
                    gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                    gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
                ) as unwrapped,
                torch.no_grad(),
                DistributedBackend(trainer.accelerator).summon_full_params(trainer.model_wrapped, recurse=False),
            ):
                unwrapped.eval()
                for call in range(calls):
                    chunk = prompts[call * per_call : (call + 1) * per_call]
                    texts = self._texts(chunk or [filler])
                    batch = tokenizer(
                        texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
                    ).to(trainer.accelerator.device)
                    output = unwrapped.generate(**batch, generation_config=config)
                    decoded = tokenizer.batch_decode(
                        output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
                    )
                    groups.extend(regroup(decoded, per_prompt, s.num_samples)[: len(chunk)])
        finally:
            model.train(was_training)
        return groups

    def _vllm_generate(self, prompts: list[Any], seed: int) -> list[list[str]]:
        """`num_samples` completions per prompt from the trainer's vLLM engine, after pushing the current weights."""
        trainer, tokenizer = self.trainer, self._tokenizer()
        engine = trainer.vllm_generation
        # Sleep level 2 discards the engine's weights: they are pushed again even when they were this step's.
        sleeping = self.engine == "colocate" and getattr(engine, "_llm_weights_sleeping", False)
        if sleeping or trainer.state.global_step != getattr(trainer, "_last_loaded_step", None):
            engine.sync_weights()  # every process takes part (parameters may be gathered); wakes the weights up
            trainer._last_loaded_step = trainer.state.global_step  # the trainer then skips its own sync
        token_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in self._texts(prompts)]
        s = self.settings
        greedy = s.temperature == 0
        per_prompt = 1 if greedy else s.num_samples  # vLLM refuses n > 1 with greedy decoding: decode once, repeat
        top_p, top_k = 1.0 if greedy else s.top_p, s.top_k or 0
        sampling = dict(n=per_prompt, temperature=s.temperature, top_p=top_p, top_k=top_k, max_tokens=s.max_new_tokens)
        if self.engine == "server":
            if not token_ids:
                return []
            completions = engine.vllm_client.generate(prompts=token_ids, **sampling)["completion_ids"]
        else:
            from vllm import SamplingParams

            params = SamplingParams(**sampling, seed=seed)
            requests = [{"prompt_token_ids": ids} for ids in token_ids]
            if engine.enable_sleep_mode:
                engine.llm.wake_up(tags=["kv_cache"])
            try:
                outputs = engine.llm.generate(requests, sampling_params=params, use_tqdm=False) if requests else []
            finally:
                if engine.enable_sleep_mode:  # as TRL leaves the engine after its own generation
                    engine.llm.sleep(level=2)
                    engine._llm_weights_sleeping = True
            completions = [choice.token_ids for output in outputs for choice in output.outputs]
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completions]
        return regroup(texts, per_prompt, s.num_samples)
