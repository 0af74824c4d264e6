"""Estimator accuracy: predicted vs measured memory of a real single-process training step on this machine's CPU.

For each configuration a real model of the architecture (random weights) runs a steady-state step (forward with
HF's loss, backward, fused AdamW, as the Trainer path does); measured are the bytes held for backward after
forward + loss (live storages: saved tensors and what checkpoint recompute closures hold) and the peak of live tensor bytes (torch MemTracker). Predicted is
`toolkit estimate` with --device-kind cpu (the CPU kernels' saved tensors) for the same step. Ratios are
predicted / measured, all from one run.

    python benchmarks/accuracy.py            # writes benchmarks/results/accuracy.{md,json}
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

from provenance import meta as provenance_meta
from toolkit.estimate.profile import measure_step, predict_step
from toolkit.run.tiny import tiny_config

# (architecture, precision, attention, checkpointing, micro-batch, seq, shape)
CONFIGS = [
    ("gpt2", "fp32", "eager", False, 2, 256, dict(hidden=256, layers=4, heads=4, ffn=1024)),
    ("gpt2", "bf16", "sdpa", False, 4, 128, dict(hidden=256, layers=4, heads=4, ffn=1024)),
    ("gpt2", "bf16-pure", "sdpa", True, 2, 256, dict(hidden=256, layers=4, heads=4, ffn=1024)),
    ("llama", "fp32", "sdpa", False, 2, 256, dict(hidden=256, layers=4, heads=8, kv_heads=2, ffn=688)),
    ("llama", "bf16", "eager", False, 2, 256, dict(hidden=256, layers=4, heads=8, kv_heads=2, ffn=688)),
    ("llama", "bf16", "sdpa", True, 4, 256, dict(hidden=256, layers=4, heads=8, kv_heads=2, ffn=688)),
    ("llama", "bf16-pure", "sdpa", False, 1, 512, dict(hidden=256, layers=4, heads=8, kv_heads=2, ffn=688)),
    ("qwen2", "bf16", "sdpa", False, 2, 256, dict(hidden=256, layers=4, heads=8, kv_heads=2, ffn=688)),
    ("mistral", "bf16-pure", "eager", True, 2, 256, dict(hidden=256, layers=4, heads=8, kv_heads=2, ffn=688)),
    ("opt", "fp32", "sdpa", False, 2, 256, dict(hidden=256, layers=4, heads=4, ffn=1024)),
    ("opt", "bf16", "eager", True, 2, 256, dict(hidden=256, layers=4, heads=4, ffn=1024)),
    ("gemma2", "bf16", "eager", False, 2, 256, dict(hidden=256, layers=4, heads=4, kv_heads=2, ffn=688)),
    ("gemma2", "bf16-pure", "eager", True, 2, 256, dict(hidden=256, layers=4, heads=4, kv_heads=2, ffn=688)),
    ("llama", "fp32", "eager", False, 3, 384, dict(hidden=192, layers=3, heads=6, kv_heads=3, ffn=512)),
]

# Architectures with no tiny preset and no special case anywhere in toolkit: plain transformers configs.
_HF = dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256, vocab_size=4000)
HF_CONFIGS = [
    ("deepseek_v3", "bf16", "eager", False, 2, 128, dict(moe_intermediate_size=64, n_routed_experts=4,
     num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
     v_head_dim=32, first_k_dense_replace=1, n_group=1, topk_group=1, num_key_value_heads=4)),
    ("bloom", "fp32", "eager", True, 2, 128, dict(n_layer=3, n_head=4)),
    ("gptj", "bf16", "eager", False, 2, 128, dict(n_embd=128, n_layer=3, n_head=4, rotary_dim=16)),
    ("gemma3_text", "fp32", "eager", True, 2, 128, dict(num_key_value_heads=2, head_dim=32)),
    ("phi", "bf16", "sdpa", False, 2, 128, {}),
    ("falcon", "fp32", "sdpa", True, 2, 128, {}),
]


def main() -> int:
    torch.set_num_threads(1)
    from transformers import AutoConfig

    rows = []
    configs = [(a, p, at, c, b, s, tiny_config(a, vocab_size=4000, max_positions=1024, **shape))
               for a, p, at, c, b, s, shape in CONFIGS]
    configs += [(a, p, at, c, b, s, AutoConfig.for_model(a, **{**_HF, **extra}))
                for a, p, at, c, b, s, extra in HF_CONFIGS]
    for arch, precision, attention, ckpt, b, s, config in configs:
        kwargs = dict(seq_len=s, micro_batch=b, precision=precision, attention=attention, checkpointing=ckpt)
        start = time.perf_counter()
        measured = measure_step(config, steps=1, **kwargs)
        predicted = predict_step(config, device_kind="cpu", **kwargs)
        row = {"arch": arch, "precision": precision, "attention": attention, "checkpointing": ckpt,
               "micro_batch": b, "seq": s, "params": predicted["params"],
               "act_measured": measured.activations_bytes, "act_predicted": predicted["activations_bytes"],
               "peak_measured": measured.peak_bytes, "peak_predicted": predicted["peak_bytes"],
               "peak_phase": predicted["peak_phase"]}
        row["act_ratio"] = row["act_predicted"] / row["act_measured"]
        row["peak_ratio"] = row["peak_predicted"] / row["peak_measured"]
        rows.append(row)
        print(f"{arch:12}{precision:10}{attention:6}{'ckpt' if ckpt else '    '} b{b} s{s}: activations "
              f"{row['act_ratio']:.4f}, peak {row['peak_ratio']:.4f} ({time.perf_counter() - start:.0f} s)",
              flush=True)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            **provenance_meta()}
    (out / "accuracy.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = ["# Estimator accuracy: predicted / measured on real CPU tensors", "",
             f"One run, {meta['date']}, torch {meta['torch']}, {meta['machine']}. Produced by "
             "`python benchmarks/accuracy.py`. Measured: bytes held for backward once forward and loss are done "
             "(every storage still alive, by storage: saved tensors and checkpoint closures; autocast weight copies "
             "excluded) and the peak of live tensor bytes over a steady-state step (forward, HF loss, backward, fused AdamW; "
             "torch MemTracker). Predicted: `toolkit estimate --device-kind cpu --strategy ddp` on one device. The last "
             f"{len(HF_CONFIGS)} rows are architectures with no preset or special case in toolkit.", "",
             "| arch | precision | attention | ckpt | b | seq | params | activations MiB (pred / meas) | ratio | "
             "peak MiB (pred / meas) | ratio | peak phase |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['arch']} | {r['precision']} | {r['attention']} | {'yes' if r['checkpointing'] else 'no'} "
                     f"| {r['micro_batch']} | {r['seq']} | {r['params']:,} | {r['act_predicted'] / 2**20:.2f} / "
                     f"{r['act_measured'] / 2**20:.2f} | {r['act_ratio']:.4f} | {r['peak_predicted'] / 2**20:.2f} / "
                     f"{r['peak_measured'] / 2**20:.2f} | {r['peak_ratio']:.4f} | {r['peak_phase']} |")
    worst_act = max(abs(r["act_ratio"] - 1) for r in rows)
    worst_peak = max(abs(r["peak_ratio"] - 1) for r in rows)
    lines += ["", f"Worst activation error {worst_act:.2%}; worst peak error {worst_peak:.2%} "
              f"over {len(rows)} configurations.", ""]
    (out / "accuracy.md").write_text("\n".join(lines))
    print(f"worst activations {worst_act:.2%}, worst peak {worst_peak:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
