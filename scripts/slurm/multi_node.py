"""Per-node commands for multi-node training under SLURM, used by scripts/slurm/multi_node.sbatch.

The job's nodes are split into N training nodes (the first ones, in SLURM's order) and, by default, one vLLM node
(the last one). Each subcommand reads the SLURM environment and prints, or with `--exec` runs, one command:

    python scripts/slurm/multi_node.py layout --recipe R       # checks every setting, prints shell assignments
    python scripts/slurm/multi_node.py vllm --recipe R --exec  # `vllm serve` (TRL's settings) on the vLLM node
    python scripts/slurm/multi_node.py wait --url URL           # until the vLLM server answers /health
    python scripts/slurm/multi_node.py train --recipe R --exec [-- --recipe_field value ...]
                                                                # one `accelerate launch` per training node

`train --config_file` picks the sharding: accelerate_configs/multi_node_zero3.yaml (DeepSpeed ZeRO-3, the default) or
accelerate_configs/multi_node_fsdp2.yaml (PyTorch FSDP2); the batch script passes its ACCELERATE_CONFIG setting.

`layout` also checks the batch script's settings (`SETTINGS`, environment variables), the accelerate config (with
accelerate's own loader; one that cannot run on several nodes is refused) and the vLLM server command, so a bad value
stops the job before any process starts. Every value is checked, whether it comes from the environment,
an argument or the recipe (ports, counts, seconds): a bad one ends the helper with status 2 and one line naming the
setting, its value and what it must be (`multi_node.py: error: VLLM_PORT='80000': must be a port number, 1-65535`),
never a traceback. An application script, not part of the `trl_bandpo` package: the standard library, PyYAML to
read the recipe, and accelerate to read its config.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_ACCELERATE_CONFIG = "accelerate_configs/multi_node_zero3.yaml"
FSDP2_ACCELERATE_CONFIG = "accelerate_configs/multi_node_fsdp2.yaml"  # the same launch, PyTorch FSDP2 instead
DEFAULT_MAIN_PROCESS_PORT = 29500
DEFAULT_VLLM_PORT = 8000
PROMPT_BUDGET = 1024  # prompt tokens on top of max_completion_length for the vLLM context, as the recipes' headers
# The vLLM server TRL's trainers talk to is vLLM's own `vllm serve` (TRL 1.16 deprecates its wrapper), in dev mode
# (the weight-push and reset routes) and with the settings TRL's trainers need: the routes TRL's client uses for
# multimodal prompts, the NCCL weight transfer, log-probs after sampling processing, and no cap on returned log-probs.
VLLM_SERVER_ENV = ("VLLM_SERVER_DEV_MODE=1",)
TRL_SERVER_FLAGS = (
    "--enable-scale-out", "--weight-transfer-config", '{"backend": "nccl"}', "--logprobs-mode", "processed_logprobs",
    "--max-logprobs", "-1",
)  # fmt: skip


class LaunchError(RuntimeError):
    """The SLURM environment or the arguments do not describe a valid multi-node launch."""


# ------------------------------------------------------------------------------------------------------------------
# Nodes
# ------------------------------------------------------------------------------------------------------------------


def _split_top_level(expression: str) -> list[str]:
    """`a[1-2,4],b` -> ['a[1-2,4]', 'b']: commas outside brackets separate host names."""
    parts, depth, current = [], 0, ""
    for char in expression:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            raise LaunchError(f"unbalanced ']' in node list {expression!r}")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise LaunchError(f"unbalanced '[' in node list {expression!r}")
    return [part for part in [*parts, current] if part]


def _expand_one(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    numbers = []
    for item in match.group(1).split(","):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise LaunchError(f"cannot read range {item!r} in node name {name!r}")
        width = len(low)  # zero padding: node[08-10] -> node08 node09 node10
        numbers += [str(k).zfill(width) for k in range(int(low), int(high or low) + 1)]
    return [host for number in numbers for host in _expand_one(f"{head}{number}{tail}")]


def expand_nodelist(expression: str) -> list[str]:
    """Host names of a SLURM node list such as `gpu[001-003,007],login1` (what `scontrol show hostnames` prints)."""
    return [host for part in _split_top_level(expression.strip()) for host in _expand_one(part)]


GPU_FORMS = "accepted: a count (8) or one TYPE:COUNT (h100:8, gpu:h100:8)"


def gpus_per_node(env: Mapping[str, str], override: int | None = None) -> int:
    """GPUs on each node: the argument, else SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE (`8` or `h100:8`). Several
    GPU types on a node (`h100:8,a100:4`) are refused, not summed: one training process per GPU, all of one kind."""
    if override is not None:
        return check_value("--gpus_per_node", override, _COUNT)
    per_node = env.get("SLURM_GPUS_PER_NODE", "").strip()
    if "," in re.sub(r"\(.*?\)", "", per_node):  # a comma outside `(IDX:0,2)`: several types
        raise LaunchError(f"SLURM_GPUS_PER_NODE={per_node!r} lists several GPU types: request one type per node, "
                          f"or pass --gpus_per_node; {GPU_FORMS}")  # fmt: skip
    for key, value in ((key, env.get(key, "").strip()) for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")):
        match = re.fullmatch(r"(?:[\w.-]+:){0,2}(\d+)(?:\([^)]*\))?", value)
        if value and (match is None or int(match.group(1)) == 0):
            raise LaunchError(f"{key}={value!r} is not a number of GPUs > 0; {GPU_FORMS}")
        if value:
            return int(match.group(1))
    raise LaunchError(
        "cannot tell the number of GPUs per node: SLURM_GPUS_ON_NODE and SLURM_GPUS_PER_NODE are unset (submit with "
        "`#SBATCH --gpus-per-node=8`) or pass --gpus_per_node"
    )


@dataclass(frozen=True)
class Layout:
    train_nodes: tuple[str, ...]
    vllm_node: str | None
    gpus_per_node: int

    @property
    def num_processes(self) -> int:
        return len(self.train_nodes) * self.gpus_per_node


def job_layout(env: Mapping[str, str], vllm_nodes: int = 1, gpus: int | None = None) -> Layout:
    """Split the job's nodes (SLURM_JOB_NODELIST) into training nodes and `vllm_nodes` (0 or 1) vLLM nodes, last."""
    if isinstance(vllm_nodes, bool) or vllm_nodes not in (0, 1):
        raise LaunchError(f"vllm_nodes={vllm_nodes!r}: must be 0 or 1")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchError("SLURM_JOB_NODELIST is not set: run inside a SLURM job (sbatch or salloc)")
    nodes = expand_nodelist(nodelist)
    if len(nodes) < 1 + vllm_nodes:
        raise LaunchError(
            f"the job has {len(nodes)} node(s) ({nodelist}): need at least one training node plus "
            f"{vllm_nodes} vLLM node(s)"
        )
    train = nodes[: len(nodes) - vllm_nodes]
    return Layout(tuple(train), nodes[-1] if vllm_nodes else None, gpus_per_node(env, gpus))


