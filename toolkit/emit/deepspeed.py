"""The DeepSpeed JSON for a plan: ZeRO plans (run by the HF Trainer, TRL or a user's accelerate loop) and pipeline
plans (run by toolkit.train).

Two files for ZeRO plans, from one function:
  ds_config.json            HF-style "auto" where *both* runners that read it fill the value themselves, so the same
                            file works under the HF Trainer / TRL (transformers integrations/deepspeed.py
                            HfTrainerDeepSpeedConfig.trainer_config_process) and under a custom accelerate loop
                            (accelerate accelerator.py Accelerator._prepare_deepspeed):
                              train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
                                (Trainer: per_device_train_batch_size x gradient_accumulation_steps x world;
                                 accelerate: the prepared DataLoader's batch_size x Accelerator's accumulation),
                              gradient_clipping (Trainer: max_grad_norm; accelerate: 1.0),
                              optimizer.params.lr / weight_decay of an optimizer-offload plan (Trainer: learning_rate /
                                weight_decay; accelerate: DummyOptim(lr=..., weight_decay=...)),
                              bf16.enabled / fp16.enabled (Trainer: bf16 / fp16; accelerate: the Accelerator's
                                mixed_precision, which training_args.json's accelerate_loop names: a YAML next to a
                                DeepSpeed file cannot set it, so a loop that omits it runs fp32; bf16-pure plans keep
                                them concrete).
                            The plan's numbers for them travel in training_args.json (toolkit.emit.user_settings).
                            Everything else is concrete, because only one of the runners would fill it: the
                            optimizer's betas / eps (accelerate fills neither), and bucket sizes (both would fill the
                            same values).
  ds_config.deepspeed.json  the same with every value concrete, for DeepSpeed's own launcher and a script that calls
                            deepspeed.initialize(config=...) itself (nothing fills "auto" there). An AdamW plan's
                            file holds the whole optimizer block, hyper-parameters included (LEARNING_RATE,
                            ADAM_BETAS, ADAM_EPSILON, WEIGHT_DECAY: what toolkit.train trains the plan with unless
                            told otherwise), so a script that passes no optimizer trains with the plan's, never with
                            DeepSpeed's silent defaults (DeepSpeedCPUAdam's lr 1e-3 under offload); a script that
                            passes its own keeps it (DeepSpeedEngine._configure_optimizer prefers the client's).
                            No scheduler block: the plan carries none (toolkit.train's schedule needs the run's step
                            count), so the learning rate is constant unless the script passes lr_scheduler.

Concrete values:
  - precision: bf16 / fp16 blocks with "enabled" true or false;
  - ZeRO-1/2 x Ulysses SP: "gradient_predivide_factor" dp x sp and "reduce_scatter": false, so that DeepSpeed
    averages the gradient over the sequence-data-parallel group instead of summing the SP ranks' for any script
    (average_over_sp_ranks);
  - ZeRO stage, offload devices, and buckets from the hidden size h the way transformers fills them
    (integrations/deepspeed.py trainer_config_finalize): reduce_bucket_size = h*h,
    stage3_prefetch_bucket_size = int(0.9*h*h), stage3_param_persistence_threshold = 10*h;
  - the optimizer-offload AdamW block {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
    "betas": [0.9, 0.999], "eps": 1e-8}} (TrainingArguments' defaults for betas / eps): DeepSpeed must own the
    optimizer there so that it builds DeepSpeedCPUAdam (a torch AdamW on CPU partitions is several times slower).
    Consequence for a user's accelerate loop: it must pass accelerate.utils.DummyOptim (accelerate refuses a real
    optimizer next to an "optimizer" block); PLAN.md and training_args.json say so. Every other plan has no
    optimizer and no scheduler block: the Trainer (or the user's loop, or toolkit.train for pipelines) builds them.

Pipeline and hybrid JSONs hold no "auto" at all: toolkit.train calls deepspeed.initialize itself, and nothing fills
them. Pipeline runs are ZeRO 0-1 only (DeepSpeed refuses 2/3 with a PipelineModule); a bf16 pipeline uses ZeRO-1
with "data_types": {"grad_accum_dtype": "fp32"}, which selects DeepSpeed's fp32-accumulating BF16_Optimizer
(runtime/engine.py _do_optimizer_sanity_check; bf16 with stage 0 and fp32 accumulation is refused there).
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from toolkit.errors import UserError
from toolkit.plan.schema import Plan
from toolkit.inputs.autoep import autoep_section
from toolkit.inputs.strategy import Engine

GRADIENT_CLIPPING = 1.0
"""transformers.TrainingArguments.max_grad_norm default, and what accelerate fills for "auto": the plan's value."""
ADAM_BETAS = (0.9, 0.999)
ADAM_EPSILON = 1e-8
"""TrainingArguments' adam_beta1 / adam_beta2 / adam_epsilon defaults (written concrete: accelerate fills neither)."""
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.0
"""toolkit.train's --lr and --weight-decay defaults (toolkit.train.args; a test holds them equal): the concrete
file's optimizer hyper-parameters."""

