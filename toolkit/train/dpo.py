"""DPO in toolkit.train: a DPO plan (plan.dpo) runs TRL's DPOTrainer on the same engines as supervised fine-tuning
(DDP, ZeRO-1/2/3, FSDP2 from the plan's accelerate / DeepSpeed configs), with the plan's batch (the micro-batch
counts chosen / rejected pairs) and the plan's DPOConfig settings (training_args.json's dpo_config).

The data is TRL's preference format: rows with "prompt", "chosen" and "rejected", all strings (TRL adds the EOS to
the completions) or all conversations (lists of {"role", "content"} turns, rendered with the chat template).

The reference (docs/ENGINE_FACTS.md, "DPO"; trl/trainer/dpo_trainer.py DPOTrainer.__init__):
- kept, full fine-tuning: a second model, built here exactly as the policy (same source, same seed: for
  --random-init the same random weights), since TRL would otherwise load one from config._name_or_path (which a
  random-init model does not have); TRL prepares it for the engine (prepare_deepspeed / prepare_fsdp);
- kept or precomputed, LoRA / QLoRA: none; the policy with its adapter disabled is the reference (TRL's own path
  when it is given peft_config);
- precomputed, full fine-tuning: TRL scores the dataset with the policy before training (under DeepSpeed through
  an inference engine of it); under FSDP TRL needs a reference model for that pass, which it drops afterwards;
- none: refused when the plan is made (toolkit.inputs.preference: TRL 1.16's DPOTrainer has no reference-free loss).
"""

from __future__ import annotations

from typing import Any

from toolkit.errors import UserError
from toolkit.plan.schema import Plan

PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")
"""The columns of TRL's explicit-prompt preference format (trl/data_utils.py is_conversational, extract_prompt)."""


def check_dpo_run(plan: Plan, args) -> None:
    """The planner's DPO rule (toolkit.inputs.preference.dpo_problem) against the run's own flags: what the plan
    refuses with DPO, toolkit.train refuses too (one line, before any process or model)."""
    from toolkit.inputs.preference import dpo_problem

    if plan.dpo and (problem := dpo_problem(plan.dpo_spec, plan.strategy_spec, compile=args.compile)):
        raise UserError(problem)


def preference_row_problem(row: dict[str, Any]) -> str | None:
    """Why one row is not a preference pair DPOTrainer can tokenize, or None."""
    from toolkit.train.data import conversation_problem

    missing = [name for name in PREFERENCE_FIELDS if row.get(name) is None]
    if missing:
        return (f"has no {', '.join(repr(m) for m in missing)}; DPO data needs 'prompt', 'chosen' and 'rejected' in "
                "every row (TRL's preference format)")
    kinds = {name: type(row[name]).__name__ for name in PREFERENCE_FIELDS}
    if all(isinstance(row[name], str) for name in PREFERENCE_FIELDS):
        return None
    if all(isinstance(row[name], list) for name in PREFERENCE_FIELDS):
        for name in PREFERENCE_FIELDS:
            problem = conversation_problem(row[name], name=name, need_assistant=name != "prompt")
            if problem:
                return problem
        return None
    return ("mixes " + ", ".join(f"{k} as {v}" for k, v in kinds.items()) + "; give all three as strings or all "
            "three as lists of {\"role\", \"content\"} turns")


def build_preference_datasets(data: str, *, eval_fraction: float, seed: int, max_eval_pairs: int | None):
    """(train, eval or None): datasets.Dataset of prompt / chosen / rejected rows, the held-out pairs being the
    data's validation file when a folder has one, else `eval_fraction` of the pairs (a seeded shuffle). DPOTrainer
    tokenizes them (and truncates to the plan's max_length)."""
    from toolkit.train.data import _main_process_first, load_raw

    with _main_process_first():
        train, evaluation = load_raw(data)
    train = _pairs(train, data)
    if len(train) == 0:
        raise UserError(f"DPO data {data} holds no rows; give prompt / chosen / rejected rows")
    if evaluation is not None:
        evaluation = _pairs(evaluation, data)
    elif eval_fraction > 0 and len(train) >= 2:
        split = train.train_test_split(test_size=max(1, round(len(train) * eval_fraction)), seed=seed, shuffle=True)
        train, evaluation = split["train"], split["test"]
    if evaluation is not None and len(evaluation) == 0:
        evaluation = None
    if evaluation is not None and max_eval_pairs is not None and len(evaluation) > max_eval_pairs:
        evaluation = evaluation.select(range(max_eval_pairs))
    return train, evaluation


