"""GRPO in toolkit.train: a GRPO plan (plan.grpo) runs TRL's GRPOTrainer on the same engines as supervised
fine-tuning (DDP, ZeRO-1/2/3, FSDP2 from the plan's accelerate / DeepSpeed configs), with the plan's batch (the
micro-batch counts completions, num_generations of them per prompt) and the plan's GRPOConfig settings
(training_args.json's grpo_config), on rewards named by --reward (toolkit.train.rewards).

Generation is in the training process (transformers' generate on the policy; under ZeRO-3 TRL gathers the weights
for it). A plan that generates with vLLM is refused where vLLM cannot run (no GPU, or no vllm package); elsewhere
its settings go to TRL as they are (not exercised by toolkit's tests, which run on CPUs).

The data is TRL's prompt format: rows with "prompt", a string (standard) or a list of {"role", "content"} turns
(conversational, rendered with the chat template and a generation prompt); other columns are passed to the reward
functions by name, as TRL does.

The reference (docs/ENGINE_FACTS.md, "GRPO"; trl/trainer/grpo_trainer.py GRPOTrainer.__init__): none when beta is 0
(TRL's default); with beta > 0 and full fine-tuning a second model, built here exactly as the policy (same source,
same seed: for --random-init the same random weights; TRL would load one from config._name_or_path); with LoRA the
policy with its adapter disabled.

Sampling: TRL seeds each process differently once (set_seed(seed, device_specific=True)), so a run's completions
depend on how many processes share it. toolkit.train reseeds before every generation from the seed and the
generation's place in the run (its call number x processes + rank): two runs whose generations hold the same prompts
in the same places (e.g. one process generating one group per micro-step, or two processes one group each) sample
the same completions, and ranks never sample alike.
"""

from __future__ import annotations

from typing import Any

from toolkit.errors import UserError
from toolkit.plan.schema import Plan

PROMPT_FIELD = "prompt"
"""The column of TRL's prompt-only format (trl/data_utils.py is_conversational, maybe_apply_chat_template)."""

VLLM_TRAIN_PROBLEM = ("the plan generates with vLLM (use_vllm), which needs a GPU and the vllm package, and this "
                      "machine lacks one or the other: re-plan without --use-vllm (generation in the training "
                      "process, transformers' generate), or run it on GPUs with vllm installed")


def check_grpo_run(plan: Plan, args, *, on_cpu: bool | None) -> list:
    """What toolkit.train refuses of a GRPO plan before any process or model (one line), and the run's rewards: the
    plan's reward model by name, which TRL loads (AutoModelForSequenceClassification, num_labels=1; checked here as
    the planner did, toolkit.inputs.reward), and the reward functions of --reward (toolkit.train.rewards), needed
    only without a reward model. on_cpu None: the run is not on this machine (a rehearsal checking the real run's
    arguments), whose vLLM is then not asked about."""
    from toolkit.train.rewards import load_rewards

    if plan.grpo_spec.use_vllm and on_cpu is not None and (on_cpu or not _vllm_installed()):
        raise UserError(VLLM_TRAIN_PROBLEM)
    reward_model = plan.grpo_spec.reward_model
    if reward_model is None:
        return load_rewards(args.reward)
    from toolkit.inputs.reward import reward_model_of

    reward_model_of(reward_model)
    return [reward_model, *(load_rewards(args.reward) if args.reward else [])]


def reward_model_numel(trainer) -> int:
    """Elements of the reward models' parameters this rank holds (a ZeRO-3 partition's or a DTensor's local ones),
    0 without one."""
    import torch

    models = [f for f in getattr(trainer, "reward_funcs", []) if isinstance(f, torch.nn.Module)]
    return sum(getattr(p, "ds_tensor", getattr(p, "_local_tensor", p)).numel() for m in models for p in m.parameters())


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def prompt_row_problem(row: dict[str, Any]) -> str | None:
    """Why one row is not a prompt GRPOTrainer can generate from, or None."""
    from toolkit.train.data import conversation_problem

    prompt = row.get(PROMPT_FIELD)
    if prompt is None:
        return "has no 'prompt'; GRPO data needs a 'prompt' in every row (TRL's prompt-only format)"
    if isinstance(prompt, str):
        return None if prompt.strip() else "has an empty 'prompt'; give the text the policy completes"
    if isinstance(prompt, list):
        return conversation_problem(prompt, name=PROMPT_FIELD, need_assistant=False)
    return (f"has a 'prompt' of type {type(prompt).__name__}; give a string or a list of {{\"role\", \"content\"}} "
            "turns")


