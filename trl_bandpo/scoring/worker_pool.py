r"""Worker processes with wall-clock deadlines, for computations that may never end: the `math_verify` comparison
(`trl_bandpo.scoring.verifier`) and the strict grader's sympy stages (`trl_bandpo.scoring.strict_grader`).

A `WorkerPool` runs tasks (lists of JSON arguments) in worker processes that each serve one entry point (a function,
named with its file, called once to warm up, that returns the task handler). The caller waits with wall-clock
deadlines (``selectors``, no signals: any thread): a worker that misses a task's deadline is SIGKILLed (which also
stops one busy inside C code) and replaced, and the task fails; once a call's budget is spent, busy workers are
killed and the remaining tasks stay undone. Workers start lazily and stay idle between calls. Each runs ``python -c``
(no re-import of the caller's ``__main__``), loads this file and its entry's file by path (not `trl_bandpo`), caps
its address space (`WORKER_MEMORY_BYTES`) and each task's CPU time, exits when its input pipe closes, and dies with
the process that started it, even a SIGKILLed one (Linux's ``PR_SET_PDEATHSIG``; elsewhere a watchdog thread and
the CPU cap). Without POSIX pipes `WorkerPool.run` raises RuntimeError rather than run unbounded.

Why no library: ``pebble`` and ``loky`` unpickle a task's function by importing its module (here the heavy
`trl_bandpo`), ``pebble`` starts workers through ``multiprocessing`` (which re-imports ``__main__``, or forks a
threaded trainer), ``loky`` has no per-task timeout, and neither sets ``PR_SET_PDEATHSIG``.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
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
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

WORKER_MEMORY_BYTES = 4 * 1024**3  # address-space cap of each worker process (RLIMIT_AS)
WORKER_START_TIMEOUT_S = 120.0  # a worker that is not ready after this long is an environment problem


class Failure(enum.Enum):
    """Why a task has no result."""

    TIMED_OUT = "it took longer than its timeout, or crashed its worker"
    SKIPPED = "not tried: another task of its group timed out in this call"
    OUT_OF_BUDGET = "the call's budget ran out before it was done"


# --- The worker's side (runs in a fresh interpreter that has loaded only this file) ---

# `load` imports a file as a module of a stand-alone package made of its folder; a worker loads this file with it and
# serves the entry point named on its command line.
_LOADER = """\
import importlib, os, sys, types
packages = {}
def load(path):
    folder, name = os.path.split(os.path.splitext(path)[0])
    if folder not in packages:
        packages[folder] = types.ModuleType(f'_worker_package_{len(packages)}')
        packages[folder].__path__ = [folder]
        sys.modules[packages[folder].__name__] = packages[folder]
    return importlib.import_module(packages[folder].__name__ + '.' + name)