def _number(low: float, high: float = float("inf"), pattern: str = r"\d+") -> Callable[[str], bool]:
    return lambda text: re.fullmatch(pattern, text) is not None and low <= float(text) <= high


_COUNT, _PORT = ("a whole number >= 1", _number(1)), ("a port number, 1-65535", _number(1, 65535))
_SECONDS = ("a number of seconds > 0", _number(1e-3, pattern=r"\d+(\.\d+)?"))
#: The settings of multi_node.sbatch (environment variables; unset or empty: its default) -> (what each must be, the
#: check). `layout` checks them all before the batch script starts anything.
SETTINGS = {
    "VLLM_NODES": ("0 or 1", lambda v: v in ("0", "1")),
    "ACCELERATE_CONFIG": ("an existing file, relative to the repository root", os.path.isfile),
    "MAIN_PROCESS_PORT": _PORT,
    "RDZV_BACKEND": ("static or c10d", lambda v: v in ("static", "c10d")),
    "VLLM_PORT": _PORT,
    "VLLM_TENSOR_PARALLEL_SIZE": _COUNT,
    "VLLM_DATA_PARALLEL_SIZE": _COUNT,
    "VLLM_MAX_MODEL_LEN": _COUNT,
    "VLLM_STARTUP_TIMEOUT": _SECONDS,
    "VLLM_HEALTH_INTERVAL": _SECONDS,
    "SLURM_CPUS_ON_NODE": _COUNT,
}


