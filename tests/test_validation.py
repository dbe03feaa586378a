"""Validation during training (`trl_bandpo.evaluation.validation`): real tiny BandPO runs on CPU with a local
benchmark, the vLLM paths against stand-in engines, the recipe factory's checks, and a 2-process ZeRO-3 run."""

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from datasets import Dataset

import trl_bandpo.evaluation.validation as validation
from trl_bandpo import BandPOConfig, BandPOTrainer
from trl_bandpo.evaluation.settings import recipe_fields
from trl_bandpo.evaluation.validation import ValidationCallback, ValidationSettings

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture
def bench(tmp_path):
    rows = [{"problem": f"{i}+{i}=?", "answer": str(2 * i)} for i in (1, 2, 3)]
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def reward(completions, answer, **kwargs):
    return [float(c.strip().startswith(a)) + 0.05 * len(c) for c, a in zip(completions, answer)]


def make_trainer(model_dir, output_dir, callbacks=None, **overrides):
    kwargs = dict(
        output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
        max_steps=3, learning_rate=0.1, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    kwargs.update(overrides)
    dataset = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)])
    return BandPOTrainer(
        model=model_dir, reward_funcs=reward, args=BandPOConfig(**kwargs), train_dataset=dataset, callbacks=callbacks
    )


@pytest.fixture
def parity_score(monkeypatch):
    """Replace the scorer: a completion is correct when its length is even; every call is recorded."""
    calls = []

    def fake_score(name, completions, solutions, timeout_s=None):
        calls.append((name, list(completions), list(solutions)))
        return [len(text) % 2 == 0 for text in completions]

    monkeypatch.setattr(validation, "score", fake_score)
    return calls


def val_entries(trainer, key):
    return [(entry["step"], entry[key]) for entry in trainer.state.log_history if key in entry]


def test_validation_logs_at_the_right_steps_and_training_goes_on(tiny_model_dir, bench, tmp_path, parity_score):
    trainer = make_trainer(tiny_model_dir, tmp_path / "out")
    callback = ValidationCallback(
        [str(bench)], every_steps=2, num_samples=3, max_new_tokens=6, ks=[1, 3], trainer=trainer
    )
    assert callback in trainer.callback_handler.callbacks
    trainer.train()
    assert trainer.model.training
    assert [step for step, _ in val_entries(trainer, "loss")] == [1, 2, 3]  # the trainer's own logs are intact
    steps = [step for step, _ in val_entries(trainer, "val/tiny/mean@3")]
    assert steps == [2, 3]  # every 2 steps, and the last step
    assert len(parity_score) == 2 and all(name == "math_verify" for name, _, _ in parity_score)
    for (_, completions, solutions), step in zip(parity_score, steps):
        assert solutions == ["2"] * 3 + ["4"] * 3 + ["6"] * 3
        counts = [sum(len(t) % 2 == 0 for t in completions[i * 3 : (i + 1) * 3]) for i in range(3)]
        entry = next(e for e in trainer.state.log_history if e["step"] == step and "val/tiny/mean@3" in e)
        assert entry["val/tiny/mean@3"] == pytest.approx(sum(counts) / 9)
        assert entry["val/tiny/pass@3"] == pytest.approx(sum(c > 0 for c in counts) / 3)
        assert entry["val/tiny/best@3"] == pytest.approx(sum(1 - (1 - c / 3) ** 3 for c in counts) / 3)
        assert entry["val/tiny/pass@1"] == pytest.approx(entry["val/tiny/mean@3"])
        for key, value in entry.items():
            if key.startswith("val/tiny/"):
                assert 0.0 <= value <= 1.0, (key, value)
        assert entry["val/seconds"] >= 0


def test_validation_leaves_the_training_run_unchanged(tiny_model_dir, bench, tmp_path, parity_score):
    """Sampling runs inside fork_rng with its own seed: the same losses and weights with and without validation."""
    runs = []
    for with_validation in (False, True):
        trainer = make_trainer(tiny_model_dir, tmp_path / f"out{with_validation}")
        if with_validation:
            ValidationCallback([str(bench)], every_steps=1, num_samples=2, max_new_tokens=4, trainer=trainer)
        trainer.train()
        losses = [loss for _, loss in val_entries(trainer, "loss")]
        runs.append((losses, {k: v.detach().clone() for k, v in trainer.model.named_parameters()}))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][name], value) for name, value in runs[1][1].items())


