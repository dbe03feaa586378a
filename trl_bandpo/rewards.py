r"""Verifiable math rewards: `math_verify` on the last ``\boxed{...}`` answer of a completion.

The reward reads the *last* ``\boxed{...}`` (or ``\fbox{...}``, or ``\boxed 42``) of a completion, compares it
with the dataset's ground-truth answer (column ``solution``) using `math_verify`, and returns one score per
completion: +1/-1 for DGPO (`boxed_signed_reward`), 1/0 for accuracy (`boxed_accuracy_reward`), or any pair from
the `math_verify_reward` factory.

Timeout design (why a worker process)
-------------------------------------
`math_verify`'s own timeouts use ``signal.alarm``: they work only in the main thread, take whole seconds, and cannot
interrupt long computations done in C (``\boxed{9^{9^{9^{9}}}}`` makes sympy build an integer with hundreds of
millions of digits inside one call that no signal can break into). So every comparison the cheap checks below
cannot settle runs in a separate worker process (``python -c ...``, talking JSON lines over pipes), and the caller
waits for the answer with a wall-clock deadline (``selectors``, no signals): a worker that misses its deadline is
killed (SIGKILL) and replaced, and that answer scores wrong. This works from any thread, in forked processes, and
bounds every answer's time whatever sympy does. Workers are started lazily, kept in a small pool between calls (a
start costs about a second, once), import only this file and `math_verify` (not the training script: no
``multiprocessing`` spawn re-import of ``__main__``), cap their address space (`WORKER_MEMORY_BYTES`) and exit when
their input pipe closes. Before anything reaches a worker:

* answers longer than `MAX_ANSWER_CHARS` or nested deeper than `MAX_BRACE_DEPTH` braces score wrong at once,
* a pure-string check (after light LaTeX normalisation: ``\dfrac``/``\text{}``/spacing/``$``, leading zeros of
  integers, case) accepts identical answers without any sympy work,
* verdicts are cached per (gold, answer) pair, and each distinct pair is verified once per call.

Nothing here executes model output: answers are only handed to `math_verify.parse` with the LaTeX extractor
(``LatexExtractionConfig``, a grammar parser), never to ``eval``/``sympify``/``parse_expr``.
On non-POSIX systems (no selectable pipes) the comparison runs in-process with `math_verify`'s own timeouts.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_BRACE_DEPTH",
    "MathVerifyReward",
    "boxed_accuracy_reward",
    "boxed_signed_reward",
    "completion_text",
    "extract_boxed_answer",
    "is_equivalent",
    "math_verify_reward",
    "score_completions",
]

MAX_ANSWER_CHARS = 1000  # longest boxed answer we try to verify (real answers are well under 300 characters)
MAX_BRACE_DEPTH = 16  # deepest brace nesting we try to verify (\frac{\sqrt{..}}{..} is depth 2)
WORKER_MEMORY_BYTES = 4 * 1024**3  # address-space cap of each verifier process (RLIMIT_AS)
WORKER_START_TIMEOUT_S = 120.0  # a worker that is not ready after this long is an environment problem
DEFAULT_NUM_WORKERS = max(1, min(4, os.cpu_count() or 1))
_CACHE_SIZE = 65536

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


# ----------------------------------------------------------------------------------------------------------------
# Answer extraction and cheap normalisation (pure Python, linear time)
# ----------------------------------------------------------------------------------------------------------------


def completion_text(completion: Any) -> str:
    """The text of one completion: a string, or a conversation ``[{"role": ..., "content": ...}, ...]`` (last message).

    Content given as a list of parts (``[{"type": "text", "text": ...}]``) is joined; anything else gives ``""``.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)) and completion:
        message = completion[-1]
        content = message.get("content") if isinstance(message, dict) else message
        if isinstance(content, str):
            return content
        if isinstance(content, (list, tuple)):
            parts = [p.get("text", "") if isinstance(p, dict) else p for p in content]
            return "".join(p for p in parts if isinstance(p, str))
    return ""


def _braced_argument(text: str, open_pos: int) -> str | None:
    """Content of the brace group opening at ``text[open_pos] == "{"``; None when it never closes."""
    depth = 0
    i = open_pos
    n = len(text)
    while i < n:
        char = text[i]
        if char == "\\":  # an escaped character (\{, \}, \\) never opens or closes a group
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_pos + 1 : i]
        i += 1
    return None


