"""Hardware: a GPU from the catalog, how many per node, how many nodes, and the links between them.

Specs users type: `8xH100-80GB`, `H200` (one GPU), `2x8xA100-80GB` (2 nodes of 8), with `--nodes N` as the other
way to say the node count. The catalog (presets/gpus.json) is the one source of GPU facts; a GPU name is taken
only when it is exact (find_gpu: a family such as `A100` or `H100` is refused with its members).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import lru_cache

from toolkit import bounds
from toolkit.bounds import check_number
from toolkit.errors import UserError
from toolkit.paths import GPU_CATALOG_FILE

from toolkit.inputs.choices import GIB
GB = 1000**3

DEFAULT_INTER_NODE_GBPS = 50.0
"""400 Gb/s InfiniBand / RoCE per node direction (one 400G NIC), a common cluster fabric; override with
--inter-node-gbps (e.g. 8 x 400G rails = 400 GB/s on a DGX H100)."""

DEFAULT_CPU_RAM_GIB = 1024
"""Host RAM per node when not given: DGX-class 8-GPU servers ship 1-2 TiB; override with --cpu-ram-gib."""


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    bf16_tflops: float
    fp16_tflops: float
    fp32_tflops: float
    tf32_tflops: float
    hbm_gbps: float
    intra_node_gbps: float
    """Per-GPU unidirectional GPU-to-GPU bandwidth inside a node (NVLink / xGMI, or PCIe without them)."""
    pcie_gbps: float
    """Host link, per GPU, unidirectional: offload traffic goes through it."""
    interconnect: str
    bf16_supported: bool
    source: str = ""
    architecture: str = ""
    """Chip generation (ampere, hopper, ...): what the step-time model's compute efficiency is keyed by."""
    tdp_w: float = 0.0
    """Board power the datasheet's peaks are quoted at (0: not in the catalog)."""
    die: str = ""
    """Chip and enabled SMs: entries sharing it differ only in power, clocks and memory (power_limited reads them)."""
    power_limit_w: float = 0.0
    """The board power limit this GPU runs at, when one is set (power_limited); 0: none (the TDP)."""
    cuda_context_bytes: int = 0
    """A training process's CUDA context measured on this GPU (benchmarks/gpu_check.py: cudaMemGetInfo's used bytes
    minus torch's reserved); 0: not measured, toolkit.estimate.devicememory's assumed figure is used."""
    compute_ratio: float = 1.0
    """Measured over predicted compute time on this machine, from a stored calibration (toolkit.inputs.calibration):
    the step-time model divides its matmul efficiency by it; 1: uncalibrated."""
    step_overhead_s: float = 0.0
    """Seconds every step takes beside the model's terms on this machine, from the same calibration (fitted where its
    runs span two compute sizes); the step-time model adds it to each step; 0: none fitted."""

    def peak_tflops(self, precision: str) -> float:
        """Dense peak for the precision a step computes in. fp32 uses the plain fp32 peak: torch keeps fp32
        matmuls out of TF32 unless `allow_tf32` is set, and the HF Trainer leaves it alone by default."""
        if precision in ("bf16", "bf16-pure"):
            return self.bf16_tflops if self.bf16_supported else 0.0
        if precision == "fp16":
            return self.fp16_tflops
        return self.fp32_tflops


@dataclass(frozen=True)
class Hardware:
    gpu: Gpu
    gpus_per_node: int
    nodes: int = 1
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS
    """Per-node unidirectional network bandwidth between nodes, GB/s."""
    cpu_ram_bytes_per_node: int = DEFAULT_CPU_RAM_GIB * GIB

    def __post_init__(self) -> None:
        if self.gpus_per_node <= 0 or self.nodes <= 0:
            raise UserError(f"GPU count must be positive, got {self.gpus_per_node} GPU(s) x {self.nodes} node(s)")
        check_number("GPUs per node", self.gpus_per_node, bounds.GPUS_PER_NODE)
        check_number("node count", self.nodes, bounds.NODES)
        check_number("--inter-node-gbps", self.inter_node_gbps, bounds.INTER_NODE_GBPS)
        check_number("--cpu-ram-gib", self.cpu_ram_bytes_per_node / GIB, bounds.CPU_RAM_GIB)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def spec(self) -> str:
        prefix = f"{self.nodes}x" if self.nodes > 1 else ""
        return f"{prefix}{self.gpus_per_node}x{self.gpu.name}"


