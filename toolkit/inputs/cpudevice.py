"""This machine's CPU as the device of a step-time model: `--gpus 2xcpu` prices a step of N CPU processes over gloo,
what `toolkit tune --cpu` and `toolkit launch --rehearse` run (issue 30, Deliver 4).

Nothing here is fitted. Each figure is measured once on this machine, at this process's torch thread count (the
ranks of a CPU launch run with the same OMP_NUM_THREADS), and kept in the disk cache keyed by the CPU model, the
thread count and the torch version (toolkit.cache), so every later estimate reads the same figures:

- the compute peak per precision: the best of a few square torch.mm products (fp32 / bf16 / fp16), FLOPs 2 n^3 over
  the wall time; the step-time model takes it as the peak at efficiency 1 (toolkit.estimate.efficiency), since a
  measured GEMM rate already is what a large matmul reaches here;
- memory bandwidth: a large tensor copy, bytes read + written over the wall time; it stands for HBM and, offload
  being a host copy, for the host link.

Not measured: gloo's collective bandwidth between the processes (it needs a world of processes); INTRA_GBPS is an
assumed figure and the communication term built on it is the least trusted part (tune's calibration folds it into
the measured ratio, see toolkit.inputs.calibration). Memory: the host's MemTotal, which the ranks share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CPU_NAME = "cpu"
"""What `--gpus` takes for this machine's CPU processes (`2xcpu`)."""
CPU_ARCHITECTURE = "cpu"
INTRA_GBPS = 1.0
"""gloo's collective bandwidth between CPU ranks of one machine, GB/s: assumed (gloo sends through loopback TCP;
not measured here)."""
GEMM_N = {"fp32": 512, "bf16": 256, "fp16": 256}
"""Square matmul size per precision: big enough for the kernels' steady rate, small enough to measure in well
under a second on one thread (bf16 / fp16 run without AMX on many CPUs, several times slower than fp32)."""
COPY_BYTES = 64 * 2**20


def cpu_model() -> str:
    """The CPU model string of /proc/cpuinfo (`model name`), or the platform's processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def host_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 16 * 2**30


@dataclass(frozen=True)
class CpuRates:
    """What was measured on this CPU (module docstring)."""

    fp32_tflops: float
    bf16_tflops: float
    fp16_tflops: float
    copy_gbps: float
    threads: int
    model: str


def _gemm_tflops(dtype_name: str, repeats: int = 5) -> float:
    import torch

    n = GEMM_N[dtype_name]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # first call: kernel selection, allocations
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - began)
    return 2 * n**3 / best / 1e12


def _copy_gbps(repeats: int = 3) -> float:
    import torch

    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - began)
    return 2 * COPY_BYTES / best / 1e9


def measure(key: tuple) -> dict:
    """The rates of this CPU at this thread count (`key`: model, threads, torch version: the cache key)."""
    return {"fp32_tflops": _gemm_tflops("fp32"), "bf16_tflops": _gemm_tflops("bf16"),
            "fp16_tflops": _gemm_tflops("fp16"), "copy_gbps": _copy_gbps(), "threads": key[1], "model": key[0]}


@lru_cache(maxsize=1)
def cpu_rates() -> CpuRates:
    """This CPU's measured rates, from the disk cache when this CPU, thread count and torch measured them before."""
    import torch

    from toolkit import cache

    key = (cpu_model(), torch.get_num_threads(), cache.installed_version("torch"))
    stored = cache.get("cpu-rates", list(key), code=measure, decode=lambda v: CpuRates(**v))
    if stored is not None:
        return stored
    rates = measure(key)
    cache.put("cpu-rates", list(key), rates, code=measure)
    return CpuRates(**rates)
