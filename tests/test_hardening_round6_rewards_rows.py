"""Hardening, round 6: rewards that are no usable numbers follow `on_nonfinite`, naming the reward function and the
completion (TRL zeroed their group's advantages in silence, or failed converting a string); the dataset columns our
trainers read are checked when a trainer is built, naming the column and the row (TRL failed after loading the
model). Each case failed before its fix."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from datasets import Dataset
from datasets import Image as ImageFeature
from PIL import Image
from test_trainers import addition_dataset, shaped_reward, train_args

from trl_bandpo import BandPOConfig, BandPOTrainer
from trl_bandpo.training.nonfinite import NonFiniteTrainingError

NOT_LOADED = "no/model-is-loaded-before-this"  # a hub id: loading it offline would fail with an OSError
GROUP = 4  # train_args' num_generations


# -- 2. rewards that are no usable numbers ---------------------------------------------------------------------------


def first_is(value):
    """A reward function returning `value` for the first completion of each call, a finite reward for the others."""

    def first_is(completions, **kwargs):
        return [value] + [0.05 * len(c) for c in completions[1:]]

    return first_is


def none_for_first(completions, **kwargs):
    return [None] + [1.0] * (len(completions) - 1)


def _trainer(tiny_model_dir, tmp_path, reward_funcs, **overrides):
    args = train_args(BandPOConfig, tmp_path, max_steps=1, **overrides)
    return BandPOTrainer(model=tiny_model_dir, reward_funcs=reward_funcs, args=args, train_dataset=addition_dataset())


def _parameters(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


@pytest.mark.parametrize(
    "value, named",
    [(math.inf, "returned inf"), (-math.inf, "returned -inf"), (math.nan, "returned nan"), (None, "returned None"),
     ("1.5", "returned '1.5'"), ([1.0], r"returned \[1\.0\]")],
    ids=["inf", "-inf", "nan", "None", "string", "list"],
)  # fmt: skip
def test_an_unusable_reward_stops_naming_the_function_and_the_completion(tiny_model_dir, tmp_path, value, named):
    """Before: inf, -inf, NaN and None trained on with the group's advantages set to 0 (loss and grad norm logged as
    0.0, `reward` as inf); a string or a list failed in TRL with "too many dimensions 'str'" or a shape error."""
    trainer = _trainer(tiny_model_dir, tmp_path, first_is(value))
    before = _parameters(trainer)
    with pytest.raises(NonFiniteTrainingError, match=rf"reward function 'first_is' {named} for completion 0 \('.*'\) "
                       r"at optimizer step 0: no finite advantage follows .*on_nonfinite='stop'"):  # fmt: skip
        trainer.train()
    assert all(torch.equal(p.detach(), before[name]) for name, p in trainer.model.named_parameters())


def test_a_reward_function_may_abstain_where_another_scores(tiny_model_dir, tmp_path):
    """TRL's None for "no opinion" still works when another function scores the completion; when none does, it is
    refused, naming every function."""
    _trainer(tiny_model_dir, tmp_path / "one", [none_for_first, shaped_reward]).train()
    trainer = _trainer(tiny_model_dir, tmp_path / "both", [none_for_first, first_is(None)])
    with pytest.raises(NonFiniteTrainingError, match=r"reward function 'none_for_first' returned None, 'first_is' "
                       r"returned None for completion 0 "):  # fmt: skip
        trainer.train()


class Recording:
    """`first_is(value)` recording what it returns."""

    def __init__(self, value):
        self.value, self.returned, self.__name__ = value, [], "recording"

    def __call__(self, completions, **kwargs):
        self.returned = [self.value] + [float(len(c) % 5) for c in completions[1:]]
        return self.returned


@pytest.mark.parametrize("scale_rewards", ["group", "batch"])
def test_skip_drops_the_group_and_the_others_keep_their_advantages(tiny_model_dir, tmp_path, scale_rewards):
    """The first group's first reward is inf: with on_nonfinite='skip' that group is dropped with a warning (advantage
    0, tokens masked out, not counted in num_items_in_batch), and the other groups' advantages are TRL's formula on
    their own rewards. Before: every advantage of the group (with scale_rewards='batch', of the batch) was 0."""
    reward = Recording(math.inf)
    trainer = _trainer(tiny_model_dir, tmp_path, reward, on_nonfinite="skip", scale_rewards=scale_rewards)
    trainer.model.train()
    dataset = addition_dataset()
    batch = [dataset[i] for i in range(4) for _ in range(GROUP)]
    with pytest.warns(RuntimeWarning, match=r"'recording' returned inf for completion 0 .*its group is dropped"):
        output = trainer._generate_and_score_completions(batch)
    kept = torch.tensor(reward.returned[GROUP:])
    spread = kept.view(-1, GROUP).std(dim=1).repeat_interleave(GROUP) if scale_rewards == "group" else kept.std()
    expected = (kept - kept.view(-1, GROUP).mean(dim=1).repeat_interleave(GROUP)) / (spread + 1e-4)
    assert kept.std() > 0 and torch.allclose(output["advantages"][GROUP:], expected, atol=1e-5)
    assert output["advantages"][:GROUP].eq(0).all() and output["completion_mask"][:GROUP].eq(0).all()
    assert output["completion_mask"][GROUP:].sum() > 0
    assert output["num_items_in_batch"] == output["completion_mask"].sum()


def test_skip_trains_on_the_other_groups(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, Recording("high"), on_nonfinite="skip")
    before = _parameters(trainer)
    with pytest.warns(RuntimeWarning, match=r"'recording' returned 'high' for completion 0 .*its group is dropped"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert not all(torch.equal(p.detach(), before[name]) for name, p in trainer.model.named_parameters())


def test_dynamic_sampling_replaces_a_dropped_group(tiny_model_dir, tmp_path):
    """With dynamic sampling the dropped group has no signal, so a fresh prompt's group takes its place."""
    reward = Recording(math.nan)
    trainer = _trainer(tiny_model_dir, tmp_path, reward, on_nonfinite="skip", dynamic_sampling=True)
    trainer.model.train()
    dataset = addition_dataset()
    with pytest.warns(RuntimeWarning, match="its group is dropped"):
        output = trainer._generate_and_score_completions([dataset[i] for i in range(4) for _ in range(GROUP)])
    assert trainer._metrics["train"]["dynamic_sampling/dropped_group_share"][-1] > 0
    groups = output["completion_mask"].view(-1, GROUP, output["completion_mask"].shape[1]).sum(dim=(1, 2))
    signal = output["advantages"].view(-1, GROUP).ne(0).any(dim=1)
    assert (signal | groups.eq(0)).all()  # each group has a signal, or is a filler masked out


