r"""A reward call is bounded as a whole, verifier processes die with their parent, bad ground truths never raise.

Timing tests use fake verifier processes (the real worker loop of `trl_bandpo.scoring.worker_pool` with `math_verify`
replaced by a function that sleeps on answers starting with ``slow`` and accepts those starting with ``right``), so
that their timing is deterministic; bounds are asserted with generous slack.
"""

import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trl_bandpo.scoring import verifier, worker_pool
from trl_bandpo.scoring.rewards import MathVerifyReward, score_completions

REPO = Path(__file__).resolve().parents[1]
SLACK_S = 4.0  # start-up of fake workers, a loaded machine

FAKE_ENTRY = """
import time


def fake_equal(gold, answer):
    if answer.startswith("slow"):
        time.sleep(600)
    return answer.startswith("right")


def worker_handler():
    return fake_equal
"""


@pytest.fixture
def fake_workers(monkeypatch, tmp_path):
    """Verifier processes serving `FAKE_ENTRY`, with an empty verdict cache; the real pool comes back after."""
    (tmp_path / "fake_verifier.py").write_text(FAKE_ENTRY)
    verifier._POOL.shutdown()
    monkeypatch.setattr(verifier._POOL, "path", str(tmp_path / "fake_verifier.py"))
    monkeypatch.setattr(verifier._POOL, "function", "worker_handler")
    monkeypatch.setattr(verifier, "_VERDICTS", OrderedDict())
    yield
    verifier._POOL.shutdown()


def boxed(answers):
    return [rf"\boxed{{{answer}}}" for answer in answers]


def test_call_budget_cuts_off_a_batch_of_slow_answers(fake_workers, caplog):
    answers = [f"right{i}" for i in range(4)] + [f"slow{i}" for i in range(64)]
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trl_bandpo.scoring.rewards"):
        flags = score_completions(
            boxed(answers), [f"gold{i}" for i in range(68)], timeout_s=0.5, num_workers=2, call_timeout_s=2.0
        )
    elapsed = time.monotonic() - started
    assert flags == [True] * 4 + [False] * 64
    assert elapsed < 2.0 + SLACK_S, f"{elapsed:.1f} s"
    warnings = [record.getMessage() for record in caplog.records if "not verified" in record.getMessage()]
    assert len(warnings) == 1  # once per call
    cut_off = int(re.search(r"(\d+) of 68 answers", warnings[0]).group(1))
    assert 32 <= cut_off <= 64  # about 4 slow answers per worker fit in 2 s; the rest were never tried


def test_default_budget_bounds_a_batch_of_slow_answers(fake_workers):
    budget = 0.5 * (4 + 64 / (8 * 2))  # default_call_timeout(timeout_s=0.5, num_workers=2, num_pairs=64)
    started = time.monotonic()
    golds = [f"gold{i}" for i in range(64)]
    flags = score_completions(boxed(f"slow{i}" for i in range(64)), golds, timeout_s=0.5, num_workers=2)
    elapsed = time.monotonic() - started
    assert flags == [False] * 64
    assert elapsed < budget + SLACK_S, f"{elapsed:.1f} s (each slow answer in turn: 16 s or more)"
    from trl_bandpo.scoring.rewards import default_call_timeout

    assert default_call_timeout(0.5, 2, 64) == budget


def test_an_answer_that_timed_out_is_not_verified_again_with_another_gold(fake_workers, monkeypatch):
    starts = []
    original_init = worker_pool._Worker.__init__

    def counting_init(self, command):
        starts.append(time.monotonic())
        original_init(self, command)

    monkeypatch.setattr(worker_pool._Worker, "__init__", counting_init)
    started = time.monotonic()
    flags = score_completions(boxed(["slow"] * 8), [f"gold{i}" for i in range(8)], timeout_s=0.5, num_workers=1)
    elapsed = time.monotonic() - started
    assert flags == [False] * 8
    assert len(starts) <= 2  # the first worker, and one replacing it after the one timeout (not 8 timeouts)
    assert elapsed < 0.5 + SLACK_S, f"{elapsed:.1f} s"
    # Only the pair that did time out is remembered: the others were never verified.
    assert [(f"gold{i}", "slow") in verifier._VERDICTS for i in range(8)] == [True] + [False] * 7


def test_answers_cut_off_by_the_budget_are_not_cached(fake_workers):
    started = time.monotonic()
    flags = score_completions(boxed(["slow", "right"]), ["g1", "g2"], timeout_s=30, num_workers=1, call_timeout_s=0.5)
    assert flags == [False, False]  # "right" never got a worker before the budget ran out
    assert time.monotonic() - started < 0.5 + SLACK_S
    assert score_completions(boxed(["right"]), ["g2"], num_workers=1) == [True]  # verified now


