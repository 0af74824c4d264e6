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

# Image-text classes (issue 31), tiny, from the real checkpoints' configs (tests/arch_configs): the text tokens and
# `images` images of `size` a sample, the vision tower trained or frozen; fp32, sdpa, micro-batch 1.
# (architecture config, layers, checkpointing, text tokens, images, size, tower)
IMAGE_CONFIGS = [
    ("qwen2.5-vl-7b-instruct", 2, False, 96, 2, "448x280", "train"),
    ("qwen2.5-vl-7b-instruct", 2, True, 96, 2, "448x280", "freeze"),
    ("qwen3.5-27b", 4, False, 96, 2, "448x280", "train"),
    ("qwen3.5-27b", 4, True, 96, 2, "448x280", "freeze"),
    ("gemma-3-4b-it", 2, False, 96, 2, "448x280", "train"),
    ("gemma-3-4b-it", 2, True, 96, 2, "448x280", "freeze"),
]
ARCH_CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "arch_configs"


def tiny_image_config(name: str, layers: int):
    """The checkpoint's image-text config shrunk (toolkit.run.tiny.shrink_config, its vision tower too), with its
    image, vision start / end and video token ids (Gemma-3: image, begin and end of image) inside the tiny
    vocabulary (500-503 of 512)."""
    from toolkit.inputs.modelconfig import load_config
    from toolkit.run.tiny import shrink_config

    config = shrink_config(load_config(str(ARCH_CONFIGS / f"{name}.json")), layers=layers, max_positions=1024,
                           images=True)
    if getattr(config, "mm_tokens_per_image", None):  # Gemma-3: begin / end of image around its fixed count
        config.image_token_id, config.boi_token_id, config.eoi_token_id = 500, 501, 502
        return config
    config.image_token_id, config.vision_start_token_id, config.vision_end_token_id = 500, 501, 502
    config.video_token_id = 503
    return config


def _scored(row: dict, config, **kwargs) -> dict:
    """`row` with the measured and predicted activations and peak of one step of `config` (measure_step /
    predict_step's keywords) and their ratios; printed with the seconds both took."""
    start = time.perf_counter()
    measured = measure_step(config, steps=1, **kwargs)
    predicted = predict_step(config, device_kind="cpu", **kwargs)
    row = {**row, "params": predicted["params"],
           "act_measured": measured.activations_bytes, "act_predicted": predicted["activations_bytes"],
           "peak_measured": measured.peak_bytes, "peak_predicted": predicted["peak_bytes"],
           "peak_phase": predicted["peak_phase"]}
    row = {**row, "act_ratio": row["act_predicted"] / row["act_measured"],
           "peak_ratio": row["peak_predicted"] / row["peak_measured"]}
    print(f"{row['arch']:12}{kwargs['precision']:10}{kwargs['attention']:6}"
          f"{'ckpt' if kwargs['checkpointing'] else '    '} b{kwargs['micro_batch']} s{kwargs['seq_len']}"
          + (f" + {kwargs['images']} x {kwargs['image_size']} ({kwargs['vision_tower']})" if "images" in kwargs else "")
          + f": activations {row['act_ratio']:.4f}, peak {row['peak_ratio']:.4f} ({time.perf_counter() - start:.0f} s)",
          flush=True)
    return row


def main() -> int:
    torch.set_num_threads(1)
    from transformers import AutoConfig

    rows = []
    configs = [(a, p, at, c, b, s, tiny_config(a, vocab_size=4000, max_positions=1024, **shape))
               for a, p, at, c, b, s, shape in CONFIGS]
    configs += [(a, p, at, c, b, s, AutoConfig.for_model(a, **{**_HF, **extra}))
                for a, p, at, c, b, s, extra in HF_CONFIGS]
    for arch, precision, attention, ckpt, b, s, config in configs:
        row = {"arch": arch, "precision": precision, "attention": attention, "checkpointing": ckpt,
               "micro_batch": b, "seq": s}
        rows.append(_scored(row, config, seq_len=s, micro_batch=b, precision=precision, attention=attention,
                            checkpointing=ckpt))
    image_rows = []
    for name, layers, ckpt, text, images, size, tower in IMAGE_CONFIGS:
        config = tiny_image_config(name, layers)
        row = {"arch": config.model_type, "checkpointing": ckpt, "text_tokens": text, "images": images,
               "image_size": size, "vision_tower": tower}
        image_rows.append(_scored(row, config, seq_len=text, micro_batch=1, precision="fp32", attention="sdpa",
                                  checkpointing=ckpt, images=images, image_size=size, vision_tower=tower))
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            **provenance_meta()}
    (out / "accuracy.json").write_text(json.dumps({"meta": meta, "rows": rows, "image_rows": image_rows},
                                                  indent=2) + "\n")
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
    lines += ["", "Image-text classes (issue 31): tiny models of real checkpoints' configs (tests/arch_configs, "
              "shrunk with their vision towers), fp32, sdpa, micro-batch 1, the text tokens around the images as a "
              "Qwen-VL processor lays them out, random pixel values in the shape and patch grid the model's own image "
              "processor gives at that size. Measured activations add the batch's float32 pixel values, alive "
              "before the forward and resident for the step, which the estimate counts with the activations; with "
              "checkpointing the peak is in the tower's backward (its blocks recomputed). Gemma-3's batch is its "
              "processor's: each image a square of pixels, its fixed count of tokens between begin- and end-of-image, "
              "and token_type_ids marking them, from which Gemma3Model builds an explicit mask in which each image's "
              "tokens attend each other both ways (get_block_sequence_ids_for_mask), kept by SDPA in every layer as "
              "an additive float32 bias; the estimate traces the language model with the marks its processor gives "
              "(toolkit.inputs.images.image_marks_keyword: the processor's return_mm_token_type_ids and the "
              "keyword the forward takes them under).", "",
              "| arch | tower | ckpt | text + images | params | activations MiB (pred / meas) | ratio | "
              "peak MiB (pred / meas) | ratio | peak phase |", "|" + "---|" * 10]
    for r in image_rows:
        lines.append(f"| {r['arch']} | {r['vision_tower']} | {'yes' if r['checkpointing'] else 'no'} | "
                     f"{r['text_tokens']} + {r['images']} x {r['image_size']} | {r['params']:,} | "
                     f"{r['act_predicted'] / 2**20:.2f} / {r['act_measured'] / 2**20:.2f} | {r['act_ratio']:.4f} | "
                     f"{r['peak_predicted'] / 2**20:.2f} / {r['peak_measured'] / 2**20:.2f} | {r['peak_ratio']:.4f} | "
                     f"{r['peak_phase']} |")
    every = rows + image_rows
    worst_act = max(abs(r["act_ratio"] - 1) for r in every)
    worst_peak = max(abs(r["peak_ratio"] - 1) for r in every)
    lines += ["", f"Worst activation error {worst_act:.2%}; worst peak error {worst_peak:.2%} "
              f"over {len(every)} configurations ({len(image_rows)} of them image-text).", ""]
    (out / "accuracy.md").write_text("\n".join(lines))
    print(f"worst activations {worst_act:.2%}, worst peak {worst_peak:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