def extract_boxed_answer(text: Any) -> str | None:
    r"""The argument of the last ``\boxed``/``\fbox`` in ``text``, or None when there is none or it is malformed.

    Handles nested braces (``\boxed{\frac{1}{2}}`` -> ``\frac{1}{2}``), escaped braces, and the brace-less form
    ``\boxed 42`` (argument up to the next whitespace or ``$``). A last box that never closes (a truncated
    completion) gives None: the answer is incomplete, earlier boxes are not used instead.
    """
    if not isinstance(text, str):
        return None
    last = None
    for match in _BOX_COMMAND.finditer(text):
        last = match
    if last is None:
        return None
    pos = last.end()
    n = len(text)
    while pos < n and text[pos] in " \t":
        pos += 1
    if pos < n and text[pos] == "{":
        return _braced_argument(text, pos)
    if pos > last.end():  # "\boxed 42": the command takes one space-delimited token
        token = re.match(r"[^\s$]+", text[pos : pos + MAX_ANSWER_CHARS + 1])
        return token.group(0) if token else None
    return None


def _brace_depth(text: str) -> int:
    """Deepest nesting of unescaped braces in ``text``."""
    depth = deepest = 0
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif char == "}":
            depth -= 1
        i += 1
    return deepest


def _admissible(answer: str | None) -> bool:
    """Whether an extracted answer is worth verifying (non-empty, within the length and nesting caps)."""
    return (
        answer is not None
        and bool(answer.strip())
        and len(answer) <= MAX_ANSWER_CHARS
        and _brace_depth(answer) <= MAX_BRACE_DEPTH
    )