"""
_BOOTSTRAP = _LOADER + "load(sys.argv[1]).serve(load, *sys.argv[2:])\n"


def serve(load: Callable[[str], Any], path: str, function: str, parent_pid: str) -> None:
    """A worker's main loop: read ``[timeout_s, args]`` JSON lines on stdin, write the handler's JSON results."""
    _die_with_parent(int(parent_pid))
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        cap = WORKER_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(WORKER_MEMORY_BYTES, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray output (Python prints or C libraries writing to fd 1) must not corrupt the protocol
    sys.stdout = sys.stderr
    handle = getattr(load(path), function)()  # imports and warm-up happen before saying ready
    protocol.write("ready\n")
    for line in sys.stdin:
        try:
            timeout_s, args = json.loads(line)
            _limit_cpu(timeout_s)
            result = json.dumps(handle(*args))
        except Exception:  # noqa: BLE001 - a bad task must not end the worker
            result = "null"
        protocol.write(result + "\n")


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


def _limit_cpu(timeout_s: float | None) -> None:
    """Let the kernel kill this worker (SIGXCPU) if a task uses far more CPU time than its wall-clock limit, so that
    a worker orphaned while busy in C code stops where there is no parent-death signal."""
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = hard if timeout_s is None else int(usage.ru_utime + usage.ru_stime + 2 * timeout_s + 5)
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


# --- The caller's side ---

_SPAWN_REQUESTS: tuple[int, queue.SimpleQueue] | None = None  # (owner pid, the queue its spawner thread serves)
_SPAWN_LOCK = threading.Lock()


def _serve_spawn_requests(requests: queue.SimpleQueue) -> None:
    while True:
        command, reply = requests.get()
        try:  # start_new_session: a terminal's Ctrl-C goes to the caller, which then closes our pipes
            pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "close_fds": True, "start_new_session": True}
            reply.put(subprocess.Popen(command, **pipes))
        except Exception as error:  # noqa: BLE001 - raised in the caller's thread
            reply.put(error)


def _spawn(command: list[str]) -> subprocess.Popen:
    """A process started by one daemon thread that lives as long as this process: Linux sends the parent-death signal
    when the *thread* that started a process ends, so a worker started by a short-lived caller thread (a thread
    pool's) would die with it, maybe in the middle of another caller's task."""
    global _SPAWN_REQUESTS
    with _SPAWN_LOCK:
        if _SPAWN_REQUESTS is None or _SPAWN_REQUESTS[0] != os.getpid():  # first use, or a forked child
            _SPAWN_REQUESTS = (os.getpid(), queue.SimpleQueue())
            threading.Thread(target=_serve_spawn_requests, args=(_SPAWN_REQUESTS[1],), daemon=True).start()
        requests = _SPAWN_REQUESTS[1]
    reply: queue.SimpleQueue = queue.SimpleQueue()
    requests.put((command, reply))
    process = reply.get(timeout=WORKER_START_TIMEOUT_S)
    if isinstance(process, Exception):
        raise process
    return process


class _Worker:
    """One worker process, the partial line read from it, and its task."""

    def __init__(self, command: list[str]) -> None:
        self.process = _spawn(command)
        self.fd = self.process.stdout.fileno()
        self.buffer = b""
        self.ready = False
        self.start_deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        self.task: int | None = None
        self.deadline = math.inf

    def send(self, timeout_s: float, args: Sequence) -> None:
        line = json.dumps([timeout_s if timeout_s < math.inf else None, list(args)]) + "\n"
        self.process.stdin.write(line.encode())
        self.process.stdin.flush()

    def read_lines(self) -> list[str] | None:
        """Complete lines available now (call when the pipe is readable); None at end of file."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [line.decode(errors="replace").strip() for line in lines]

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, close the pipes and reap; never raises for a process that is already gone."""
        for stop in (self.process.kill, self.process.stdin.close, self.process.stdout.close):
            with contextlib.suppress(OSError):
                stop()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)


def _result(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


class WorkerPool:
    """Worker processes serving the entry point `function` of the file `path` (thread-safe).

    ``getattr(module, function)()`` runs once in each worker before it takes tasks and returns the handler, called
    as ``handler(*args)`` for each task; its result must be JSON-serialisable (an exception gives None).
    """

    def __init__(self, path: str, function: str, name: str, max_idle: int = 16) -> None:
        self.path, self.function, self.name, self.max_idle = os.path.abspath(path), function, name, max_idle
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._owner_pid = os.getpid()
        _POOLS.add(self)

    def _new_worker(self) -> _Worker:
        here = os.path.abspath(__file__)
        return _Worker([sys.executable, "-c", _BOOTSTRAP, here, self.path, self.function, str(os.getpid())])

    def _take(self, count: int) -> list[_Worker]:
        with self._lock:
            if os.getpid() != self._owner_pid:  # forked: those pipes belong to the parent process
                self._idle, self._owner_pid = [], os.getpid()
            taken, self._idle = self._idle[:count], self._idle[count:]
        alive = [worker for worker in taken if worker.alive()]
        for worker in set(taken) - set(alive):
            worker.kill()
        return alive + [self._new_worker() for _ in range(count - len(alive))]

    def _give_back(self, workers: list[_Worker]) -> None:
        with self._lock:
            keep = os.getpid() == self._owner_pid  # not if forked during the call
            for worker in workers:
                if keep and worker.alive() and worker.task is None and len(self._idle) < self.max_idle:
                    self._idle.append(worker)
                else:
                    worker.kill()

    def shutdown(self) -> None:
        """Stop every idle worker (all pools are shut down at exit)."""
        with self._lock:
            idle = self._idle if os.getpid() == self._owner_pid else []
            self._idle = []
        for worker in idle:
            worker.kill()

    def run(
        self,
        tasks: Sequence[Sequence],
        timeout_s: float,
        num_workers: int = 1,
        call_timeout_s: float = math.inf,
        groups: Sequence[Hashable] | None = None,
    ) -> list[Any]:
        """The handler's result for each task (its ``args``), on up to `num_workers` workers at once, or a `Failure`.

        Each task gets `timeout_s` seconds of wall clock from when it is sent (else `Failure.TIMED_OUT`, as when it
        crashes its worker), all of them `call_timeout_s` seconds from when the first worker is ready (else
        `Failure.OUT_OF_BUDGET`; worker start-up is bounded by `WORKER_START_TIMEOUT_S`). A task whose group
        (``groups[i]``) had a timed-out task earlier in this call is not tried (`Failure.SKIPPED`). Raises
        RuntimeError when a worker cannot start at all (a broken environment), or without POSIX pipes.
        """
        if os.name != "posix":
            raise RuntimeError(
                f"the {self.name} worker processes need POSIX pipes, which this system ({os.name}) lacks: they bound "
                "the wall-clock time of math_verify / sympy on each answer. The 'dapo' and 'math_reward' scorers need "
                "no workers."
            )
        results: list[Any] = [Failure.OUT_OF_BUDGET] * len(tasks)
        if not tasks:
            return results
        todo = deque(range(len(tasks)))
        failed_groups: set = set()
        budget_end: float | None = None
        workers = self._take(min(num_workers, len(tasks)))
        selector = selectors.DefaultSelector()
        for worker in workers:
            selector.register(worker.fd, selectors.EVENT_READ, worker)

        def replace(index: int, failed: bool) -> None:  # kill a worker and start another (its task failed?)
            old = workers[index]
            if failed:
                results[old.task] = Failure.TIMED_OUT
                if groups is not None:
                    failed_groups.add(groups[old.task])
            old.task = None
            selector.unregister(old.fd)
            old.kill()
            workers[index] = self._new_worker()
            selector.register(workers[index].fd, selectors.EVENT_READ, workers[index])

        try:
            while True:
                now = time.monotonic()
                if budget_end is None and any(worker.ready for worker in workers):
                    budget_end = now + call_timeout_s
                if budget_end is not None and now >= budget_end:  # out of budget: the rest stays undone
                    for index, worker in enumerate(workers):
                        if worker.task is not None:
                            replace(index, failed=False)
                    return results
                for index, worker in enumerate(workers):
                    while worker.ready and worker.task is None and todo:
                        task = todo.popleft()
                        if groups is not None and groups[task] in failed_groups:
                            results[task] = Failure.SKIPPED
                            continue
                        try:
                            worker.send(timeout_s, tasks[task])
                        except OSError:  # died while idle: try the task again on a fresh worker
                            todo.appendleft(task)
                            replace(index, failed=False)
                            break
                        worker.task, worker.deadline = task, now + timeout_s
                if not todo and all(worker.task is None for worker in workers):
                    return results
                # Wake up at the next deadline: a busy worker's task, a starting worker's start-up, the budget.
                waits = [w.deadline for w in workers if w.task is not None]
                waits += [w.start_deadline for w in workers if not w.ready]
                waits += [budget_end] if budget_end is not None else []
                wait = min(waits, default=0.0) - time.monotonic()
                for key, _ in selector.select(max(0.0, wait) if wait < math.inf else None):
                    worker = key.data
                    index = workers.index(worker)
                    lines = worker.read_lines()
                    if lines is None:  # the worker exited
                        if not worker.ready:
                            raise RuntimeError(
                                f"a {self.name} worker process ({sys.executable}) exited while starting (exit code "
                                f"{worker.process.poll()}; its error output is above): are its dependencies installed?"
                            )
                        replace(index, failed=worker.task is not None)  # crashed on a task (e.g. out of memory)
                        continue
                    for line in lines:
                        if line == "ready":
                            worker.ready = True
                        elif worker.task is not None:
                            results[worker.task] = _result(line)
                            worker.task, worker.deadline = None, math.inf
                now = time.monotonic()
                for index, worker in enumerate(workers):
                    if worker.task is not None and now >= worker.deadline:
                        replace(index, failed=True)  # too slow: killed, the task fails
                    elif not worker.ready and now >= worker.start_deadline:
                        raise RuntimeError(
                            f"a {self.name} worker process did not start within {WORKER_START_TIMEOUT_S:.0f} s"
                        )
        except BaseException:
            for worker in workers:  # interrupted mid-exchange: these workers cannot be reused
                worker.kill()
            raise
        finally:
            selector.close()
            self._give_back(workers)


_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for pool in list(_POOLS):
        pool.shutdown()