def _pairs(raw, data: str):
    missing = [name for name in PREFERENCE_FIELDS if name not in raw.column_names]
    if missing:
        raise UserError(f"DPO data {data} has no {', '.join(repr(m) for m in missing)} column (columns: "
                        f"{', '.join(raw.column_names)}); a DPO plan trains on rows with 'prompt', 'chosen' and "
                        "'rejected' (TRL's preference format)")
    for index in range(min(len(raw), 64)):
        problem = preference_row_problem(raw[index])
        if problem:
            raise UserError(f"DPO data {data}: row {index + 1} {problem}")
    return raw.select_columns(list(PREFERENCE_FIELDS))


def dpo_config_kwargs(plan: Plan) -> dict[str, Any]:
    """DPOConfig keyword arguments beyond TrainingArguments': the plan's DPO settings (the same dict a user's script
    gets from own_script.dpo_config()), and padding to the plan's max_length so that every batch has the shape the
    plan's memory was computed for (TRL's collator pads to the longest pair otherwise)."""
    return {**plan.dpo_spec.dpo_config_kwargs(plan.seq_len), "pad_to_multiple_of": plan.seq_len}


def needs_reference_model(plan: Plan, adapter) -> bool:
    """toolkit.train builds a reference model of its own: full fine-tuning with the reference kept, or precomputed
    under FSDP (TRL loads one for the precompute pass there: DPOTrainer.__init__, 'Under FSDP, the policy isn't
    sharded until train')."""
    from toolkit.inputs.preference import KEPT
    from toolkit.inputs.strategy import Engine

    if adapter is not None:
        return False
    return plan.dpo_spec.reference == KEPT or plan.engine == Engine.FSDP2


def make_dpo_trainer(plan: Plan, *, model, ref_model, adapter, tokenizer, training_args, train_data, eval_data,
                     callbacks, throughput):
    """TRL's DPOTrainer over the plan's model(s) and data, logging throughput and per-rank peak memory."""
    from trl import DPOTrainer

    from toolkit.patches.actoffload import OffloadedSteps
    from toolkit.train.autoep_export import AutoEPSaves

    class PlanDPOTrainer(AutoEPSaves, OffloadedSteps, DPOTrainer):
        def log(self, logs, *a, **kw):
            throughput.add_to(logs, self)
            super().log(logs, *a, **kw)

    try:
        trainer = PlanDPOTrainer(model=model, ref_model=ref_model, args=training_args, train_dataset=train_data,
                                 eval_dataset=eval_data, processing_class=tokenizer, callbacks=callbacks,
                                 peft_config=adapter.lora_config() if adapter is not None else None)
    except (ValueError, NotImplementedError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"TRL's DPOTrainer refuses the plan's DPO settings: {first[:300]}; re-plan without that "
                        "setting") from None
    if ref_model is not None and plan.dpo_spec.reference != "kept":
        trainer.ref_model = None  # FSDP's precompute pass is done: the plan holds no reference during training
    if plan.activation_offloading:
        from toolkit.patches.actoffload import offload_context
        from toolkit.train import cpu

        # Where DPOTrainer builds its own (dpo_trainer.py ~889: after Trainer.__init__, on self.model, the PEFT model
        # for an adapter plan), which the DPOConfig here leaves off (activation_offloading stays False: TRL's own
        # constructor fails on a CPU-only torch); DPOTrainer.training_step then runs inside it.
        trainer.offload = offload_context(trainer.model, on_cpu=cpu.on_cpu())
    return trainer