def test_at_start_every_step_and_no_end(tiny_model_dir, bench, tmp_path, parity_score):
    trainer = make_trainer(tiny_model_dir, tmp_path / "out", max_steps=2)
    ValidationCallback([str(bench)], every_steps=1, num_samples=2, max_new_tokens=4, at_start=True, trainer=trainer)
    trainer.train()
    assert [step for step, _ in val_entries(trainer, "val/tiny/mean@2")] == [0, 1, 2]

    trainer = make_trainer(tiny_model_dir, tmp_path / "out2", max_steps=3)
    ValidationCallback(
        [str(bench)], every_steps=2, num_samples=2, max_new_tokens=4, at_end=False, temperature=0.0, trainer=trainer
    )
    parity_score.clear()
    trainer.train()
    assert [step for step, _ in val_entries(trainer, "val/tiny/mean@2")] == [2]
    (_, completions, _), *_ = parity_score
    assert all(completions[i] == completions[i + 1] for i in range(0, 6, 2))  # greedy: one decoding, repeated


def test_a_callback_without_its_trainer_fails_at_train_begin(tiny_model_dir, bench, tmp_path):
    callback = ValidationCallback([str(bench)], every_steps=1, num_samples=2, max_new_tokens=4)
    trainer = make_trainer(tiny_model_dir, tmp_path / "out", callbacks=[callback])
    with pytest.raises(RuntimeError, match=r"not attached to a trainer: call callback.attach\(trainer\)"):
        trainer.train()
    assert callback.attach(trainer) is callback
    assert trainer.callback_handler.callbacks.count(callback) == 1  # already registered: not added twice


def test_recipe_fields_build_the_settings_and_messages_name_the_fields(bench):
    """The recipe's val_* fields (`recipe_fields`) build the callback's `ValidationSettings`; nothing set, no
    benchmarks; every refusal names the recipe field, also those found when the benchmarks are loaded."""
    fields = recipe_fields()
    assert fields().validation_settings().benchmarks is None
    settings = fields(
        val_benchmarks=str(bench), val_every_steps=3, val_num_samples=4, val_scorer="tiny=dapo",
        val_max_new_tokens=16, val_temperature=0.7, val_before_train=True,
    ).validation_settings(prompt_template="dapo")  # fmt: skip
    callback = ValidationCallback(settings)
    assert callback.settings is settings and isinstance(settings, ValidationSettings)
    assert (settings.every_steps, settings.num_samples, settings.max_new_tokens, settings.at_start) == (3, 4, 16, True)
    assert callback.scorers == {"tiny": "dapo"} and settings.temperature == 0.7 and settings.ks == [4]
    assert callback.problems["tiny"][1] == ["2", "4", "6"]
    bad = [
        ({"val_every_steps": 0}, "val_every_steps must be an integer >= 1, got 0"),
        ({"val_num_samples": 0}, "val_num_samples must be an integer >= 1, got 0"),
        ({"val_max_new_tokens": -1}, "val_max_new_tokens must be an integer >= 1, got -1"),
        ({"val_scorer": "prime"}, r"val_scorer must be one of \['math_verify', 'dapo', 'strict', 'math_reward'\]"),
        ({"val_timeout_s": "5"}, "val_timeout_s must be None or a finite number > 0, got '5'"),
        ({"val_temperature": -1.0}, "val_temperature must be a finite number >= 0, got -1.0"),
        ({"val_prompt_template": "chatml"}, r"val_prompt_template must be one of \['boxed', 'dapo'\]"),
        ({"val_backend": "sglang"}, r"val_backend must be one of \['auto', 'vllm', 'transformers'\], got 'sglang'"),
        ({"val_ks": [8], "val_num_samples": 4}, r"val_ks must be .* in \[1, val_num_samples=4\], got \[8\]"),
        ({"val_before_train": "no"}, "val_before_train must be true or false, got 'no'"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            fields(val_benchmarks=str(bench), **kwargs).validation_settings()
    with pytest.raises(ValueError, match="val_scorer has no scorer for benchmark 'tiny'"):
        ValidationCallback(fields(val_benchmarks=str(bench), val_scorer="other=dapo").validation_settings())
    with pytest.raises(ValueError, match="val_benchmarks: .*no-such.jsonl"):
        ValidationCallback(fields(val_benchmarks=["no-such.jsonl"]).validation_settings())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"timeout_s": "5"}, "timeout_s must be None or a finite number > 0, got '5'"),
        ({"timeout_s": [5]}, r"timeout_s must be None or a finite number > 0, got \[5\]"),
        ({"at_start": "no"}, "at_start must be true or false, got 'no'"),
        ({"at_end": 1}, "at_end must be true or false, got 1"),
        (
            {"benchmarks": 5},
            r"benchmarks must be a registry name, a local file or name=path, a list of them, or a "
            r"mapping name -> Dataset or path, got 5",
        ),
        ({"benchmarks": [5]}, r"benchmarks must be .*, got \[5\]"),
        ({"benchmarks": {"a": 5}}, r"benchmarks must be .*, got \{'a': 5\}"),
        ({"trainer": 5}, r"trainer must be a transformers Trainer \(such as BandPOTrainer\) to attach to, got 5"),
        ({"seed": "0"}, r"seed must be an integer in \[0, 4294967295\], got '0'"),
        ({"benchmarks": []}, r"benchmarks must name at least one benchmark, got \[\]"),
        ({"batch_size": 2.0}, "batch_size must be an integer >= 1, got 2.0"),
    ],
)
def test_every_argument_is_checked_with_a_clear_value_error(bench, kwargs, message):
    """A value of the wrong type is a ValueError naming the argument, the value and what is allowed, not a bare
    TypeError from deep inside (``timeout_s='5'`` used to raise "'<' not supported between ...")."""
    arguments = {"benchmarks": [str(bench)], "num_samples": 2, "max_new_tokens": 4} | kwargs
    with pytest.raises(ValueError, match=message):
        ValidationCallback(**arguments)