def check_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The settings that are set in `env`, each checked: a LaunchError names the first bad one and its value."""
    settings = {name: env[name] for name in SETTINGS if env.get(name)}
    for name, value in settings.items():
        check_value(name, value, SETTINGS[name])
    return settings


def check_value(name: str, value, kind: tuple[str, Callable[[str], bool]]):
    """`value` (a string from the environment, or an int or float given to a function) when it is `kind`'s (`_COUNT`,
    `_PORT`, `_SECONDS`), else a LaunchError naming `name`, the value and what it must be."""
    what, ok = kind
    text = format(value, "f") if isinstance(value, float) else str(value)  # 8.0 is no count; 1e-05 reads 0.000010
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not ok(text):
        raise LaunchError(f"{name}={value!r}: must be {what}")
    return value


def _argument(kind: tuple[str, Callable[[str], bool]], convert: Callable[[str], object] = int):
    """An argparse `type` that takes only `kind`'s values: its error names the value and what it must be."""

    def parse(text: str):
        if not kind[1](text):
            raise argparse.ArgumentTypeError(f"must be {kind[0]}, got {text!r}")
        return convert(text)

    return parse


# ------------------------------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------------------------------


def read_yaml(path: str, label: str | None = None) -> dict:
    """The mapping the YAML file `path` holds, else a LaunchError that starts with `label` (default: the recipe)."""
    import yaml

    label = label or f"recipe {path}"
    if not os.path.isfile(path):
        raise LaunchError(f"{label} does not exist (paths are relative to the repository root)")
    try:
        with open(path) as f:
            fields = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise LaunchError(f"{label} cannot be read: {' '.join(str(err).split())}") from None
    if not isinstance(fields, dict):
        got = "an empty file" if fields is None else f"a {type(fields).__name__}"
        raise LaunchError(f"{label} must hold a mapping of field: value, got {got}")
    return fields


#: The `distributed_type`s that run as one `accelerate launch` (torchrun) per node on NCCL GPUs, as srun starts them.
MULTI_NODE_TYPES = ("MULTI_GPU", "DEEPSPEED", "FSDP")


def check_accelerate_config(path: str, name: str = "config_file") -> str:
    """`path` when accelerate's own loader reads it as a config that runs on several nodes (`MULTI_NODE_TYPES`;
    DeepSpeed with its `standard` launcher, not one that ssh-es into a hostfile's nodes), else a LaunchError naming
    `name`, the file and what is wrong: all before the vLLM server starts, not in `accelerate launch` on every node."""
    read_yaml(path, f"{name}={path!r}: the accelerate config")  # exists, is YAML, holds a mapping
    from accelerate.commands.config.config_args import load_config_from_file

    try:  # accelerate's own loader: the keys and values it accepts (a recipe has no distributed_type)
        config = load_config_from_file(path)
    except (ValueError, TypeError) as err:
        raise LaunchError(f"{name}={path!r} is not an accelerate config: {' '.join(str(err).split())}") from None
    kind = getattr(config.distributed_type, "value", config.distributed_type)  # NO unquoted: YAML's False
    if kind not in MULTI_NODE_TYPES:
        raise LaunchError(f"{name}={path!r} has distributed_type {kind!r}, which cannot run on several nodes: "
                          f"must be one of {', '.join(MULTI_NODE_TYPES)}")  # fmt: skip
    deepspeed = config.deepspeed_config if isinstance(config.deepspeed_config, dict) else {}
    launcher = deepspeed.get("deepspeed_multinode_launcher") if kind == "DEEPSPEED" else "standard"
    if launcher != "standard":  # unset: accelerate's default, pdsh
        raise LaunchError(f"{name}={path!r} has deepspeed_multinode_launcher {launcher!r}: must be 'standard' "
                          "(one accelerate launch per node, started by srun)")  # fmt: skip
    return path