@lru_cache(maxsize=1)
def _catalog_entries() -> list[dict]:
    return json.loads(GPU_CATALOG_FILE.read_text())["gpus"]


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, Gpu]:
    """Every GPU by canonical name."""
    fields = set(Gpu.__dataclass_fields__)
    return {entry["name"]: Gpu(**{k: v for k, v in entry.items() if k in fields}) for entry in _catalog_entries()}


def power_points(gpu: Gpu) -> list[tuple[float, float, str]]:
    """(board watts, dense bf16 peak, the entries quoted there) of every catalog entry sharing `gpu`'s die, by watts:
    the evidence power_limited interpolates between (one point or none: a limit cannot be modelled)."""
    if not gpu.die or gpu.tdp_w <= 0:
        return []
    points: dict[tuple[float, float], list[str]] = {}
    for g in gpu_catalog().values():
        if g.die == gpu.die and g.tdp_w > 0 and g.bf16_tflops > 0:
            points.setdefault((g.tdp_w, g.bf16_tflops), []).append(g.name)
    return [(w, peak, ", ".join(names)) for (w, peak), names in sorted(points.items())]


def power_limited(gpu: Gpu, watts: float) -> Gpu:
    """The GPU run under a board power limit (`nvidia-smi -pl`): its compute peaks at the clock that limit sustains;
    memory bandwidth, capacity and links unchanged.

    NVIDIA quotes each product's dense tensor peak at the clock its TDP sustains under tensor load, below the boost
    clock (H100 SXM, 700 W: 989 TFLOP/s bf16 = 132 SMs x 4096 FLOP/clock at 1.83 GHz; H100 NVL, the same 132-SM die
    at 400 W: 835 TFLOP/s, 1.55 GHz). Catalog entries sharing a die give those (TDP, peak) points; the peak at
    `watts` is linear between the two points around it, and every peak (bf16, fp16, tf32, fp32) takes the same
    ratio to the TDP's. Refused (UserError, one line): a limit above the TDP, below the die's lowest datasheet point
    (no extrapolation: no evidence there), or on a GPU whose die has fewer than two points in the catalog.
    An assumption (sustained clock linear in board power between datasheet points), named in docs/ENGINE_FACTS.md."""
    check_number("power limit (W)", watts, bounds.POWER_LIMIT_W)
    points = power_points(gpu)
    if len(points) < 2:
        have = ", ".join(g.name for g in gpu_catalog().values() if len(power_points(g)) > 1)
        raise UserError(f"the GPU catalog has no board-power data for {gpu.name} (one datasheet point of its die or "
                        f"none), so power limit {watts:g} W cannot be modelled for it; drop the power limit (GPUs with "
                        f"that data: {have})")
    low, tdp = points[0][0], gpu.tdp_w
    give = f"give {low:g} W" if low == tdp else f"give {low:g} to {tdp:g} W"
    if watts > tdp:
        raise UserError(f"power limit {watts:g} W is above {gpu.name}'s {tdp:g} W board power (the TDP its datasheet "
                        f"peaks are quoted at); {give}, or no power limit")
    if watts < low:
        raise UserError(f"power limit {watts:g} W is below {low:g} W, the lowest board power with a datasheet peak "
                        f"for {gpu.name}'s die ({points[0][2]}), and the model does not extrapolate; {give}, or no "
                        "power limit")
    (w0, p0, _), (w1, p1, _) = next((a, b) for a, b in zip(points, points[1:]) if watts <= b[0])
    at_tdp = next(p for w, p, _ in points if w == tdp)
    ratio = (p0 + (p1 - p0) * (watts - w0) / (w1 - w0)) / at_tdp
    return replace(gpu, bf16_tflops=gpu.bf16_tflops * ratio, fp16_tflops=gpu.fp16_tflops * ratio,
                   fp32_tflops=gpu.fp32_tflops * ratio, tf32_tflops=gpu.tf32_tflops * ratio, power_limit_w=watts)


