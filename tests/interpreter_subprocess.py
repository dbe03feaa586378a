"""Run a kernel test module's `__main__` under `TRITON_INTERPRET=1` in a subprocess.

The interpreter must be chosen before Triton is imported, and pytest runs every test module in one process, so the
kernel tests save their cases, run their own file as a script with the variable set, and load the outputs back.
"""

import os
import subprocess
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreter_subprocess(script, cases, tmp_dir, while_running=None):
    """Save `cases`, run `python script cases.pt out.pt` with the interpreter on, return the loaded outputs.

    `while_running` (a callable) runs in this process meanwhile, e.g. to compute the float64 references.
    """
    cases_path, out_path = os.path.join(tmp_dir, "cases.pt"), os.path.join(tmp_dir, "out.pt")
    torch.save(cases, cases_path)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(script), cases_path, out_path],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if while_running is not None:
        while_running()
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"interpreter subprocess failed:\n{log}"
    return torch.load(out_path)
