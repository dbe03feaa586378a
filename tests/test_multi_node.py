"""Multi-node launch: accelerate_configs/multi_node_zero3.yaml and multi_node_fsdp2.yaml, the SLURM command builder
scripts/slurm/multi_node.py and the batch script scripts/slurm/multi_node.sbatch (run here against stand-ins for srun,
trl and accelerate), plus real two-machine ZeRO-3 and FSDP2 runs on this host (slow)."""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "accelerate_configs" / "multi_node_zero3.yaml"
CONFIG_FSDP2 = REPO / "accelerate_configs" / "multi_node_fsdp2.yaml"
# The multi-node configs, each with the single-node config whose backend settings it keeps.
CONFIGS = {"zero3": (CONFIG, "zero3.yaml"), "fsdp2": (CONFIG_FSDP2, "fsdp2.yaml")}
MULTI_NODE_FIELDS = ("num_machines", "machine_rank", "main_process_ip", "main_process_port", "num_processes",
                     "rdzv_backend", "same_network")  # fmt: skip
# The backend fields each header explains, beyond the multi-node ones.
HEADER_FIELDS = {
    "zero3": ("deepspeed_multinode_launcher",),
    "fsdp2": ("fsdp_version", "fsdp_auto_wrap_policy", "fsdp_reshard_after_forward", "fsdp_cpu_ram_efficient_loading",
              "fsdp_state_dict_type"),
}  # fmt: skip
SBATCH = REPO / "scripts" / "slurm" / "multi_node.sbatch"
RECIPE = "recipes/dgpo/deepseek-r1-distill-qwen-14b_dgpo_vllm-server.yaml"