def power_fields(gpu: Gpu, precision: str) -> dict:
    """The power limit and the dense peak it leaves, for --json ({} without a limit)."""
    if not gpu.power_limit_w:
        return {}
    return {"watts": gpu.power_limit_w, "tdp_w": gpu.tdp_w, "precision": precision,
            "dense_peak_tflops": round(gpu.peak_tflops(precision), 1),
            "tdp_dense_peak_tflops": find_gpu(gpu.name).peak_tflops(precision), "source": power_source(gpu)}


def power_json(gpu: Gpu, precision: str) -> dict:
    """{"power_limit": power_fields(...)} for a --json object when a limit is set, else {}."""
    return {"power_limit": power_fields(gpu, precision)} if gpu.power_limit_w else {}


def power_words(gpu: Gpu, precision: str) -> str:
    """', 500 W power limit: 887 TFLOP/s dense bf16 peak (989 at the 700 W TDP)' when a limit is set, else ''."""
    f = power_fields(gpu, precision)
    return (f", {f['watts']:g} W power limit: {f['dense_peak_tflops']:.0f} TFLOP/s dense {precision} peak "
            f"({f['tdp_dense_peak_tflops']:.0f} at the {f['tdp_w']:g} W TDP)") if f else ""


def power_source(gpu: Gpu) -> str:
    """Where a power-limited peak comes from, for --explain and plan notes ('' without a limit)."""
    if not gpu.power_limit_w:
        return ""
    points = "; ".join(f"{w:g} W {p:g} TFLOP/s ({names})" for w, p, names in power_points(gpu))
    return (f"{gpu.power_limit_w:g} W power limit: tensor peaks scaled by the bf16 peak linear in board power between "
            f"the datasheet points of the {gpu.die} die ({points}); HBM bandwidth and links unchanged "
            "(toolkit.inputs.hardware.power_limited; real clocks under a cap are not linear in power)")


@lru_cache(maxsize=1)
def _alias_index() -> dict[str, str]:
    """Every name and alias (normalised) -> canonical name."""
    index: dict[str, str] = {}
    for entry in _catalog_entries():
        for alias in [entry["name"], *entry.get("aliases", [])]:
            index[_norm(alias)] = entry["name"]
    return index


def _norm(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower()).replace("-gb", "gb")


def find_gpu(name: str) -> Gpu:
    """The catalog entry `name` names exactly: its name or one of its aliases, case, spaces and underscores aside
    (`h100_80gb` is H100-SXM-80GB). Nothing is guessed from part of a name: a family several entries share (`A100`:
    40 and 80 GB; `H100`: SXM 80 / 96 GB, PCIe, NVL) is refused with the entries it could mean, and so is a shortening
    that names one entry by a prefix (`B200-SX`). The catalog's aliases are themselves never such a family
    (tests/test_catalog.py)."""
    key = _norm(name)
    from toolkit.inputs.cpudevice import CPU_NAME

    if key == CPU_NAME:
        return cpu_gpu()
    index = _alias_index()
    if key in index:
        return gpu_catalog()[index[key]]
    family = sorted({canonical for alias, canonical in index.items() if alias.startswith(key + "-")})
    if family:
        raise UserError(f"GPU '{name}' is ambiguous: the catalog has {', '.join(family)}; give one of them "
                        "(`toolkit gpus` lists them)" if len(family) > 1 else
                        f"GPU '{name}' is not a catalog name; did you mean {family[0]}? (`toolkit gpus` lists them)")
    known = ", ".join(sorted(gpu_catalog()))
    raise UserError(f"unknown GPU '{name}'; known GPUs: {known}")