# ------------------------------------------------------------------------------------------------------------------
# vLLM: the trainer's engine, against stand-ins
# ------------------------------------------------------------------------------------------------------------------


class FakeEngine:
    def __init__(self, mode, tokenizer, tensor_parallel_size=1, enable_sleep_mode=False):
        self.mode, self.tensor_parallel_size, self.enable_sleep_mode = mode, tensor_parallel_size, enable_sleep_mode
        self.syncs, self.requests = 0, []
        answer = tokenizer(r"so \boxed{2}", add_special_tokens=False)["input_ids"]

        def generate(requests, sampling_params, use_tqdm):
            self.requests.append((requests, sampling_params.kwargs))
            n = sampling_params.kwargs["n"]
            choice = types.SimpleNamespace
            return [types.SimpleNamespace(outputs=[choice(token_ids=answer) for _ in range(n)]) for _ in requests]

        def client_generate(prompts, **kwargs):
            self.requests.append((prompts, kwargs))
            return {"completion_ids": [answer] * (len(prompts) * kwargs["n"])}

        self.events, self._llm_weights_sleeping = [], enable_sleep_mode  # TRL leaves a sleeping engine asleep
        self.llm = types.SimpleNamespace(
            generate=lambda *a, **k: (self.events.append("generate"), generate(*a, **k))[1],
            wake_up=lambda tags: self.events.append(("wake_up", tuple(tags))),
            sleep=lambda level: self.events.append(("sleep", level)),
        )
        self.vllm_client = types.SimpleNamespace(generate=client_generate)

    def sync_weights(self):  # TRL's sync_weights wakes the weights of a sleeping engine up, then pushes them
        self.syncs += 1
        self.events.append("sync")
        self._llm_weights_sleeping = False


