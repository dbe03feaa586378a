"""Drop-in use in other people's code (README, "Drop-in use"): TRL's own GRPO script with the trainer's name swapped,
a project whose config subclasses `GRPOConfig`, TRL fields the selected loss ignores, and warnings that point at
the user's line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import trl
from test_trainers import addition_dataset, shaped_reward, train_args
from trl import GRPOConfig

from trl_bandpo import BandPOConfig, BandPOTrainer, DGPOConfig, DGPOTrainer

TRL_SCRIPTS = Path(trl.__file__).parent / "scripts"


def _swap(source: str, method: str) -> str:
    """TRL's script with `GRPOTrainer`/`GRPOConfig` replaced by ours, by text replacement only; one line first makes
    `from trl import BandPOTrainer` resolve to trl_bandpo's class."""
    shim = f"import trl, trl_bandpo; trl.{method}Trainer, trl.{method}Config = trl_bandpo.{method}Trainer, trl_bandpo.{method}Config\n"  # noqa: E501
    return shim + source.replace("GRPOTrainer", f"{method}Trainer").replace("GRPOConfig", f"{method}Config")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["BandPO", "DGPO"])
def test_trls_own_grpo_script_runs_with_our_trainers(tiny_model_dir, tmp_path, method):
    """`trl/scripts/grpo.py` as the installed TRL ships it (TrlParser command line, dataset by name, reward by import
    path, save), trained two off-policy steps on the tiny model, offline: our metrics are in the saved log."""
    source = (TRL_SCRIPTS / "grpo.py").read_text()
    assert "GRPOTrainer(" in source and "GRPOConfig" in source  # the names we swap are still there
    script = tmp_path / "grpo_swapped.py"
    script.write_text(_swap(source, method))
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "train.jsonl", "w") as f:
        for a in range(8):
            f.write(json.dumps({"prompt": f"{a}+{a}=", "solution": str(2 * a)}) + "\n")
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(completions, **kwargs):\n    return [0.1 * len(c) for c in completions]\n"
    )
    out = tmp_path / "out"
    command = [
        sys.executable, str(script), "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data),
        "--reward_funcs", "my_rewards.length_reward", "--output_dir", str(out), "--use_cpu", "true",
        "--bf16", "false", "--dtype", "float32", "--max_steps", "2", "--per_device_train_batch_size", "4",
        "--num_generations", "4", "--max_completion_length", "6", "--num_iterations", "2", "--logging_steps", "1",
        "--save_strategy", "steps", "--save_steps", "2", "--report_to", "none", "--seed", "0",
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(tmp_path))
    run = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    log = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    steps = [entry for entry in log if "loss" in entry]
    assert len(steps) == 2
    assert all("bounds/upper_mean" in entry and "clip_ratio_by_prob/high/p0.0-0.2" in entry for entry in steps)
    if method == "DGPO":
        assert all("dgpo/frac_LN" in entry for entry in steps)
    else:  # Band bounds: wider than the clip interval on the tail tokens of a random tiny model
        assert all(entry["bounds/upper_mean"] > 1.2 for entry in steps)


# The shapes of config classes projects write, in a module of their own (a fresh process imports it to load the
# pickled `training_args.bin`, as it must for GRPOTrainer's).
PROJECT_CONFIGS = """
from dataclasses import dataclass, field

from trl import GRPOConfig

POST_INITS = []


@dataclass
class ProjectConfig(GRPOConfig):
    system_prompt: str = field(default="Be brief.")
    chat_template: str | None = field(default=None)


class PlainSubclass(GRPOConfig):
    team = "rl"


class WithInit(GRPOConfig):
    def __init__(self, *args, tag="default", **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag


@dataclass
class CountingPostInit(GRPOConfig):
    def __post_init__(self):
        super().__post_init__()
        POST_INITS.append(self.output_dir)
"""