def load_builder():
    spec = importlib.util.spec_from_file_location("multi_node", REPO / "scripts" / "slurm" / "multi_node.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


mn = load_builder()


def slurm_env(rank: int, node: str, **extra) -> dict[str, str]:
    """The environment of one task of `srun --ntasks-per-node=1` on the two training nodes of a 3-node job."""
    env = {"SLURM_JOB_NODELIST": "gpu[001-003]", "SLURM_GPUS_ON_NODE": "8", "SLURM_PROCID": str(rank),
           "SLURMD_NODENAME": node, "SLURM_STEP_NUM_TASKS": "2"}  # fmt: skip
    return {**env, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------------------------
# The accelerate config
# ------------------------------------------------------------------------------------------------------------------


def header_of(path: Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))


@pytest.mark.parametrize("backend", sorted(CONFIGS))
def test_config_loads_with_accelerate_and_has_the_multi_node_fields(backend):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    path, single_name = CONFIGS[backend]
    config = load_config_from_file(str(path))  # accelerate's own loader: rejects unknown keys
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type == {"zero3": "DEEPSPEED", "fsdp2": "FSDP"}[backend]
    assert config.compute_environment == "LOCAL_MACHINE"
    assert config.num_machines >= 2 and config.machine_rank == 0
    assert config.main_process_ip and isinstance(config.main_process_port, int)
    assert config.rdzv_backend in ("static", "c10d")
    assert config.num_processes % config.num_machines == 0  # a total over the machines
    if backend == "zero3":
        assert config.deepspeed_config["deepspeed_multinode_launcher"] == "standard"  # one launcher per node, no ssh
        assert not config.fsdp_config
    else:
        assert config.fsdp_config["fsdp_version"] == 2 and not config.deepspeed_config
        assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"  # save_model writes a loadable model
    # the same backend settings as the single-node config: every field but the multi-node ones
    multi, single = (yaml.safe_load(p.read_text()) for p in (path, REPO / "accelerate_configs" / single_name))
    section = {"zero3": "deepspeed_config", "fsdp2": "fsdp_config"}[backend]
    assert dict(getattr(config, section)) == single[section]
    assert {k: v for k, v in multi.items() if k not in MULTI_NODE_FIELDS} == {
        k: v for k, v in single.items() if k not in MULTI_NODE_FIELDS
    }
    header = header_of(path)
    for field in MULTI_NODE_FIELDS + HEADER_FIELDS[backend]:
        assert f"#   {field}" in header, f"the header does not explain {field}"
    assert f"accelerate launch --config_file accelerate_configs/{path.name}" in header


@pytest.mark.parametrize("backend", sorted(CONFIGS))
def test_config_headers_show_the_builders_launcher_flags(backend):
    """Each header's example command passes the launcher flags the SLURM builder passes, in its order."""
    path = CONFIGS[backend][0]
    lines = [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
    start = next(k for k, line in enumerate(lines) if line.startswith("accelerate launch "))
    command = " ".join(lines[start : start + 4]).replace("\\", " ").split()
    built = mn.train_command(slurm_env(0, "gpu001"), RECIPE, config_file=f"accelerate_configs/{path.name}")
    assert command[: command.index("-m")][::2] == built[: built.index("-m")][::2]  # program, flags; not the values
    assert command[command.index("--config_file") + 1] == f"accelerate_configs/{path.name}"


@pytest.mark.parametrize("backend", sorted(CONFIGS))
def test_builder_argv_drives_accelerate_to_the_intended_torchrun_layout(backend):
    """The builder's argv, parsed by `accelerate launch` itself with the config: 2 nodes x 8 processes, this node's
    rank, the rendezvous endpoint on the first training node, the backend's settings for the processes (accelerate's
    launcher internals; skipped if moved)."""
    launch = pytest.importorskip("accelerate.commands.launch")
    utils = pytest.importorskip("accelerate.utils.launch")
    internals = ("prepare_deepspeed_cmd_env", "prepare_multi_gpu_env")
    if not hasattr(launch, "_validate_launch_command") or not all(hasattr(utils, name) for name in internals):
        pytest.skip("this accelerate version moved its launcher internals")
    if backend == "zero3":
        pytest.importorskip("deepspeed")
    config = CONFIGS[backend][0]
    argv = mn.train_command(slurm_env(1, "gpu002"), RECIPE, config_file=str(config), main_process_port=29611)
    args = launch.launch_command_parser().parse_args(argv[2:])
    args, defaults, _ = launch._validate_launch_command(args)
    if backend == "zero3":
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        cmd, env = utils.prepare_deepspeed_cmd_env(args)
        assert cmd is None  # torchrun in this process, not the pdsh/ssh `deepspeed` runner
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    else:
        assert args.use_fsdp and not args.use_deepspeed  # launch_command's multi_gpu_launcher: torchrun, per node
        env = utils.prepare_multi_gpu_env(args)
        assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
        assert env["FSDP_STATE_DICT_TYPE"] == "FULL_STATE_DICT" and env["FSDP_RESHARD_AFTER_FORWARD"] == "true"
        assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"  # FSDP2 needs no fsdp_sync_module_states with it
        assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "8")
    assert args.rdzv_backend == "static" and args.rdzv_endpoint == "gpu001:29611"
    assert args.training_script == "trl_bandpo.cli.train" and args.module


def accelerate_config_with(tmp_path: Path, name: str, text: str | None = None, **fields) -> str:
    """`text` as a file, or the multi-node ZeRO-3 config with `fields` changed (None: removed from its section)."""
    path = tmp_path / f"{name}.yaml"
    if text is None:
        config = yaml.safe_load(CONFIG.read_text())
        for key, value in fields.items():
            section = config["deepspeed_config"] if key.startswith("deepspeed_") else config
            section.pop(key) if value is None else section.update({key: value})
        text = yaml.safe_dump(config)
    path.write_text(text)
    return str(path)


# (name, the file's text or the multi-node ZeRO-3 config's fields changed, what the one-line refusal says)
BAD_ACCELERATE_CONFIGS = [
    ("empty", {"text": ""}, "the accelerate config must hold a mapping of field: value, got an empty file"),
    ("invalid_yaml", {"text": "distributed_type: [FSDP\n"}, "the accelerate config cannot be read: while parsing"),
    ("a_list", {"text": "- DEEPSPEED\n"}, "must hold a mapping of field: value, got a list"),
    ("the_recipe", {"text": (REPO / RECIPE).read_text()},
     "is not an accelerate config: A `distributed_type` must be specified"),
    ("unknown", {"distributed_type": "ZERO3"}, "not an accelerate config: 'ZERO3' is not a valid DistributedType"),
    ("single_process", {"distributed_type": "NO"}, "has distributed_type 'NO', which cannot run on several nodes: "
                                                   "must be one of MULTI_GPU, DEEPSPEED, FSDP"),
    ("no_unquoted", {"text": "distributed_type: NO\n"}, "has distributed_type False, which cannot run on several"),
    ("cpu", {"distributed_type": "MULTI_CPU"}, "has distributed_type 'MULTI_CPU', which cannot run on several nodes"),
    ("tpu", {"distributed_type": "XLA"}, "has distributed_type 'XLA', which cannot run on several nodes"),
    ("pdsh", {"deepspeed_multinode_launcher": "pdsh"}, "has deepspeed_multinode_launcher 'pdsh': must be 'standard'"),
    ("no_launcher", {"deepspeed_multinode_launcher": None}, "deepspeed_multinode_launcher None: must be 'standard'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "content", "message"), BAD_ACCELERATE_CONFIGS, ids=[c[0] for c in BAD_ACCELERATE_CONFIGS]
)
def test_an_accelerate_config_that_cannot_run_on_several_nodes_is_refused_by_layout_and_train(
    tmp_path, name, content, message, capsys, monkeypatch
):
    """Hardening round 6, item 4: `layout` and `train` passed an empty file, invalid YAML, the recipe itself or
    `distributed_type: 'NO'` on, and `accelerate launch` failed on every node once the vLLM server was up."""
    path = accelerate_config_with(tmp_path, name, **content)
    monkeypatch.setattr(os, "execvpe", lambda *args: pytest.fail(f"ran {args}"))
    for key, value in slurm_env(0, "gpu001").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("ACCELERATE_CONFIG", path)
    train = ["train", "--recipe", RECIPE, "--exec", "--config_file", path]
    for argv, setting in ((["layout", "--recipe", RECIPE], "ACCELERATE_CONFIG"), (train, "config_file")):
        assert mn.main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith(f"multi_node.py: error: {setting}={path!r}") and message in err, err
    with pytest.raises(mn.LaunchError, match=re.escape(message)):  # called from Python: the same refusal
        mn.train_command(slurm_env(0, "gpu001"), RECIPE, config_file=path)


def test_every_shipped_config_but_the_single_process_ones_runs_on_several_nodes():
    for path in sorted((REPO / "accelerate_configs").glob("*.yaml")):
        relative = str(path.relative_to(REPO))
        if path.name in ("single_gpu.yaml", "cpu.yaml"):
            with pytest.raises(mn.LaunchError, match="distributed_type 'NO', which cannot run on several nodes"):
                mn.check_accelerate_config(relative)
        else:
            assert mn.check_accelerate_config(relative) == relative


@pytest.mark.parametrize(
    ("fields", "several_nodes"),
    [({}, True), ({"distributed_type": "FSDP"}, True), ({"distributed_type": "MULTI_GPU"}, True),
     ({"distributed_type": "NO"}, False), ({"distributed_type": "MULTI_CPU"}, False),
     ({"deepspeed_multinode_launcher": "pdsh"}, False), ({"deepspeed_multinode_launcher": None}, False)],
)  # fmt: skip
def test_the_configs_refused_are_those_accelerate_would_not_start_per_node_with_torchrun(
    tmp_path, fields, several_nodes
):
    """The reference is `accelerate launch` itself, given the builder's argv for 2 nodes: a config runs on several
    nodes when accelerate starts torchrun with nnodes=2 in this process (the DeepSpeed `standard` launcher, FSDP,
    multi-GPU); with `NO` or `MULTI_CPU` it starts one plain process that ignores the other node, and with any other
    DeepSpeed launcher the `deepspeed` runner, which ssh-es into the nodes of a hostfile (accelerate's launcher
    internals; skipped if moved)."""
    launch = pytest.importorskip("accelerate.commands.launch")
    utils = pytest.importorskip("accelerate.utils.launch")
    if not hasattr(launch, "_validate_launch_command") or not hasattr(utils, "prepare_deepspeed_cmd_env"):
        pytest.skip("this accelerate version moved its launcher internals")
    path = accelerate_config_with(tmp_path, "config", **fields)
    argv = mn.train_command(slurm_env(1, "gpu002"), RECIPE)  # the default config, then this one in its place
    argv[argv.index("--config_file") + 1] = path
    args, _, _ = launch._validate_launch_command(launch.launch_command_parser().parse_args(argv[2:]))
    torchrun = args.multi_gpu or args.use_fsdp
    if args.use_deepspeed:
        pytest.importorskip("deepspeed")
        args.deepspeed_fields_from_accelerate_config = ""
        torchrun = utils.prepare_deepspeed_cmd_env(args)[0] is None  # None: torchrun here, not the ssh runner
    assert torchrun == several_nodes
    if several_nodes:
        assert mn.check_accelerate_config(path) == path
    else:
        with pytest.raises(mn.LaunchError, match=f"config_file={re.escape(repr(path))} has "):
            mn.check_accelerate_config(path)


# ------------------------------------------------------------------------------------------------------------------
# The command builder
# ------------------------------------------------------------------------------------------------------------------


def test_train_argv_for_two_nodes_rank_0():
    argv = mn.train_command(slurm_env(0, "gpu001"), RECIPE, extra=["--gradient_accumulation_steps", "16"])
    assert argv == [
        "accelerate", "launch", "--config_file", "accelerate_configs/multi_node_zero3.yaml",
        "--num_machines", "2", "--machine_rank", "0", "--main_process_ip", "gpu001", "--main_process_port", "29500",
        "--num_processes", "16", "--rdzv_backend", "static",
        "-m", "trl_bandpo.cli.train", "--config", "recipes/dgpo/deepseek-r1-distill-qwen-14b_dgpo_vllm-server.yaml",
        "--vllm_server_host", "gpu003", "--vllm_server_port", "8000", "--gradient_accumulation_steps", "16",
    ]  # fmt: skip


def test_train_argv_for_rank_1_through_the_command_line(capsys, monkeypatch):
    env = slurm_env(1, "gpu002", SLURM_GPUS_ON_NODE="", SLURM_GPUS_PER_NODE="h100:8")
    argv = ["train", "--recipe", RECIPE, "--main_process_port", "29555", "--rdzv_backend", "c10d",
            "--", "--gradient_accumulation_steps", "16", "--output_dir", "/shared/runs/14b"]  # fmt: skip
    assert mn.run(argv, env) == [
        "accelerate", "launch", "--config_file", "accelerate_configs/multi_node_zero3.yaml",
        "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "gpu001", "--main_process_port", "29555",
        "--num_processes", "16", "--rdzv_backend", "c10d",
        "-m", "trl_bandpo.cli.train", "--config", "recipes/dgpo/deepseek-r1-distill-qwen-14b_dgpo_vllm-server.yaml",
        "--vllm_server_host", "gpu003", "--vllm_server_port", "8000",
        "--gradient_accumulation_steps", "16", "--output_dir", "/shared/runs/14b",
    ]  # fmt: skip
    # main reads os.environ: without a SLURM job it stops with the reason; inside one it prints the command
    for key in [key for key in os.environ if key.startswith("SLURM")]:
        monkeypatch.delenv(key)
    assert mn.main(argv) == 2
    assert "SLURM_JOB_NODELIST is not set" in capsys.readouterr().err
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert mn.main(argv) == 0
    assert capsys.readouterr().out.split() == mn.run(argv, env)


def test_train_argv_with_the_fsdp2_config_differs_only_in_the_config(capsys):
    """`--config_file accelerate_configs/multi_node_fsdp2.yaml` (what ACCELERATE_CONFIG passes): the same launch,
    rank by rank, with the FSDP2 config; the ZeRO-3 config stays the default."""
    assert mn.DEFAULT_ACCELERATE_CONFIG == "accelerate_configs/multi_node_zero3.yaml"
    assert mn.FSDP2_ACCELERATE_CONFIG == "accelerate_configs/multi_node_fsdp2.yaml" and CONFIG_FSDP2.is_file()
    for rank, node in ((0, "gpu001"), (1, "gpu002")):
        base = ["train", "--recipe", RECIPE, "--", "--gradient_accumulation_steps", "16"]
        zero3 = mn.run(base, slurm_env(rank, node))
        fsdp2 = mn.run([*base[:3], "--config_file", mn.FSDP2_ACCELERATE_CONFIG, *base[3:]], slurm_env(rank, node))
        at = zero3.index("--config_file") + 1
        assert zero3[at] == mn.DEFAULT_ACCELERATE_CONFIG and fsdp2[at] == mn.FSDP2_ACCELERATE_CONFIG
        assert fsdp2[:at] + fsdp2[at + 1 :] == zero3[:at] + zero3[at + 1 :]
        assert fsdp2 == mn.train_command(slurm_env(rank, node), RECIPE, config_file=mn.FSDP2_ACCELERATE_CONFIG,
                                         extra=["--gradient_accumulation_steps", "16"])  # fmt: skip
    # the batch script's setting: `layout` accepts it
    env = {"SLURM_JOB_NODELIST": "gpu[001-003]", "SLURM_GPUS_ON_NODE": "8"}
    env["ACCELERATE_CONFIG"] = mn.FSDP2_ACCELERATE_CONFIG
    assert mn.run(["layout", "--recipe", RECIPE], env) is None
    assert "NUM_PROCESSES=16\n" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # the help of `train --config_file` names both configs
        mn.main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert mn.DEFAULT_ACCELERATE_CONFIG in help_text and mn.FSDP2_ACCELERATE_CONFIG in help_text


def test_every_recipe_flag_the_builder_adds_is_a_training_field():
    from trl_bandpo.cli.recipe import DATACLASS_TYPES, RecipeParser

    argv = mn.train_command(slurm_env(0, "gpu001"), RECIPE)
    flags = [a[2:] for a in argv[argv.index("trl_bandpo.cli.train") + 1 :] if a.startswith("--")]
    assert flags and set(flags) <= RecipeParser(DATACLASS_TYPES).known | {"config"}


def test_vllm_argv_and_layout():
    env = {"SLURM_JOB_NODELIST": "gpu[001-003]", "SLURM_GPUS_ON_NODE": "8"}
    assert mn.run(["vllm", "--recipe", RECIPE], env) == [
        "VLLM_SERVER_DEV_MODE=1", "vllm", "serve", "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B",
        "--tensor-parallel-size", "8", "--data-parallel-size", "1", "--host", "0.0.0.0", "--port", "8000",
        "--max-model-len", "9216", "--enable-scale-out", "--weight-transfer-config", '{"backend": "nccl"}',
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
    ]  # fmt: skip
    argv = mn.run(["vllm", "--recipe", RECIPE, "--tensor_parallel_size", "2", "--data_parallel_size", "4",
                   "--vllm_port", "8100", "--", "--enforce-eager"], env)  # fmt: skip
    assert argv[argv.index("--tensor-parallel-size") :] == [
        "--tensor-parallel-size", "2", "--data-parallel-size", "4", "--host", "0.0.0.0", "--port", "8100",
        "--max-model-len", "9216", "--enable-scale-out", "--weight-transfer-config", '{"backend": "nccl"}',
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1", "--enforce-eager",
    ]  # fmt: skip
    with pytest.raises(mn.LaunchError, match="needs more than the 8 GPUs"):
        mn.run(["vllm", "--recipe", RECIPE, "--tensor_parallel_size", "4", "--data_parallel_size", "4"], env)
    layout = mn.job_layout(env)
    assert mn.layout_assignments(layout, 8000) == {
        "TRAIN_NODES": "gpu001,gpu002", "NUM_TRAIN_NODES": "2", "GPUS_PER_NODE": "8", "NUM_PROCESSES": "16",
        "MAIN_PROCESS_IP": "gpu001", "VLLM_NODE": "gpu003", "VLLM_PORT": "8000",
        "VLLM_HEALTH_URL": "http://gpu003:8000/health",
    }  # fmt: skip
    no_server = mn.job_layout(env, vllm_nodes=0)
    assert no_server.train_nodes == ("gpu001", "gpu002", "gpu003") and no_server.vllm_node is None
    argv = mn.train_command({**env, "SLURM_PROCID": "2"}, "recipes/dgpo/deepseek-r1-distill-qwen-14b_dgpo.yaml",
                            layout=no_server)  # fmt: skip
    assert argv[argv.index("--num_processes") + 1] == "24" and "--vllm_server_host" not in argv


def test_the_server_flags_are_the_ones_trl_imposes():
    """TRL 1.16's deprecated server command runs `vllm serve` with settings of its own on top of the ones it
    translates (`trl.scripts.vllm_serve.build_command`): the helper passes exactly those."""
    vllm_serve = pytest.importorskip("trl.scripts.vllm_serve")
    with pytest.MonkeyPatch.context() as patch:  # as with the vLLM >= 0.30 of the vllm extra, installed or not
        patch.setattr(vllm_serve, "is_vllm_available", lambda min_version=None: True)
        command = vllm_serve.build_command(vllm_serve.ScriptArguments(model="m"))
    translated = ["--host", "--port", "--tensor-parallel-size", "--data-parallel-size", "--gpu-memory-utilization",
                  "--dtype", "--kv-cache-dtype", "--model-impl", "--uvicorn-log-level"]  # fmt: skip
    rest = command[command.index("m") + 1 :]
    for flag in translated:  # each ScriptArguments field: flag and value
        at = rest.index(flag)
        del rest[at : at + 2]
    assert tuple(rest) == mn.TRL_SERVER_FLAGS


def test_the_commands_shown_in_the_docs_are_the_builders():
    """docs/multi-node.md shows what the helper prints for its dry-run example; both stay in step."""
    text = (REPO / "docs" / "multi-node.md").read_text()
    shown = [line for line in text.splitlines() if line.startswith(("accelerate launch ", "VLLM_SERVER_DEV_MODE=1 "))]
    env = {"SLURM_JOB_NODELIST": "gpu[001-003]", "SLURM_GPUS_ON_NODE": "8", "SLURM_PROCID": "1"}
    train = mn.run(["train", "--recipe", RECIPE, "--", "--gradient_accumulation_steps", "16"], env)
    vllm = mn.run(["vllm", "--recipe", RECIPE], env)
    assert " ".join(train) in shown and shlex.join(vllm) in shown  # as the helper prints them


def test_the_fsdp2_command_in_the_docs_is_the_zero3_one_with_its_config():
    """docs/multi-node.md's FSDP2 command is its ZeRO-3 command for node 1 with only the config changed."""
    text = (REPO / "docs" / "multi-node.md").read_text()
    commands = [" ".join(line.replace("\\", " ").split()) for line in re.sub(r"\\\n\s*", " ", text).splitlines()]
    launches = [line for line in commands if line.startswith("accelerate launch ")]
    fsdp2 = [line for line in launches if mn.FSDP2_ACCELERATE_CONFIG in line]
    zero3 = [line for line in launches if "--machine_rank 1" in line and mn.DEFAULT_ACCELERATE_CONFIG in line]
    assert len(fsdp2) == 1 and zero3
    assert fsdp2[0] == zero3[0].replace(mn.DEFAULT_ACCELERATE_CONFIG, mn.FSDP2_ACCELERATE_CONFIG)
    assert f"ACCELERATE_CONFIG={mn.FSDP2_ACCELERATE_CONFIG} sbatch" in text


@pytest.mark.parametrize(
    ("expression", "hosts"),
    [
        ("gpu[001-003,007]", ["gpu001", "gpu002", "gpu003", "gpu007"]),
        ("a1,b[8-10],c", ["a1", "b8", "b9", "b10", "c"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("node17", ["node17"]),
    ],
)
def test_expand_nodelist(expression, hosts):
    assert mn.expand_nodelist(expression) == hosts


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLURM_GPUS_ON_NODE": "8", "SLURM_PROCID": "0"}, "SLURM_JOB_NODELIST is not set"),
        ({"SLURM_JOB_NODELIST": "gpu[001-003]", "SLURM_GPUS_ON_NODE": "8"}, "SLURM_PROCID is not set"),
        ({"SLURM_JOB_NODELIST": "gpu[001-003]", "SLURM_PROCID": "0"}, "SLURM_GPUS_ON_NODE"),
        (slurm_env(2, "gpu003", SLURM_STEP_NUM_TASKS="3"), "one task per training node"),
        (slurm_env(2, "gpu003", SLURM_STEP_NUM_TASKS="2"), "not a training node rank"),
        (slurm_env(1, "gpu001"), "runs on gpu001 but training node 1 is gpu002"),
        ({"SLURM_JOB_NODELIST": "gpu001", "SLURM_GPUS_ON_NODE": "8", "SLURM_PROCID": "0"}, "at least one training"),
        ({"SLURM_JOB_NODELIST": "gpu[001-003", "SLURM_GPUS_ON_NODE": "8", "SLURM_PROCID": "0"}, "unbalanced"),
    ],
)
def test_missing_or_inconsistent_slurm_environment_is_a_clear_error(env, message):
    with pytest.raises(mn.LaunchError, match=message):
        mn.train_command(env, RECIPE)


@pytest.mark.parametrize(
    ("env", "gpus"),
    [
        ({"SLURM_GPUS_PER_NODE": "8"}, 8),
        ({"SLURM_GPUS_PER_NODE": "h100:8"}, 8),
        ({"SLURM_GPUS_PER_NODE": "gpu:h100:4"}, 4),
        ({"SLURM_GPUS_PER_NODE": "a100:2(IDX:0,1)"}, 2),
        ({"SLURM_GPUS_ON_NODE": "4", "SLURM_GPUS_PER_NODE": "h100:8"}, 4),  # what this node got wins
    ],
)
def test_gpus_per_node_reads_typed_counts(env, gpus):
    assert mn.gpus_per_node(env) == gpus


@pytest.mark.parametrize(
    ("env", "message"),
    [
        # several GPU types on a node are refused, not summed, even where SLURM_GPUS_ON_NODE holds their sum
        ({"SLURM_GPUS_PER_NODE": "h100:8,a100:4"}, "SLURM_GPUS_PER_NODE='h100:8,a100:4' lists several GPU types"),
        ({"SLURM_GPUS_ON_NODE": "12", "SLURM_GPUS_PER_NODE": "h100:8,a100:4"}, "lists several GPU types"),
        ({"SLURM_GPUS_PER_NODE": "h100"}, "SLURM_GPUS_PER_NODE='h100' is not a number of GPUs > 0"),
        ({"SLURM_GPUS_PER_NODE": "h100:0"}, "SLURM_GPUS_PER_NODE='h100:0' is not a number of GPUs > 0"),
        ({"SLURM_GPUS_ON_NODE": "eight", "SLURM_GPUS_PER_NODE": "8"}, "SLURM_GPUS_ON_NODE='eight' is not a number"),
    ],
)
def test_unreadable_gpu_counts_name_the_variable_value_and_accepted_forms(env, message):
    with pytest.raises(mn.LaunchError, match=message) as err:
        mn.gpus_per_node(env)
    assert "accepted: a count (8) or one TYPE:COUNT (h100:8" in str(err.value) and "\n" not in str(err.value)


def test_layout_checks_the_batch_scripts_settings(capsys):
    """`layout` reads the settings from the environment (VLLM_NODES, VLLM_PORT, ...) and checks them all."""
    env = {"SLURM_JOB_NODELIST": "gpu[001-003]", "SLURM_GPUS_ON_NODE": "8"}
    assert mn.run(["layout", "--recipe", RECIPE], {**env, "VLLM_NODES": "0", "RDZV_BACKEND": "c10d"}) is None
    assert "TRAIN_NODES=gpu001,gpu002,gpu003\n" in capsys.readouterr().out
    good = {"VLLM_PORT": "8100", "MAIN_PROCESS_PORT": "29501", "VLLM_STARTUP_TIMEOUT": "2.5", "VLLM_NODES": "1",
            "VLLM_TENSOR_PARALLEL_SIZE": "4", "VLLM_DATA_PARALLEL_SIZE": "2", "VLLM_HEALTH_INTERVAL": "1",
            "ACCELERATE_CONFIG": "accelerate_configs/zero3.yaml", "VLLM_MAX_MODEL_LEN": "4096"}  # fmt: skip
    mn.run(["layout", "--recipe", RECIPE], {**env, **good})
    assert "VLLM_HEALTH_URL=http://gpu003:8100/health" in capsys.readouterr().out
    for name, value, message in [
        ("RDZV_BACKEND", "etcd", "RDZV_BACKEND='etcd': must be static or c10d"),
        ("VLLM_PORT", "80000", "VLLM_PORT='80000': must be a port number, 1-65535"),
        ("VLLM_STARTUP_TIMEOUT", "30m", "VLLM_STARTUP_TIMEOUT='30m': must be a number of seconds > 0"),
        ("VLLM_DATA_PARALLEL_SIZE", "16", "tensor parallel 0 x data parallel 16 needs more than the 8 GPUs"),
    ]:
        with pytest.raises(mn.LaunchError, match=message):
            mn.run(["layout", "--recipe", RECIPE], {**env, name: value})


def test_cli_errors_name_the_problem(capsys):
    assert mn.main(["train", "--recipe", "recipes/dgpo/missing.yaml"]) == 2
    assert "recipes/dgpo/missing.yaml does not exist" in capsys.readouterr().err
    assert mn.main(["layout"]) == 2
    assert "`layout` needs --recipe" in capsys.readouterr().err


def recipe_with(tmp_path: Path, **fields) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load((REPO / RECIPE).read_text()), **fields}))
    return str(path)


