r"""The `math_verify` comparison of two LaTeX answers, run in a pool of worker processes with a wall-clock bound.

`verify_pairs` returns a verdict for each ``(gold, answer)`` pair, cached per pair, each computed by `math_verify`
within a per-answer time limit, and all of them within a per-call budget.

Why worker processes: `math_verify`'s own timeouts use ``signal.alarm``; they work only in the main thread, take
whole seconds, and cannot interrupt long computations done in C (``\boxed{9^{9^{9^{9}}}}`` makes sympy build an
integer with hundreds of millions of digits inside one call that no signal can break into). So every comparison runs
in a worker process (``python -c ...``, JSON lines over pipes), and the caller waits with a wall-clock deadline
(``selectors``, no signals, any thread): a worker that misses it is killed (SIGKILL) and replaced, and that answer
scores wrong. Workers are started lazily, kept in a small pool between calls (a start costs about a second), import
only this file and `math_verify` (no ``multiprocessing`` re-import of ``__main__``), cap their address space
(`WORKER_MEMORY_BYTES`), exit when their input pipe closes, and die with the process that started them even while
busy in C code (Linux's ``PR_SET_PDEATHSIG``; a watchdog thread elsewhere). Each distinct pair is verified once per
call, and an answer that timed out is not tried again in that call. Once a call's budget (``call_timeout_s``) is
spent, busy workers are killed and the pairs not yet verified stay unverified (None, not cached).

A worker executes this file by path: it imports only the standard library (and `math_verify` lazily). No model
output is executed: answers go only to `math_verify.parse` with the LaTeX extractor (a grammar parser), never to
``eval``/``sympify``. Without selectable pipes (non-POSIX) it runs in-process with `math_verify`'s own timeouts.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import queue
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

__all__ = ["DEFAULT_NUM_WORKERS", "WORKER_MEMORY_BYTES", "WORKER_START_TIMEOUT_S", "verify_pairs"]

WORKER_MEMORY_BYTES = 4 * 1024**3  # address-space cap of each verifier process (RLIMIT_AS)
WORKER_START_TIMEOUT_S = 120.0  # a worker that is not ready after this long is an environment problem
DEFAULT_NUM_WORKERS = max(1, min(4, os.cpu_count() or 1))
_VERDICT_CACHE_SIZE = 65536


# --- The math_verify comparison itself (runs inside a worker process, or in-process on non-POSIX systems) ---

_PARSE_CACHE: OrderedDict[str, list] = OrderedDict()


def _parse_answer(latex: str, timeout_s: int | None) -> list:
    """`math_verify.parse` of one answer with the LaTeX extractor only (no Python-expression parser)."""
    from math_verify import LatexExtractionConfig, parse

    if latex in _PARSE_CACHE:
        _PARSE_CACHE.move_to_end(latex)
        return _PARSE_CACHE[latex]
    parsed = parse(
        "\\boxed{" + latex + "}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        parsing_timeout=timeout_s,
    )
    _PARSE_CACHE[latex] = parsed
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


def _die_with_parent(parent_pid: int) -> None:
    """Make this process exit when `parent_pid` (the process that started it) dies, even while busy in C code."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1

    def watch() -> None:  # portable fallback; it runs only when the main thread lets go of the GIL
        while os.getppid() == parent_pid:  # also catches a parent that died before the prctl call
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _worker_main(parent_pid: int | None = None) -> None:
    """Entry point of a verifier process: read ``[gold, answer]`` JSON lines on stdin, write ``1``/``0`` lines."""
    import logging

    if parent_pid is not None:
        _die_with_parent(parent_pid)
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
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


# --- Worker processes and their pool (the caller's side) ---

# Runs this file (not the package: its __init__ may import heavy trainer code) in a fresh interpreter.
_WORKER_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_trl_bandpo_verifier', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._worker_main(int(sys.argv[2]))\n"
)


_SPAWN_REQUESTS: tuple[int, queue.SimpleQueue] | None = None  # (owner pid, the queue its spawner thread serves)
_SPAWN_LOCK = threading.Lock()


def _serve_spawn_requests(requests: queue.SimpleQueue) -> None:
    while True:
        command, reply = requests.get()
        try:  # start_new_session: a terminal's Ctrl-C goes to the trainer, which then closes our pipes
            pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "close_fds": True, "start_new_session": True}
            reply.put(subprocess.Popen(command, **pipes))
        except Exception as error:  # noqa: BLE001 - raised in the caller's thread
            reply.put(error)


def _start_worker_process() -> subprocess.Popen:
    """A fresh verifier process, started by one daemon thread that lives as long as this process: Linux sends the
    parent-death signal when the *thread* that started a process ends, so a worker started by a short-lived caller
    thread (a thread pool's) would die with it, maybe in the middle of another caller's task."""
    global _SPAWN_REQUESTS
    with _SPAWN_LOCK:
        if _SPAWN_REQUESTS is None or _SPAWN_REQUESTS[0] != os.getpid():  # first use, or a forked child
            _SPAWN_REQUESTS = (os.getpid(), queue.SimpleQueue())
            threading.Thread(target=_serve_spawn_requests, args=(_SPAWN_REQUESTS[1],), daemon=True).start()
        requests = _SPAWN_REQUESTS[1]
    reply: queue.SimpleQueue = queue.SimpleQueue()
    requests.put(([sys.executable, "-c", _WORKER_BOOTSTRAP, os.path.abspath(__file__), str(os.getpid())], reply))
    process = reply.get(timeout=WORKER_START_TIMEOUT_S)
    if isinstance(process, Exception):
        raise process
    return process