def prompt_tokens(prompt: Any, tokenizer) -> int:
    """A prompt's length in tokens as GRPOTrainer renders it (the chat template with a generation prompt for a
    conversation; refused in one line where the tokenizer has none)."""
    if isinstance(prompt, str):
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("GRPO data holds conversational prompts and the tokenizer has no chat template; give string "
                        "prompts or a tokenizer with a chat template (--tokenizer)")
    return len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))


def build_prompt_datasets(data: str):
    """(train, None): a datasets.Dataset of the data's rows (the "prompt" column and the columns the rewards may
    read). A GRPO run holds no evaluation set (evaluation would generate again)."""
    from toolkit.train.data import _main_process_first, load_raw

    with _main_process_first():
        train, _ = load_raw(data)
    if PROMPT_FIELD not in train.column_names:
        raise UserError(f"GRPO data {data} has no 'prompt' column (columns: {', '.join(train.column_names)}); a GRPO "
                        "plan trains on rows with a 'prompt' (TRL's prompt-only format)")
    if len(train) == 0:
        raise UserError(f"GRPO data {data} holds no rows; give rows with a 'prompt'")
    for index in range(min(len(train), 64)):
        problem = prompt_row_problem(train[index])
        if problem:
            raise UserError(f"GRPO data {data}: row {index + 1} {problem}")
    return train, None


def grpo_config_kwargs(plan: Plan) -> dict[str, Any]:
    """GRPOConfig keyword arguments beyond TrainingArguments': the plan's GRPO settings (num_generations,
    max_completion_length, beta, use_vllm). generation_batch_size is left to GRPOConfig, which derives it from the
    processes it runs on (the plan's global batch on the plan's world). No evaluation (build_prompt_datasets holds no
    evaluation set; GRPOConfig would otherwise check an evaluation batch of whole groups the run never makes)."""
    return {**plan.grpo_spec.grpo_config_kwargs(), "eval_strategy": "no"}


def make_grpo_trainer(plan: Plan, *, model, ref_model, rewards, adapter, tokenizer, training_args, train_data,
                      callbacks, throughput):
    """TRL's GRPOTrainer over the plan's model(s) and data, logging throughput and per-rank peak memory."""
    import contextlib

    import torch
    from trl import GRPOTrainer
    from trl.trainer import grpo_trainer

    from toolkit.train.autoep_export import AutoEPSaves

    class PlanGRPOTrainer(AutoEPSaves, GRPOTrainer):
        def log(self, logs, *a, **kw):
            throughput.add_to(logs, self)
            super().log(logs, *a, **kw)

        def _generate(self, prompts):
            if self.model.training:  # the generation's place in the run (module docstring)
                call = self._step // (self.args.steps_per_generation * self.num_iterations)
                torch.manual_seed(self.args.seed + call * self.accelerator.num_processes
                                  + self.accelerator.process_index)
            return super()._generate(prompts)

    # beta > 0, full fine-tuning: TRL builds the reference with create_model_from_path(the policy's name or path);
    # it gets the policy's twin made here instead (module docstring).
    reference = contextlib.nullcontext()
    if ref_model is not None:
        reference = _swapped(grpo_trainer, "create_model_from_path", lambda *a, **kw: ref_model)
    try:
        with reference:
            trainer = PlanGRPOTrainer(model=model, reward_funcs=rewards, args=training_args, train_dataset=train_data,
                                      processing_class=tokenizer, callbacks=callbacks,
                                      peft_config=adapter.lora_config() if adapter is not None else None)
    except (ValueError, NotImplementedError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"TRL's GRPOTrainer refuses the plan's GRPO settings: {first[:300]}; re-plan without that "
                        "setting") from None
    return trainer


class _swapped:
    """Within the block, module.name is `value` (put back afterwards, also on an error)."""

    def __init__(self, module, name: str, value):
        self.module, self.name, self.value = module, name, value

    def __enter__(self):
        self.saved = getattr(self.module, self.name)
        setattr(self.module, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.saved)
        return False