BAD_VALUES = [
    # (argv after the subcommand's --recipe, extra environment, the setting named, what it must be)
    (["vllm", "--tensor_parallel_size", "0"], {}, "--tensor_parallel_size", "'0'", "a whole number >= 1"),
    (["vllm", "--tensor_parallel_size", "two"], {}, "--tensor_parallel_size", "'two'", "a whole number >= 1"),
    (["vllm", "--data_parallel_size", "0"], {}, "--data_parallel_size", "'0'", "a whole number >= 1"),
    (["vllm", "--data_parallel_size", "-2"], {}, "--data_parallel_size", "'-2'", "a whole number >= 1"),
    (["vllm", "--max_model_len", "-5"], {}, "--max_model_len", "'-5'", "a whole number >= 1"),
    (["vllm", "--vllm_port", "http"], {}, "--vllm_port", "'http'", "a port number, 1-65535"),
    (["vllm", "--vllm_port", "0"], {}, "--vllm_port", "'0'", "a port number, 1-65535"),
    (["vllm", "--vllm_port", "70000"], {}, "--vllm_port", "'70000'", "a port number, 1-65535"),
    (["vllm", "--gpus_per_node", "0"], {}, "--gpus_per_node", "'0'", "a whole number >= 1"),
    (["layout", "--gpus_per_node", "eight"], {}, "--gpus_per_node", "'eight'", "a whole number >= 1"),
    (["layout", "--vllm_nodes", "2"], {}, "--vllm_nodes", "'2'", "0 or 1"),
    (["train", "--main_process_port", "abc"], {}, "--main_process_port", "'abc'", "a port number, 1-65535"),
    (["train", "--main_process_port", "0"], {}, "--main_process_port", "'0'", "a port number, 1-65535"),
    (["train", "--rdzv_backend", "etcd"], {}, "--rdzv_backend", "'etcd'", "'static', 'c10d'"),
    (
        ["train", "--config_file", "accelerate_configs/multi_node_fsdp.yaml"],
        {},
        "--config_file",
        "'accelerate_configs/multi_node_fsdp.yaml'",
        "an existing file",
    ),
    (["train"], {"SLURM_STEP_NUM_TASKS": "two"}, "SLURM_STEP_NUM_TASKS", "'two'", "a whole number >= 1"),
    (["train"], {"SLURM_PROCID": "first"}, "SLURM_PROCID", "'first'", "is not a task number"),
    (["wait", "--timeout", "abc"], {}, "--timeout", "'abc'", "a number of seconds > 0"),
    (["wait", "--interval", "-1"], {}, "--interval", "'-1'", "a number of seconds > 0"),
    (["wait", "--interval", "0"], {}, "--interval", "'0'", "a number of seconds > 0"),
    (["wait", "--pid", "x"], {}, "--pid", "'x'", "a whole number >= 1"),
]


