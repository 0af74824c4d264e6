"""Liger's fused linear cross-entropy under DeepSpeed ZeRO-3, launched by tests/test_liger.py:
`liger_zero3.py MODEL OUTPUT SUMMARY WORLD`, WORLD the torchrun rank count, or `reference` for one plain process.

The model is patched as the HF Trainer's use_liger_kernel patches it (toolkit.patches.liger's substitutes: Liger's
Triton kernels need a GPU), so its forward reads `self.lm_head.weight` outside the lm_head module, as Liger's
lce_forward does. fp32, every parameter partitioned (stage3_param_persistence_threshold 0), one 16-token sample a
rank a micro-step, 2 micro-steps a step, 3 steps, checkpointing on. Each rank records, per step, the head weight's
ZeRO status and local elements after each of the parameter coordinator's fetches and releases
(deepspeed/runtime/zero/partitioned_param_coordinator.py fetch_sub_module / release_sub_module /
release_backward_leftovers), when the fused loss receives the weight, and at the step's start, before its optimizer
step and at its end; it writes SUMMARY/rankN.json with its losses. The reference (no DeepSpeed, all of a step's
samples in one batch) writes SUMMARY/reference.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

import toolkit.patches.liger as liger

SEQ = 16
STEPS = 3
ACCUMULATE = 2


class Steps(TrainerCallback):
    """Opens a new list of head events at each step's start; notes the head's status there, before the optimizer
    step (backward done) and at the step's end."""

    def __init__(self, events: list):
        self.events = events
        self.note = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append([])
        if self.note:
            self.note("step begin", None)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.note:
            self.note("before optimizer step", None)

    def on_step_end(self, args, state, control, **kwargs):
        if self.note:
            self.note("step end", None)


def record_head(model, events: list, steps: Steps) -> None:
    """Wraps the coordinator's fetch / release and the fused loss so that `events[-1]` gets (what, module class,
    the head weight's ds_status and local elements after it) in the order the step runs them."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    head = model.lm_head.weight  # before the engine wraps _parameters: no gather

    def note(what: str, module) -> None:
        if events:
            events[-1].append((what, type(module).__name__, head.ds_status.name, head.data.numel()))

    def wrap(name: str):
        original = getattr(PartitionedParameterCoordinator, name)

        def wrapped(self, module, forward: bool, *args, **kwargs):
            result = original(self, module, forward, *args, **kwargs)
            note(f"{name.split('_')[0]} {'forward' if forward else 'backward'}", module)
            return result

        setattr(PartitionedParameterCoordinator, name, wrapped)

    wrap("fetch_sub_module")
    wrap("release_sub_module")
    leftovers = PartitionedParameterCoordinator.release_backward_leftovers

    def released(self):  # the ZeRO-3 optimizer's backward_epilogue calls it once backward is over
        leftovers(self)
        note("backward leftovers released", None)

    PartitionedParameterCoordinator.release_backward_leftovers = released
    fused = liger.fused_linear_cross_entropy

    def fused_loss(hidden_states, weight, *args, **kwargs):
        note("fused loss", model)
        return fused(hidden_states, weight, *args, **kwargs)

    liger.fused_linear_cross_entropy = fused_loss
    steps.note = note


def main(model_dir: str, output: str, summary: str, world: str) -> None:
    reference = world == "reference"
    world = 2 if reference else int(world)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUMULATE,
              "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}}}
    args = TrainingArguments(output_dir=output, per_device_train_batch_size=world * ACCUMULATE if reference else 1,
                             gradient_accumulation_steps=1 if reference else ACCUMULATE, activation_checkpointing=True,
                             max_steps=STEPS, save_strategy="no", logging_steps=1, learning_rate=3e-3,
                             weight_decay=0.0, lr_scheduler_type="constant", max_grad_norm=1.0, optim="adamw_torch",
                             deepspeed=None if reference else config, report_to=[], use_cpu=True, seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(1, model.config.vocab_size, (world * ACCUMULATE * STEPS, SEQ),
                        generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    events: list = []
    with liger.liger_applied(model):
        steps = Steps(events)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[steps])
        if not reference:
            record_head(model, events, steps)
        trainer.train()
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    Path(summary).mkdir(parents=True, exist_ok=True)
    if reference:
        (Path(summary) / "reference.json").write_text(json.dumps({"losses": losses}))
        return
    rank = torch.distributed.get_rank()
    (Path(summary) / f"rank{rank}.json").write_text(json.dumps({"losses": losses, "events": events}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
