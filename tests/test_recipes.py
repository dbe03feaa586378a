"""Every recipe parses through `trl_bandpo.cli.recipe`'s parser, matches its paper's settings and batch mapping, and
says how to launch it; every accelerate config loads; misspelled keys fail loudly."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import pytest
import yaml

from trl_bandpo.cli.recipe import DATACLASS_TYPES, ConfigError, RecipeParser, parse_args
from trl_bandpo.cli.train import main, trainer_class_for, validation_settings
from trl_bandpo.core.losses import policy_loss_spec

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
ACCELERATE_CONFIGS = ROOT / "accelerate_configs"
# The papers' recipes; recipes/async/ (TRL's asynchronous trainer, not a paper setting) has its own tests below,
# recipes/smollm2/ (a real model on a CPU) its own file, tests/test_smollm2_recipes.py.
RECIPE_FILES = sorted(path for path in RECIPES.rglob("*.yaml") if path.parent.name not in ("async", "smollm2"))
RECIPE_IDS = [str(path.relative_to(RECIPES)) for path in RECIPE_FILES]
ASYNC_RECIPE_FILES = sorted((RECIPES / "async").glob("*.yaml"))

# Paper batch settings: prompts per step P, samples per prompt G, prompts per mini-batch M.
PAPER_BATCH = {"bandpo": (256, 16, 64), "dgpo": (512, 16, 32), "lora": (16, 8, 4)}
# Paper training steps per model (generation batches).
PAPER_STEPS = {
    ("bandpo", "qwen2.5-3b-instruct"): 800,
    ("bandpo", "deepseek-r1-distill-qwen-1.5b"): 800,
    ("bandpo", "deepseek-r1-distill-qwen-7b"): 500,
    ("bandpo", "deepseek-r1-distill-llama-8b"): 500,
    ("dgpo", "deepseek-r1-distill-qwen-1.5b"): 500,
    ("dgpo", "deepseek-r1-distill-qwen-7b"): 500,
    ("dgpo", "deepseek-r1-distill-qwen-14b"): 500,
    ("lora", "qwen2.5-0.5b-instruct"): 200,
    ("lora", "qwen2.5-1.5b-instruct"): 200,
}
HUB_IDS = {
    "qwen2.5-3b-instruct": "Qwen/Qwen2.5-3B-Instruct",
    "qwen2.5-0.5b-instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-1.5b-instruct": "Qwen/Qwen2.5-1.5B-Instruct",
    "deepseek-r1-distill-qwen-1.5b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    "deepseek-r1-distill-qwen-7b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "deepseek-r1-distill-qwen-14b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B",
    "deepseek-r1-distill-llama-8b": "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
}
DGPO_LR = {"1.5b": 1e-6, "7b": 4.63e-7, "14b": 3.27e-7}
# File-name method -> (policy_loss, loss_type or None for "the folder's default").
METHODS = {
    "grpo": ("clip", None),
    "clip-higher": ("clip", None),
    "band-kl-0.03": ("band", None),
    "band-kl-0.05": ("band", None),
    "band-kl-0.1": ("band", None),
    "band-tv-0.05": ("band", None),
    "band-chi2-0.05": ("band", None),
    # extensions beyond both papers (docs/extensions.md)
    "adaptive-band-kl-0.05": ("band", None),
    "band-dgpo-kl-0.05": ("band_dgpo", None),
    "dynamic-band-kl-0.05": ("band", None),
    "relaxed-band-kl-0.05": ("relaxed_band", None),
    "dcpo": ("dcpo", None),
    "cispo": ("cispo", None),  # ours: both-sided clip, as the DGPO paper ran it
    "gppo": ("gppo", None),
    "ce-gppo": ("ce_gppo", None),
    "aspo": ("aspo", None),
    "dgpo": ("dgpo", None),
    "dppo-tv-0.15": ("dppo_tv", None),  # DPPO-Binary in BandPO's setting (docs/band-and-dppo.md)
    "dppo-kl-0.05": ("dppo_kl", None),
    "drpo": ("drpo", None),  # DRPO and SPO in BandPO's setting, the DRPO authors' epsilon (docs/policy-losses.md)
    "spo": ("spo", None),
    # the masking trust regions in BandPO's setting (docs/policy-losses.md, "Masking trust regions")
    "cppo-0.15": ("cppo", "dapo"),  # CPPO's token-mean, its code's default aggregation
    "trm": ("trm", None),
    "m2po": ("m2po", None),
    "icepop": ("icepop", None),
}
DEFAULT_LOSS_TYPE = {"bandpo": "grpo", "dgpo": "dapo", "lora": "grpo"}
# Keys allowed to differ between the recipes of one (folder, model): the policy loss and the run's name.
POLICY_KEYS = {
    "policy_loss", "band_divergence", "band_radius", "band_upper_max", "epsilon", "epsilon_high",
    "delta", "loss_type", "dgpo_n", "dgpo_m", "ce_gppo_beta1", "ce_gppo_beta2", "aspo_c_pos", "aspo_c_neg",
    "output_dir", "run_name", "band_radius_by", "band_radius_exponent", "band_radius_min", "band_radius_max",
    "dynamic_sampling", "dynamic_sampling_max_rounds", "dppo_tv_radius", "dppo_kl_radius", "dppo_ratio_cap",
    "drpo_epsilon", "spo_epsilon", "cppo_delta", "cppo_w_min", "cppo_delta_b", "trm_divergence", "trm_reduce",
    "trm_threshold", "m2po_threshold", "icepop_low", "icepop_high",
}  # fmt: skip


def _split_name(path: Path):
    folder = path.parent.name
    stem = path.stem
    server = stem.endswith("_vllm-server")
    stem = stem.removesuffix("_vllm-server")
    model, _, method = stem.partition("_")
    return folder, model, method, server


def _parse(path: Path, *extra: str):
    # bf16 (the recipes' precision) is validated against the device; this CPU-only host needs use_cpu to accept it.
    return parse_args(["--config", str(path), "--use_cpu", "true", *extra])


def _header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def _launch_processes(header: str) -> int:
    match = re.search(r"accelerate launch --config_file accelerate_configs/(\S+)\.yaml --num_processes (\d+)", header)
    assert match, "the header must give the accelerate launch command with --config_file and --num_processes"
    assert (ACCELERATE_CONFIGS / f"{match.group(1)}.yaml").is_file(), f"no accelerate_configs/{match.group(1)}.yaml"
    return int(match.group(2))


def test_recipe_set_is_complete():
    names = {str(path.relative_to(RECIPES)) for path in RECIPE_FILES}
    for model in ("qwen2.5-3b-instruct", "deepseek-r1-distill-qwen-1.5b", "deepseek-r1-distill-qwen-7b",
                  "deepseek-r1-distill-llama-8b"):  # fmt: skip
        for method in (
            "grpo",
            "clip-higher",
            "band-kl-0.05",
            "relaxed-band-kl-0.05",
            "dcpo",
            "dppo-tv-0.15",
            "dppo-kl-0.05",
            "drpo",
            "spo",
            "cppo-0.15",
        ):
            assert f"bandpo/{model}_{method}.yaml" in names
        assert f"bandpo/{model}_band-kl-0.05_vllm-server.yaml" in names
        assert {f"bandpo/{model}_band-tv-0.05.yaml", f"bandpo/{model}_band-chi2-0.05.yaml"} <= names
    for model in ("qwen2.5-3b-instruct", "deepseek-r1-distill-qwen-7b"):
        assert {f"bandpo/{model}_band-kl-0.03.yaml", f"bandpo/{model}_band-kl-0.1.yaml"} <= names
    for method in ("trm", "m2po", "icepop"):
        assert f"bandpo/qwen2.5-3b-instruct_{method}.yaml" in names
    for model in ("deepseek-r1-distill-qwen-1.5b", "deepseek-r1-distill-qwen-7b", "deepseek-r1-distill-qwen-14b"):
        for method in ("grpo", "cispo", "gppo", "ce-gppo", "aspo", "dgpo"):
            assert f"dgpo/{model}_{method}.yaml" in names
        assert f"dgpo/{model}_dgpo_vllm-server.yaml" in names
    for model in ("qwen2.5-0.5b-instruct", "qwen2.5-1.5b-instruct"):
        for method in ("grpo", "band-kl-0.05", "dgpo", "dppo-tv-0.15", "dppo-kl-0.05", "drpo", "spo", "cppo-0.15"):
            assert f"lora/{model}_{method}.yaml" in names
    assert (RECIPES / "README.md").is_file()


@pytest.mark.parametrize("path", RECIPE_FILES, ids=RECIPE_IDS)
def test_recipe_parses_and_matches_its_paper(path):
    folder, model, method, server = _split_name(path)
    with warnings.catch_warnings():  # a recipe sets no field its policy loss ignores
        warnings.filterwarnings("error", message=".*no effect with policy_loss.*", category=UserWarning)
        script_args, args, model_args = _parse(path)

    # Header: what, hardware, the launch command for this very file.
    header = _header(path)
    assert header, "a recipe starts with a comment header"
    assert "Hardware:" in header and "Launch:" in header
    assert f"--config recipes/{path.relative_to(RECIPES)}" in header
    num_processes = _launch_processes(header)

    # Model, method and trainer class.
    assert model_args.model_name_or_path == HUB_IDS[model]
    policy_loss, loss_type = METHODS[method]
    assert args.policy_loss == policy_loss
    assert args.loss_type == (loss_type or DEFAULT_LOSS_TYPE[folder])
    expected_trainer = "DGPOTrainer" if policy_loss == "dgpo" else "BandPOTrainer"
    assert trainer_class_for(args.policy_loss).__name__ == expected_trainer
    band = re.fullmatch(r"(?:relaxed-|adaptive-|dynamic-)?band(?:-dgpo)?-(kl|tv|chi2)-([\d.]+)", method)
    if band:
        assert (args.band_divergence, args.band_radius) == (band.group(1), float(band.group(2)))
        assert args.band_upper_max == 10.0
    # Extensions: exactly one of them per recipe, and nowhere else.
    assert (args.band_radius_by == "entropy") == method.startswith("adaptive-")
    if method.startswith("adaptive-"):
        assert (args.band_radius_min, args.band_radius_max, args.band_radius_exponent) == (0.0125, 0.2, 1.0)
    assert args.dynamic_sampling == method.startswith("dynamic-")
    if method == "band-dgpo-kl-0.05":
        assert (args.dgpo_n, args.dgpo_m, args.delta) == (2, 2.0, None)
    dppo = re.fullmatch(r"dppo-(kl|tv)-([\d.]+)", method)
    if dppo:  # the DPPO authors' radius and C = 10,000 (truncation effectively off)
        assert getattr(args, f"dppo_{dppo.group(1)}_radius") == float(dppo.group(2))
        assert args.dppo_ratio_cap == 10000.0 and (args.dppo_radius_low, args.dppo_radius_high) == (None, None)
    if method in ("drpo", "spo"):  # the DRPO authors' threshold for both (UniRL's drpo_epsilon)
        assert getattr(args, f"{method}_epsilon") == 12.5
    if method == "cppo-0.15":  # the paper's delta for dense models (Table 3), the authors' w_min and delta_b
        assert (args.cppo_delta, args.cppo_w_min, args.cppo_delta_b) == (0.15, 0.8, 0.02)
    if method == "trm":  # verl's seq_mean_k3 presets
        assert (args.trm_divergence, args.trm_reduce, args.trm_threshold) == ("k3", "mean", 0.01)
    if method == "m2po":  # AReaL's example recipe (actor.m2_threshold)
        assert args.m2po_threshold == 0.04
    if method == "icepop":  # the paper's values as its ports quote them
        assert (args.icepop_low, args.icepop_high) == (0.5, 5.0)
    if method in ("adaptive-band-kl-0.05", "band-dgpo-kl-0.05", "dynamic-band-kl-0.05"):
        assert "Extension beyond both papers (docs/extensions.md)" in header

    # Batch mapping (recipes/README.md): P prompts x G samples per generation, M prompts per optimizer step.
    prompts, samples, mini_batch = PAPER_BATCH[folder]
    assert args.num_generations == samples
    assert args.generation_batch_size == prompts * samples
    assert args.per_device_train_batch_size * num_processes * args.gradient_accumulation_steps == mini_batch * samples
    assert args.generation_batch_size % (args.per_device_train_batch_size * num_processes) == 0
    steps_per_generation = args.generation_batch_size // (args.per_device_train_batch_size * num_processes)
    assert steps_per_generation == (prompts // mini_batch) * args.gradient_accumulation_steps
    assert args.num_iterations == 1
    assert args.max_steps == PAPER_STEPS[(folder, model)] * prompts // mini_batch
    assert args.logging_steps == prompts // mini_batch

    # Shared settings.
    assert args.temperature == 1.0 and args.top_p == 1.0
    assert args.bf16 and args.max_grad_norm == 1.0
    assert args.lr_scheduler_type == "constant" and args.warmup_steps == 0
    assert args.scale_rewards == "group"
    assert args.output_dir.endswith(f"{folder}/{path.stem}")
    if folder in ("bandpo", "dgpo"):  # neither paper's verl runs corrected for the vLLM/trainer mismatch
        assert args.vllm_importance_sampling_correction is False
    # Validation during training: every 5 paper steps (BandPO's scripts; DGPO states none, the same is chosen),
    # mean@32 on the paper's benchmarks, with its response length; none in the LoRA recipes.
    validation = validation_settings(script_args)
    if folder == "lora":
        assert validation is None
    else:
        assert script_args.val_preset == folder
        assert validation.every_steps == 5 * (prompts // mini_batch)
        assert validation.at_start == (folder == "bandpo")  # the BandPO authors validate before training
        assert validation.num_samples == 32
        assert (validation.temperature, validation.top_p, validation.top_k) == (1.0, 1.0, None)
        assert validation.max_new_tokens == args.max_completion_length
        assert validation.prompt_template == script_args.prompt_template  # validation prompted like training
        if folder == "bandpo":
            assert validation.benchmarks == ["aime2024", "aime2025", "amc2023"]
            assert validation.scorer == {
                "aime2024": "dapo",
                "aime2025": "dapo",
                "amc2023": "math_reward",
            }  # verl's math reward, as inferred from the authors' data scripts
        else:
            assert set(validation.benchmarks) == {
                "aime2024-math-ai", "aime2025-math-ai", "amc2023", "math500", "minerva", "olympiadbench"
            }  # fmt: skip
            assert validation.scorer == "strict"
            assert validation.ks == [1, 2, 4, 8, 16, 32]
    if folder == "bandpo":
        # the authors' data, prompt and reward: DAPO-Math-17k (en) + MATH L3-5, DAPO's "Answer:" prompt, math_dapo
        assert script_args.dataset_name == ["dapo-math-17k", "math-level3to5"]
        assert (script_args.prompt_template, script_args.reward) == ("dapo", "dapo")
        assert script_args.max_prompt_tokens == 1024
        assert args.learning_rate == 1e-6 and args.beta == 0.001
        no_dual_clip = method == "band-dgpo-kl-0.05" or method.startswith("dppo-") or method in (
            "drpo", "spo", "cppo-0.15", "m2po", "icepop"
        )  # fmt: skip
        assert args.delta == (None if no_dual_clip else 10.0)
        assert args.use_bias_correction_kl is False
        assert args.max_completion_length == 4096
        assert (args.adam_beta1, args.adam_beta2, args.weight_decay) == (0.9, 0.999, 0.01)
        expected_eps = {"grpo": (0.2, 0.2), "dcpo": (0.16, 0.2)}.get(method, (0.2, 0.28))
        if "epsilon" not in policy_loss_spec(args.policy_loss).config_fields:
            expected_eps = (0.2, None)  # TRL's defaults: a recipe sets no field its loss ignores (it would warn)
        assert (args.epsilon, args.epsilon_high) == expected_eps
    elif folder == "dgpo":
        assert script_args.dataset_name == ["dapo-math-17k-original"]  # DAPO-Math-17k as released
        assert (script_args.prompt_template, script_args.reward) == ("boxed", "signed")
        assert math.isclose(args.learning_rate, DGPO_LR[model.rsplit("-", 1)[1]])
        assert args.beta == 0.0 and args.max_completion_length == 8192 and args.seed == 42
        assert (args.adam_beta1, args.adam_beta2) == (0.9, 0.95)
        assert args.epsilon == 0.2
        assert args.epsilon_high == 0.2
        assert args.delta == (3.0 if method == "grpo" else None)
        if method == "dgpo":
            assert (args.dgpo_n, args.dgpo_m) == ((2, 2.0) if model.endswith("1.5b") else (1, 2.0))
        if method == "ce-gppo":
            assert (args.ce_gppo_beta1, args.ce_gppo_beta2) == (0.75, 1.0)
        if method == "aspo":
            assert (args.aspo_c_pos, args.aspo_c_neg) == (3.0, 3.0)
    else:
        assert model_args.use_peft and model_args.lora_r == 32 and model_args.lora_target_modules
        assert args.use_vllm is False and num_processes == 1

    # vLLM: colocated, or a server whose command is in the header.
    if folder != "lora":
        assert args.use_vllm
        assert args.vllm_mode == ("server" if server else "colocate")
    if server:
        serve = re.search(r"VLLM_SERVER_DEV_MODE=1 vllm serve (\S+) --tensor-parallel-size (\d+)", header)
        assert serve, "a server recipe gives the exact `vllm serve` command"
        assert serve.group(1) == model_args.model_name_or_path
        assert "--max-model-len" in header


def test_recipes_of_a_set_differ_only_in_the_policy_loss():
    groups: dict[tuple, list[tuple[str, dict]]] = {}
    for path in RECIPE_FILES:
        folder, model, method, server = _split_name(path)
        groups.setdefault((folder, model, server), []).append((path.name, yaml.safe_load(path.read_text())))
    for key, members in groups.items():
        reference_name, reference = members[0]
        for name, recipe in members[1:]:
            for field in (set(reference) | set(recipe)) - POLICY_KEYS:
                assert reference.get(field) == recipe.get(field), (
                    f"{key}: {name} and {reference_name} differ in {field!r} "
                    f"({recipe.get(field)!r} vs {reference.get(field)!r})"
                )


def test_server_variant_matches_its_colocated_recipe():
    for path in RECIPE_FILES:
        if not path.stem.endswith("_vllm-server"):
            continue
        colocated = yaml.safe_load(path.with_name(path.stem.removesuffix("_vllm-server") + ".yaml").read_text())
        server = yaml.safe_load(path.read_text())
        allowed = {"vllm_mode", "output_dir", "run_name", "gradient_accumulation_steps"}
        allowed |= {key for key in set(colocated) | set(server) if key.startswith("vllm_")}
        for field in (set(colocated) | set(server)) - allowed:
            assert colocated.get(field) == server.get(field), f"{path.name}: {field!r} differs from colocated"


# ---------------------------------------------------------------------------------------------------------------------
# Loud failures
# ---------------------------------------------------------------------------------------------------------------------

RECIPE = RECIPES / "bandpo" / "qwen2.5-3b-instruct_band-kl-0.05.yaml"


def _copy_with(tmp_path, old: str, new: str) -> Path:
    text = RECIPE.read_text()
    assert old in text
    target = tmp_path / "recipe.yaml"
    target.write_text(text.replace(old, new, 1))
    return target


def test_misspelled_recipe_key_fails_naming_it(tmp_path):
    recipe = _copy_with(tmp_path, "learning_rate: 1.0e-6", "learnig_rate: 1.0e-6")
    with pytest.raises(ConfigError) as err:
        _parse(recipe)
    message = str(err.value)
    assert "'learnig_rate'" in message and "did you mean" in message and "'learning_rate'" in message
    assert str(recipe) in message


def test_misspelled_policy_key_fails_naming_it(tmp_path):
    recipe = _copy_with(tmp_path, "band_radius: 0.05", "band_radious: 0.05")
    with pytest.raises(ConfigError, match=r"'band_radious'.*did you mean 'band_radius'"):
        _parse(recipe)


def test_misspelled_command_line_flag_fails_naming_it():
    with pytest.raises(ConfigError, match=r"'band_radus'.*did you mean 'band_radius'"):
        _parse(RECIPE, "--band_radus", "0.1")


def test_main_exits_with_status_2_and_a_message(tmp_path, capsys):
    recipe = _copy_with(tmp_path, "num_generations: 16", "num_generation: 16")
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(recipe), "--use_cpu", "true"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "'num_generation'" in err and "'num_generations'" in err


@pytest.mark.parametrize(
    "old, new, needle",
    [
        ("policy_loss: band", "policy_loss: bandd", "policy_loss"),
        ("reward: dapo", "reward: binary", "reward"),
        ("band_radius: 0.05", "band_radius: -1.0", "band"),
    ],
)
def test_invalid_values_fail(tmp_path, old, new, needle):
    with pytest.raises(ConfigError, match=needle):
        _parse(_copy_with(tmp_path, old, new))


def test_command_line_overrides_the_recipe():
    script_args, args, _ = _parse(RECIPE, "--band_radius", "0.1", "--max_steps", "7", "--dataset_name", "x.jsonl")
    assert args.band_radius == 0.1 and args.max_steps == 7
    assert script_args.dataset_name == ["x.jsonl"]


def test_none_on_the_command_line_unsets_a_recipe_value():
    _, args, _ = _parse(RECIPE, "--delta", "none", "--band_upper_max=null")
    assert args.policy_loss == "band" and args.delta is None and args.band_upper_max is None
    with pytest.raises(ConfigError, match="delta"):  # dgpo with the recipe's dual clip left on
        _parse(RECIPE, "--policy_loss", "dgpo")


def test_help_renders():
    assert "--band_radius" in RecipeParser(DATACLASS_TYPES).format_help()


# ---------------------------------------------------------------------------------------------------------------------
# accelerate configs
# ---------------------------------------------------------------------------------------------------------------------

ACCELERATE_EXPECTED = {
    "single_gpu": ("NO", 1, None),
    "cpu": ("NO", 1, None),  # the SmolLM2 recipes: one process, float32, on the CPU
    "multi_gpu": ("MULTI_GPU", 8, None),
    "zero2": ("DEEPSPEED", 8, 2),
    "zero3": ("DEEPSPEED", 8, 3),
    "zero3_offload": ("DEEPSPEED", 8, 3),
    "fsdp2": ("FSDP", 8, None),
    "multi_node_zero3": ("DEEPSPEED", 16, 3),  # 2 nodes x 8 GPUs; tests/test_multi_node.py checks the rest
    "multi_node_fsdp2": ("FSDP", 16, None),
}


@pytest.mark.parametrize("name", sorted(ACCELERATE_EXPECTED))
def test_accelerate_config_loads(name):
    from accelerate.commands.config.config_args import load_config_from_file

    path = ACCELERATE_CONFIGS / f"{name}.yaml"
    config = load_config_from_file(str(path))  # accelerate's own loader: rejects unknown keys
    distributed_type, num_processes, zero_stage = ACCELERATE_EXPECTED[name]
    assert str(config.distributed_type).split(".")[-1] == distributed_type
    assert config.num_processes == num_processes
    cpu = name == "cpu"
    assert str(config.mixed_precision).split(".")[-1] == ("no" if cpu else "bf16")
    assert config.use_cpu is cpu
    if zero_stage is not None:
        assert config.deepspeed_config["zero_stage"] == zero_stage
        offload = "cpu" if name == "zero3_offload" else "none"
        assert config.deepspeed_config["offload_optimizer_device"] == offload
        assert config.deepspeed_config["offload_param_device"] == offload
    if name.endswith("fsdp2"):
        assert config.fsdp_config["fsdp_version"] == 2
    assert _header(path).startswith("#"), "each accelerate config starts with a comment saying when to use it"


def test_accelerate_configs_are_the_expected_set():
    assert {path.stem for path in ACCELERATE_CONFIGS.glob("*.yaml")} == set(ACCELERATE_EXPECTED)


@pytest.mark.parametrize("path", [p for p in RECIPE_FILES if p.stem.endswith("_vllm-server")], ids=lambda p: p.stem)
def test_server_header_describes_the_parallelism_its_command_starts(path):
    """The header's 'tensor parallel N' / 'data parallel M' are the sizes its `vllm serve` command passes."""
    header = " ".join(line.lstrip("#").strip() for line in _header(path).splitlines())
    command = re.search(r"vllm serve .*", header).group(0)
    tp = int(re.search(r"--tensor-parallel-size (\d+)", command).group(1))
    dp = int(re.search(r"--data-parallel-size (\d+)", command).group(1)) if "--data-parallel-size" in command else 1
    described = header[: header.index("vllm serve")]
    assert re.findall(r"tensor parallel (\d+)", described) == [str(tp)]
    assert re.findall(r"data parallel (\d+)", described) in ([], [str(dp)])