def cpu_gpu() -> Gpu:
    """This machine's CPU processes as the step-time model's device (`--gpus 2xcpu`), from the rates measured
    here (toolkit.inputs.cpudevice)."""
    from toolkit.inputs.cpudevice import CPU_ARCHITECTURE, CPU_NAME, INTRA_GBPS, cpu_rates, host_memory_bytes

    r = cpu_rates()
    return Gpu(name=CPU_NAME, memory_bytes=host_memory_bytes(), bf16_tflops=r.bf16_tflops,
               fp16_tflops=r.fp16_tflops, fp32_tflops=r.fp32_tflops, tf32_tflops=0.0, hbm_gbps=r.copy_gbps,
               intra_node_gbps=INTRA_GBPS, pcie_gbps=r.copy_gbps, interconnect="gloo", bf16_supported=True,
               architecture=CPU_ARCHITECTURE,
               source=f"measured on {r.model} at {r.threads} thread{'s' if r.threads != 1 else ''}: torch.mm "
                      f"fp32 {r.fp32_tflops * 1e3:.1f} / bf16 {r.bf16_tflops * 1e3:.1f} / fp16 "
                      f"{r.fp16_tflops * 1e3:.1f} GFLOP/s, copy {r.copy_gbps:.1f} GB/s; gloo {INTRA_GBPS:g} GB/s "
                      "assumed (toolkit.inputs.cpudevice)")


_SPEC = re.compile(r"^\s*(?:(?P<nodes>-?\d+)\s*[x*]\s*)?(?:(?P<count>-?\d+)\s*[x*]\s*)?"
                   r"(?P<gpu>[A-Za-z][^\x00-\x1f]*?)\s*$")  # no control characters in the GPU name


def parse_hardware(spec: str, *, nodes: int | None = None, inter_node_gbps: float | None = None,
                   cpu_ram_gib: float | None = None, power_limit_w: float | None = None) -> Hardware:
    """`8xH100-80GB`, `2x8xA100-80GB`, `H200` (one GPU); `nodes` overrides the node count of a one-node spec;
    `power_limit_w` a board power limit per GPU, at most its TDP (power_limited)."""
    match = _SPEC.match(spec or "")
    if not match:
        raise UserError(f"cannot read GPU spec '{spec}'; write it like 8xH100-80GB or 2x8xA100-80GB")
    first, second = match.group("nodes"), match.group("count")
    if second is None:
        spec_nodes, count = 1, int(first) if first is not None else 1
    else:
        spec_nodes, count = int(first), int(second)
    if count <= 0 or spec_nodes <= 0:
        raise UserError(f"GPU spec '{spec}' has a zero or negative count; write it like 8xH100-80GB")
    check_number(f"GPU spec '{spec}': GPUs per node", count, bounds.GPUS_PER_NODE)
    check_number(f"GPU spec '{spec}': node count", spec_nodes, bounds.NODES)
    if nodes is not None:
        if nodes <= 0:
            raise UserError(f"--nodes must be positive, got {nodes}")
        if second is not None and nodes != spec_nodes:
            raise UserError(f"GPU spec '{spec}' says {spec_nodes} nodes but --nodes says {nodes}; give one of them")
        spec_nodes = nodes
    gpu = find_gpu(match.group("gpu"))
    if power_limit_w is not None:
        gpu = power_limited(gpu, float(power_limit_w))
    kwargs: dict = {}
    if inter_node_gbps is not None:
        kwargs["inter_node_gbps"] = float(inter_node_gbps)
    if cpu_ram_gib is not None:
        check_number("--cpu-ram-gib", float(cpu_ram_gib), bounds.CPU_RAM_GIB)
        kwargs["cpu_ram_bytes_per_node"] = int(float(cpu_ram_gib) * GIB)
    return Hardware(gpu=gpu, gpus_per_node=count, nodes=spec_nodes, **kwargs)