@pytest.fixture
def fake_vllm(monkeypatch):
    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    module = types.ModuleType("vllm")
    module.SamplingParams = SamplingParams
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setitem(sys.modules, "vllm", module)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_the_trainers_vllm_engine_is_reused(mode, tiny_model_dir, bench, tmp_path, fake_vllm):
    trainer = make_trainer(tiny_model_dir, tmp_path / "out")
    engine = FakeEngine(mode, trainer.processing_class)
    trainer.use_vllm, trainer.vllm_generation, trainer._last_loaded_step = True, engine, -1
    callback = ValidationCallback(
        [str(bench)], every_steps=1, num_samples=4, max_new_tokens=7, top_k=5, seed=3, trainer=trainer
    )
    assert callback.engine == mode
    metrics = callback.validate()
    assert metrics["val/tiny/mean@4"] == pytest.approx(1 / 3)  # every sample answers 2: right for 1+1 only
    assert metrics["val/tiny/pass@4"] == pytest.approx(1 / 3)
    assert engine.syncs == 1 and trainer._last_loaded_step == trainer.state.global_step
    callback.validate()
    assert engine.syncs == 1  # the engine already holds this step's weights
    prompts, sampling = engine.requests[0]
    expected = {"n": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 5, "max_tokens": 7}
    if mode == "colocate":
        assert sampling == {**expected, "seed": 3} and len(prompts) == 3 and prompts[0]["prompt_token_ids"]
    else:
        assert sampling == expected and len(prompts) == 3 and isinstance(prompts[0][0], int)
    assert trainer.state.log_history[-1]["val/tiny/mean@4"] == pytest.approx(1 / 3)


def test_without_vllm_engine_backend_vllm_fails_and_transformers_can_be_forced(tiny_model_dir, bench, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path / "out")
    with pytest.raises(ValueError, match="backend='vllm' needs the trainer's vLLM engine.*use_vllm=False"):
        ValidationCallback([str(bench)], num_samples=2, max_new_tokens=4, backend="vllm", trainer=trainer)
    trainer.use_vllm = True
    trainer.vllm_generation = FakeEngine("colocate", trainer.processing_class)
    forced = ValidationCallback([str(bench)], num_samples=2, max_new_tokens=4, backend="transformers", trainer=trainer)
    assert forced.engine is None


def test_a_sleeping_colocated_engine_is_woken_and_put_back_to_sleep(tiny_model_dir, bench, tmp_path, fake_vllm):
    """The paper recipes colocate vLLM with sleep mode (level 2 discards the weights): every validation pushes the
    weights (which wakes them), wakes the KV cache, samples, and leaves the engine asleep as TRL expects it."""
    trainer = make_trainer(tiny_model_dir, tmp_path / "out")
    engine = FakeEngine("colocate", trainer.processing_class, enable_sleep_mode=True)
    trainer.use_vllm, trainer.vllm_generation, trainer._last_loaded_step = True, engine, -1
    callback = ValidationCallback([str(bench)], num_samples=2, max_new_tokens=4, backend="vllm", trainer=trainer)
    assert callback.engine == "colocate"
    cycle = ["sync", ("wake_up", ("kv_cache",)), "generate", ("sleep", 2)]
    assert callback.validate()["val/tiny/mean@2"] == pytest.approx(1 / 3)
    assert engine.events == cycle and engine._llm_weights_sleeping
    callback.validate()  # the same step: the weights were discarded by the sleep, so they are pushed again
    assert engine.events == cycle * 2 and engine.syncs == 2


def test_tensor_parallel_ranks_share_problems_and_count_once(tiny_model_dir, tmp_path, fake_vllm):
    """Colocated vLLM with tensor parallelism 2 on 4 processes: the two ranks of a group send the same prompts with
    the same seed (vLLM's tensor parallelism needs it), the groups split the problems, and only each group's first
    rank counts, so the summed counts are those of one pass over every problem."""
    rows = [{"problem": f"{i}+{i}=?", "answer": str(2 * i)} for i in range(1, 6)]  # "so \boxed{2}" is right once
    bench = tmp_path / "five.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    trainer = make_trainer(tiny_model_dir, tmp_path / "out")
    trainer.use_vllm, trainer._last_loaded_step = True, -1
    trainer.vllm_generation = FakeEngine("colocate", trainer.processing_class, tensor_parallel_size=2)
    callback = ValidationCallback([str(bench)], num_samples=3, max_new_tokens=4, backend="vllm", trainer=trainer)
    real_accelerator, sent, counted = trainer.accelerator, {}, {}
    try:
        for rank in range(4):
            engine = FakeEngine("colocate", trainer.processing_class, tensor_parallel_size=2)
            trainer.vllm_generation = engine
            trainer.accelerator = types.SimpleNamespace(
                num_processes=4, process_index=rank, device=torch.device("cpu"),
                reduce=lambda tensor, reduction, rank=rank: counted.setdefault(rank, tensor.clone()),
            )  # fmt: skip
            callback._correct_counts(step=7)
            requests, sampling = engine.requests[0]
            sent[rank] = ([r["prompt_token_ids"] for r in requests], sampling["seed"])
    finally:
        trainer.accelerator = real_accelerator
    assert sent[0] == sent[1] and sent[2] == sent[3] and sent[0][1] != sent[2][1]
    assert (len(sent[0][0]), len(sent[2][0])) == (3, 2)  # problems 0, 2, 4 and 1, 3
    assert counted[1].sum() == 0 and counted[3].sum() == 0
    total = sum(counted.values())
    assert total.tolist() == [3, 0, 0, 0, 0]  # 3 of 3 samples right on 1+1, none elsewhere


