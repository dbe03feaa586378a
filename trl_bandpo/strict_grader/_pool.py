"""Worker processes for the strict grader: each verdict is computed in a separate process with a wall-clock bound.

sympy can take unbounded time (``simplify``, or an integer power with hundreds of millions of digits computed in C,
which no signal interrupts), so `run_grade` sends the pair to a worker process (``python -c``, JSON lines over
pipes) and waits with a deadline (`selectors`, no signals: it works in any thread). A worker that misses the
deadline is killed (SIGKILL) and the answer is wrong. Idle workers are kept for the next call (starting one costs
about a second: it imports sympy); each thread of the caller uses its own worker. A worker imports only the three
rule modules of this package, loaded by path as a stand-alone package (not `trl_bandpo`, whose import may be heavy),
caps its address space, exits when its input closes, and caps the CPU time of each answer, so that a worker left
behind by a dead parent stops too. This is the pattern of `trl_bandpo.verifier`.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import threading
import time

from ..verifier import stop_process

WORKER_START_TIMEOUT_S = 120.0  # a worker that is not ready after this long is an environment problem
_MAX_IDLE = 8

# Loads this folder's rule modules as the package `_trl_bandpo_strict_grader`, without importing trl_bandpo.
_BOOTSTRAP = (
    "import importlib, sys, types\n"
    "package = types.ModuleType('_trl_bandpo_strict_grader')\n"
    "package.__path__ = [sys.argv[1]]\n"
    "sys.modules[package.__name__] = package\n"
    "importlib.import_module(package.__name__ + '._grade').worker_main()\n"
)


class _WorkerDied(Exception):
    pass


class _Worker:
    def __init__(self) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, here],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,  # a terminal's Ctrl-C goes to the caller, which then closes the pipes
        )
        self.buffer = b""
        self.ready = False

    def read_line(self, deadline: float) -> str | None:
        """The next line from the worker, or None if none came by `deadline`; `_WorkerDied` at end of output."""
        fd = self.process.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(remaining):
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise _WorkerDied
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode(errors="replace").strip()

    def ask(self, given: str, gold: str, timeout_s: float) -> str | None:
        if not self.ready:
            if self.read_line(time.monotonic() + WORKER_START_TIMEOUT_S) != "ready":
                raise RuntimeError(f"a strict-grader worker did not start within {WORKER_START_TIMEOUT_S:.0f} s")
            self.ready = True
        self.process.stdin.write((json.dumps([given, gold, timeout_s]) + "\n").encode())
        self.process.stdin.flush()
        return self.read_line(time.monotonic() + timeout_s)

    def kill(self) -> None:
        stop_process(self.process)


_LOCK = threading.Lock()
_IDLE: list[_Worker] = []
_OWNER = [os.getpid()]


def _take() -> _Worker:
    with _LOCK:
        if _OWNER[0] != os.getpid():  # a forked child: those workers belong to the parent
            _IDLE.clear()
            _OWNER[0] = os.getpid()
        while _IDLE:
            worker = _IDLE.pop()
            if worker.process.poll() is None:
                return worker
            worker.kill()
    return _Worker()


def _give_back(worker: _Worker) -> None:
    with _LOCK:
        if len(_IDLE) < _MAX_IDLE and _OWNER[0] == os.getpid():
            _IDLE.append(worker)
            return
    worker.kill()


def shutdown() -> None:
    """Stop the idle workers (registered with `atexit`)."""
    with _LOCK:
        idle = list(_IDLE) if _OWNER[0] == os.getpid() else []
        _IDLE.clear()
    for worker in idle:
        worker.kill()


atexit.register(shutdown)


def run_grade(given: str, gold: str, timeout_s: float) -> bool:
    """The worker's verdict on (given, gold), or False when it takes longer than `timeout_s` or the worker crashes.

    Raises RuntimeError when a worker cannot start at all (a broken environment, e.g. no sympy).
    """
    for attempt in range(2):
        worker = _take()
        try:
            line = worker.ask(given, gold, timeout_s)
        except (_WorkerDied, BrokenPipeError) as error:
            worker.kill()
            if not worker.ready:
                raise RuntimeError(f"a strict-grader worker ({sys.executable}) exited while starting") from error
            if attempt == 0 and isinstance(error, BrokenPipeError):
                continue  # it died while idle: try once more with a fresh one
            return False  # it crashed on this answer (e.g. out of memory): wrong
        except BaseException:
            worker.kill()
            raise
        if line is None:  # too slow: kill it, the answer is wrong
            worker.kill()
            return False
        _give_back(worker)
        return line == "1"
    return False