FP16_DYNAMIC_LOSS_SCALE: dict[str, Any] = {
    "enabled": True,
    "loss_scale": 0,            # 0 = dynamic loss scaling
    "initial_scale_power": 16,  # start at 2**16, halve on overflow
    "loss_scale_window": 1000,  # double after this many steps without overflow
    "hysteresis": 2,
    "min_loss_scale": 1,
}
"""DeepSpeed's documented dynamic-scaling defaults (runtime/precision_config.py FP16_FORMAT), written out."""

RUNNER_FILLED_AUTO_KEYS: tuple[str, ...] = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
)
"""Keys ds_config.json of a ZeRO plan leaves "auto": the HF Trainer and accelerate both fill them (module docstring)."""
PRECISION_AUTO_KEYS: tuple[str, ...] = ("bf16.enabled", "fp16.enabled")
"""Also "auto" in ds_config.json of a ZeRO plan, bf16-pure excepted (precision_blocks)."""
OFFLOAD_OPTIMIZER_AUTO_KEYS: tuple[str, ...] = ("optimizer.params.lr", "optimizer.params.weight_decay")
"""The optimizer-offload AdamW block's "auto" keys (Trainer: TrainingArguments; accelerate: DummyOptim)."""


def hidden_size(plan: Plan) -> int:
    """The model's hidden size, read the way transformers reads it for the bucket formulas."""
    config = plan.model_config
    for key in ("hidden_size", "n_embd", "d_model"):
        if isinstance(config.get(key), int):
            return config[key]
    if isinstance(config.get("hidden_sizes"), list) and config["hidden_sizes"]:
        return max(config["hidden_sizes"])
    text = config.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("hidden_size"), int):
        return text["hidden_size"]
    raise UserError(f"plan for {plan.model} has no hidden_size (or n_embd) in its model_config; "
                    "re-plan it from the model's config.json")


