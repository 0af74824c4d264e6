"""What a training process holds on its GPU besides the step's tensors, term by term, each from its source
(docs/ENGINE_FACTS.md, "What nvidia-smi shows"):

  nvidia-smi = reserved (the caching allocator's segments, cuBLAS's workspaces among them)
             + CUDA context (driver, lazily loaded kernels)
             + NCCL's own buffers (cudaMalloc'd by NCCL, outside torch's allocator)

The planner judges "fits" on this figure against the GPU's memory: a process OOMs when the allocator cannot
reserve a new segment, and the context and NCCL's buffers already hold their share of the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.inputs.choices import GIB

MIB = 1 << 20

CUDA_CONTEXT_BYTES = int(0.75 * GIB)
"""CUDA context of a training process with lazy module loading (torch sets CUDA_MODULE_LOADING=LAZY unless the user
set it, since torch 1.13, pytorch#86509): the driver's own structures plus the kernels the step has loaded (cuBLAS,
attention, NCCL, elementwise). Published bare contexts with lazy loading are 256 MiB (RTX 3090, torch 2.7 cu128,
invoke-ai/InvokeAI#9413) to 426 MiB (RTX 6000 Ada, torch 2.10 cu130, unslothai/unsloth-zoo#1053), ~300-400 MB
(ptrblck, pytorch#107667, #109888); eager loading added 380 MB in torch's own test (pytorch#86509: 287 vs 667 MB).
No published reading separates a training step's context by GPU generation, so one figure serves every GPU until
benchmarks/gpu_check.py measures one (cudaMemGetInfo minus reserved) and it is written to that GPU's
`cuda_context_bytes` in toolkit/catalog/gpus.json, which then wins."""

CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
"""torch's default cuBLAS workspace before Hopper, CUBLAS_WORKSPACE_CONFIG ':4096:2:16:8' (8.1 MiB;
aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize)."""
CUBLAS_WORKSPACE_BYTES_SM90 = 4096 * 8 * 1024
"""The same default on compute capability 9.x and later (Hopper, Blackwell): 32 MiB."""
HIPBLAS_WORKSPACE_BYTES = 32 * MIB
"""ROCm's default (HIPBLAS_WORKSPACE_CONFIG): 32 MiB, 128 MiB on gfx942 and later (MI300X)."""
HIPBLAS_WORKSPACE_BYTES_GFX942 = 128 * MIB
CUBLAS_HANDLES = 2
"""Workspaces a step keeps: torch caches one per (cuBLAS handle, stream) and hands handles out per thread; forward
and the optimizer step run on the main thread, backward on autograd's device thread (its own handle), all on the
compute stream. The cuBLASLt workspace is the same buffer (TORCH_CUBLASLT_UNIFIED_WORKSPACE, default on)."""

NCCL_BUFFSIZE = 1 << 22
"""NCCL_BUFFSIZE's default, the Simple protocol's buffer per connection (4 MiB; NCCL src/init.cc DEFAULT_BUFFSIZE,
docs: Environment Variables, NCCL_BUFFSIZE)."""
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8
"""LL128's buffer per connection: elements per thread x threads x NCCL_STEPS x 8 bytes (4.69 MiB; DEFAULT_LL128_BUFFSIZE)."""
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16
"""LL's buffer per connection: lines per thread x threads x NCCL_STEPS x 16-byte lines (512 KiB; DEFAULT_LL_BUFFSIZE)."""
NCCL_PEERS = 2
"""Receive connections a rank has per channel: its ring predecessor and its tree (chain) neighbour."""
NCCL_CHANNELS = {"nvlink": 16, "xgmi": 16, "pcie": 4}
"""Channels NCCL opens per communicator, by the GPUs' link (an assumption: NCCL picks them from the topology it
detects, up to NCCL_MAX_NCHANNELS 32; NCCL_DEBUG=INFO prints the count). NVLink SHARP (NVLS) buffers on NVSwitch
systems are not counted (NCCL_NVLS_ENABLE=0 turns them off)."""


@dataclass(frozen=True)
class DeviceTerms:
    """The bytes outside the step's tensors, with their sources."""

    context_bytes: int
    context_source: str
    nccl_bytes: int
    nccl_source: str
    workspace_bytes: int
    workspace_source: str


def cuda_context_bytes(gpu) -> tuple[int, str]:
    measured = getattr(gpu, "cuda_context_bytes", 0)
    if measured:
        return measured, f"measured on {gpu.name} (toolkit/catalog/gpus.json cuda_context_bytes)"
    return CUDA_CONTEXT_BYTES, ("assumed: driver + lazily loaded kernels of a training step (CUDA_MODULE_LOADING=LAZY, "
                                "torch's default); no per-GPU reading yet (docs/ENGINE_FACTS.md)")


def cublas_workspace_bytes(gpu) -> tuple[int, str]:
    """torch's cuBLAS (hipBLAS) workspaces of a training step, allocated through the caching allocator."""
    arch = gpu.architecture
    if arch.startswith("cdna"):
        each = HIPBLAS_WORKSPACE_BYTES_GFX942 if arch >= "cdna3" else HIPBLAS_WORKSPACE_BYTES
        rule = "hipBLAS default (128 MiB on gfx942+)" if arch >= "cdna3" else "hipBLAS default"
    elif arch in ("hopper", "blackwell"):
        each, rule = CUBLAS_WORKSPACE_BYTES_SM90, "compute capability 9+: 32 MiB"
    else:
        each, rule = CUBLAS_WORKSPACE_BYTES, "before Hopper: ':4096:2:16:8' = 8.1 MiB"
    return CUBLAS_HANDLES * each, (f"{CUBLAS_HANDLES} cuBLAS handles (main thread, autograd's backward thread) x "
                                   f"{each / MIB:.1f} MiB ({rule}; CublasHandlePool.cpp), in the caching allocator")


def communicators(grid) -> int:
    """NCCL communicators a rank joins: one per process group of more than one rank that runs collectives (data
    parallel shard / replicate, tensor, context, sequence, expert, pipeline neighbours), plus the default group
    over the world when it is none of them (accelerate's barriers run on it)."""
    if grid is None or grid.world <= 1:
        return 0
    degrees = [d for d in (grid.dp_shard, grid.dp_replicate, grid.tensor, grid.context, grid.sequence, grid.expert,
                           grid.pipeline_stages) if d > 1]
    return len(degrees) + (0 if grid.world in degrees else 1)


def nccl_buffer_bytes(gpu, grid) -> tuple[int, str]:
    n = communicators(grid)
    if n == 0:
        return 0, "one process: no communicator"
    link = next((k for k in NCCL_CHANNELS if gpu.interconnect.startswith(k)), "pcie")
    channels = NCCL_CHANNELS[link]
    per_connection = NCCL_BUFFSIZE + NCCL_LL128_BUFFSIZE + NCCL_LL_BUFFSIZE
    total = n * channels * NCCL_PEERS * per_connection
    return total, (f"{n} communicator(s) x {channels} channels ({link}, assumed) x {NCCL_PEERS} peers x "
                   f"{per_connection / MIB:.2f} MiB (Simple 4 + LL128 4.69 + LL 0.5 MiB, NCCL's defaults); "
                   "NVLS buffers not counted")


def device_terms(gpu, grid) -> DeviceTerms:
    context, context_source = cuda_context_bytes(gpu)
    nccl, nccl_source = nccl_buffer_bytes(gpu, grid)
    workspace, workspace_source = cublas_workspace_bytes(gpu)
    return DeviceTerms(context, context_source, nccl, nccl_source, workspace, workspace_source)
