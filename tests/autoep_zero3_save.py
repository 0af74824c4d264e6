"""A user's own HF Trainer script on DeepSpeed AutoEP under ZeRO-3, launched by tests/test_moe.py:
`autoep_zero3_save.py MODEL OUTPUT SUMMARY WORLD`, WORLD the torchrun rank count, or `reference` for one plain
process. fp32, autoep_size 2, every parameter partitioned (stage3_param_persistence_threshold 0), the 16-bit gather
on save asked as ZeRO-3's own advice has it (the save the engine refuses for AutoEP), one 16-token sample a rank a
step, 2 steps, a checkpoint each step. The trainer takes its model saves from
toolkit.train.autoep_export.AutoEPSaves; after training each rank asks the engine for its own 16-bit consolidation
and records the refusal. Each rank writes SUMMARY/rankN.json: its losses, the refusal, its parameter partition's
elements, and the live model's logits on tokens 1-16 at the end; the reference writes SUMMARY/reference.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from toolkit.patches.autoep import allow_string_keys
from toolkit.train.autoep_export import AutoEPSaves

SEQ = 16
STEPS = 2


class AutoEPTrainer(AutoEPSaves, Trainer):
    pass


def main(model_dir: str, output: str, summary: str, world: str) -> None:
    """`world` ranks of AutoEP under ZeRO-3, or with `reference` one process on the same samples (all of a step's
    in one batch), torch's AdamW, the same clipping and learning rate, no DeepSpeed."""
    reference = world == "reference"
    world = 4 if reference else int(world)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}},
              "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}}
    if not reference:
        allow_string_keys()
    args = TrainingArguments(output_dir=output, per_device_train_batch_size=world if reference else 1,
                             max_steps=STEPS, save_steps=1, logging_steps=1, learning_rate=3e-3, weight_decay=0.0,
                             lr_scheduler_type="constant", max_grad_norm=1.0, optim="adamw_torch",
                             deepspeed=None if reference else config, report_to=[], use_cpu=True, seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(1, model.config.vocab_size, (world * STEPS, SEQ), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = AutoEPTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    if reference:
        Path(summary).mkdir(parents=True, exist_ok=True)
        (Path(summary) / "reference.json").write_text(json.dumps({"losses": losses}))
        return
    trainer.save_model(output)
    engine = trainer.model_wrapped
    try:
        engine._zero3_consolidated_16bit_state_dict()
        refusal = None
    except NotImplementedError as exc:
        refusal = str(exc)
    with torch.no_grad():
        logits = engine.module(input_ids=torch.arange(1, SEQ + 1).unsqueeze(0)).logits
    rank = dist.get_rank()
    record = {"losses": losses,
              "refusal": refusal, "local_numel": sum(p.ds_tensor.numel() for p in engine.module.parameters()),
              "probe_logits": logits.tolist()}
    Path(summary).mkdir(parents=True, exist_ok=True)
    (Path(summary) / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:])