def test_workers_started_from_a_short_lived_thread_outlive_it(fake_workers):
    """Linux's parent-death signal follows the thread that started a process: workers must not die with it."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(score_completions, boxed(["right"]), ["g"], num_workers=1).result() == [True]
    (worker,) = verifier._POOL._idle  # started while serving the pool's thread, which has exited now
    time.sleep(0.5)
    assert worker.alive()
    assert score_completions(boxed(["right-again"]), ["g"], num_workers=1, call_timeout_s=60) == [True]
    assert verifier._POOL._idle == [worker]  # the same process served the second call


@pytest.mark.parametrize("value", [0, -1.0, "5", True, float("nan")])
def test_call_timeout_is_checked(value):
    with pytest.raises(ValueError, match="call_timeout_s"):
        MathVerifyReward(call_timeout_s=value)
    with pytest.raises(ValueError, match="call_timeout_s"):
        score_completions([r"\boxed{1}"], ["1"], call_timeout_s=value)


def test_bad_ground_truths_and_completions_never_raise():
    class Unprintable:
        def __str__(self):
            raise RuntimeError("no")

    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    solutions = [
        10**5000,  # more digits than int-to-str conversion allows
        -(10**5000),
        10**30000,
        float("nan"),
        Unprintable(),
        {"answer": 7},
        b"7",
        deep,
        "\\boxed{",
        "\x00",
        "$$",
        [None, 7],
    ]
    completions = [r"\boxed{7}"] * len(solutions)
    flags = score_completions(completions, solutions, timeout_s=1.0)
    assert flags == [False] * (len(solutions) - 1) + [True]
    odd_completions = [None, 5, {"content": Unprintable()}, [{"role": "assistant", "content": [Unprintable()]}]]
    assert score_completions(odd_completions, [7] * 4) == [False] * 4


def test_a_huge_integer_gold_is_written_out_exactly():
    from trl_bandpo.scoring.answers import gold_alternatives

    (text,) = gold_alternatives(10**5000 + 7)
    assert text == "1" + "0" * 4999 + "7"
    assert score_completions([r"\boxed{7}", r"\boxed{8}"], [10**5000 + 7, 8]) == [False, True]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie waiting for a reaper is dead


SCORER = r"""
from trl_bandpo.scoring import verifier
from trl_bandpo.scoring.rewards import score_completions

score_completions([r"\boxed{1}", r"\boxed{2}"], ["3", "4"], num_workers=2)  # two ready workers
print(*[worker.process.pid for worker in verifier._POOL._idle], flush=True)
towers = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{8^{8^{8^{8}}}}"]  # minutes of sympy work inside C, each
score_completions(towers, ["5", "6"], timeout_s=600, num_workers=2)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_busy_workers_die_with_a_killed_scorer():
    scorer = subprocess.Popen([sys.executable, "-c", SCORER], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        pids = [int(pid) for pid in scorer.stdout.readline().split()]
        assert len(pids) == 2, pids
        time.sleep(1.5)  # both workers are now deep in a power tower
        assert all(_alive(pid) for pid in pids)
        os.kill(scorer.pid, signal.SIGKILL)
        scorer.wait(timeout=10)
        deadline = time.monotonic() + 5.0
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [pid for pid in pids if _alive(pid)]
        for pid in survivors:  # clean up before failing
            os.kill(pid, signal.SIGKILL)
        assert not survivors, "verifier processes outlived their parent"
    finally:
        if scorer.poll() is None:
            scorer.kill()
        scorer.stdout.close()


def test_no_budget_means_no_cut_off(fake_workers):
    flags = score_completions(boxed(["right1", "right2"]), ["g", "g"], num_workers=1, call_timeout_s=math.inf)
    assert flags == [True, True]


IMPORTS = r"""
import os, threading
import trl_bandpo.scoring.rewards, trl_bandpo.scoring.strict_grader
import trl_bandpo.scoring.verifier, trl_bandpo.scoring.worker_pool
children = [open(f"/proc/self/task/{task}/children").read().split() for task in os.listdir("/proc/self/task")]
print(threading.active_count(), sum(map(len, children)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_importing_starts_no_thread_and_no_process():
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["1", "0"]  # one Python thread (the main one), no child process


def test_worker_files_load_without_the_package():
    """A worker loads its files by path: neither `trl_bandpo` (heavy) nor the caller's `__main__` is imported."""
    files = [worker_pool.__file__, verifier.__file__, REPO / "trl_bandpo" / "scoring" / "strict_grader" / "_grade.py"]
    code = worker_pool._LOADER + (
        "for path in sys.argv[1:]:\n"
        "    load(path)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trl_bandpo', 'torch', '__mp_main__')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *map(str, files)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_cap_their_address_space(fake_workers):
    assert score_completions(boxed(["right"]), ["g"], num_workers=1) == [True]
    (worker,) = verifier._POOL._idle
    limits = Path(f"/proc/{worker.process.pid}/limits").read_text()
    (line,) = [line for line in limits.splitlines() if line.startswith("Max address space")]
    assert line.split()[3] == str(worker_pool.WORKER_MEMORY_BYTES)  # the soft limit


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_starts_its_own_workers(fake_workers):
    assert score_completions(boxed(["right"]), ["g"], num_workers=1) == [True]
    (parent_worker,) = verifier._POOL._idle
    pid = os.fork()
    if pid == 0:  # the child: it must not use the parent's pipes
        ok = False
        try:
            ok = score_completions(boxed(["right2"]), ["g"], num_workers=1, call_timeout_s=30) == [True]
            ok = ok and len(verifier._POOL._idle) == 1 and verifier._POOL._idle[0] is not parent_worker
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert parent_worker.alive() and verifier._POOL._idle == [parent_worker]
    assert score_completions(boxed(["right3"]), ["g"], num_workers=1, call_timeout_s=30) == [True]