def zero_buckets(hidden: int, stage: int) -> dict[str, int]:
    """Bucket sizes (elements) from the hidden size: the formulas accelerate and transformers use for "auto"."""
    if stage == 0:
        return {}
    buckets = {"reduce_bucket_size": hidden * hidden}
    if stage == 3:
        buckets["stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
        buckets["stage3_param_persistence_threshold"] = 10 * hidden
    return buckets


def ds_zero_stage(plan: Plan) -> int:
    """The ZeRO stage the JSON carries: the plan's, except bf16 pipelines which need ZeRO-1 (module docstring)."""
    if plan.engine == Engine.PIPELINE:
        if plan.zero_stage > 1:
            raise UserError(f"plan {plan.strategy} asks ZeRO-{plan.zero_stage} with pipeline parallelism; "
                            "DeepSpeed's pipeline engine runs ZeRO 0 or 1 only (use hybrid for ZeRO-1)")
        if plan.precision in ("bf16", "bf16-pure"):
            return 1
    return plan.zero_stage


def precision_blocks(plan: Plan, stage: int, *, runner_fills: bool = False) -> dict[str, Any]:
    """bf16 / fp16 blocks, both always present so that precision is explicit and checkable.

    runner_fills: "enabled" is "auto" in both blocks (bf16-pure excepted: its master-weight keys mean nothing
    without bf16), because both runners fill it: the HF Trainer from TrainingArguments' bf16 / fp16
    (HfTrainerDeepSpeedConfig.trainer_config_process), accelerate from the Accelerator's mixed_precision
    (DeepSpeedPlugin.set_mixed_precision). A script that turns bf16 off on a dev box then runs fp32 instead of
    being refused for a mismatch; training_args.json states what each runner must set for the plan's precision.
    """
    blocks = _concrete_precision_blocks(plan, stage)
    if runner_fills and plan.precision != "bf16-pure":
        for name in ("bf16", "fp16"):
            blocks[name] = {**blocks[name], "enabled": "auto"}
    return blocks


def _concrete_precision_blocks(plan: Plan, stage: int) -> dict[str, Any]:
    if plan.precision == "fp16":
        return {"fp16": dict(FP16_DYNAMIC_LOSS_SCALE), "bf16": {"enabled": False}}
    if plan.precision == "bf16":
        blocks: dict[str, Any] = {"bf16": {"enabled": True}, "fp16": {"enabled": False}}
        if plan.engine == Engine.PIPELINE:
            blocks["data_types"] = {"grad_accum_dtype": "fp32"}
        return blocks
    if plan.precision == "bf16-pure":
        if stage < 1:
            raise UserError("precision bf16-pure keeps master weights in bf16, which DeepSpeed supports with "
                            "ZeRO 1-3 only; use --precision bf16 or a ZeRO strategy")
        return {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                "fp16": {"enabled": False}}
    return {"bf16": {"enabled": False}, "fp16": {"enabled": False}}


def offload_block(device: str, nvme_path: str | None, *, params: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        if not nvme_path:
            raise UserError(f"plan offloads {'parameters' if params else 'the optimizer'} to NVMe; pass "
                            "--nvme-path with a directory on a local NVMe drive (each node needs its own)")
        block["nvme_path"] = nvme_path
    return block


def zero_block(plan: Plan, stage: int, nvme_path: str | None) -> dict[str, Any]:
    block: dict[str, Any] = {"stage": stage}
    if stage == 0:
        return block
    block["contiguous_gradients"] = True
    # DeepSpeed's own defaults, written out so the planner's bucket memory reads them: overlap only for stage 3
    # (overlap costs about 4.5x the bucket sizes) and never under pipeline (the engine disables it).
    block["overlap_comm"] = stage == 3
    block.update(zero_buckets(hidden_size(plan), stage))
    if stage == 3:
        block["stage3_max_live_parameters"] = 1_000_000_000
        block["stage3_max_reuse_distance"] = 1_000_000_000
        # Without it a ZeRO-3 save_model writes an empty model (docs/ENGINE_FACTS.md, DeepSpeed); under AutoEP the
        # engine refuses that gather (toolkit.inputs.autoep.AUTOEP_ZERO3_SAVE) and toolkit.train.autoep_export saves.
        block["stage3_gather_16bit_weights_on_model_save"] = not plan.grid.autoep
        if plan.leaf_modules:
            # Replaces DeepSpeed's default list (three transformers MoE block classes, leaf_module_config.py) with
            # the model's own block; the engine applies it before it installs ZeRO-3's hooks (engine.py
            # _configure_distributed_model), whichever runner calls deepspeed.initialize.
            block["leaf_module"] = {"classes": list(plan.leaf_modules)}
    if plan.offload_optimizer != "none":
        block["offload_optimizer"] = offload_block(plan.offload_optimizer, nvme_path, params=False)
    if plan.offload_params != "none":
        if stage != 3:
            raise UserError(f"plan {plan.strategy} offloads parameters at ZeRO-{stage}; parameter offload needs "
                            "ZeRO-3 (use zero3-offload)")
        block["offload_param"] = offload_block(plan.offload_params, nvme_path, params=True)
    return block


def ds_config(plan: Plan, *, nvme_path: str | None = None, runner_fills: bool | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON (as a dict) for a ZeRO, pipeline or hybrid plan.

    runner_fills: leave RUNNER_FILLED_AUTO_KEYS (and the offload optimizer's lr / weight_decay) "auto" for the HF
    Trainer / accelerate to fill (ds_config.json); default: for ZeRO plans, never for pipelines (nothing fills
    them). False gives the fully concrete file (ds_config.deepspeed.json).
    """
    if plan.engine not in (Engine.DEEPSPEED, Engine.PIPELINE):
        raise ValueError(f"plan engine {plan.engine} has no DeepSpeed config")
    if runner_fills is None:
        runner_fills = plan.engine == Engine.DEEPSPEED
    stage = ds_zero_stage(plan)
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": GRADIENT_CLIPPING,
    }
    if runner_fills:
        config.update({key: "auto" for key in RUNNER_FILLED_AUTO_KEYS})
    if plan.grid.autoep:
        # Written out: DeepSpeed's default clips at 1.0 (runtime/constants.py GRADIENT_CLIPPING_DEFAULT), and an
        # AutoEP plan's clipping is part of what its losses were measured with (docs/ENGINE_FACTS.md, AutoEP).
        config["gradient_clipping"] = GRADIENT_CLIPPING
        config["expert_parallel"] = autoep_section(plan.model_type, plan.grid.expert)
    config.update(precision_blocks(plan, stage, runner_fills=runner_fills))
    config["zero_optimization"] = zero_block(plan, stage, nvme_path)
    if plan.optimizer == "adamw" and (owns_optimizer(plan) or
                                      (plan.engine == Engine.DEEPSPEED and not runner_fills)):
        config["optimizer"] = adamw_block(runner_fills=runner_fills)
    elif plan.offload_optimizer != "none":
        # DeepSpeed refuses a client optimizer next to optimizer offload unless told to accept it.
        config["zero_force_ds_cpu_optimizer"] = False
    if plan.optimizer != "adamw" and stage > 0:
        # ZeRO accepts only the optimizers in runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS without this flag.
        config["zero_allow_untested_optimizer"] = True
    if plan.engine == Engine.PIPELINE:
        config["steps_per_print"] = 100  # the pipeline engine logs loss and step time this often
    if averages_over_sp_ranks(plan):
        average_over_sp_ranks(config, plan.grid.data_parallel * plan.grid.sequence)
    if plan.sequence_parallel > 1 and not runner_fills:
        # Ulysses: DeepSpeedConfig divides the world by it for the batch identity when it has no mpu (the HF
        # zero.Init path, deepspeed/runtime/config.py); train_batch_size above already counts world / sp ranks.
        # Not in the file the HF Trainer fills: it fills "auto" train_batch_size over every rank (world x micro x
        # accumulation, integrations/deepspeed.py; accelerate narrows it to the data-parallel ranks only at
        # deepspeed.initialize), so with this key ZeRO-3's zero.Init refuses the Trainer's value (measured, issue 17:
        # "train_batch_size is not equal to ... 8 != 2 * 2 * 1.0" for ZeRO-3 x SP 2).
        config["sequence_parallel_size"] = plan.sequence_parallel
    return config


def averages_over_sp_ranks(plan: Plan) -> bool:
    """Whether the plan's DeepSpeed JSON carries average_over_sp_ranks's two keys: ZeRO-1/2 x Ulysses SP."""
    return plan.engine == Engine.DEEPSPEED and plan.sequence_parallel > 1 and plan.zero_stage in (1, 2)


def average_over_sp_ranks(config: dict[str, Any], group_ranks: int) -> None:
    """Make ZeRO-1/2 average the gradient over the sequence-data-parallel group (dp x sp ranks) instead of summing
    the SP ranks' (docs/ENGINE_FACTS.md, "ZeRO-1/2 x Ulysses SP: the gradient counted sp times"), so that any script
    the file runs, the user's own Trainer included, trains on the single-process gradient. Without reduce_scatter,
    stage_1_and_2.py `average_tensor` takes `gradient_reduction_w_predivide`: divide by gradient_predivide_factor,
    all-reduce, then multiply by factor / (group / sp) unless the factor equals the group's size; a factor of exactly
    dp x sp skips that multiply and leaves the sum divided by dp x sp. Any other group size gives back the sp-fold
    gradient, never a worse one."""
    config["gradient_predivide_factor"] = group_ranks
    config["zero_optimization"]["reduce_scatter"] = False


def sp_gradient_multiple(config: dict[str, Any], *, sp: int, group_ranks: int | None) -> int:
    """How many times the SP ranks' gradient ends up counted when DeepSpeed runs `config` under transformers' SP loss
    with `sp` ranks per sequence group and `group_ranks` (dp x sp; None: not known) in the sequence-data-parallel
    group: 1 (the single process's gradient) or sp (docs/ENGINE_FACTS.md, "ZeRO-1/2 x Ulysses SP: the gradient
    counted sp times"). ZeRO-3's reduce-scatter divides by the whole group; ZeRO-1/2 do only as
    average_over_sp_ranks sets them up (contiguous gradients, no reduce-scatter, post-scaling, the factor equal to
    the group's size); stage 0 and ZeRO-3 without reduce-scatter sum the SP ranks."""
    if sp <= 1:
        return 1
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    stage = zero.get("stage", 0)
    reduce_scatter = ds_bool(zero.get("reduce_scatter", True))
    if stage == 3:
        return 1 if reduce_scatter else sp
    offload = isinstance(zero.get("offload_optimizer"), dict) and zero["offload_optimizer"].get("device") not in (
        None, "none")
    averages = (stage in (1, 2) and not reduce_scatter and (ds_bool(zero.get("contiguous_gradients", True)) or offload)
                and not ds_bool(config.get("prescale_gradients", False)) and group_ranks is not None
                and config.get("gradient_predivide_factor") == group_ranks)
    return 1 if averages else sp


_BOOL = TypeAdapter(bool)


def ds_bool(value: Any) -> bool:
    """A DeepSpeed boolean as its pydantic config models read it (DeepSpeedConfigModel validates in pydantic's lax
    mode: True / 1 and the strings "true", "1", "yes", "on", "t", "y" in any case are true); anything pydantic refuses
    (DeepSpeed's config then refuses the file itself) reads as false here."""
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return False


def adamw_block(*, runner_fills: bool) -> dict[str, Any]:
    """DeepSpeed's "optimizer" block for the plan's AdamW: lr and weight_decay "auto" where a runner fills them
    (OFFLOAD_OPTIMIZER_AUTO_KEYS), else every hyper-parameter written out."""
    if runner_fills:
        params: dict[str, Any] = {key.rsplit(".", 1)[1]: "auto" for key in OFFLOAD_OPTIMIZER_AUTO_KEYS}
        params.update({"betas": list(ADAM_BETAS), "eps": ADAM_EPSILON})
    else:
        params = {"lr": LEARNING_RATE, "betas": list(ADAM_BETAS), "eps": ADAM_EPSILON, "weight_decay": WEIGHT_DECAY}
    return {"type": "AdamW", "params": params}


def owns_optimizer(plan: Plan) -> bool:
    """ds_config.json holds an "optimizer" block: a user's accelerate loop must pass accelerate's DummyOptim. So
    does a DeepSpeed AutoEP plan's: ZeRO refuses a client optimizer whose param groups mark no MoE parameters
    ("The model has moe layers, but None of the param groups are marked as MoE", runtime/engine.py)."""
    return plan.engine == Engine.DEEPSPEED and (plan.offload_optimizer != "none" or plan.grid.autoep) \
        and plan.optimizer == "adamw"


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def auto_keys(config: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every "auto" value in a DeepSpeed config."""
    found: list[str] = []
    if isinstance(config, dict):
        for key, value in config.items():
            found += auto_keys(value, f"{prefix}{key}.")
    elif is_auto(config):
        found.append(prefix.rstrip("."))
    return found


def enabled(block: Any) -> bool:
    """A precision or offload block switched on, as DeepSpeed reads "enabled" (a bool, or the string "true")."""
    return isinstance(block, dict) and ds_bool(block.get("enabled", False))


def json_precision(config: dict[str, Any]) -> str:
    """The precision a DeepSpeed JSON trains in: bf16, fp16 or fp32."""
    if enabled(config.get("bf16")) or enabled(config.get("bfloat16")):
        return "bf16"
    return "fp16" if enabled(config.get("fp16")) else "fp32"


def plan_disagreements(config: dict[str, Any], plan: Plan, *,
                       max_grad_norm: float | None = None) -> dict[str, tuple[Any, Any]]:
    """Where a DeepSpeed JSON disagrees with the plan it sits beside (and with the run's --max-grad-norm, when
    given): {key: (the file's value, the planned value)}. The one rule `toolkit check`, the Trainer runner and the
    pipeline runner apply. "auto" and absent keys agree (a runner fills them); any other value must equal the
    plan's number. Keys: train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps,
    gradient_clipping (with max_grad_norm), precision (bf16 / fp16 / fp32, bf16-pure planned as bf16),
    zero_optimization.stage (ds_zero_stage) and sequence_parallel_size (the plan's degree; DeepSpeed divides the
    world by it wherever no mpu is passed)."""
    out: dict[str, tuple[Any, Any]] = {}
    numbers = [("train_batch_size", plan.global_batch), ("train_micro_batch_size_per_gpu", plan.micro_batch),
               ("gradient_accumulation_steps", plan.grad_accum)]
    if max_grad_norm is not None:
        numbers.append(("gradient_clipping", max_grad_norm))
    for key, planned in numbers:
        value = config.get(key)
        if value is None or is_auto(value):
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or float(value) != float(planned):
            out[key] = (value, planned)
    planned_precision = {"bf16-pure": "bf16"}.get(plan.precision, plan.precision)
    runner_decides = any(isinstance(config.get(name), dict) and is_auto(config[name].get("enabled"))
                         for name in ("bf16", "fp16"))  # "auto": the runner fills it (precision_blocks)
    if json_precision(config) != planned_precision and not runner_decides:
        out["precision"] = (json_precision(config), plan.precision)
    zero = config.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if isinstance(stage, int) and stage != ds_zero_stage(plan):
        out["zero_optimization.stage"] = (stage, ds_zero_stage(plan))
    sp = config.get("sequence_parallel_size")
    if sp is not None and sp != plan.sequence_parallel:
        out["sequence_parallel_size"] = (sp, plan.sequence_parallel)
    return out

