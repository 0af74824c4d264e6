"""One GPU's memory for one strategy and job, as the memory model reports it (Breakdown, its named Terms), and the
bytes outside the tensors that every estimate adds: the CUDA context, the communicators' buffers and the caching
allocator's fallback margin. Kept apart from toolkit.estimate.memory, which computes them, so that the modules adding
to a breakdown (GRPO's generation) need not import the model that calls them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toolkit.estimate.devicememory import CUDA_CONTEXT_BYTES  # noqa: F401  (re-exported: the memory model's names)
from toolkit.estimate.hostram import HostRam
from toolkit.inputs.choices import GIB

ALLOCATOR_MARGIN = 0.05
"""Caching-allocator reserved over allocated, minus 1: only the fallback where the step's allocation events are not
recorded (regions traced compiled rather than eager, activation offloading, interpolations between traces whose events differ, pipeline stages with several
micro-batches in flight); elsewhere the step is replayed through the allocator model (toolkit.estimate.reserved).
Still assumed. The one published reserved/allocated pair of
a modelled job (accelerate benchmarks/fsdp2, Qwen2.5-1.5B FSDP2 on 8 x H100, seq 128: ~4350 MiB allocated, ~7050
MiB reserved, benchmarks/results/published.md) gives 1.62, but its allocated figure is sampled by a thread and misses
short peaks, and the absolute gap (2.6 GiB) is of the size of FSDP2's per-stream all-gather / reduce-scatter blocks
rather than a share of the peak; gpu_check.py measures both per engine on one GPU so the margin can be derived."""


def reserved_bytes(peak_bytes: int) -> int:
    """What torch.cuda.max_memory_reserved would report for a tensor peak: the caching allocator's segments, the
    peak plus ALLOCATOR_MARGIN (CUDA context and NCCL buffers are outside it)."""
    return int(peak_bytes * (1 + ALLOCATOR_MARGIN))


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "source": self.source}


@dataclass(frozen=True)
class Breakdown:
    """One GPU's memory for one strategy and job. All in bytes."""

    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    """Optimizer states and fp32 master weights."""
    activations_bytes: int
    """Saved for backward after forward + loss, all in-flight micro-batches (autocast weight copies excluded)."""
    logits_loss_bytes: int
    """Part of activations_bytes: what the final norm, LM head and loss keep (the fp32 log-softmax of the
    logits dominates for large vocabularies); 0 on pipeline stages without the head."""
    autocast_copy_bytes: int
    buffers_bytes: int
    """Engine buffers: DDP buckets, ZeRO reduce/prefetch buckets, ZeRO-3/FSDP2 gathered parameters."""
    transient_bytes: int
    """At the peak phase, what lives only in that phase (logits and their gradients, step temporaries)."""
    peak_bytes: int
    """Highest live tensor total over the step (what torch.cuda.max_memory_allocated would report)."""
    peak_phase: str
    context_bytes: int
    """Outside the caching allocator: the CUDA context + NCCL's buffers (nccl_bytes)."""
    margin_bytes: int
    """Reserved over allocated: what the allocator's segments hold that no tensor uses at the peak (fragmentation,
    segment rounding, per-stream pools)."""
    required_bytes: int
    """reserved + CUDA context + NCCL buffers: the nvidia-smi figure, what must fit in the GPU."""
    capacity_bytes: int
    cpu_bytes_per_node: int
    nvme_bytes_per_node: int
    terms: tuple[Term, ...] = ()
    notes: tuple[str, ...] = ()
    stage_required_bytes: tuple[int, ...] = ()
    """Pipeline plans: required bytes of every stage (the breakdown describes the largest)."""
    host: HostRam | None = None
    """Host RAM per node at load, during training and at save (toolkit.estimate.hostram)."""
    reference_bytes: int = 0
    """DPO / GRPO: the reference model's weights on this GPU (toolkit.estimate.preference), part of the peak."""
    reward_bytes: int = 0
    """GRPO with --reward-model: the reward model's weights on this GPU (toolkit.estimate.reward), part of the peak."""
    nccl_bytes: int = 0
    """Part of context_bytes: NCCL's communicator buffers (toolkit.estimate.devicememory)."""
    workspace_bytes: int = 0
    """Part of peak_bytes: torch's cuBLAS workspaces, allocated through the caching allocator."""
    allocator_conf: str = ""
    """PYTORCH_CUDA_ALLOC_CONF the reserved figure was replayed with ("" = torch's defaults)."""
    between_steps_bytes: int = 0
    """What stays allocated between optimizer steps, beside which a GRPO step generates: parameters, persistent
    gradient partitions, optimizer states and master weights, persistent engine buffers, the reference's weights (the
    step's own gradients are freed by the Trainer's zero_grad, set_to_none; ZeRO-3's and FSDP2's gathered parameters
    are partitioned again by the end of backward)."""
    gathered_bytes: int = 0
    """ZeRO-3's and FSDP2's parameters gathered during the step (within buffers_bytes): FSDP2's root and the layers it
    unshards at once, ZeRO-3's kept for reuse; 0 for other engines."""
    phase_peaks: tuple[tuple[str, int], ...] = ()
    """The live tensor total at each phase's own highest moment, in step order (the policy's forward, a reference's
    no_grad forward, backward, the optimizer step; GRPO's reward scoring and generation where the job has them),
    cuBLAS workspaces included as in peak_bytes, which is the largest of them."""
    generation_bytes: int = 0
    """GRPO generating in the training process (transformers' generate): the live total at generate's own peak, the
    bytes held between steps, ZeRO-3's / FSDP2's gathered parameters and generate's cache and temporaries
    (toolkit.estimate.grpo.with_generation), whether or not it is the step's peak; 0 for any other job."""
    refusal: str = ""
    """Why the job does not fit although required_bytes might (GRPO vLLM colocate: a share for vLLM too small for
    its weights, or training over the rest; toolkit.estimate.grpo), or empty."""
    vllm_window: tuple[float, float] | None = None
    """GRPO vLLM colocate: the vllm_gpu_memory_utilization (low, high) that holds vLLM's weights and one batch's KV
    cache and leaves training what it needs (low > high: no window on this GPU); None for any other job."""

    def phase_words(self) -> str:
        """phase_peaks as plan prints them: 'forward 30.12, backward 32.51 (peak), optimizer step 28.30' GiB."""
        return ", ".join(f"{name} {b / GIB:.2f}" + (" (peak)" if b == self.peak_bytes else "")
                         for name, b in self.phase_peaks)

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.capacity_bytes and not self.refusal

    @property
    def reserved_bytes(self) -> int:
        """What torch.cuda.max_memory_reserved would report: the tensor peak plus the allocator's overhead (replayed,
        or the assumed margin where the step's events are not recorded)."""
        return self.peak_bytes + self.margin_bytes

    @property
    def nvidia_smi_bytes(self) -> int:
        """What nvidia-smi shows for the process at the step's peak: reserved + CUDA context + NCCL buffers."""
        return self.reserved_bytes + self.context_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.required_bytes

    def to_dict(self) -> dict[str, Any]:
        keys = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "logits_loss_bytes",
                "autocast_copy_bytes", "buffers_bytes", "transient_bytes", "peak_bytes", "peak_phase",
                "context_bytes", "margin_bytes", "required_bytes", "capacity_bytes", "cpu_bytes_per_node",
                "nvme_bytes_per_node")
        out: dict[str, Any] = {k: getattr(self, k) for k in keys}
        out["reserved_bytes"] = self.reserved_bytes
        out["nvidia_smi_bytes"] = self.nvidia_smi_bytes
        out["nccl_bytes"] = self.nccl_bytes
        out["workspace_bytes"] = self.workspace_bytes
        out["allocator_conf"] = self.allocator_conf
        if self.reference_bytes:
            out["reference_bytes"] = self.reference_bytes
        if self.reward_bytes:
            out["reward_bytes"] = self.reward_bytes
        if self.refusal:
            out["refusal"] = self.refusal
        if self.stage_required_bytes:
            out["stage_required_bytes"] = list(self.stage_required_bytes)
        if self.host is not None:
            out["host_load_bytes_per_node"] = self.host.load_bytes_per_node
            out["host_save_bytes_per_node"] = self.host.save_bytes_per_node
            out["host_peak_bytes_per_node"] = self.host.peak_bytes_per_node
        return out