@pytest.mark.parametrize("path", RECIPE_FILES, ids=RECIPE_IDS)
def test_every_recipe_parses_with_the_cpu_overrides(path, tmp_path):
    """`trl-bandpo tiny-model`'s overrides turn any recipe into a CPU run that its 16 problems can feed: no bf16,
    vLLM or validation benchmarks, two steps, 32-token completions, 4 prompts per generation batch."""
    from trl_bandpo.cli.tiny_model import cpu_train_command

    argv = cpu_train_command(tmp_path / "tiny", str(path)).split()[3:]  # after `HF_HUB_OFFLINE=1 trl-bandpo train`
    script_args, args, model_args = parse_args(argv)
    assert (args.use_cpu, args.bf16, args.use_vllm, args.max_steps, args.max_completion_length) == (
        True, False, False, 2, 32
    )  # fmt: skip
    assert model_args.model_name_or_path == str(tmp_path / "tiny") and model_args.dtype == "float32"
    assert script_args.dataset_name == [str(tmp_path / "tiny" / "problems.jsonl")]
    assert validation_settings(script_args) is None
    assert args.generation_batch_size // args.num_generations == 4 <= 16
    # one optimizer step per pass over the generation batch, two passes: the second step off-policy
    assert (args.steps_per_generation, args.num_iterations) == (args.gradient_accumulation_steps, 2)


