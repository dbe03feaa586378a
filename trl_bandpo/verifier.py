r"""The `math_verify` comparison of two LaTeX answers, run in a pool of worker processes with a wall-clock bound.

`verify_pairs` is the entry point: it returns a verdict for each ``(gold, answer)`` pair, cached per pair, each
computed by `math_verify` within a time budget or counted wrong.

Timeout design (why a worker process)
-------------------------------------
`math_verify`'s own timeouts use ``signal.alarm``: they work only in the main thread, take whole seconds, and cannot
interrupt long computations done in C (``\boxed{9^{9^{9^{9}}}}`` makes sympy build an integer with hundreds of
millions of digits inside one call that no signal can break into). So every comparison runs in a separate worker
process (``python -c ...``, talking JSON lines over pipes), and the caller waits for the answer with a wall-clock
deadline (``selectors``, no signals): a worker that misses its deadline is killed (SIGKILL) and replaced, and that
answer scores wrong. This works from any thread, in forked processes, and bounds every answer's time whatever sympy
does. Workers are started lazily, kept in a small pool between calls (a start costs about a second, once), import
only this file and `math_verify` (not the package, nor the training script: no ``multiprocessing`` spawn re-import
of ``__main__``), cap their address space (`WORKER_MEMORY_BYTES`) and exit when their input pipe closes. Verdicts
are cached per (gold, answer) pair, and each distinct pair is verified once per call.

Because a worker executes this file by path, it imports nothing from `trl_bandpo` (only the standard library, and
`math_verify` lazily). Nothing here executes model output: answers are only handed to `math_verify.parse` with the
LaTeX extractor (``LatexExtractionConfig``, a grammar parser), never to ``eval``/``sympify``/``parse_expr``.
On non-POSIX systems (no selectable pipes) the comparison runs in-process with `math_verify`'s own timeouts.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import selectors
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

__all__ = [
    "DEFAULT_NUM_WORKERS",
    "WORKER_MEMORY_BYTES",
    "WORKER_START_TIMEOUT_S",
    "verify_pairs",
]

WORKER_MEMORY_BYTES = 4 * 1024**3  # address-space cap of each verifier process (RLIMIT_AS)
WORKER_START_TIMEOUT_S = 120.0  # a worker that is not ready after this long is an environment problem
DEFAULT_NUM_WORKERS = max(1, min(4, os.cpu_count() or 1))
_VERDICT_CACHE_SIZE = 65536


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


# ----------------------------------------------------------------------------------------------------------------
# Worker processes and their pool (the caller's side)
# ----------------------------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------------------------
# The shared pool and the verdict cache
# ----------------------------------------------------------------------------------------------------------------

_POOL = _VerifierPool()
atexit.register(_POOL.shutdown)

_VERDICTS: OrderedDict[tuple[str, str], bool] = OrderedDict()
_VERDICTS_LOCK = threading.Lock()


def verify_pairs(pairs: list[tuple[str, str]], timeout_s: float, num_workers: int) -> list[bool]:
    """Verdicts for (gold, answer) pairs: cached ones, then the rest through the worker pool.

    Args:
        pairs: ``(gold, answer)`` LaTeX strings (the insides of boxes); repeated pairs are verified once.
        timeout_s: wall-clock budget per verified pair; a pair that exceeds it is not equal.
        num_workers: verifier processes used in parallel.

    Returns:
        One boolean per pair, in order. Never raises on bad answers: malformed or too slow answers are False.
    """
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
            while len(_VERDICTS) > _VERDICT_CACHE_SIZE:
                _VERDICTS.popitem(last=False)
    return [verdicts[pair] for pair in pairs]
