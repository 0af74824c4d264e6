"""The caching-allocator model (toolkit/estimate/allocator.py) against the real CUDA caching allocator, on the GPU
day: each sequence of allocations and frees below is replayed by the model and run on the device (torch.empty of
the same byte sizes, on the same streams, with the same record_stream / synchronize), and the reserved and allocated
peaks, segments and retries are compared. One child process per PYTORCH_CUDA_ALLOC_CONF (the allocator reads it once
at start); a sequence with a capacity runs under torch.cuda.set_per_process_memory_fraction(capacity / total).

    python benchmarks/gpu_check.py --device cuda --allocator --out "$OUT"    # writes gpu_allocator.json
    python benchmarks/gpu_check.py --device cpu --allocator --out DIR        # the model's side only (tests run it)

On CPU there is no caching allocator: every row carries the prediction and says the measurement needs CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
SETTINGS = ("", "expandable_segments:True", "max_split_size_mb:64", "roundup_power2_divisions:4")
"""Each runs every sequence in its own child process."""

SEQUENCES: dict[str, tuple[list[tuple], int | None]] = {
    # name: (events, capacity bytes or None); events as toolkit.estimate.allocator.replay reads them
    "small requests share a 2 MiB segment": ([("malloc", "a", 100_000), ("malloc", "b", 100_000)], None),
    "1-10 MiB requests split a 20 MiB segment": (
        [("malloc", "a", 4 * MiB), ("malloc", "b", 4 * MiB), ("malloc", "c", 4 * MiB)], None),
    "large remainder under 1 MiB stays": ([("malloc", "a", 11 * MiB + MiB // 2)], None),
    "best fit leaves a 40 MiB sliver": (
        [("malloc", "a", 100 * MiB), ("free", "a"), ("malloc", "b", 60 * MiB), ("malloc", "c", 60 * MiB)], None),
    "freed neighbours merge": (
        [("malloc", "a", 100 * MiB), ("free", "a"), ("malloc", "b", 60 * MiB), ("malloc", "c", 30 * MiB),
         ("free", "b"), ("free", "c"), ("malloc", "d", 100 * MiB)], None),
    "oversize block for a near size": (
        [("malloc", "a", 100 * MiB), ("free", "a"), ("malloc", "b", 85 * MiB)], None),
    "no reuse across streams": ([("malloc", "a", 50 * MiB, 0), ("free", "a"), ("malloc", "b", 50 * MiB, 1)], None),
    "record_stream defers the free": (
        [("malloc", "a", 50 * MiB, 0), ("record_stream", "a", 1), ("free", "a"), ("malloc", "b", 50 * MiB, 0)],
        None),
    "record_stream then sync reuses": (
        [("malloc", "a", 50 * MiB, 0), ("record_stream", "a", 1), ("free", "a"), ("sync", 1),
         ("malloc", "b", 50 * MiB, 0)], None),
    "out of memory frees the cache and retries": (
        [("malloc", "a", 600 * MiB), ("free", "a"), ("malloc", "b", 800 * MiB)], 1000 * MiB),
    "a transformer-like step": (
        [*(("malloc", f"w{i}", 48 * MiB) for i in range(8)),
         *(e for i in range(8) for e in (("malloc", f"act{i}", 24 * MiB), ("malloc", f"tmp{i}", 7 * MiB),
                                        ("free", f"tmp{i}"))),
         *(e for i in reversed(range(8)) for e in (("malloc", f"g{i}", 48 * MiB), ("free", f"act{i}"),
                                                   ("malloc", f"t{i}", 3 * MiB), ("free", f"t{i}")))], None),
}


def predicted(setting: str, events: list[tuple], capacity: int | None) -> dict:
    from toolkit.estimate.allocator import AllocatorSettings, OutOfMemory, replay

    try:
        s = replay(events, AllocatorSettings.from_conf(setting, capacity=capacity))
    except OutOfMemory as exc:
        return {"oom": str(exc)}
    return {"reserved_peak": s.peak_reserved, "allocated_peak": s.peak_allocated, "reserved": s.reserved,
            "segments": s.segments, "retries": s.alloc_retries}  # cudaMalloc segments, as torch's stat counts


def measured(events: list[tuple], capacity: int | None) -> dict:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, capacity / total) if capacity else 1.0)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
    streams = {0: torch.cuda.current_stream()}
    tensors: dict = {}
    try:
        for event in events:
            kind = event[0]
            if kind == "malloc":
                stream = streams.setdefault(event[3] if len(event) > 3 else 0, torch.cuda.Stream())
                with torch.cuda.stream(stream):
                    tensors[event[1]] = torch.empty(event[2], dtype=torch.uint8, device="cuda")
            elif kind == "free":
                del tensors[event[1]]
            elif kind == "record_stream":
                stream = streams.setdefault(event[2], torch.cuda.Stream())
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(1_000_000)  # work queued there, so the recorded event is not yet done
                tensors[event[1]].record_stream(stream)
            elif kind == "sync":
                streams.setdefault(event[1], torch.cuda.Stream()).synchronize()
        stats = torch.cuda.memory_stats()
        out = {"reserved_peak": stats["reserved_bytes.all.peak"], "allocated_peak": stats["allocated_bytes.all.peak"],
               "reserved": stats["reserved_bytes.all.current"],
               "segments": stats["segment.all.current"] - before.get("segment.all.current", 0),
               "retries": stats["num_alloc_retries"] - before.get("num_alloc_retries", 0)}
    except torch.cuda.OutOfMemoryError as exc:
        out = {"oom": str(exc).splitlines()[0][:200]}
    tensors.clear()
    torch.cuda.synchronize()
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    return out


def child(device: str, rows_path: str) -> int:
    setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    cuda = device.startswith("cuda")
    rows = []
    for name, (events, capacity) in SEQUENCES.items():
        row = {"label": f"{name} | {setting or 'default'}", "allocator": setting or "default",
               "predicted": predicted(setting, events, capacity)}
        if cuda:
            try:
                row["measured"] = measured(events, capacity)
            except Exception as exc:  # one failing sequence must not cost the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        else:
            row["skipped"] = "no caching allocator on CPU: the measurement needs CUDA"
        rows.append(row)
    Path(rows_path).write_text(json.dumps(rows))
    return 0


def allocator_check(device: str, out_dir: str) -> int:
    """One child per SETTINGS entry; all rows to gpu_allocator.json."""
    rows: list[dict] = []
    for setting in SETTINGS:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        if setting:
            env["PYTORCH_CUDA_ALLOC_CONF"] = setting
        with tempfile.TemporaryDirectory() as tmp:
            part = Path(tmp) / "rows.json"
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), device, str(part)], env=env,
                                  timeout=300)
            if proc.returncode or not part.is_file():
                rows.append({"label": f"allocator {setting or 'default'}", "error": f"exit code {proc.returncode}"})
                continue
            rows += json.loads(part.read_text())
    meta = {"device": device, "date": time.strftime("%Y-%m-%d"), "settings": [s or "default" for s in SETTINGS]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_allocator.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(child(sys.argv[1], sys.argv[2]))