# ---------------------------------------------------------------------------------------------------------------------
# recipes/async: TRL's asynchronous trainer (async_rollouts: true)
# ---------------------------------------------------------------------------------------------------------------------


def test_async_recipe_set():
    assert [path.name for path in ASYNC_RECIPE_FILES] == ["qwen2.5-3b-instruct_band-kl-0.05_async.yaml"]


@pytest.mark.parametrize("path", ASYNC_RECIPE_FILES, ids=lambda p: p.stem)
def test_async_recipe_is_its_synchronous_recipe_on_the_async_trainer(path):
    """Parsed into the async config, with every key it shares with the synchronous BandPO recipe of its model that
    generates on a server (`_vllm-server`: the same 4 training GPUs) set to the same value; the header launches this
    file on FSDP2 next to a `vllm serve` in the trainer's dtype, with the paper's mini-batch per optimizer step."""
    from trl_bandpo.training.async_trainer import AsyncPolicyLossConfig

    script_args, args, model_args = _parse(path)
    assert script_args.async_rollouts is True and isinstance(args, AsyncPolicyLossConfig)
    assert trainer_class_for(args.policy_loss, asynchronous=True).__name__ == "AsyncBandPOTrainer"
    model, method = path.stem.removesuffix("_async").split("_", 1)
    synchronous = yaml.safe_load((RECIPES / "bandpo" / f"{model}_{method}_vllm-server.yaml").read_text())
    recipe = yaml.safe_load(path.read_text())
    shared = (set(recipe) & set(synchronous)) - {"output_dir", "run_name", "dtype"}
    assert {
        "policy_loss",
        "band_radius",
        "band_upper_max",
        "delta",
        "dataset_name",
        "reward",
        "learning_rate",
    } <= shared
    for key in shared:
        assert recipe[key] == synchronous[key], key
    assert model_args.model_name_or_path == HUB_IDS[model]
    assert model_args.dtype == args.dtype == "float32"  # one dtype field: the async config's, copied to the model's

    header = _header(path)
    assert "Hardware:" in header and "Launch:" in header and "Not a paper setting" in header
    assert f"--config recipes/{path.relative_to(RECIPES)}" in header
    assert "--config_file accelerate_configs/fsdp2.yaml" in header  # AsyncGRPOTrainer runs on FSDP2
    num_processes = _launch_processes(header)
    serve = re.search(r"VLLM_SERVER_DEV_MODE=1 vllm serve (\S+) .*--max-model-len (\d+) --dtype (\S+)", header)
    assert serve and serve.group(1) == model_args.model_name_or_path and serve.group(3) == args.dtype
    assert int(serve.group(2)) >= script_args.max_prompt_tokens + args.max_completion_length
    assert args.vllm_server_base_url == "http://127.0.0.1:8000"  # vllm serve's default port
    _, samples, mini_batch = PAPER_BATCH["bandpo"]
    assert args.token_budget == 0  # a fixed count of samples per micro-batch
    assert args.per_device_train_batch_size * num_processes * args.gradient_accumulation_steps == mini_batch * samples
    assert args.num_generations == samples
    assert args.max_steps == synchronous["max_steps"]