# ------------------------------------------------------------------------------------------------------------------
# Two processes
# ------------------------------------------------------------------------------------------------------------------

TWO_PROCESS_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from datasets import Dataset
    import trl_bandpo.evaluation.validation as validation
    from trl_bandpo import BandPOConfig, BandPOTrainer

    model_dir, bench, out = sys.argv[1:4]
    scored = []

    def fake_score(name, completions, solutions, timeout_s=None):
        scored.extend(solutions)
        return [len(text) % 2 == 0 for text in completions]

    validation.score = fake_score
    dataset = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)])
    args = BandPOConfig(
        output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=2,
        learning_rate=5e-2, logging_steps=1, report_to="none", save_strategy="no", seed=0, use_cpu=True,
    )
    reward = lambda completions, answer, **kw: [0.05 * len(c) for c in completions]
    trainer = BandPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
    validation.ValidationCallback(
        [bench], every_steps=1, num_samples=2, max_new_tokens=4, batch_size=2, trainer=trainer
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"log_history": trainer.state.log_history, "scored": scored, "training": trainer.model.training,
                   "world": trainer.accelerator.num_processes}, f)
    trainer.end()  # the process group destroyed, then no interpreter teardown (a thread torn down at exit can abort a
    os._exit(0)  # rank after its work is written: "terminate called without an active exception")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("accelerate") is None
    and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "accelerate")),
    reason="accelerate CLI not installed",
)
def test_two_processes_shard_the_problems_and_agree(tiny_model_dir, tmp_path):
    """2 CPU processes under DeepSpeed ZeRO-3, 5 problems: each process scores its shard (3 and 2 problems, the
    same number of generate calls), and both log the same metrics, computed from all 5."""
    pytest.importorskip("deepspeed")
    rows = [{"problem": f"{i}+{i}=?", "answer": str(2 * i)} for i in range(1, 6)]
    bench = tmp_path / "five.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    script = tmp_path / "run.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    accelerate = shutil.which("accelerate") or str(Path(sys.executable).parent / "accelerate")
    command = [
        accelerate, "launch", "--config_file", str(SCRIPTS / "zero3_cpu.yaml"), "--main_process_port", "29631",
        str(script), tiny_model_dir, str(bench), str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert all(rank["world"] == 2 and rank["training"] for rank in ranks)
    shards = [sorted(set(rank["scored"]), key=int) for rank in ranks]
    assert shards == [["2", "6", "10"], ["4", "8"]]  # problems 0, 2, 4 and 1, 3
    assert [len(rank["scored"]) for rank in ranks] == [2 * 3 * 2, 2 * 2 * 2]  # 2 validations x problems x samples
    logged = [[e for e in rank["log_history"] if "val/five/mean@2" in e] for rank in ranks]
    assert [e["step"] for e in logged[0]] == [1, 2]
    for entry0, entry1 in zip(*logged, strict=True):
        for key in ("val/five/mean@2", "val/five/pass@2", "val/five/best@2"):
            assert entry0[key] == entry1[key] and 0.0 <= entry0[key] <= 1.0
    assert [e["step"] for e in ranks[0]["log_history"] if "loss" in e] == [1, 2]