@pytest.mark.parametrize(("argv", "env", "setting", "value", "allowed"), BAD_VALUES)
def test_every_bad_value_is_one_line_and_status_2_before_anything_runs(
    argv, env, setting, value, allowed, capsys, monkeypatch
):
    """Issue 27, item 9: raw tracebacks for non-numeric ports and counts, `--tensor_parallel_size 0` read as 8."""
    for key in [key for key in os.environ if key.startswith("SLURM")]:
        monkeypatch.delenv(key)
    for key, val in {**slurm_env(0, "gpu001"), **env}.items():
        monkeypatch.setenv(key, val)
    monkeypatch.setattr(os, "execvpe", lambda *args: pytest.fail(f"ran {args}"))
    monkeypatch.setattr(mn.urllib.request, "urlopen", lambda *args, **kw: pytest.fail("polled the server"))
    command = argv[0]
    target = {"wait": ["--url", "http://127.0.0.1:9/health"], "layout": ["--recipe", RECIPE]}
    assert mn.main([command, *target.get(command, ["--recipe", RECIPE, "--exec"]), *argv[1:]]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("multi_node.py: error: "), err
    assert setting in err and value in err and allowed in err, err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"vllm_server_port": "http"}, "the recipe's vllm_server_port='http': must be a port number, 1-65535"),
        ({"vllm_server_port": 0}, "the recipe's vllm_server_port=0: must be a port number, 1-65535"),
        ({"max_completion_length": "lots"}, "the recipe's max_completion_length='lots': must be a whole number >= 1"),
        ({"vllm_max_model_length": -1}, "the recipe's vllm_max_model_length=-1: must be a whole number >= 1"),
    ],
)
def test_bad_recipe_values_are_one_line_and_status_2(tmp_path, fields, message, capsys, monkeypatch):
    for key, val in {"SLURM_JOB_NODELIST": "gpu[001-003]", "SLURM_GPUS_ON_NODE": "8"}.items():
        monkeypatch.setenv(key, val)
    assert mn.main(["layout", "--recipe", recipe_with(tmp_path, **fields)]) == 2
    assert capsys.readouterr().err == f"multi_node.py: error: {message}\n"
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "broken.yaml").write_text("model: [unclosed\n")
    for name, text in (
        ("list.yaml", "must hold a mapping of field: value, got a list"),
        ("broken.yaml", "cannot be read"),
    ):
        assert mn.main(["vllm", "--recipe", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and text in err, err


def test_the_builders_refuse_what_the_command_line_refuses():
    """Called from Python, the builders refuse the same values: a tensor parallel size of 0 is not "unset"."""
    env = {"SLURM_JOB_NODELIST": "gpu[001-003]", "SLURM_GPUS_ON_NODE": "8"}
    fields = {"model_name_or_path": "m"}
    assert mn.vllm_command(fields, 8)[mn.vllm_command(fields, 8).index("--tensor-parallel-size") + 1] == "8"
    for kwargs, message in [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size=0: must be a whole number >= 1"),
        ({"data_parallel_size": 0}, "data_parallel_size=0: must be a whole number >= 1"),
        ({"port": 0}, "port=0: must be a port number"),
        ({"max_model_len": 0}, "max_model_len=0: must be a whole number >= 1"),
        ({"tensor_parallel_size": 2.0}, r"tensor_parallel_size=2.0: must be a whole number >= 1"),
    ]:
        with pytest.raises(mn.LaunchError, match=message):
            mn.vllm_command(fields, 8, **kwargs)
    with pytest.raises(mn.LaunchError, match="main_process_port=70000: must be a port number"):
        mn.train_command({**env, "SLURM_PROCID": "0"}, RECIPE, main_process_port=70000)
    with pytest.raises(mn.LaunchError, match="--gpus_per_node=0: must be a whole number >= 1"):
        mn.job_layout(env, gpus=0)
    with pytest.raises(mn.LaunchError, match="interval=0: must be a number of seconds > 0"):
        mn.wait_for_health("http://127.0.0.1:9/health", timeout=1, interval=0)


@contextlib.contextmanager
def health_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_wait_for_health():
    with health_server() as base:
        assert mn.wait_for_health(f"{base}/health", timeout=5, interval=0.05) < 5
        with pytest.raises(mn.LaunchError, match="exited before"):  # 404: not up; the server process died
            mn.wait_for_health(f"{base}/missing", timeout=5, interval=0.05, alive=lambda: False, log=lambda m: None)
    with pytest.raises(mn.LaunchError, match="did not answer within"):
        mn.wait_for_health(f"http://127.0.0.1:{free_port()}/health", timeout=0.2, interval=0.05, log=lambda m: None)


# ------------------------------------------------------------------------------------------------------------------
# The batch script
# ------------------------------------------------------------------------------------------------------------------


def test_sbatch_calls_the_builder_and_parses():
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash\n")
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --ntasks-per-node=1" in directives and any("--gpus-per-node" in d for d in directives)
    for call in ('python "$HELPER" layout', 'python "$HELPER" vllm --exec', 'python "$HELPER" wait',
                 'python "$HELPER" train --exec'):  # fmt: skip
        assert call in text, call
    assert "HELPER=scripts/slurm/multi_node.py" in text and "--kill-on-bad-exit=1" in text
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash on this machine")
    result = subprocess.run([bash, "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


FAKE_SRUN = """#!/bin/bash
# Stand-in for srun: one task per node of --nodelist, with the SLURM task variables, stopped on SIGTERM.
nodelist="" ntasks=1
while [[ $1 == -* ]]; do
    case $1 in --nodelist=*) nodelist=${1#*=} ;; --ntasks=*) ntasks=${1#*=} ;; esac
    shift
done
echo "srun $nodelist $*" >> "$FAKE_LOG/srun.txt"
IFS=, read -r -a nodes <<< "$nodelist"
pids=()
for ((k = 0; k < ntasks; k++)); do
    SLURM_PROCID=$k SLURMD_NODENAME=${nodes[k]} SLURM_STEP_NUM_TASKS=$ntasks "$@" &
    pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null; exit 143' TERM
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""

FAKE_VLLM = """#!{python}
# Stand-in for `vllm serve`: answers /health on --port until stopped.
import http.server, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
with open(os.path.join(os.environ["FAKE_LOG"], "vllm.json"), "w") as f:
    f.write(repr({{"argv": sys.argv[1:], "pid": os.getpid(), "dev_mode": os.environ.get("VLLM_SERVER_DEV_MODE")}}))
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("0.0.0.0", port), Handler).serve_forever()
"""

FAKE_ACCELERATE = """#!{python}
# Stand-in for `accelerate`: records its argv per node; FAKE_FAIL_RANK makes that node fail.
import json, os, sys
rank = os.environ["SLURM_PROCID"]
with open(os.path.join(os.environ["FAKE_LOG"], f"accelerate{{rank}}.json"), "w") as f:
    json.dump(sys.argv[1:], f)
sys.exit(3 if os.environ.get("FAKE_FAIL_RANK") == rank else 0)
"""


def run_sbatch(tmp_path: Path, **env_extra) -> tuple[subprocess.CompletedProcess, Path, str]:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash on this machine")
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("vllm", FAKE_VLLM), ("accelerate", FAKE_ACCELERATE)):
        (bin_dir / name).write_text(text.format(python=sys.executable) if name != "srun" else text)
        (bin_dir / name).chmod(0o755)
    python_dir = tmp_path / "python"  # `python` for the batch script, without the rest of the venv's bin
    python_dir.mkdir()
    (python_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (python_dir / "python").chmod(0o755)
    port = str(free_port())
    env = {
        "PATH": os.pathsep.join([str(bin_dir), str(python_dir), "/usr/bin", "/bin"]),
        "HOME": str(tmp_path), "FAKE_LOG": str(log), "VENV": str(tmp_path / "no-venv"),
        "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": "127.0.0.[1-3]",  # loopback: 127.0.0.3 is this host
        "SLURM_GPUS_ON_NODE": "2", "SLURM_CPUS_ON_NODE": "4", "SLURM_JOB_ID": "1",
        "VLLM_PORT": port, "VLLM_HEALTH_INTERVAL": "0.1", "VLLM_STARTUP_TIMEOUT": "60",
        **env_extra,
    }  # fmt: skip
    result = subprocess.run([bash, str(SBATCH), RECIPE, "--gradient_accumulation_steps", "32"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    return result, log, port


def assert_server_stopped(log: Path) -> None:
    pid = eval((log / "vllm.json").read_text())["pid"]  # noqa: S307 (written by the stand-in above)
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("the batch script left the vLLM server running")


@pytest.mark.parametrize("config", [None, "accelerate_configs/multi_node_fsdp2.yaml"], ids=["default", "fsdp2"])
def test_sbatch_runs_the_server_then_one_launcher_per_training_node(tmp_path, config):
    result, log, port = run_sbatch(tmp_path, **({"ACCELERATE_CONFIG": config} if config else {}))
    assert result.returncode == 0, result.stdout + result.stderr
    vllm = eval((log / "vllm.json").read_text())  # noqa: S307
    assert vllm["dev_mode"] == "1"  # the server runs in dev mode: TRL's weight push needs its routes
    assert vllm["argv"] == ["serve", "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B",
                            "--tensor-parallel-size", "2", "--data-parallel-size", "1", "--host", "0.0.0.0",
                            "--port", port, "--max-model-len", "9216", *mn.TRL_SERVER_FLAGS]  # fmt: skip
    for rank in (0, 1):
        assert json.loads((log / f"accelerate{rank}.json").read_text()) == [
            "launch", "--config_file", config or "accelerate_configs/multi_node_zero3.yaml",
            "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
            "--main_process_port", "29500", "--num_processes", "4", "--rdzv_backend", "static",
            "-m", "trl_bandpo.cli.train", "--config", RECIPE,
            "--vllm_server_host", "127.0.0.3", "--vllm_server_port", port, "--gradient_accumulation_steps", "32",
        ]  # fmt: skip
    sruns = (log / "srun.txt").read_text().splitlines()
    assert sruns[0].startswith("srun 127.0.0.3 python scripts/slurm/multi_node.py vllm --exec")
    assert sruns[1].startswith("srun 127.0.0.1,127.0.0.2 python scripts/slurm/multi_node.py train --exec")
    assert "training finished with status 0" in result.stdout
    assert_server_stopped(log)


def test_sbatch_exits_with_the_training_status_and_stops_the_server(tmp_path):
    result, log, _ = run_sbatch(tmp_path, FAKE_FAIL_RANK="1", MAIN_PROCESS_PORT="29600", RDZV_BACKEND="c10d")
    assert result.returncode == 3, result.stdout + result.stderr
    argv = json.loads((log / "accelerate0.json").read_text())
    assert argv[argv.index("--main_process_port") + 1] == "29600" and argv[argv.index("--rdzv_backend") + 1] == "c10d"
    assert_server_stopped(log)


def test_sbatch_without_a_vllm_node_trains_on_every_node(tmp_path):
    result, log, _ = run_sbatch(tmp_path, VLLM_NODES="0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (log / "vllm.json").exists()
    for rank in (0, 1, 2):
        argv = json.loads((log / f"accelerate{rank}.json").read_text())
        assert argv[argv.index("--num_machines") : argv.index("--main_process_port")] == [
            "--num_machines", "3", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
        ]  # fmt: skip
        assert argv[argv.index("--num_processes") + 1] == "6" and "--vllm_server_host" not in argv


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"RDZV_BACKEND": "bogus"}, "RDZV_BACKEND='bogus': must be static or c10d"),
        ({"MAIN_PROCESS_PORT": "abc"}, "MAIN_PROCESS_PORT='abc': must be a port number, 1-65535"),
        ({"VLLM_STARTUP_TIMEOUT": "soon"}, "VLLM_STARTUP_TIMEOUT='soon': must be a number of seconds > 0"),
        ({"VLLM_HEALTH_INTERVAL": "0"}, "VLLM_HEALTH_INTERVAL='0': must be a number of seconds > 0"),
        ({"ACCELERATE_CONFIG": "missing.yaml"}, "ACCELERATE_CONFIG='missing.yaml': must be an existing file"),
        ({"ACCELERATE_CONFIG": "accelerate_configs/single_gpu.yaml"},
         "ACCELERATE_CONFIG='accelerate_configs/single_gpu.yaml' has distributed_type 'NO', which cannot run"),
        ({"ACCELERATE_CONFIG": RECIPE}, f"ACCELERATE_CONFIG='{RECIPE}' is not an accelerate config"),
        ({"VLLM_NODES": "2"}, "VLLM_NODES='2': must be 0 or 1"),
        ({"VLLM_MAX_MODEL_LEN": "8k"}, "VLLM_MAX_MODEL_LEN='8k': must be a whole number >= 1"),
        ({"VLLM_TENSOR_PARALLEL_SIZE": "4"}, "tensor parallel 4 x data parallel 1 needs more than the 2 GPUs"),
        ({"SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "h100:8,a100:4"},
         "SLURM_GPUS_PER_NODE='h100:8,a100:4' lists several GPU types"),
    ],
)  # fmt: skip
def test_sbatch_checks_every_setting_before_starting_anything(tmp_path, setting, message):
    """A bad setting ends the job at once, naming the variable, before the vLLM server (or anything) starts."""
    result, log, _ = run_sbatch(tmp_path, **setting)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"multi_node.py: error: {message}" in result.stderr
    assert not (log / "srun.txt").exists() and not (log / "vllm.json").exists(), "a process started"
    assert "training finished" not in result.stdout


def test_sbatch_without_a_recipe_prints_its_usage(tmp_path):
    bash = shutil.which("bash") or pytest.skip("no bash on this machine")
    result = subprocess.run([bash, str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "usage: sbatch" in result.stderr


# ------------------------------------------------------------------------------------------------------------------
# Two machines on one host
# ------------------------------------------------------------------------------------------------------------------

CPU_OVERRIDES = {"use_cpu": True, "mixed_precision": "no"}
CPU_DEEPSPEED = {"zero3_init_flag": False, "zero3_save_16bit_model": False}


def run_two_machines(tmp_path: Path, config: dict, script: str, tiny_model_dir: str) -> None:
    """Two `accelerate launch` processes, machine ranks 0 and 1 of a 2-machine job, 1 CPU process each, started with
    the launcher flags the SLURM builder emits and `config` (a multi-node config switched to CPU), running
    tests/scripts/`script` MODEL OUTPUT_DIR as one world of 2; both must exit with 0."""
    try:
        port = free_port()
    except OSError as err:
        pytest.skip(f"cannot open a TCP socket on 127.0.0.1 for the rendezvous: {err}")
    config_file = tmp_path / "multi_node_cpu.yaml"
    config_file.write_text(yaml.safe_dump(config))
    accelerate = shutil.which("accelerate") or os.path.join(os.path.dirname(sys.executable), "accelerate")
    layout = mn.Layout(train_nodes=("127.0.0.1", "127.0.0.1"), vllm_node=None, gpus_per_node=1)
    command = [str(REPO / "tests" / "scripts" / script), tiny_model_dir, str(tmp_path)]
    processes = []
    for rank in (0, 1):
        argv = mn.train_command(
            {"SLURM_PROCID": str(rank)},
            "unused.yaml",
            layout=layout,
            config_file=str(config_file),
            main_process_port=port,
            program=accelerate,
        )
        argv = argv[: argv.index("-m")] + command  # the launcher part of the builder's argv, a test script
        log = open(tmp_path / f"machine{rank}.log", "w")  # closed below
        processes.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    try:
        codes = [process.wait(timeout=300) for process, _ in processes]
    finally:
        for process, log in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            log.close()
    texts = [(tmp_path / f"machine{k}.log").read_text() for k in (0, 1)]
    errors = [line for text in texts for line in text.splitlines() if "Error" in line and "Warning" not in line]
    assert codes == [0, 0], "\n".join(errors[:20] + [text[-2000:] for text in texts])


@pytest.mark.slow
def test_two_machines_on_one_host_train_bandpo_with_zero3(tiny_model_dir, tmp_path):
    """Two `accelerate launch` processes, machine ranks 0 and 1 of a 2-machine job, 1 CPU process each, with the
    launcher flags the SLURM builder emits and the multi-node config (switched to CPU): they meet at the rendezvous
    and run two BandPO steps under DeepSpeed ZeRO-3 as one world of 2."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: the config's launcher path needs it")
    config = yaml.safe_load(CONFIG.read_text())
    config.update(CPU_OVERRIDES)
    config["deepspeed_config"].update(CPU_DEEPSPEED)
    run_two_machines(tmp_path, config, "zero3_bandpo_run.py", tiny_model_dir)
    ranks = [json.loads((tmp_path / f"log_history_rank{k}.json").read_text()) for k in (0, 1)]
    assert all(rank["world"] == 2 and rank["deepspeed"] for rank in ranks)
    steps = [[e for e in rank["log_history"] if "loss" in e] for rank in ranks]
    assert len(steps[0]) == len(steps[1]) == 2
    for entry0, entry1 in zip(*steps):
        for key in ("loss", "entropy", "bounds/upper_mean"):  # the same global step on both machines
            assert entry0.get(key) == pytest.approx(entry1.get(key), nan_ok=True), key


@pytest.mark.slow
def test_two_machines_on_one_host_train_bandpo_with_fsdp2(tiny_model_dir, tmp_path):
    """The same two machines with accelerate_configs/multi_node_fsdp2.yaml as it is but for CPU (gloo, no bf16;
    cpu_ram_efficient_loading on, so the shards come from machine 0's weights by broadcast): FSDP2 shards the model
    over the world of 2 and every shard holds the checkpoint's weights, two BandPO steps run, the step-2 trainer
    checkpoint holds the gathered model and the full optimizer state (FULL_STATE_DICT), and `save_model` gathers a
    model that `from_pretrained` loads, trained. tests/scripts/fsdp2_bandpo_run.py says how it gets accelerate to apply
    FSDP on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    config = yaml.safe_load(CONFIG_FSDP2.read_text())
    config.update(CPU_OVERRIDES)
    run_two_machines(tmp_path, config, "fsdp2_bandpo_run.py", tiny_model_dir)
    ranks = [json.loads((tmp_path / f"fsdp2_rank{k}.json").read_text()) for k in (0, 1)]
    for rank in ranks:
        assert rank["world"] == 2 and rank["backend"] == "gloo" and not rank["deepspeed"]
        assert rank["distributed_type"] == "DistributedType.FSDP" and rank["fsdp_version"] == 2
        assert rank["sharded"], "the trained model's parameters are not DTensors: FSDP2 did not shard it"
        assert rank["global_step"] == 2
        assert rank["compared_at_start"] > 0 and rank["differing_at_start"] == [], "a shard missed the broadcast"
    steps = [[e for e in rank["log_history"] if "loss" in e] for rank in ranks]
    assert len(steps[0]) == len(steps[1]) == 2
    for entry0, entry1 in zip(*steps):
        assert math.isfinite(entry0["loss"]) and math.isfinite(entry0["grad_norm"])
        for key in ("loss", "entropy", "bounds/upper_mean"):  # the same global step on both machines
            assert entry0.get(key) == pytest.approx(entry1.get(key), nan_ok=True), key
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before, after = initial.state_dict(), trained.state_dict()
    assert set(after) == set(before)
    assert all(torch.isfinite(value).all() for value in after.values())
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(changed) >= len(before) // 2, f"only {changed} changed"
    checkpoint = tmp_path / "checkpoint-2"
    saved = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    assert all(torch.equal(saved[name], after[name]) for name in after)  # the checkpoint is the trained model
    optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=False)["state"]  # written by machine 0 alone
    params = dict(trained.named_parameters())
    assert set(optimizer) == set(params)
    for name, moments in optimizer.items():  # whole tensors, gathered from both shards
        assert moments["exp_avg"].shape == moments["exp_avg_sq"].shape == params[name].shape, name
    assert all((checkpoint / f"generation_buffer_rank{k}.pt").is_file() for k in (0, 1))


def test_builder_is_not_part_of_the_package():
    """An application script: the package never imports it, it does not import the package, and it stays small."""
    for path in (REPO / "trl_bandpo").rglob("*.py"):
        text = path.read_text()
        assert "import scripts" not in text and "from scripts" not in text, path
    source = (REPO / "scripts" / "slurm" / "multi_node.py").read_text()
    assert "import trl_bandpo" not in source and "from trl_bandpo" not in source
    assert len(source.splitlines()) < 540  # 400 until it checked the batch script's settings, 450 until every value,
    # 500 until it read the accelerate config
