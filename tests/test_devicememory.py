"""What nvidia-smi shows beyond the caching allocator (toolkit.estimate.devicememory): the CUDA context, NCCL's
buffers and cuBLAS's workspaces, each from its source, and the estimate that adds them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from toolkit.estimate.devicememory import (CUDA_CONTEXT_BYTES, communicators, cublas_workspace_bytes,
                                           cuda_context_bytes, nccl_buffer_bytes)
from toolkit.estimate.memory import estimate_memory
from toolkit.inputs.grid import grid_of
from toolkit.inputs.hardware import find_gpu, parse_hardware
from toolkit.inputs.job import Job
from toolkit.inputs.strategy import parse_strategy

MIB = 1 << 20


def test_cublas_workspace_is_32_mib_per_handle_from_hopper_on_and_8_mib_before():
    """torch's default CUBLAS_WORKSPACE_CONFIG: ':4096:2:16:8' = 2 x 4096 KiB + 8 x 16 KiB before compute capability
    9, 4096 x 8 KiB from it; two handles (the main thread's and autograd's backward thread's)."""
    assert cublas_workspace_bytes(find_gpu("H100-80GB"))[0] == 2 * 32 * MIB == 67_108_864
    assert cublas_workspace_bytes(find_gpu("B200"))[0] == 67_108_864
    assert cublas_workspace_bytes(find_gpu("A100-80GB"))[0] == 2 * (8 * MIB + 128 * 1024) == 17_039_360
    assert cublas_workspace_bytes(find_gpu("MI300X"))[0] == 2 * 128 * MIB


def test_nccl_buffers_count_each_communicator_channel_and_peer():
    """NCCL's default per-connection buffers: Simple 4 MiB + LL128 120 x 640 x 8 x 8 B + LL 8 x 512 x 8 x 16 B =
    9,633,792 B; a rank has 2 receive peers per channel, 16 channels over NVLink, 4 over PCIe."""
    h100, pcie = find_gpu("H100-80GB"), find_gpu("L40S")
    zero3 = parse_strategy("zero3")
    one_node = grid_of(zero3, parse_hardware("8xH100-80GB"))
    assert communicators(one_node) == 1
    assert nccl_buffer_bytes(h100, one_node)[0] == 16 * 2 * 9_633_792 == 308_281_344
    assert nccl_buffer_bytes(pcie, grid_of(zero3, parse_hardware("8xL40S")))[0] == 4 * 2 * 9_633_792
    assert nccl_buffer_bytes(h100, grid_of(zero3, parse_hardware("1xH100-80GB")))[0] == 0
    hsdp = grid_of(parse_strategy("fsdp2-hybrid"), parse_hardware("2x8xH100-80GB"))
    assert communicators(hsdp) == 3  # shard group, replicate group, and the world's default group


def test_a_measured_context_in_the_catalog_wins_over_the_assumed_one():
    h100 = find_gpu("H100-80GB")
    assert cuda_context_bytes(h100)[0] == CUDA_CONTEXT_BYTES
    assert cuda_context_bytes(replace(h100, cuda_context_bytes=600 * MIB))[0] == 600 * MIB


def test_required_is_the_nvidia_smi_figure_reserved_plus_context_plus_nccl(llama7b):
    """Allocated, reserved and nvidia-smi, one step's three readings: the workspaces are allocated (part of the
    peak), the allocator's overhead makes reserved, context and NCCL make nvidia-smi; fits is judged on the last."""
    b = estimate_memory(llama7b, parse_strategy("zero3"), Job(seq_len=2048), parse_hardware("8xH100-80GB"))
    assert b.workspace_bytes == 67_108_864 and b.nccl_bytes == 308_281_344
    assert b.context_bytes == CUDA_CONTEXT_BYTES + b.nccl_bytes
    assert b.reserved_bytes == b.peak_bytes + b.margin_bytes
    assert b.nvidia_smi_bytes == b.reserved_bytes + b.context_bytes == b.required_bytes
    assert b.fits == (b.nvidia_smi_bytes <= b.capacity_bytes)
    names = [t.name for t in b.terms]
    assert {"cuBLAS workspaces", "CUDA context", "NCCL buffers"} <= set(names)
    one = estimate_memory(llama7b, parse_strategy("zero3"), Job(seq_len=2048), parse_hardware("1xH100-80GB"))
    assert one.nccl_bytes == 0 and one.context_bytes == CUDA_CONTEXT_BYTES


def test_a_cpu_job_has_no_cublas_workspace(llama7b):
    b = estimate_memory(llama7b, parse_strategy("ddp"), Job(seq_len=256, device_kind="cpu"),
                        parse_hardware("1xH100-80GB"))
    assert b.workspace_bytes == 0


@pytest.fixture(scope="module")
def llama7b():
    from toolkit.inputs.modelspec import resolve_model

    return resolve_model("llama-2-7b")
