"""LoRA / QLoRA estimates for Llama-2-7B, Llama-3-8B and Llama-3-70B beside what peers publish for the same jobs.

    python benchmarks/lora.py     # writes benchmarks/results/lora.md

Peers (all published numbers, none re-measured here):
- LLaMA-Factory README, "Hardware Requirement" table (github.com/hiyouga/LLaMA-Factory, marked "estimated"; no
  sequence length, rank or batch stated): LoRA 16-bit 7B 16 GB, 70B 160 GB; QLoRA 4-bit 7B 6 GB, 70B 48 GB.
- Unsloth benchmarks (docs.unsloth.ai/basics/unsloth-benchmarks, unsloth.ai/blog/llama3-3): 4-bit QLoRA on all
  linear layers, rank 32, batch 1, longest sequence that fits with Hugging Face + Flash Attention 2 (the
  "Hugging Face + FA2" column: their baseline, i.e. what transformers + PEFT + bitsandbytes do): Llama 3.1 8B
  16 GB 2,551, 24 GB 5,789, 48 GB 15,502, 80 GB 28,454 tokens; Llama 3.3 70B on an 80 GB A100 6,916 tokens,
  48 GB OOM.
- Answer.AI FSDP + QLoRA (answer.ai/posts/2024-03-06-fsdp-qlora): Llama-2-70B trains on two 24 GB GPUs with FSDP,
  4-bit weights stored in a float dtype, gradient checkpointing, CPU offload and Flash Attention 2.
Ours come from the same code `toolkit estimate --method lora|qlora` runs (GPU kernels, bf16). GB here = 10^9
bytes where peers say GB; our required bytes are printed in both GB and GiB.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from toolkit.inputs.hardware import parse_hardware
from toolkit.inputs.job import Job
from toolkit.inputs.lora import Adapter, counts_for_spec
from toolkit.estimate.memory import estimate_memory
from toolkit.inputs.modelspec import resolve_model
from toolkit.inputs.strategy import parse_strategy

GB = 1e9
GIB = 2**30


def _estimate(model: str, gpus: str, strategy: str, seq: int, adapter: Adapter, *, checkpointing: bool = True,
              attention: str = "flash_attention_2"):
    spec = resolve_model(model)
    job = Job(seq_len=seq, micro_batch=1, precision="bf16", checkpointing=checkpointing, attention=attention,
              adapter=adapter)
    return spec, estimate_memory(spec, parse_strategy(strategy), job, parse_hardware(gpus))


def _longest_fit(model: str, gpus: str, adapter: Adapter, limit: int) -> int:
    """Longest sequence (multiple of 128) whose required bytes fit the GPU: bisection on the estimate."""
    lo, hi = 0, limit // 128
    while lo < hi:
        mid = (lo + hi + 1) // 2
        _, b = _estimate(model, gpus, "ddp", mid * 128, adapter)
        lo, hi = (mid, hi) if b.fits else (lo, mid - 1)
    return lo * 128


def main() -> int:
    lora16 = Adapter(method="lora", r=16, alpha=32, dropout=0.05, targets="all-linear")
    qlora16 = replace(lora16, method="qlora")
    qlora32 = Adapter(method="qlora", r=32, alpha=32, dropout=0.0, targets="all-linear")
    lines = ["# LoRA / QLoRA: our estimates beside the peers' published numbers", "",
             f"{time.strftime('%Y-%m-%d')}, `python benchmarks/lora.py`. bf16 compute, AdamW over the adapters, "
             "micro-batch 1, activation checkpointing, Flash Attention 2 footprint, one GPU (DDP) unless stated. "
             "'required' = tensor peak + CUDA context + allocator margin (toolkit/estimate/memory.py). Peers' sources are in "
             "the docstring of benchmarks/lora.py.", ""]

    lines += ["## Trainable parameters (PEFT on the meta device)", "",
              "| model | targets | r | trainable | all params (PEFT) | QLoRA frozen base (4-bit + constants; rest bf16) |",
              "|---|---|---:|---:|---:|---:|"]
    for model in ("llama-2-7b", "llama-3-8b", "llama-3-70b"):
        spec = resolve_model(model)
        for adapter in (qlora16, replace(qlora16, targets="q_proj,v_proj")):
            c = counts_for_spec(spec, adapter)
            lines.append(f"| {model} | {adapter.targets} | {adapter.r} | {c.trainable_params:,} | "
                         f"{c.all_params:,} | {(c.quantized_bytes + c.unquantized_frozen_params * 2) / GB:.2f} GB |")

    lines += ["", "## Fixed jobs: required memory per GPU", "",
              "| model | method | seq | strategy on GPUs | ours required | ours GiB | fits | peer says |",
              "|---|---|---:|---|---:|---:|---|---|"]
    jobs = [
        ("llama-2-7b", lora16, 2048, "ddp", "1xA100-80GB", "LLaMA-Factory LoRA 7B: 16 GB"),
        ("llama-2-7b", qlora16, 2048, "ddp", "1xA100-80GB", "LLaMA-Factory QLoRA-4 7B: 6 GB"),
        ("llama-3-8b", lora16, 2048, "ddp", "1xA100-80GB", "Unsloth blog: community LoRA bf16 Llama 3 8B 'only used 16GB'"),
        ("llama-3-8b", qlora16, 2048, "ddp", "1xA100-80GB", "LLaMA-Factory QLoRA-4 7B: 6 GB (8B not listed)"),
        ("llama-3-70b", lora16, 2048, "zero3", "4xH100-80GB", "LLaMA-Factory LoRA 70B: 160 GB (in all)"),
        ("llama-3-70b", qlora16, 2048, "ddp", "1xA100-80GB", "LLaMA-Factory QLoRA-4 70B: 48 GB"),
        ("llama-3-70b", replace(qlora16, quant_storage="bfloat16"), 2048, "fsdp2", "2xRTX-4090",
         "Answer.AI: 70B QLoRA on 2 x 24 GB with FSDP (+ CPU offload)"),
        ("llama-3-70b", qlora16, 2048, "fsdp2", "2xRTX-4090", "same job, 4-bit stored as uint8 (not sharded)"),
    ]
    for model, adapter, seq, strategy, gpus, peer in jobs:
        _, b = _estimate(model, gpus, strategy, seq, adapter)
        n = parse_hardware(gpus).world_size
        total = f" ({b.required_bytes * n / GB:.0f} GB in all)" if n > 1 else ""
        lines.append(f"| {model} | {adapter.method} r{adapter.r} | {seq} | {strategy} on {gpus} | "
                     f"{b.required_bytes / GB:.1f} GB{total} | {b.required_bytes / GIB:.2f} | "
                     f"{'yes' if b.fits else 'no'} | {peer} |")
        print(lines[-1], flush=True)

    lines += ["", "## Longest sequence that fits (QLoRA r=32, all linear layers, batch 1)", "",
              "| model | GPU | ours | Unsloth's 'Hugging Face + FA2' |", "|---|---|---:|---:|"]
    # V100-16GB stands for a 16 GB card by its capacity only (it has no bf16).
    for model, gpus, peer in (("llama-3.1-8b", "1xV100-16GB", "2,551 (16 GB)"),
                              ("llama-3.1-8b", "1xRTX-4090", "5,789 (24 GB)"),
                              ("llama-3.1-8b", "1xA100-80GB", "28,454 (80 GB)"),
                              ("llama-3.1-70b", "1xA100-80GB", "6,916 (80 GB A100)")):
        try:
            longest = _longest_fit(model, gpus, qlora32, 65536)
        except Exception as exc:  # a GPU name missing from the catalog: say so, do not stop the report
            lines.append(f"| {model} | {gpus} | ({type(exc).__name__}: {exc}) | {peer} |")
            continue
        lines.append(f"| {model} | {gpus} | {longest:,} | {peer} |")
        print(lines[-1], flush=True)

    lines += ["", "## Step time: full, LoRA and QLoRA on the same job (toolkit/estimate/timing.py)", "",
              "Same job, DDP on one GPU, micro-batch 1 x accumulation 8, checkpointing, r=16 on all linear layers. "
              "LoRA's extra passes (lora_overhead_s) and QLoRA's 4-bit dequantisation (dequant_s) are named terms "
              "of the step; their bandwidth efficiencies are assumed, not measured (no GPU in the session that "
              "wrote them). No peer publishes step times for these exact jobs that we could verify; the "
              "published speeds beside them are still to be recorded.", "",
              "| model | GPU | seq | method | step s | compute s | LoRA extra s | dequant s | QLoRA / LoRA |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    from toolkit.estimate.timing import step_time

    for model, gpus, seq in (("llama-2-7b", "1xA100-80GB", 512), ("llama-3-8b", "1xRTX-4090", 2048)):
        spec, hw = resolve_model(model), parse_hardware(gpus)
        steps = {}
        for method in ("full", "lora", "qlora"):
            adapter = Adapter(method=method) if method != "full" else Adapter()
            job = Job(seq_len=seq, micro_batch=1, grad_accum=8, precision="bf16", checkpointing=True,
                      attention="flash_attention_2", adapter=adapter)
            timing = step_time(spec, parse_strategy("ddp"), job, hw)
            steps[method] = timing.step_time_s
            ratio = f"{steps['qlora'] / steps['lora']:.2f}" if method == "qlora" else ""
            lines.append(f"| {model} | {gpus} | {seq} | {method} | {timing.step_time_s:.2f} | {timing.compute_s:.2f} "
                         f"| {timing.lora_overhead_s:.2f} | {timing.dequant_s:.2f} | {ratio} |")
            print(lines[-1], flush=True)

    lines += ["", "## Reading the comparison", "",
              "- LLaMA-Factory's table gives one number per model size with no sequence length or rank; ours depend "
              "on both, and at seq 2048 with checkpointing they land near its LoRA / QLoRA rows for 7B.",
              "- Unsloth's baseline column is the longest padded sequence HF + FA2 ran; ours is the longest our "
              "estimate says fits. A baseline that keeps the non-quantised weights (embeddings, LM head, norms) in "
              "fp32, as peft.prepare_model_for_kbit_training does, holds ~2.1 GB more for Llama 3.1 8B than our "
              "toolkit.train (which leaves them in bf16), and fits shorter sequences.",
              "- Longest sequences: ours are 1.3-1.8x Unsloth's HF + FA2 baseline. Not measured here (this session had no "
              "GPU; benchmarks/gpu_check.py --qlora is the check to run). Known differences: the baseline's recipe "
              "(if it calls peft.prepare_model_for_kbit_training, embeddings, LM head and norms are upcast to fp32; "
              "the page does not state the optimizer or checkpointing) and padding to the length; our activations "
              "are traced "
              "and within 3% of real tensors on CPU (tests/test_lora.py), the CUDA context and allocator margin "
              "are assumed (toolkit/estimate/memory.py).",
              "- Answer.AI's 70B on 2 x 24 GB also offloads parameters to CPU; toolkit plans FSDP2 without CPU "
              "offload, so our estimate says it does not fit at seq 2048 without it.",
              "- FSDP2 with 4-bit weights stored as uint8: accelerate leaves them out of sharding (fsdp_utils.py), so "
              "each GPU holds the whole 4-bit base; store them in bf16 (--qlora-quant-storage bfloat16) to shard.",
              ""]
    out = Path(__file__).parent / "results" / "lora.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