def machine_rank(env: Mapping[str, str], layout: Layout) -> int:
    """This node's rank among the training nodes: SLURM_PROCID of a step with one task per training node."""
    if "SLURM_PROCID" not in env:
        raise LaunchError(
            "SLURM_PROCID is not set: run `train` inside `srun --ntasks-per-node=1` on the training "
            "nodes (one task per node)"
        )
    if not env["SLURM_PROCID"].isdigit():
        raise LaunchError(f"SLURM_PROCID={env['SLURM_PROCID']!r} is not a task number")
    rank = int(env["SLURM_PROCID"])
    tasks = env.get("SLURM_STEP_NUM_TASKS")
    if tasks is not None:
        check_value("SLURM_STEP_NUM_TASKS", tasks, _COUNT)
    if tasks is not None and int(tasks) != len(layout.train_nodes):
        raise LaunchError(
            f"the step runs {tasks} tasks for {len(layout.train_nodes)} training nodes: start exactly "
            "one task per training node"
        )
    if not 0 <= rank < len(layout.train_nodes):
        raise LaunchError(f"SLURM_PROCID={rank} is not a training node rank (0..{len(layout.train_nodes) - 1})")
    here = env.get("SLURMD_NODENAME")
    if here and here in layout.train_nodes and layout.train_nodes[rank] != here:
        raise LaunchError(
            f"task {rank} runs on {here} but training node {rank} is {layout.train_nodes[rank]}: "
            "the rank-0 task must run on the first training node (use srun's default block order)"
        )
    return rank


def train_command(
    env: Mapping[str, str],
    recipe: str,
    *,
    layout: Layout | None = None,
    config_file: str = DEFAULT_ACCELERATE_CONFIG,
    main_process_port: int = DEFAULT_MAIN_PROCESS_PORT,
    rdzv_backend: str = "static",
    vllm_port: int = DEFAULT_VLLM_PORT,
    extra: Sequence[str] = (),
    program: str = "accelerate",
) -> list[str]:
    """The `accelerate launch` argv of this training node (rank from SLURM_PROCID, layout from the job)."""
    layout = layout or job_layout(env)
    if rdzv_backend not in ("static", "c10d"):
        raise LaunchError(f"rdzv_backend={rdzv_backend!r}: must be static or c10d")
    check_value("main_process_port", main_process_port, _PORT)
    check_value("vllm_port", vllm_port, _PORT)
    check_accelerate_config(config_file)
    rank = machine_rank(env, layout)
    argv = [
        program, "launch", "--config_file", config_file,
        "--num_machines", str(len(layout.train_nodes)), "--machine_rank", str(rank),
        "--main_process_ip", layout.train_nodes[0], "--main_process_port", str(main_process_port),
        "--num_processes", str(layout.num_processes), "--rdzv_backend", rdzv_backend,
        "-m", "trl_bandpo.cli.train", "--config", recipe,
    ]  # fmt: skip
    if layout.vllm_node is not None:
        argv += ["--vllm_server_host", layout.vllm_node, "--vllm_server_port", str(vllm_port)]
    return argv + list(extra)


def vllm_command(
    recipe_fields: Mapping,
    gpus: int,
    *,
    model: str | None = None,
    tensor_parallel_size: int | None = None,
    data_parallel_size: int = 1,
    port: int = DEFAULT_VLLM_PORT,
    max_model_len: int | None = None,
    extra: Sequence[str] = (),
    program: str = "vllm",
) -> list[str]:
    """`VLLM_SERVER_DEV_MODE=1 vllm serve` with TRL's settings (`TRL_SERVER_FLAGS`) for the recipe's model, tensor
    parallel over the node's GPUs unless told otherwise; the leading `NAME=value` items are environment variables
    (`main` sets them when it runs the command)."""
    model = model or recipe_fields.get("model_name_or_path")
    if not model:
        raise LaunchError("the recipe has no model_name_or_path: pass --model")
    check_value("data_parallel_size", data_parallel_size, _COUNT)
    check_value("port", port, _PORT)
    if tensor_parallel_size is not None:  # 0 is refused, not read as "unset"
        check_value("tensor_parallel_size", tensor_parallel_size, _COUNT)
    tp = gpus // data_parallel_size if tensor_parallel_size is None else tensor_parallel_size
    if tp < 1 or tp * data_parallel_size > gpus:
        raise LaunchError(
            f"tensor parallel {tp} x data parallel {data_parallel_size} needs more than the {gpus} "
            "GPUs of the vLLM node"
        )
    if max_model_len is None:
        max_model_len = recipe_fields.get("vllm_max_model_length")
        if max_model_len is not None:
            check_value("the recipe's vllm_max_model_length", max_model_len, _COUNT)
    if max_model_len is None and recipe_fields.get("max_completion_length") is not None:
        completion = check_value("the recipe's max_completion_length", recipe_fields["max_completion_length"], _COUNT)
        max_model_len = int(completion) + PROMPT_BUDGET
    if max_model_len is not None:
        check_value("max_model_len", max_model_len, _COUNT)
    argv = [
        *VLLM_SERVER_ENV, program, "serve", str(model), "--tensor-parallel-size", str(tp),
        "--data-parallel-size", str(data_parallel_size), "--host", "0.0.0.0", "--port", str(port),
    ]  # fmt: skip
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    return argv + list(TRL_SERVER_FLAGS) + list(extra)