ASYNC_RECIPE = RECIPES / "async" / "qwen2.5-3b-instruct_band-kl-0.05_async.yaml"


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--val_preset", "bandpo"], "val_preset='bandpo' cannot be used with async_rollouts"),
        (["--eval_dataset_name", "aime2024"], "eval_dataset_name=['aime2024'] cannot be used with async_rollouts"),
        (["--load_in_4bit", "true"], "load_in_4bit: true cannot be used with async_rollouts"),
        (["--attn_implementation", "sdpa"], "attn_implementation='sdpa' cannot be used with async_rollouts"),
        (["--use_vllm", "true"], "'use_vllm'"),  # the async trainer always generates on the server
        (["--band_radius_by", "entropy"], "'band_radius_by'"),  # no old-policy entropies in a rollout sample
        (["--beta", "0.001"], "'beta'"),  # no reference model
        (["--async_rollouts", "maybe"], "async_rollouts must be true or false, got 'maybe'"),
    ],
)
def test_async_recipe_refuses_what_the_async_trainer_cannot_do(extra, needle):
    with pytest.raises(ConfigError) as caught:
        _parse(ASYNC_RECIPE, *extra)
    assert needle in str(caught.value)
    if needle.startswith("'"):  # an unknown key: the message says which config the keys come from
        assert "AsyncPolicyLossConfig" in str(caught.value)