@pytest.fixture
def project_configs(tmp_path, monkeypatch):
    (tmp_path / "project_configs.py").write_text(PROJECT_CONFIGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    sys.modules.pop("project_configs", None)
    return importlib.import_module("project_configs")


def _common(tmp_path, name):
    base = train_args(GRPOConfig, tmp_path / name, max_steps=1)
    names = ("output_dir", "per_device_train_batch_size", "num_generations", "max_completion_length", "num_iterations",
             "gradient_accumulation_steps", "max_steps", "learning_rate", "logging_steps", "report_to", "use_cpu",
             "seed")  # fmt: skip
    return {name: getattr(base, name) for name in names}


@pytest.mark.parametrize("trainer_class,config_class", [(BandPOTrainer, BandPOConfig), (DGPOTrainer, DGPOConfig)])
def test_a_project_config_that_subclasses_grpoconfig_is_used_as_it_is(
    tiny_model_dir, tmp_path, caplog, trainer_class, config_class, project_configs
):
    """The trainer trains with the project's own config object (`trainer.args` is it: class, fields, values), our
    settings at their defaults, says so once, trains with our loss and saves."""
    args = project_configs.ProjectConfig(
        **_common(tmp_path, "run"), system_prompt="Answer with a number.", epsilon=0.25
    )
    trainer = trainer_class(
        model=tiny_model_dir, reward_funcs=shaped_reward, args=args, train_dataset=addition_dataset()
    )
    assert trainer.args is args
    assert (args.system_prompt, args.epsilon, args.max_completion_length) == ("Answer with a number.", 0.25, 6)
    assert not hasattr(args, "policy_loss")  # nothing of ours is written into the user's object
    assert trainer.policy_args.policy_loss == {BandPOConfig: "band", DGPOConfig: "dgpo"}[config_class]
    assert trainer.policy_args.band_radius == 0.05 and trainer.policy_args.dgpo_m == 2.0
    said = [r.getMessage() for r in caplog.records if "trains with it as it is" in r.getMessage()]
    assert len(said) == 1 and config_class.__name__ in said[0]
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and "bounds/upper_mean" in logged[0]


def test_the_shapes_of_project_configs_are_kept_and_their_saved_args_load_in_a_fresh_process(
    tiny_model_dir, tmp_path, project_configs
):
    """Dataclass and plain subclasses, a custom `__init__`, a `__post_init__` with side effects, attributes added
    after construction: every value is kept, none of the user's code runs again, and `training_args.bin` loads in a
    fresh process that imports the project's module and trl_bandpo (as GRPOTrainer's does)."""
    shapes = {
        "dataclass": project_configs.ProjectConfig(**_common(tmp_path, "dataclass"), system_prompt="Terse."),
        "plain": project_configs.PlainSubclass(**_common(tmp_path, "plain")),
        "init": project_configs.WithInit(**_common(tmp_path, "init"), tag="mine"),
        "post_init": project_configs.CountingPostInit(**_common(tmp_path, "post_init")),
    }
    for args in shapes.values():
        args.added_later = "kept"
    assert len(project_configs.POST_INITS) == 1
    saved = {}
    for name, args in shapes.items():
        trainer = BandPOTrainer(
            model=tiny_model_dir, reward_funcs=shaped_reward, args=args, train_dataset=addition_dataset()
        )
        assert trainer.args is args and args.added_later == "kept"
        trainer.save_model(str(tmp_path / name / "saved"))
        saved[name] = tmp_path / name / "saved" / "training_args.bin"
    assert shapes["init"].tag == "mine" and shapes["dataclass"].system_prompt == "Terse."
    assert len(project_configs.POST_INITS) == 1  # the user's __post_init__ ran once, at construction
    code = (
        "import sys, torch, project_configs, trl_bandpo\n"
        "for path in sys.argv[1:]:\n"
        "    args = torch.load(path, weights_only=False)\n"
        "    shown = [getattr(args, name, '-') for name in ('added_later', 'tag', 'system_prompt')]\n"
        "    print(type(args).__name__, *shown)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code, *map(str, saved.values())], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:4] == [
        "ProjectConfig kept - Terse.",
        "PlainSubclass kept - -",
        "WithInit kept mine -",
        "CountingPostInit kept - -",
    ]


def test_a_plain_grpoconfig_is_served_and_other_args_are_refused(tiny_model_dir, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = BandPOTrainer(
        model=tiny_model_dir, reward_funcs=shaped_reward, args=args, train_dataset=addition_dataset()
    )
    assert trainer.args is args and trainer.policy_args.policy_loss == "band"
    with pytest.raises(TypeError, match="needs a GRPOConfig"):
        BandPOTrainer(model=tiny_model_dir, reward_funcs=shaped_reward, args={"output_dir": "x"})


def test_a_project_config_is_checked_as_ours(tiny_model_dir, tmp_path):
    """The TRL fields our losses read, and the settings TRL does not check, are refused in a project's config as in
    ours, before the model loads."""
    for fields, named in ((dict(epsilon=1.5), "epsilon"), (dict(learning_rate=float("nan")), "learning_rate")):
        args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
        for key, value in fields.items():
            setattr(args, key, value)
        with pytest.raises(ValueError, match=named):
            BandPOTrainer(model="no/such-model", reward_funcs=shaped_reward, args=args)


@pytest.mark.parametrize(
    "config_class,fields,named",
    [
        (BandPOConfig, dict(epsilon=3e-4, epsilon_high=4e-4), ["epsilon", "epsilon_high"]),  # TRL's gspo.py values
        (DGPOConfig, dict(band_radius=0.1), ["band_radius"]),
        (BandPOConfig, dict(policy_loss="clip", dgpo_n=2), ["dgpo_n"]),
    ],
)
def test_a_field_the_loss_ignores_warns_once_at_the_users_line(config_class, fields, named):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config_class(output_dir="unused", use_cpu=True, report_to="none", **fields)
    ignored = [w for w in caught if "no effect with policy_loss" in str(w.message)]
    assert len(ignored) == 1
    assert all(f"{name}=" in str(ignored[0].message) for name in named)
    assert ignored[0].filename == __file__


def test_fields_the_loss_reads_do_not_warn():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no effect with policy_loss.*")
        BandPOConfig(output_dir="unused", use_cpu=True, report_to="none", policy_loss="relaxed_band", epsilon=0.3)
        DGPOConfig(output_dir="unused", use_cpu=True, report_to="none", epsilon=0.3, epsilon_high=0.28)
        BandPOConfig(output_dir="unused", use_cpu=True, report_to="none", delta=10.0)


class _EnvironmentWithReward:
    def reset(self, **kwargs):
        return None

    def get_reward(self):
        return 1.0


def test_trls_warnings_from_our_constructor_point_at_the_users_line(tiny_model_dir, tmp_path, monkeypatch):
    """TRL warns that `environment_factory` is experimental from inside GRPOTrainer.__init__; through our trainer the
    warning names this file and line, not trl_bandpo/training/trainer.py (whatever TRL then decides about the
    tokenizer)."""
    monkeypatch.delenv("TRL_EXPERIMENTAL_SILENCE", raising=False)
    args = BandPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", policy_loss="clip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            BandPOTrainer(model=tiny_model_dir, args=args, train_dataset=addition_dataset(),
                          environment_factory=_EnvironmentWithReward)  # fmt: skip
        except ValueError:
            pass  # the tiny tokenizer's chat template has no tool calling: TRL refuses it after warning
    experimental = [w for w in caught if "experimental" in str(w.message)]
    assert experimental and all(w.filename == __file__ for w in experimental)


def test_a_model_folder_that_does_not_exist_is_named(tmp_path):
    """The hub would answer "Repo id must be in the form ..." for a path: the trainers say the folder is missing."""
    for trainer_class in (BandPOTrainer, DGPOTrainer):
        with pytest.raises(ValueError, match=r"model '.*missing' is no folder here \(it does not exist\)"):
            trainer_class(model=str(tmp_path / "missing"), reward_funcs=shaped_reward)
