"""Workarounds that let the GPU engines run on a machine with no GPU (gloo), measured (docs/ENGINE_FACTS.md).

Only the training entry calls these; on a GPU machine every function here is a no-op.
"""

from __future__ import annotations

import os
import sys


def exit_process(code: int) -> None:
    """Leave the process with `code`, tearing down the process group first.

    ZeRO-3 runs sometimes abort at interpreter exit after finishing ("terminate called without an active
    exception", 3 of 12 runs); destroying the group and leaving with os._exit gave 0 of 8 (docs/ENGINE_FACTS.md).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # tearing down must never mask the run's own exit code
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def configure_cpu_state(engine: str, *, sequence_parallel: bool = False):
    """Create accelerate's shared state over gloo the way each engine needs it on a machine without a GPU.

    Call before TrainingArguments and pass it `accelerator_config={"use_configured_state": True}`; returns the
    PartialState. `sequence_parallel`: the run has a DeepSpeed Ulysses SP degree above 1 (contiguous_sequence_shards).
    What each engine needs (measured, docs/ENGINE_FACTS.md "Running the engines without a GPU"):
    - ddp: the CPU flag, which gives MULTI_CPU over gloo (the launcher's multi-GPU flag alone would start
      unsynchronised trainings).
    - deepspeed: `backend="gloo"` with ACCELERATE_USE_DEEPSPEED (set by `accelerate launch` with a DeepSpeed
      config); without it accelerate finds no backend and DeepSpeed's batch assertion fails.
    - fsdp2: gloo, then tell the state it is multi-device; otherwise accelerate silently skips FSDP on CPU.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and engine != "deepspeed":
        return PartialState(cpu=True)  # one process: nothing to communicate (accelerate refuses a backend here)
    if engine == "ddp":
        return PartialState(cpu=True, backend="gloo")
    if engine == "deepspeed":
        os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
        if sequence_parallel:
            contiguous_sequence_shards()
        return PartialState(backend="gloo")
    if engine == "fsdp2":
        state = PartialState(backend="gloo")
        if state.num_processes > 1:
            state.distributed_type = DistributedType.MULTI_GPU
        return state
    raise ValueError(f"no CPU state for engine {engine!r}")


def contiguous_sequence_shards() -> None:
    """Make DeepSpeed's Ulysses data-loader adapter hand out each sequence shard as its own tensor, as it does on a GPU.

    UlyssesSPDataLoaderAdapter.refill cuts every batch as `batch[k][:, chunk * rank:chunk * (rank + 1)].cpu()`: on
    a GPU `.cpu()` copies the slice into a new contiguous tensor, on a CPU it returns the slice itself, a view whose
    rows are a whole sequence apart. At a micro-batch above 1 the causal-LM loss's `shift_labels.view(-1)` then
    fails (docs/ENGINE_FACTS.md "Ulysses SP at a micro-batch above 1 on CPU"). Idempotent."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    original = UlyssesSPDataLoaderAdapter.__next__
    if getattr(original, "toolkit_contiguous", False):
        return

    def __next__(self):
        batch = original(self)
        return {k: v.contiguous() if torch.is_tensor(v) else v for k, v in batch.items()}

    __next__.toolkit_contiguous = True
    UlyssesSPDataLoaderAdapter.__next__ = __next__


def unpinned_offload(accelerator) -> str | None:
    """FSDP2's CPUOffloadPolicy without a GPU: accelerate builds it with pin_memory=True (fsdp_offload_params: true),
    and pinning host memory needs an accelerator (`fully_shard` raises "Cannot access accelerator device when none
    is available."). The same policy unpinned trains over gloo (docs/ENGINE_FACTS.md); pinning only changes how the
    host-device copies run, which a CPU run does not have. Returns the note to print, or None when nothing changed."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    offload = getattr(plugin, "cpu_offload", None)
    if not on_cpu() or type(offload).__name__ != "CPUOffloadPolicy" or not offload.pin_memory:
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    return ("FSDP2 CPU offload on CPU: CPUOffloadPolicy(pin_memory=False) (pinned host memory needs a GPU; the plan's "
            "YAML keeps accelerate's pinned default for the GPUs)")



def unpacked_4bit(*models) -> str | None:
    """QLoRA without a GPU: bitsandbytes' Linear4bit, on a CPU with AVX512-BF16, repacks its weight for a CPU kernel
    the first time it runs without grad (the evaluation), and that repack asserts 32-row blocks
    ("N must be divisible by block_n"), and its inverse at save asserts uint8 storage, which a bf16
    quant_storage (QLoRA under ZeRO-3 / FSDP) is not (bitsandbytes/nn/modules.py Linear4bit.forward and
    _save_to_state_dict). Each layer is told the CPU has no such kernel, so evaluation runs the same dequantising
    matmul as training. Returns the note to print, or None when nothing changed."""
    if not on_cpu():
        return None
    changed = 0
    for model in models:
        for module in model.modules() if model is not None else ():
            if getattr(module, "support_avx512bf16_for_cpu", False):
                module.support_avx512bf16_for_cpu = False
                changed += 1
    return (f"QLoRA on CPU: bitsandbytes' packed CPU kernel off in {changed} 4-bit layers (evaluation dequantises "
            "as training does)") if changed else None


def peak_memory_bytes() -> int:
    """This process's peak memory: allocated device memory on a GPU, else the RSS high-water mark."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import resource

    # ru_maxrss is KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)