def test_async_rollouts_switches_any_recipe_to_the_async_config(tmp_path):
    """The key is read from the command line too (flag alone, or a value) and unset it keeps the synchronous config."""
    from trl_bandpo.training.async_trainer import AsyncPolicyLossConfig
    from trl_bandpo.training.configs import PolicyLossConfig

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: m\ndataset_name: d\npolicy_loss: dgpo\nbf16: false\nuse_cpu: true\n")
    for extra, asynchronous in (([], False), (["--async_rollouts"], True), (["--async_rollouts", "true"], True),
                                (["--async_rollouts=false"], False)):  # fmt: skip
        script_args, args, model_args = parse_args(["--config", str(recipe), *extra])
        assert script_args.async_rollouts is asynchronous
        assert isinstance(args, AsyncPolicyLossConfig) is asynchronous and isinstance(args, PolicyLossConfig) is not (
            asynchronous
        )
        assert trainer_class_for(args.policy_loss, asynchronous).__name__ == ("Async" * asynchronous) + "DGPOTrainer"


PAPER_RECIPE_FILES = [path for path in RECIPE_FILES if path.parent.name in ("bandpo", "dgpo")]


@pytest.mark.parametrize("path", PAPER_RECIPE_FILES, ids=lambda p: p.stem)
def test_paper_recipes_show_the_rollout_old_log_probs_alternative(path, tmp_path):
    """Each paper recipe carries `old_logps_source: rollout` commented out (the adaptive-radius one says why not); the
    line, uncommented, gives a valid run of that recipe."""
    text = path.read_text()
    if "band_radius_by: entropy" in text:
        assert '# old_logps_source stays "trainer"' in text
        return
    commented = "# old_logps_source: rollout  #"
    assert text.count(commented) == 1
    uncommented = tmp_path / path.name
    uncommented.write_text(text.replace(commented, "old_logps_source: rollout  #"))
    _, args, _ = _parse(uncommented)
    assert args.old_logps_source == "rollout" and args.vllm_importance_sampling_correction is False


@pytest.mark.parametrize("value", ["1", "maybe", "[true]"])
def test_async_rollouts_that_is_no_boolean_fails_first(tmp_path, value):
    """It selects the config, so a wrong value in the recipe is refused before anything else, naming it."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"async_rollouts: {value}\nmodel_name_or_path: m\ndataset_name: d\nmax_staleness: 2\n")
    with pytest.raises(ConfigError, match="async_rollouts must be true or false"):
        parse_args(["--config", str(recipe)])