def layout_assignments(layout: Layout, vllm_port: int) -> dict[str, str]:
    """Variables the batch script evaluates: node lists for srun, sizes, the health URL."""
    return {
        "TRAIN_NODES": ",".join(layout.train_nodes),
        "NUM_TRAIN_NODES": str(len(layout.train_nodes)),
        "GPUS_PER_NODE": str(layout.gpus_per_node),
        "NUM_PROCESSES": str(layout.num_processes),
        "MAIN_PROCESS_IP": layout.train_nodes[0],
        "VLLM_NODE": layout.vllm_node or "",
        "VLLM_PORT": str(vllm_port),
        "VLLM_HEALTH_URL": f"http://{layout.vllm_node}:{vllm_port}/health" if layout.vllm_node else "",
    }


def wait_for_health(
    url: str,
    timeout: float,
    interval: float = 10.0,
    alive: Callable[[], bool] = lambda: True,
    log: Callable[[str], None] = lambda message: print(message, file=sys.stderr, flush=True),
) -> float:
    """Poll `url` until it answers 200; raise if `alive()` turns false or `timeout` seconds pass. Returns the wait."""
    check_value("timeout", timeout, _SECONDS)
    check_value("interval", interval, _SECONDS)
    start = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url, timeout=min(interval, 30.0)) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        waited = time.monotonic() - start
        if not alive():
            raise LaunchError(f"the vLLM server exited before {url} answered (see its log)")
        if waited >= timeout:
            raise LaunchError(f"{url} did not answer within {timeout:.0f} s")
        log(f"waiting for {url} ({waited:.0f} s)")
        time.sleep(interval)


# ------------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------------