def stop_process(process: subprocess.Popen) -> None:
    """Kill a worker process (SIGKILL), close its pipes and reap it; never raises for one that is already gone."""
    for stop in (process.kill, process.stdin.close, process.stdout.close):
        with contextlib.suppress(OSError):
            stop()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


class _WorkerDied(Exception):
    pass


class _Worker:
    """One verifier process and the partial line read from it."""

    def __init__(self) -> None:
        self.process = _start_worker_process()
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
        stop_process(self.process)


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
        alive = [worker for worker in taken if worker.alive()]
        for worker in set(taken) - set(alive):
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

    def verify_many(
        self, pairs: Sequence[tuple[str, str]], timeout_s: float, num_workers: int, call_timeout_s: float
    ) -> tuple[list[bool | None], set[int]]:
        """Verdicts for ``(gold, answer)`` pairs: each within `timeout_s` seconds (else False), all within
        `call_timeout_s` seconds of the first worker being ready (else None: not verified); and the indices of the
        pairs not tried because their answer had timed out with another gold (False, but not a verdict to cache)."""
        results: list[bool | None] = [None] * len(pairs)
        skipped: set[int] = set()
        if not pairs:
            return results, skipped
        todo = deque(range(len(pairs)))
        slow_answers: set[str] = set()  # answers that timed out or crashed a worker: wrong with any gold, this call
        budget_end: float | None = None
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

        def fail(index: int) -> None:  # the worker's pair took too long or crashed it: wrong
            results[workers[index].task] = False
            slow_answers.add(pairs[workers[index].task][1])
            workers[index].task = None
            replace(index)

        try:
            while True:
                now = time.monotonic()
                if budget_end is None and any(worker.ready for worker in workers):
                    budget_end = now + call_timeout_s  # worker start-up is bounded by WORKER_START_TIMEOUT_S
                if budget_end is not None and now >= budget_end:  # out of budget: the rest stays unverified
                    for index, worker in enumerate(workers):
                        if worker.task is not None:
                            worker.task = None
                            replace(index)
                    return results, skipped
                for index, worker in enumerate(workers):
                    while worker.ready and worker.task is None and todo:
                        task = todo.popleft()
                        if pairs[task][1] in slow_answers:
                            results[task] = False
                            skipped.add(task)
                            continue
                        try:
                            worker.send(*pairs[task])
                        except OSError:  # died while idle: try the task again on a fresh worker
                            todo.appendleft(task)
                            replace(index)
                            break
                        worker.task, worker.deadline = task, now + timeout_s
                if not todo and all(worker.task is None for worker in workers):
                    return results, skipped
                # Wake up at the next deadline: a busy worker's task, a starting worker's start-up, the budget.
                waits = [w.deadline for w in workers if w.task is not None]
                waits += [w.start_deadline for w in workers if not w.ready]
                waits += [budget_end] if budget_end is not None and budget_end < math.inf else []
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
                            fail(index)
                        else:
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
                        fail(index)  # timed out: kill it, the answer scores wrong
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


# --- The shared pool and the verdict cache ---

_POOL = _VerifierPool()
atexit.register(_POOL.shutdown)

_VERDICTS: OrderedDict[tuple[str, str], bool] = OrderedDict()
_VERDICTS_LOCK = threading.Lock()


def verify_pairs(
    pairs: list[tuple[str, str]], timeout_s: float, num_workers: int, call_timeout_s: float = math.inf
) -> list[bool | None]:
    """Verdicts for (gold, answer) pairs: cached ones, then the rest through the worker pool.

    Args:
        pairs: ``(gold, answer)`` LaTeX strings (the insides of boxes); repeated pairs are verified once.
        timeout_s: wall-clock limit per verified pair; a pair that exceeds it is not equal, and its answer is not
            tried again in this call with another gold.
        num_workers: verifier processes used in parallel.
        call_timeout_s: wall-clock budget of the whole call, counted from the first ready worker.

    Returns:
        One verdict per pair, in order: True or False, or None for a pair left unverified when the budget ran out
        (not cached: a later call verifies it; neither is a False for an answer that timed out with another gold).
        Never raises on bad answers: malformed or too slow answers are False.
    """
    verdicts: dict[tuple[str, str], bool | None] = {}
    with _VERDICTS_LOCK:
        for pair in pairs:
            if pair in _VERDICTS:
                verdicts[pair] = _VERDICTS[pair]
    todo = list(dict.fromkeys(pair for pair in pairs if pair not in verdicts))
    if todo:
        if os.name == "posix":
            fresh, skipped = _POOL.verify_many(todo, timeout_s, num_workers, call_timeout_s)
        else:  # no selectable pipes: in-process, with math_verify's own (whole-second) timeouts
            budget_end, skipped = time.monotonic() + call_timeout_s, set()
            fresh = [
                _math_verify_equal(g, a, max(1, math.ceil(timeout_s))) if time.monotonic() < budget_end else None
                for g, a in todo
            ]
        with _VERDICTS_LOCK:
            for index, (pair, verdict) in enumerate(zip(todo, fresh, strict=True)):
                verdicts[pair] = verdict
                if verdict is not None and index not in skipped:
                    _VERDICTS[pair] = verdict
            while len(_VERDICTS) > _VERDICT_CACHE_SIZE:
                _VERDICTS.popitem(last=False)
    return [verdicts[pair] for pair in pairs]
