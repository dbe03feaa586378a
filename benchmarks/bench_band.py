"""Benchmark of the KL Band bounds: authors'-style bisection vs our torch solver vs the Triton kernel vs a copy.

    python benchmarks/bench_band.py --device cpu                       # sizes 1e4, 1e5, 1e6
    python benchmarks/bench_band.py --device cuda --sweep              # sizes 32k, 512k, 1M, 8M, + launch configs

Methods (all on the same float old log-probs, delta = --radius, no cap unless --upper-max):
- authors-bisection: plain vectorised torch bisection on the binary-KL equation, <= 50 iterations per bound, early
  exit when the host-synced `(hi - lo).max().item() <= 1e-6` (the BandPO authors' approach, their Appendix 9.6;
  written here).
- torch-solver: `band_bounds(..., solver="torch")` (safeguarded Newton, no host sync).
- triton-kernel (CUDA only): `band_bounds(..., solver="triton")`.
- copy: `dst.copy_(src)` of 1.5 N float32, i.e. the kernel's 12 bytes per token read + written (fp32): the floor.
GB/s counts the useful bytes (input read + two outputs written) over the median time. The error column is
`max |got - ref| / max(1, ref)` over both bounds, against the torch solver run in float64 on the same input.
"""

import argparse
import math
import os
import platform
import statistics
import sys
import time

import torch

if __package__ in (None, ""):  # `python benchmarks/bench_band.py` from the repository root
    sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from trl_bandpo.core.band import band_bounds  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def authors_style_bisection(old_logps, radius, upper_max=None, max_iter=50, tol=1e-6):
    """Bisection on r for `p log(p/q) + (1-p) log((1-p)/(1-q)) = radius`, q = r p, each bound separately:
    lower on [0, 1], upper on [1, 1/p]; stops early once the widest bracket is <= tol (a host sync per step)."""
    dtype = torch.float64 if old_logps.dtype == torch.float64 else torch.float32
    p = old_logps.to(dtype).exp().clamp(1e-12, 1 - 1e-7)
    tiny = torch.finfo(dtype).tiny

    def excess(r):
        q = (r * p).clamp(tiny, 1 - 1e-7)
        return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q)) - radius

    bounds = []
    for lo, hi, rising in ((torch.zeros_like(p), torch.ones_like(p), False), (torch.ones_like(p), 1 / p, True)):
        for _ in range(max_iter):
            mid = (lo + hi) / 2
            outside = excess(mid) > 0
            if rising:
                hi, lo = torch.where(outside, mid, hi), torch.where(outside, lo, mid)
            else:
                lo, hi = torch.where(outside, mid, lo), torch.where(outside, hi, mid)
            if (hi - lo).max().item() <= tol:
                break
        bounds.append((lo + hi) / 2)
    lower, upper = bounds
    if upper_max is not None:
        upper = upper.clamp(max=upper_max)
    return lower, upper


def make_logps(n, device, dtype, seed=0):
    """p log-uniform in [1e-8, 1] for 90% of the tokens, 1 - p log-uniform in [1e-7, 0.1] for the rest."""
    g = torch.Generator(device=device).manual_seed(seed)
    u = torch.rand(n, generator=g, device=device, dtype=torch.float64)
    near_one = torch.rand(n, generator=g, device=device, dtype=torch.float64) < 0.1
    logp = torch.where(near_one, torch.log1p(-(10 ** (-7 + 6 * u))), -8 * math.log(10) * u)
    return logp.to(dtype)


class Timer:
    """Median time of `fn()` in ms: CUDA events on GPU (L2 flushed between runs); on CPU wall time (perf_counter),
    or with clock="cpu" this process's CPU time (steadier on a shared machine; with 1 thread ~ uncontended wall)."""

    def __init__(self, device, warmup, repeats, clock="wall"):
        self.device, self.warmup, self.repeats = device, warmup, repeats
        self.clock = time.process_time if clock == "cpu" else time.perf_counter
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device == "cuda" else None

    def __call__(self, fn):
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.device == "cuda":
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = self.clock()
                fn()
                times.append((self.clock() - t0) * 1e3)
        return statistics.median(times)


