"""Predicted vs measured on a real GPU: peak memory and throughput of single-device training steps.

Prepared for sessions that are lent a GPU (one H200): one short run, results written to $OUT (or
benchmarks/results/) as gpu_check.{json,md}. On CPU it runs the same code with --device cpu on tiny shapes
(a rehearsal of the script itself).

    python benchmarks/gpu_check.py --device cuda --out "$OUT"      # on the GPU machine, ~3-5 minutes
    python benchmarks/gpu_check.py --device cpu --quick             # rehearsal here

Measured: torch.cuda.max_memory_allocated over a steady-state step (forward, HF loss, backward, fused AdamW) and
the mean step time; predicted: the estimator with --device-kind cuda (GPU kernels' saved tensors) for the same
step on one GPU of this kind, and the step-time model's prediction. Ratios are predicted / measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# (label, arch shape overrides, precision, attention, checkpointing, micro-batch, seq)
CONFIGS = [
    ("llama-1b bf16 sdpa", "llama", dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192), "bf16", "sdpa", False, 4, 2048),
    ("llama-1b bf16 sdpa ckpt", "llama", dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192), "bf16", "sdpa", True, 8, 2048),
    ("llama-1b bf16-pure sdpa", "llama", dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192), "bf16-pure", "sdpa", False, 4, 2048),
    ("gpt2-medium bf16 eager", "gpt2", dict(hidden=1024, layers=24, heads=16, ffn=4096), "bf16", "eager", False, 4, 1024),
    ("gpt2-medium fp32 sdpa", "gpt2", dict(hidden=1024, layers=24, heads=16, ffn=4096), "fp32", "sdpa", False, 4, 1024),
    ("qwen2-0.5b bf16 sdpa", "qwen2", dict(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864), "bf16", "sdpa", False, 8, 1024),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU rehearsal)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--gpu", default="H200", help="catalog GPU for the step-time prediction")
    args = ap.parse_args()

    import torch

    from toolkit.hardware import parse_hardware
    from toolkit.job import Job
    from toolkit.modelspec import build_spec
    from toolkit.profile import measure_step, predict_step
    from toolkit.strategy import parse_strategy
    from toolkit.timing import step_time
    from toolkit.tiny import tiny_config

    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    rows = []
    for label, arch, shape, precision, attention, ckpt, b, s in CONFIGS:
        if args.quick:
            shape = {**shape, "hidden": 128, "layers": 2, "ffn": 256, "heads": 4,
                     **({"kv_heads": 2} if "kv_heads" in shape else {})}
            b, s = 2, 64
        config = tiny_config(arch, vocab_size=32000 if not args.quick else 1000, max_positions=max(s, 2048), **shape)
        kwargs = dict(seq_len=s, micro_batch=b, precision=precision, attention=attention, checkpointing=ckpt)
        start = time.perf_counter()
        try:
            measured = measure_step(config, device=args.device, steps=5, **kwargs)
        except Exception as exc:  # one failing config must not cost the whole lease
            rows.append({"label": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(label, "ERROR", exc, flush=True)
            if kind == "cuda":
                torch.cuda.empty_cache()
            continue
        predicted = predict_step(config, device_kind=kind, **kwargs)
        spec = build_spec(arch, config)
        job = Job(seq_len=s, micro_batch=b, precision=precision, attention=attention, checkpointing=ckpt,
                  device_kind=kind)
        timing = step_time(spec, parse_strategy("ddp"), job, parse_hardware(f"1x{args.gpu}"))
        row = {"label": label, **kwargs, "params": spec.params,
               "peak_measured": measured.peak_bytes, "peak_predicted": predicted["peak_bytes"],
               "act_measured": measured.activations_bytes, "act_predicted": predicted["activations_bytes"],
               "step_measured_s": measured.step_time_s, "step_predicted_s": timing.step_time_s,
               "peak_phase": predicted["peak_phase"]}
        row["peak_ratio"] = row["peak_predicted"] / row["peak_measured"]
        row["act_ratio"] = row["act_predicted"] / row["act_measured"]
        row["step_ratio"] = row["step_predicted_s"] / row["step_measured_s"]
        rows.append(row)
        print(f"{label}: peak {row['peak_ratio']:.3f}, activations {row['act_ratio']:.3f}, "
              f"step {row['step_ratio']:.2f} ({time.perf_counter() - start:.0f} s)", flush=True)
        if kind == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if kind == "cuda" else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "quick": args.quick}
    (out / "gpu_check.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# Predicted / measured on {meta['device']} ({meta['date']}, torch {meta['torch']})", "",
             "| config | b | seq | peak ratio | activations ratio | step-time ratio | peak phase |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | | | error: {r['error']} | | | |")
        else:
            lines.append(f"| {r['label']} | {r['micro_batch']} | {r['seq_len']} | {r['peak_ratio']:.3f} | "
                         f"{r['act_ratio']:.3f} | {r['step_ratio']:.2f} | {r['peak_phase']} |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


# QLoRA: (label, arch, shape, seq, micro-batch, checkpointing). Separate from CONFIGS and main(): run with --qlora.
QLORA_CONFIGS = [
    ("llama-1b qlora nf4 r16 all-linear", "llama", dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192), 2048, 2, False),
    ("llama-1b qlora nf4 r16 all-linear ckpt", "llama", dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192), 2048, 4, True),
]


def qlora_check(device: str, quick: bool, out_dir: str) -> int:
    """QLoRA on one device: the 4-bit base's allocated bytes after loading and the peak of a steady-state step
    (bf16 autocast, fused AdamW over the adapters), against toolkit's estimate (DDP, one GPU). Random weights are
    saved to a temporary folder and loaded back through transformers' BitsAndBytesConfig, as a real run loads them."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.hardware import parse_hardware
    from toolkit.job import Job
    from toolkit.lora import Adapter, counts_for_spec, frozen_base_bytes
    from toolkit.memory import estimate_memory
    from toolkit.modelspec import build_spec
    from toolkit.strategy import parse_strategy
    from toolkit.tiny import tiny_config
    from toolkit.train.adapters import quantization_config, wrap_model

    kind = "cuda" if device.startswith("cuda") else "cpu"
    adapter = Adapter(method="qlora", r=16, alpha=32, dropout=0.05, targets="all-linear")
    rows = []
    for label, arch, shape, s, b, ckpt in QLORA_CONFIGS:
        if quick:
            shape = {**shape, "hidden": 128, "layers": 2, "ffn": 256, "heads": 4, "kv_heads": 2}
            s, b = 64, 2
        config = tiny_config(arch, vocab_size=1000 if quick else 32000, max_positions=max(s, 2048), **shape)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
                if kind == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                model = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=quantization_config(adapter),
                                                             dtype=torch.bfloat16, device_map={"": device})
                loaded = (torch.cuda.memory_allocated() - before) if kind == "cuda" else \
                    sum(p.numel() * p.element_size() for p in model.parameters())
            model.config.use_cache = False
            if ckpt:
                model.activation_checkpointing_enable()
            model = wrap_model(model, adapter, checkpointing=ckpt)
            model.train()
            ids = torch.randint(0, config.vocab_size, (b, s), device=device)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                          fused=kind == "cuda")

            def step():
                with torch.autocast(device_type=kind, dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            step()
            if kind == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() if kind == "cuda" else 0
        except Exception as exc:  # one failing config must not cost the whole lease
            rows.append({"label": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(label, "ERROR", exc, flush=True)
            continue
        spec = build_spec(arch, config)
        job = Job(seq_len=s, micro_batch=b, precision="bf16", checkpointing=ckpt, device_kind=kind, adapter=adapter)
        predicted = estimate_memory(spec, parse_strategy("ddp"), job, parse_hardware("1xH200-141GB"))
        counts = counts_for_spec(spec, adapter)
        row = {"label": label, "seq_len": s, "micro_batch": b, "checkpointing": ckpt,
               "base_loaded_bytes": loaded, "base_predicted_bytes": frozen_base_bytes(counts, adapter, 2),
               "peak_measured": peak, "peak_predicted": predicted.peak_bytes, "step_s": elapsed,
               "trainable_params": counts.trainable_params}
        row["base_ratio"] = row["base_predicted_bytes"] / max(row["base_loaded_bytes"], 1)
        row["peak_ratio"] = row["peak_predicted"] / row["peak_measured"] if peak else None
        rows.append(row)
        print(label, row, flush=True)
        del model, optimizer
        if kind == "cuda":
            torch.cuda.empty_cache()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "qlora_check.json").write_text(json.dumps({"device": device, "quick": quick, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if "--qlora" in sys.argv:
        qlora_args = argparse.ArgumentParser()
        qlora_args.add_argument("--qlora", action="store_true")
        qlora_args.add_argument("--device", default="cuda")
        qlora_args.add_argument("--quick", action="store_true")
        qlora_args.add_argument("--out", default=str(Path(__file__).parent / "results"))
        a = qlora_args.parse_args()
        sys.exit(qlora_check(a.device, a.quick, a.out))
    sys.exit(main())