# -- 2, the asynchronous trainer: the rollout samples as TRL's worker scores them ------------------------------------


def _scored_samples(rewards_by_function):
    """The samples of one group of 4 as TRL's rollout worker scores them (`_AsyncRolloutLoop._score_group`)."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, _AsyncRolloutLoop

    def function(name, values):
        def reward(completions, **kwargs):
            return list(values)

        reward.__name__ = name
        return reward

    worker = _AsyncRolloutLoop.__new__(_AsyncRolloutLoop)
    worker.reward_funcs = [function(name, values) for name, values in rewards_by_function.items()]
    worker.reward_func_names, worker._env_reward_types = list(rewards_by_function), []
    worker._provides_rollout_reward = False
    sequence = type("Sequence", (), dict(input_ids=[5, 6, 7, 8], completion_mask=[0, 0, 1, 1],
                                         old_log_probs=[0.0, 0.0, -1.0, -2.0]))  # fmt: skip
    group = RolloutGroup(
        prompts=["1+1="] * 4, reward_kwargs={}, completions=[f"completion {i}" for i in range(4)],
        completions_ids=[[7, 8]] * 4, completions_sequences=[[sequence]] * 4, tool_call_counts=[0] * 4,
        tool_failure_counts=[0] * 4, model_version=0, group_id=7, env_rewards=[], rollout_rewards=[],
    )  # fmt: skip
    return asyncio.run(worker._score_group(group))


@pytest.fixture(scope="module")
def async_trainer(tiny_model_dir, tmp_path_factory):
    import test_async_trainer as stand_ins

    from trl_bandpo.training.async_trainer import AsyncBandPOConfig, AsyncBandPOTrainer

    with pytest.MonkeyPatch.context() as patch:
        import trl.experimental.async_grpo.async_grpo_trainer as async_module

        stand_ins.patch_for_cpu(patch)
        patch.setattr(async_module, "VLLMClient", lambda *args, **kwargs: None)
        yield stand_ins._build(AsyncBandPOTrainer, AsyncBandPOConfig, tiny_model_dir, tmp_path_factory.mktemp("a"))


@pytest.mark.parametrize(
    "rewards, named, dropped",
    [({"f": [0.0, 1.0, math.inf, 0.5]},
      r"'f' returned inf for a rollout sample of group 7 \('completion 2'\) at optimizer step 0", [0, 1, 2, 3]),
     ({"f": [0.0, None, 1.0, 0.5], "g": [1.0, None, 0.0, 0.0]},
      r"reward function 'f' returned nan, 'g' returned nan for a rollout sample of group 7 \('completion 1'\)", [1])],
    ids=["inf", "none"],
)  # fmt: skip
def test_the_async_trainer_stops_or_drops_unusable_rewards(async_trainer, rewards, named, dropped):
    """The rollout queue as the trainer reads it, holding a group scored by TRL's worker with an unusable reward and
    then a usable group: 'stop' raises at the sample, naming the function; 'skip' drops it (and, after an infinite
    reward, whose group's advantages are all NaN, the rest of its group) with a warning, and passes the rest. Before:
    an infinite reward reached the loss as NaN advantages (stopping or skipping the update without naming the reward
    function), and a completion no function scored trained with advantage 0."""
    samples, fine = _scored_samples(rewards), _scored_samples({"f": [0.0, 1.0, 2.0, 3.0]})
    queue = async_trainer.rollout_queue
    async_trainer.policy_args.on_nonfinite = "stop"
    for sample in samples + fine:
        queue.put(sample)
    with pytest.raises(NonFiniteTrainingError, match=named):
        for _ in range(len(samples)):
            queue.get(timeout=1)
    while queue.qsize():
        queue.get(timeout=1)
    async_trainer.policy_args.on_nonfinite = "skip"
    for sample in samples + fine:
        queue.put(sample)
    with pytest.warns(RuntimeWarning, match=named + r".*it is dropped, and so are the samples of its group"):
        kept = [queue.get(timeout=1).completion for _ in range(len(samples) + len(fine) - len(dropped))]
    assert kept == [f"completion {i}" for i in range(4) if i not in dropped] + [f"completion {i}" for i in range(4)]
    assert queue.qsize() == 0


# -- 3. dataset rows checked when the trainer is built, before the model loads ----------------------------------------


def _conversation(text):
    return [{"role": "user", "content": text}]


def _rows(**columns):
    """Two rows, the second with `columns` in place of the first's."""
    first = {"prompt": _conversation("1+1="), "image": Image.new("RGB", (8, 8)), "answer": "2"}
    return Dataset.from_list([first, {**first, **columns}])


def answer_reward(completions, answer, **kwargs):
    return [float(a in c) for c, a in zip(completions, answer)]


@pytest.mark.parametrize(
    "dataset, needle",
    [
        (_rows(image=None), r"train_dataset\['image'\]\[1\] must be an image: .*, got None\."),
        (Dataset.from_dict({"prompt": [_conversation("a")] * 2, "image": [__file__ + ".png", None],
                            "answer": ["1", "2"]}).cast_column("image", ImageFeature()),
         r"train_dataset\['image'\]\[0\] must be an image: .*, got '.*\.py\.png'\."),
        (Dataset.from_dict({"prompt": [_conversation("a")], "image": ["/no/such/file.png"], "answer": ["1"]}),
         r"train_dataset\['image'\]\[0\] must be an image: .*, got '/no/such/file\.png'\."),
        (Dataset.from_list([{"prompt": _conversation("a"), "images": [], "answer": "1"},
                            {"prompt": _conversation("b"), "images": None, "answer": "2"}]),
         r"train_dataset\['images'\]\[1\] must be a list of images, got None\."),
        (Dataset.from_dict({"prompt": ["a", "b"], "images": [["/no/a.png"], [__file__, "/no/b.png"]],
                            "answer": ["1", "2"]}),
         r"train_dataset\['images'\]\[0\] must be an image: .*, got '/no/a\.png'\."),
        (Dataset.from_list([{"prompt": 3, "answer": "1"}]),
         r"train_dataset\['prompt'\] must be strings or lists of .* messages, got Value\('int64'\)\."),
        (Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}]),
         r"train_dataset\['prompt'\]\[1\] must be a string or a non-empty list of messages, got None\."),
        (_rows(prompt=[]), r"train_dataset\['prompt'\]\[1\] must be a string or a non-empty list .*, got \[\]\."),
        (Dataset.from_list([{"question": "a", "answer": "1"}]),
         r"train_dataset's columns must be a list with 'prompt', got \['answer', 'question'\]\."),
        (Dataset.from_list([{"prompt": "a", "solution": "1"}]),
         r"train_dataset's columns must be a list with 'answer' \(reward function 'answer_reward' reads it\), "
         r"got \['prompt', 'solution'\]\."),
    ],
    ids=["image None", "image feature, no file", "image path, no file", "images None", "images path, no file",
         "prompt int", "prompt None", "prompt empty", "no prompt", "no answer"],
)  # fmt: skip
def test_a_dataset_row_our_trainers_cannot_use_is_refused_before_the_model_loads(dataset, needle, tmp_path):
    """Before: each passed construction and failed after the model loaded (in the image processor, the tokenizer or
    the reward call); now it is refused before, naming the column and the row (NOT_LOADED would fail to load)."""
    args = BandPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    for name in ("train_dataset", "eval_dataset"):
        kwargs = {"train_dataset": addition_dataset(), name: dataset}
        with pytest.raises(ValueError, match=needle.replace("train_dataset", name)):
            BandPOTrainer(model=NOT_LOADED, reward_funcs=answer_reward, args=args, **kwargs)