def max_error(got, ref):
    err = 0.0
    for a, b in zip(got, ref):
        a, b = a.double(), b.double()
        finite = b.isfinite()
        err = max(err, ((a[finite] - b[finite]).abs() / b[finite].abs().clamp(min=1.0)).max().item())
    return err


def parse_sizes(text):
    return [int(float(s)) for s in text.split(",") if s.strip()]


def device_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"


def header(args):
    import triton  # noqa: F401  (version only; not needed on CPU)

    lines = [
        "Command: `" + " ".join(["python"] + sys.argv) + "`",
        "",
        f"- device: {device_name(args.device)}",
        f"- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}",
        f"- dtype {args.dtype}, radius {args.radius}, upper_max {args.upper_max}, warmup {args.warmup}, "
        f"repeats {args.repeats} (median)" + ("" if args.device == "cuda" else f", {args.clock} clock"),
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", default=None, help="comma-separated token counts (default: by device)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per method (default: 5 CPU, 50 CUDA)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default: 1 CPU, 5 CUDA)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--radius", type=float, default=0.05)
    parser.add_argument("--upper-max", type=float, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="CPU timing: wall or CPU time")
    parser.add_argument("--sweep", action="store_true", help="CUDA: also time the kernel's BLOCK_SIZE / num_warps")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    args.sizes = parse_sizes(args.sizes or ("32768,524288,1048576,8388608" if cuda else "1e4,1e5,1e6"))
    args.repeats = args.repeats or (50 if cuda else 5)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    dtype = DTYPES[args.dtype]
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    timer = Timer(args.device, args.warmup, args.repeats, args.clock)

    print(header(args))
    print()
    print(
        "| tokens | method | median ms | GB/s | speed-up vs authors | speed-up vs torch solver | x copy time "
        "| max rel. error |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    sweep_rows = []
    for n in args.sizes:
        x = make_logps(n, args.device, dtype)
        ref = band_bounds(x.double(), args.radius, solver="torch", upper_max=args.upper_max)
        nbytes = n * (x.element_size() + 2 * torch.finfo(out_dtype).bits // 8)
        methods = {
            "authors-bisection": lambda: authors_style_bisection(x, args.radius, args.upper_max),
            "torch-solver": lambda: band_bounds(x, args.radius, solver="torch", upper_max=args.upper_max),
        }
        if cuda:
            methods["triton-kernel"] = lambda: band_bounds(x, args.radius, solver="triton", upper_max=args.upper_max)
        src = torch.empty(nbytes // 8, dtype=torch.float32, device=args.device).uniform_()
        dst = torch.empty_like(src)
        methods["copy"] = lambda: dst.copy_(src)

        times, errors = {}, {}
        for name, fn in methods.items():
            times[name] = timer(fn)
            errors[name] = max_error(fn(), ref) if name != "copy" else None
        for name, ms in times.items():
            err = "" if errors[name] is None else f"{errors[name]:.2e}"
            print(
                f"| {n:,} | {name} | {ms:.3f} | {nbytes / ms / 1e6:.3g} | {times['authors-bisection'] / ms:.1f} "
                f"| {times['torch-solver'] / ms:.2f} | {ms / times['copy']:.1f} | {err} |",
                flush=True,
            )
        if cuda and args.sweep:
            from trl_bandpo.kernels.band_kl import _band_kl_launch

            for block in (256, 512, 1024, 2048):
                for warps in (2, 4, 8):
                    if block // (32 * warps) < 1:
                        continue
                    ms = timer(
                        lambda: _band_kl_launch(x, args.radius, args.upper_max, block_size=block, num_warps=warps)
                    )
                    sweep_rows.append(f"| {n:,} | {block} | {warps} | {ms:.4f} | {ms / times['copy']:.1f} |")
    if sweep_rows:
        print()
        print("Kernel launch configurations (the launcher's default is 1024 / 8 for fp32, 512 / 8 for fp64):")
        print()
        print("| tokens | BLOCK_SIZE | num_warps | median ms | x copy time |")
        print("|---:|---:|---:|---:|---:|")
        print("\n".join(sweep_rows))


if __name__ == "__main__":
    main()