_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}")
_IGNORABLE = re.compile(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\[,;:! ]|\\(?:quad|qquad)(?![a-zA-Z])|\s+|\$")


def _canonical_text(answer: str) -> str:
    r"""A light normal form for the pure-string check: equal normal forms imply equal answers.

    Drops ``$``, spacing commands, whitespace, ``\left``/``\right``; unwraps ``\text{..}``-like commands; maps
    ``\dfrac``/``\tfrac`` to ``\frac``; lowercases; strips a trailing period; and writes integers without leading
    zeros (``007`` -> ``7``).
    """
    text = _TEXT_WRAPPER.sub(r"\1", answer)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _IGNORABLE.sub("", text).rstrip(".").lower()
    if re.fullmatch(r"[+-]?\d{1,1000}", text):
        sign = "-" if text.startswith("-") else ""
        digits = text.lstrip("+-").lstrip("0") or "0"
        text = ("" if digits == "0" else sign) + digits
    return text


def _gold_alternatives(solution: Any) -> list[str]:
    r"""Ground-truth answer(s) as LaTeX strings: numbers are formatted, lists are alternatives, ``$`` are dropped.

    A gold answer that contains ``\boxed{..}`` (a full worked solution) is reduced to its last boxed argument.
    """
    if solution is None or isinstance(solution, bool):
        return []
    if isinstance(solution, (list, tuple)):
        return [alt for item in solution for alt in _gold_alternatives(item)]
    if isinstance(solution, float):
        if not math.isfinite(solution):
            return []
        text = repr(int(solution)) if solution.is_integer() else repr(solution)
    elif isinstance(solution, int):
        text = str(solution)
    elif isinstance(solution, str):
        text = solution
    else:
        return []
    if _BOX_COMMAND.search(text):
        text = extract_boxed_answer(text) or ""
    text = re.sub(r"(?<!\\)\$", "", text).strip()
    return [text] if text else []


# ----------------------------------------------------------------------------------------------------------------
# The math_verify comparison itself (runs inside a worker process, or in-process on non-POSIX systems)
# ----------------------------------------------------------------------------------------------------------------

_PARSE_CACHE: OrderedDict[str, list] = OrderedDict()


def _parse_answer(latex: str, timeout_s: int | None) -> list:
    """`math_verify.parse` of one answer with the LaTeX extractor only (no Python-expression parser)."""
    from math_verify import LatexExtractionConfig, parse

    key = latex
    if key in _PARSE_CACHE:
        _PARSE_CACHE.move_to_end(key)
        return _PARSE_CACHE[key]
    parsed = parse(
        "\\boxed{" + latex + "}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        parsing_timeout=timeout_s,
    )
    _PARSE_CACHE[key] = parsed
    if len(_PARSE_CACHE) > 4096:
        _PARSE_CACHE.popitem(last=False)
    return parsed


def _math_verify_equal(gold: str, answer: str, timeout_s: int | None = None) -> bool:
    """Whether `answer` is mathematically equal to `gold` according to `math_verify` (False on any error)."""
    from math_verify import verify

    try:
        gold_parsed = _parse_answer(gold, timeout_s)
        answer_parsed = _parse_answer(answer, timeout_s)
        if not gold_parsed or not answer_parsed:
            return False
        return bool(verify(gold_parsed, answer_parsed, timeout_seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a malformed answer is a wrong answer
        return False


def _worker_main() -> None:
    """Entry point of a verifier process: read ``[gold, answer]`` JSON lines on stdin, write ``1``/``0`` lines."""
    import logging

    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray output (Python prints or C libraries writing to fd 1) must not corrupt the protocol
    sys.stdout = sys.stderr
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    _math_verify_equal("1", "1")  # import sympy and build the LaTeX grammar before saying ready
    protocol.write("ready\n")
    for line in sys.stdin:
        try:
            gold, answer = json.loads(line)
            verdict = _math_verify_equal(str(gold), str(answer))
        except (ValueError, TypeError, RecursionError, MemoryError):
            verdict = False
        protocol.write("1\n" if verdict else "0\n")


# Runs this file (not the package: its __init__ may import heavy trainer code) in a fresh interpreter.
_WORKER_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_trl_bandpo_verifier', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._worker_main()\n"
)


class _WorkerDied(Exception):
    pass


class _Worker:
    """One verifier process and the partial line read from it."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOTSTRAP, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            close_fds=True,
            start_new_session=True,  # a terminal's Ctrl-C goes to the trainer, which then closes our pipes
        )
        self.fd = self.process.stdout.fileno()
        self.buffer = b""
        self.ready = False
        self.start_deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        self.task: int | None = None
        self.deadline = math.inf

    def send(self, gold: str, answer: str) -> None:
        self.process.stdin.write((json.dumps([gold, answer]) + "\n").encode())
        self.process.stdin.flush()

    def read_lines(self) -> list[str]:
        """Complete lines available now (call when the pipe is readable); raises `_WorkerDied` at end of file."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            raise _WorkerDied
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [line.decode(errors="replace").strip() for line in lines]

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        try:
            self.process.kill()
        except OSError:
            pass
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class _VerifierPool:
    """Idle verifier processes shared by all reward functions of this process (thread-safe)."""

    def __init__(self, max_idle: int = 16) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._owner_pid = os.getpid()
        self._max_idle = max_idle

    def _take(self, count: int) -> list[_Worker]:
        with self._lock:
            if os.getpid() != self._owner_pid:  # forked: those pipes belong to the parent process
                self._idle, self._owner_pid = [], os.getpid()
            taken, self._idle = self._idle[:count], self._idle[count:]
        alive = []
        for worker in taken:
            if worker.alive():
                alive.append(worker)
            else:
                worker.kill()
        return alive + [_Worker() for _ in range(count - len(alive))]

    def _give_back(self, workers: list[_Worker]) -> None:
        with self._lock:
            for worker in workers:
                if worker.alive() and worker.task is None and len(self._idle) < self._max_idle:
                    self._idle.append(worker)
                else:
                    worker.kill()

    def shutdown(self) -> None:
        """Stop every idle worker (registered with `atexit`)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def verify_many(self, pairs: Sequence[tuple[str, str]], timeout_s: float, num_workers: int) -> list[bool]:
        """Verdicts for ``(gold, answer)`` pairs, each computed within `timeout_s` seconds of wall time or False."""
        results = [False] * len(pairs)
        if not pairs:
            return results
        queue = deque(range(len(pairs)))
        workers = self._take(min(num_workers, len(pairs)))
        selector = selectors.DefaultSelector()
        for worker in workers:
            selector.register(worker.fd, selectors.EVENT_READ, worker)

        def replace(index: int) -> None:
            old = workers[index]
            selector.unregister(old.fd)
            old.kill()
            workers[index] = _Worker()
            selector.register(workers[index].fd, selectors.EVENT_READ, workers[index])

        try:
            while True:
                now = time.monotonic()
                for index, worker in enumerate(workers):
                    if worker.ready and worker.task is None and queue:
                        task = queue.popleft()
                        try:
                            worker.send(*pairs[task])
                        except OSError:  # died while idle: try the task again on a fresh worker
                            queue.appendleft(task)
                            replace(index)
                            continue
                        worker.task, worker.deadline = task, now + timeout_s
                if not queue and all(worker.task is None for worker in workers):
                    return results
                # Wake up at the next deadline: a busy worker's task, or a starting worker's start-up.
                waits = [w.deadline for w in workers if w.task is not None]
                waits += [w.start_deadline for w in workers if not w.ready]
                events = selector.select(max(0.0, min(waits, default=0.0) - time.monotonic()))
                for key, _ in events:
                    worker = key.data
                    index = workers.index(worker)
                    try:
                        lines = worker.read_lines()
                    except _WorkerDied:
                        if not worker.ready:
                            raise RuntimeError(
                                f"a math_verify worker process ({sys.executable}) exited while starting "
                                f"(exit code {worker.process.poll()}); check that `math_verify` is installed"
                            ) from None
                        if worker.task is not None:  # crashed on this answer (e.g. out of memory): wrong
                            results[worker.task] = False
                            worker.task = None
                        replace(index)
                        continue
                    for line in lines:
                        if line == "ready":
                            worker.ready = True
                        elif worker.task is not None:
                            results[worker.task] = line == "1"
                            worker.task, worker.deadline = None, math.inf
                now = time.monotonic()
                for index, worker in enumerate(workers):
                    if worker.task is not None and now >= worker.deadline:
                        results[worker.task] = False  # timed out: kill it, the answer scores wrong
                        worker.task = None
                        replace(index)
                    elif not worker.ready and now >= worker.start_deadline:
                        raise RuntimeError(
                            f"a math_verify worker process did not start within {WORKER_START_TIMEOUT_S:.0f} s"
                        )
        except BaseException:
            for worker in workers:  # interrupted mid-exchange: these workers cannot be reused
                worker.kill()
            raise
        finally:
            selector.close()
            self._give_back(workers)


_POOL = _VerifierPool()
atexit.register(_POOL.shutdown)

_VERDICTS: OrderedDict[tuple[str, str], bool] = OrderedDict()
_VERDICTS_LOCK = threading.Lock()


def _check_timeout(timeout_s: Any) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def _check_num_workers(num_workers: Any) -> int:
    if num_workers is None:
        return DEFAULT_NUM_WORKERS
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be None or an integer >= 1, got {num_workers!r}")
    return num_workers


def _verify_pairs(pairs: list[tuple[str, str]], timeout_s: float, num_workers: int) -> list[bool]:
    """Verdicts for (gold, answer) pairs: cached ones, then the rest through the worker pool."""
    verdicts: dict[tuple[str, str], bool] = {}
    with _VERDICTS_LOCK:
        for pair in pairs:
            if pair in _VERDICTS:
                verdicts[pair] = _VERDICTS[pair]
    todo = list(dict.fromkeys(pair for pair in pairs if pair not in verdicts))
    if todo:
        if os.name == "posix":
            fresh = _POOL.verify_many(todo, timeout_s, num_workers)
        else:  # no selectable pipes: in-process, with math_verify's own (whole-second) timeouts
            fresh = [_math_verify_equal(g, a, max(1, math.ceil(timeout_s))) for g, a in todo]
        with _VERDICTS_LOCK:
            for pair, verdict in zip(todo, fresh, strict=True):
                verdicts[pair] = verdict
                _VERDICTS[pair] = verdict
            while len(_VERDICTS) > _CACHE_SIZE:
                _VERDICTS.popitem(last=False)
    return [verdicts[pair] for pair in pairs]


def score_completions(
    completions: Sequence[Any],
    solutions: Sequence[Any],
    timeout_s: float = 2.0,
    num_workers: int | None = None,
) -> list[bool]:
    """Correctness of each completion's last boxed answer against its ground truth.

    Args:
        completions: N strings or conversations (see `completion_text`).
        solutions: N ground truths (string, number, or list of acceptable alternatives).
        timeout_s: wall-clock budget per verified answer; an answer that exceeds it is wrong.
        num_workers: verifier processes used in parallel (default `DEFAULT_NUM_WORKERS`).

    Returns:
        N booleans. Never raises on bad answers: missing, malformed, oversized or too slow answers are False.
    """
    timeout_s = _check_timeout(timeout_s)
    num_workers = _check_num_workers(num_workers)
    if len(completions) != len(solutions):
        raise ValueError(
            f"completions and solutions must have the same length, got {len(completions)} and {len(solutions)}"
        )
    flags = [False] * len(completions)
    pending: list[tuple[int, list[tuple[str, str]]]] = []  # (row, [(gold, answer) for each gold alternative])
    for row, (completion, solution) in enumerate(zip(completions, solutions, strict=True)):
        answer = extract_boxed_answer(completion_text(completion))
        golds = _gold_alternatives(solution)
        if not golds or not _admissible(answer):
            continue
        answer = answer.strip()
        canonical = _canonical_text(answer)
        if any(_canonical_text(gold) == canonical for gold in golds):
            flags[row] = True
        else:
            pending.append((row, [(gold, answer) for gold in golds]))
    all_pairs = [pair for _, pairs in pending for pair in pairs]
    verdicts = iter(_verify_pairs(all_pairs, timeout_s, num_workers))
    for row, pairs in pending:
        flags[row] = any([next(verdicts) for _ in pairs])
    return flags


def is_equivalent(gold: Any, answer: str, timeout_s: float = 2.0) -> bool:
    r"""Whether the LaTeX `answer` (the inside of a box, e.g. ``\frac{1}{2}``) equals the ground truth `gold`."""
    return score_completions([f"\\boxed{{{answer}}}"], [gold], timeout_s=timeout_s)[0]


class MathVerifyReward:
    """A TRL reward function: `correct` when the last boxed answer matches ``solution``, else `wrong`.

    Call as ``reward(completions, solution, **kwargs) -> list[float]`` (N completions, N ground truths); TRL passes
    the dataset's ``solution`` column and extra keyword arguments, which are ignored. ``__name__`` names the metric.
    Instances are picklable (TRL may ship reward functions to other processes).
    """

    def __init__(
        self,
        correct: float = 1.0,
        wrong: float = -1.0,
        timeout_s: float = 2.0,
        name: str = "math_verify_reward",
        num_workers: int | None = None,
    ) -> None:
        for arg, value in (("correct", correct), ("wrong", wrong)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{arg} must be a finite number, got {value!r}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"name must be a Python identifier (it names the logged metric), got {name!r}")
        self.correct = float(correct)
        self.wrong = float(wrong)
        self.timeout_s = _check_timeout(timeout_s)
        self.num_workers = None if num_workers is None else _check_num_workers(num_workers)
        self.__name__ = name
        self.__qualname__ = name

    def __call__(self, completions: Sequence[Any], solution: Sequence[Any] | None = None, **kwargs: Any) -> list[float]:
        if solution is None:
            raise ValueError(
                f"{self.__name__} needs the ground-truth answers: give the dataset a `solution` column "
                "(trl_bandpo.data loaders do) or pass solution=[...]"
            )
        if isinstance(solution, (str, bytes)):
            raise ValueError("solution must be a list with one ground truth per completion, got a single string")
        flags = score_completions(completions, solution, timeout_s=self.timeout_s, num_workers=self.num_workers)
        return [self.correct if flag else self.wrong for flag in flags]

    def __repr__(self) -> str:
        return (
            f"MathVerifyReward(correct={self.correct}, wrong={self.wrong}, timeout_s={self.timeout_s}, "
            f"name={self.__name__!r})"
        )


def math_verify_reward(
    correct: float = 1.0,
    wrong: float = -1.0,
    timeout_s: float = 2.0,
    *,
    name: str = "math_verify_reward",
    num_workers: int | None = None,
) -> MathVerifyReward:
    r"""A reward ``fn(completions, solution, **kwargs) -> list[float]`` scoring the last ``\boxed{}`` answer.

    Args:
        correct: score of a correct answer (1.0).
        wrong: score of a wrong, missing or unverifiable answer (-1.0 as in DGPO; 0.0 for accuracy).
        timeout_s: wall-clock limit per answer, enforced by killing the verifier process (works in any thread).
        name: ``__name__`` of the function, which TRL uses for the metric ``rewards/<name>/mean``.
        num_workers: verifier processes used in parallel (default ``min(4, cpu_count)``).
    """
    return MathVerifyReward(correct=correct, wrong=wrong, timeout_s=timeout_s, name=name, num_workers=num_workers)


boxed_accuracy_reward = math_verify_reward(correct=1.0, wrong=0.0, name="boxed_accuracy_reward")
boxed_signed_reward = math_verify_reward(correct=1.0, wrong=-1.0, name="boxed_signed_reward")