def _process_alive(pid: int) -> Callable[[], bool]:
    """Whether `pid` still runs (a zombie, exited but not yet reaped by its parent, counts as gone)."""

    def alive() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    return alive


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (a LaunchError, which `main` prints), without the usage text."""

    def error(self, message: str):
        raise LaunchError(" ".join(message.split()))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="multi_node.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = _Parser(add_help=False)
    count, port, seconds = _argument(_COUNT), _argument(_PORT), _argument(_SECONDS, float)
    vllm_nodes = _argument(SETTINGS["VLLM_NODES"])
    common.add_argument("--vllm_nodes", type=vllm_nodes, default=None, help="1 (the last node serves vLLM) or 0")
    common.add_argument("--gpus_per_node", type=count, default=None, help="default: from the SLURM environment")
    common.add_argument("--vllm_port", type=port, default=None, help="default: the recipe's vllm_server_port or 8000")
    common.add_argument("--recipe", help="recipe YAML, relative to the repository root")
    for name, help_text in (
        ("layout", "check the batch script's settings (environment), print shell assignments for it"),
        ("vllm", "the vLLM server command"),
        ("train", "this node's accelerate command"),
    ):
        command = sub.add_parser(name, parents=[common], help=help_text)
        if name != "layout":
            command.add_argument("--exec", action="store_true", help="run the command instead of printing it")
    vllm = sub.choices["vllm"]
    vllm.add_argument("--model", default=None, help="default: the recipe's model_name_or_path")
    vllm.add_argument("--tensor_parallel_size", type=count, default=None, help="default: GPUs / data parallel size")
    vllm.add_argument("--data_parallel_size", type=count, default=1)
    max_len_help = f"default: the recipe's vllm_max_model_length, else max_completion_length + {PROMPT_BUDGET}"
    vllm.add_argument("--max_model_len", type=count, default=None, help=max_len_help)
    train = sub.choices["train"]
    config_help = (f"accelerate config: {DEFAULT_ACCELERATE_CONFIG} (DeepSpeed ZeRO-3, the default) or "
                   f"{FSDP2_ACCELERATE_CONFIG} (PyTorch FSDP2)")  # fmt: skip
    train.add_argument("--config_file", type=_argument(SETTINGS["ACCELERATE_CONFIG"], str),
                       default=DEFAULT_ACCELERATE_CONFIG, help=config_help)  # fmt: skip
    train.add_argument("--main_process_port", type=port, default=DEFAULT_MAIN_PROCESS_PORT)
    train.add_argument("--rdzv_backend", choices=("static", "c10d"), default="static")
    wait = sub.add_parser("wait", help="wait until the vLLM server answers")
    wait.add_argument("--url", required=True)
    wait.add_argument("--timeout", type=seconds, default=1800.0)
    wait.add_argument("--interval", type=seconds, default=10.0)
    wait.add_argument("--pid", type=count, default=None, help="stop waiting if this process (the server's srun) exits")
    return parser


def run(argv: Sequence[str], env: Mapping[str, str]) -> list[str] | None:
    """Parse `argv` (`...` `--` recipe overrides) and return the command to run, or None (printed already)."""
    argv = list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = build_parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.command == "wait":
        alive = _process_alive(args.pid) if args.pid else (lambda: True)
        waited = wait_for_health(args.url, args.timeout, args.interval, alive)
        print(f"{args.url} answered after {waited:.0f} s", file=sys.stderr)
        return None
    if not args.recipe:
        raise LaunchError(f"`{args.command}` needs --recipe")
    settings = check_settings(env) if args.command == "layout" else {}  # the others get them as arguments
    fields = read_yaml(args.recipe)
    if fields.get("vllm_server_port") is not None:
        check_value("the recipe's vllm_server_port", fields["vllm_server_port"], _PORT)
    port = args.vllm_port or int(settings.get("VLLM_PORT") or fields.get("vllm_server_port") or DEFAULT_VLLM_PORT)
    vllm_nodes = int(settings.get("VLLM_NODES", 1)) if args.vllm_nodes is None else args.vllm_nodes
    layout = job_layout(env, vllm_nodes, args.gpus_per_node)
    if args.command == "layout":
        check_accelerate_config(settings.get("ACCELERATE_CONFIG", DEFAULT_ACCELERATE_CONFIG), "ACCELERATE_CONFIG")
        if layout.vllm_node is not None:  # the server's command, built as its node will (model, GPUs, sizes)
            sizes = ("VLLM_TENSOR_PARALLEL_SIZE", "VLLM_DATA_PARALLEL_SIZE", "VLLM_MAX_MODEL_LEN")
            tp, dp, max_len = (int(settings[k]) if k in settings else None for k in sizes)
            vllm_command(fields, layout.gpus_per_node, tensor_parallel_size=tp, data_parallel_size=dp or 1,
                         max_model_len=max_len)  # fmt: skip
        for key, value in layout_assignments(layout, port).items():
            print(f"{key}={shlex.quote(value)}")
        return None
    if args.command == "vllm":
        return vllm_command(fields, layout.gpus_per_node, model=args.model, port=port, extra=extra,
                            tensor_parallel_size=args.tensor_parallel_size,
                            data_parallel_size=args.data_parallel_size, max_model_len=args.max_model_len)  # fmt: skip
    return train_command(env, args.recipe, layout=layout, config_file=args.config_file, vllm_port=port, extra=extra,
                         main_process_port=args.main_process_port, rdzv_backend=args.rdzv_backend)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    options = argv[: argv.index("--")] if "--" in argv else argv
    try:
        command = run(argv, os.environ)
    except LaunchError as err:
        print(f"multi_node.py: error: {err}", file=sys.stderr)
        return 2
    if command is None:
        return 0
    if "--exec" not in options:
        print(shlex.join(command))
        return 0
    print(f"+ {shlex.join(command)}", file=sys.stderr, flush=True)
    env = dict(os.environ)
    while command and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", command[0]):  # leading NAME=value: environment
        name, _, value = command.pop(0).partition("=")
        env[name] = value
    os.execvpe(command[0], command, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