def test_usable_datasets_pass_the_checks(tmp_path):
    """Held images, image files, URLs, base64 data, text and chat prompts, answers read through `**kwargs`, and a
    reward argument a rollout function fills: the checks pass, and loading the model is what fails."""
    image = tmp_path / "red.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(image)
    datasets = [
        _rows(),
        Dataset.from_dict({"prompt": [_conversation("a")] * 4, "image": [str(image), "https://example.com/a.png",
                           "data:image/png;base64,iVBORw0KGgo=", "iVBORw0KGgo="], "answer": ["1"] * 4}),
        Dataset.from_dict({"prompt": ["a"], "images": [[str(image)]], "answer": ["1"]})
        .cast_column("images", [ImageFeature()]),
    ]  # fmt: skip
    args = BandPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    for dataset in datasets:
        with pytest.raises(OSError):
            BandPOTrainer(model=NOT_LOADED, reward_funcs=[answer_reward, shaped_reward], args=args,
                          train_dataset=dataset)  # fmt: skip
    no_answer = Dataset.from_list([{"prompt": "a"}])
    with pytest.raises(OSError):
        BandPOTrainer(model=NOT_LOADED, reward_funcs=answer_reward, args=args, train_dataset=no_answer,
                      rollout_func=lambda prompts, trainer: {})  # fmt: skip


def test_the_async_trainer_checks_its_dataset(tmp_path):
    from trl_bandpo.training.async_trainer import AsyncBandPOConfig, AsyncBandPOTrainer

    args = AsyncBandPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    for rows, needle in [
        ([{"prompt": "a"}], r"train_dataset's columns must be a list with 'answer' \(reward function"),
        ([{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}], r"train_dataset\['prompt'\]\[1\] must be"),
    ]:
        with pytest.raises(ValueError, match=needle):
            AsyncBandPOTrainer(model=NOT_LOADED, reward_funcs=answer_reward, args=args,
                               train_dataset=Dataset.from_list(rows))  # fmt: skip
