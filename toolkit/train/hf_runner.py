"""The HF Trainer path: DDP, DeepSpeed ZeRO-1/2/3 (with offload) and FSDP2 plans, configured from plan.json.

Order matters and is the point of this file:
1. on a machine without a GPU, accelerate's shared state is created over gloo first (toolkit.train.cpu);
2. TrainingArguments is created before the model, so that for ZeRO-3 its HfDeepSpeedConfig is alive and
   from_pretrained / from_config build the model partitioned under deepspeed.zero.Init (no full copy per rank);
3. the Trainer fills the DeepSpeed JSON's "auto" values from these arguments (batch sizes, lr, clipping, ...).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from toolkit.emit.user_settings import training_arguments
from toolkit.errors import UserError
from toolkit.plan.schema import Plan
from toolkit.processes import start_up_done
from toolkit.train import checkpoints, cpu, dimensions, imagedata
from toolkit.train.args import TrainArgs
from toolkit.train.data import build_datasets
from toolkit.train.watch import held_state_bytes, param_dtypes, watch_layer_dtype, watch_step_peak
from toolkit.inputs.choices import TRL_LOSS
from toolkit.inputs.strategy import Engine
from toolkit.train.model import (build_model, check_matches_plan, check_vocab, freeze_vision_tower, load_config,
                                 load_tokenizer, model_source)
from toolkit.plan.files import DS_CONFIG


def plan_dir(args: TrainArgs) -> Path:
    path = Path(args.plan)
    return path if path.is_dir() else path.parent


def train_hf(plan: Plan, args: TrainArgs) -> int:
    if plan.engine not in (Engine.DDP, Engine.DEEPSPEED, Engine.FSDP2):
        raise UserError(f"plan engine {plan.engine!r} is not one the HF Trainer path runs (ddp, deepspeed, fsdp2)")
    rewards = None
    if plan.grpo:
        from toolkit.train.grpo import check_grpo_run

        rewards = check_grpo_run(plan, args, on_cpu=cpu.on_cpu())
    elif args.reward:
        raise UserError("--reward applies to GRPO plans and this plan is not one: it would be ignored; drop it")
    if plan.activation_offloading and plan.grpo:  # the planner refuses it too (toolkit.inputs.grpo)
        raise UserError("the plan offloads activations: TRL 1.16's GRPOConfig has no activation_offloading; re-plan "
                        "without --activation-offloading")
    from toolkit.train.dpo import check_dpo_run

    check_dpo_run(plan, args)
    dimensions.check_runnable(plan, on_cpu=cpu.on_cpu())
    if args.resume and (problem := plan.grid.resume_problem()):
        raise UserError(f"--resume: {problem}; start again without --resume")
    output = Path(args.output)
    resume_from = _resume_point(output, args.resume)

    source = model_source(plan, args.model, random_init=args.random_init)
    config = load_config(source, random_init=args.random_init)
    check_matches_plan(config, plan, source)
    tokenizer_source = args.tokenizer or (source if not Path(source).is_file() else str(Path(source).parent))
    processor = None
    if plan.images_per_sample:  # the model's own processor: its tokenizer, image processor and chat template
        processor = imagedata.load_processor(tokenizer_source)
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(tokenizer_source)
    check_vocab(config, tokenizer, source)

    from toolkit.train.adapters import adapter_for_run

    adapter = adapter_for_run(plan, args)
    dimensions.leave_sharding_to_transformers(plan)
    state = (cpu.configure_cpu_state(plan.engine, sequence_parallel=plan.sequence_parallel > 1) if cpu.on_cpu()
             else None)
    training_args = _training_arguments(plan, args, output, on_cpu=state is not None)
    _check_world(plan, training_args.world_size)
    start_up_done()  # torch, transformers, accelerate and the engine are imported (toolkit.processes)
    # Data before the model: bad data fails in seconds, not after a 70B model has loaded.
    if plan.grpo:
        from toolkit.train.grpo import build_prompt_datasets

        train_data, eval_data = build_prompt_datasets(args.data)
    elif plan.dpo:
        from toolkit.train.dpo import build_preference_datasets

        train_data, eval_data = build_preference_datasets(args.data, eval_fraction=args.eval_fraction,
                                                          seed=args.seed, max_eval_pairs=args.max_eval_blocks)
    elif processor is not None:
        train_data, eval_data = imagedata.build_image_datasets(args.data, plan, eval_fraction=args.eval_fraction,
                                                               seed=args.seed, max_eval_blocks=args.max_eval_blocks)
        collator, _ = imagedata.image_collator(processor, config, plan)
        imagedata.check_rows_fit(train_data, collator, plan)
    else:
        train_data, eval_data = build_datasets(args.data, tokenizer, plan.seq_len, eval_fraction=args.eval_fraction,
                                               seed=args.seed, text_field=args.text_field,
                                               max_eval_blocks=args.max_eval_blocks)
    from transformers import set_seed

    def new_model():
        set_seed(args.seed)  # random init (--random-init, new heads) is the same on every rank and every run
        return build_model(source, config, plan, random_init=args.random_init, attention=_attention(plan),
                           adapter=adapter, distributed_config=dimensions.distributed_config(plan))

    model = new_model()
    freeze_vision_tower(model, plan)
    if processor is not None:
        imagedata.count_labels_across_ranks(model)
    ref_model = None
    if plan.dpo:
        from toolkit.train.dpo import needs_reference_model

        # The policy's twin (the same weights, random ones included): DPO's reference at step 0 is the policy.
        ref_model = new_model() if needs_reference_model(plan, adapter) else None
    elif plan.grpo and plan.grpo_spec.reference_kept and adapter is None:
        ref_model = new_model()  # the policy's twin (beta > 0, full fine-tuning: toolkit.train.grpo)
    if plan.engine == Engine.DEEPSPEED and plan.zero_stage == 3 and not (adapter and adapter.method == "qlora"):
        _check_born_partitioned(model)  # transformers builds a quantised model on meta, never under zero.Init
    if plan.tiled:
        # The patch the planner traced (toolkit.patches.tiling): DeepSpeed's TiledMLP in every layer, the tiled
        # logits + loss in the forward; ranks agree on the chunk counts (ZeRO-3 gathers per module call).
        from toolkit.patches.tiling import apply_tiling

        apply_tiling(model, agree_across_ranks=True)
    if plan.loss == TRL_LOSS:
        # The head + loss the planner traced (toolkit.patches.trlloss): TRL's own fused LM head, as SFTTrainer
        # patches it, and SFTTrainer's loss over it; before PEFT wraps the model, as SFTTrainer does.
        from toolkit.patches.trlloss import apply_trl_loss

        apply_trl_loss(model)
    if adapter is not None and not (plan.dpo or plan.grpo):  # TRL wraps it (peft_config); disabled: the reference
        from toolkit.train.adapters import wrap_model

        model = wrap_model(model, adapter, checkpointing=plan.checkpointing)
    trainer = _make_trainer(plan, args, model, tokenizer, training_args, train_data, eval_data,
                            ref_model=ref_model, adapter=adapter, rewards=rewards,
                            collator=collator if processor is not None else None)
    seen_dtypes = watch_layer_dtype(model, plan.layer_class)
    watch_step_peak(trainer, seen_dtypes)  # the rank summary's step_peak_bytes
    unpinned = cpu.unpinned_offload(trainer.accelerator)
    unpacked = cpu.unpacked_4bit(model, ref_model)
    if state is None or trainer.is_world_process_zero():
        print(_banner(plan, args, training_args, len(train_data), eval_data), flush=True)
        for note in (unpinned, unpacked):
            if note:
                print(f"note: {note}", flush=True)
    from toolkit.patches.compiledckpt import checkpointed_layers_compiled

    with checkpointed_layers_compiled(model):  # checkpointed layers inside the compiled graph, as the plan assumes
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    refuse_untrained(trainer.state.global_step, len(train_data), plan)
    if eval_data is not None and trainer.state.global_step % training_args.eval_steps != 0:
        trainer.evaluate()  # the final model's held-out loss and perplexity, unless the last step just did it
    trainer.save_state()  # OUTPUT/trainer_state.json: the whole log history (losses, tokens/s, memory)
    _write_rank_summary(trainer, seen_dtypes)
    if not args.no_save_final:
        save_final(trainer, processor or tokenizer, output)  # an image plan's output keeps its processor
        if adapter is not None and args.merge_final and trainer.is_world_process_zero():
            from toolkit.train.adapters import base_dtype, save_merged

            save_merged(source, output, output / "merged", base_dtype(plan))
            tokenizer.save_pretrained(str(output / "merged"))
            print(f"saved the merged model to {output / 'merged'}", flush=True)
    return 0


def refuse_untrained(steps: int, sequences: int, plan: Plan) -> None:
    """A run that made no optimizer step must not save its model as trained (nor exit 0): the data held fewer
    sequences than one step takes, or every one was dropped."""
    if steps == 0:
        raise UserError(f"training made no optimizer step ({sequences} training sequence(s) of {plan.seq_len} "
                        f"tokens; one step takes a global batch of {plan.global_batch}); nothing was saved as "
                        "trained: give more data or plan a smaller --global-batch")


def _check_born_partitioned(model) -> None:
    """ZeRO-3: from_pretrained / from_config must have run under deepspeed.zero.Init (each rank holds 1/N of
    every weight; otherwise every rank first holds a full copy in host RAM). That needs TrainingArguments
    (with its HfDeepSpeedConfig) alive before the model is created, which train_hf guarantees."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    param = next(model.parameters())
    if not (is_deepspeed_zero3_enabled() and hasattr(param, "ds_id")):
        raise RuntimeError("ZeRO-3 plan but the model was not created under deepspeed.zero.Init")


def _resume_point(output: Path, resume: bool) -> Path | None:
    last = checkpoints.last_complete_checkpoint(output)
    if resume:
        if last is None and _is_rank_zero():
            print(f"note: --resume found no complete checkpoint in {output}; starting from step 0", flush=True)
        return last
    if checkpoints.checkpoint_dirs(output):
        raise UserError(f"output {output} already holds checkpoints; pass --resume to continue that run, "
                        "or choose another --output")
    return None


def check_ds_config_agrees(plan: Plan, args: TrainArgs, ds_file: Path) -> None:
    """The concrete values of ds_config.json against the plan and flags, before any process group or model: the
    Trainer checks the same only inside train(), after the model has loaded, and with a traceback per rank."""
    import json

    try:
        config = json.loads(Path(ds_file).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {ds_file}: {exc}") from None
    from toolkit.emit.deepspeed import plan_disagreements

    sources = {"train_micro_batch_size_per_gpu": "the plan's micro-batch",
               "gradient_accumulation_steps": "the plan's accumulation", "gradient_clipping": "--max-grad-norm"}
    disagree = plan_disagreements(config, plan, max_grad_norm=args.max_grad_norm)
    for key, source in sources.items():  # the rest (batch size, precision, stage) the Trainer's own checks refuse
        if key in disagree:
            found, value = disagree[key]
            raise UserError(f"{ds_file} sets {key} {found} but {source} is {value}; make them agree (edit the JSON "
                            f"or re-emit the plan)")


def _training_arguments(plan: Plan, args: TrainArgs, output: Path, *, on_cpu: bool):
    """TrainingArguments of the plan and the run (TRL's DPOConfig, which extends them, for a DPO plan)."""
    from transformers import TrainingArguments

    config_class = TrainingArguments
    if plan.dpo:
        from trl import DPOConfig

        from toolkit.train.dpo import dpo_config_kwargs

        config_class = DPOConfig
    elif plan.grpo:
        from trl import GRPOConfig

        config_class = GRPOConfig
    deepspeed = None
    if plan.engine == Engine.DEEPSPEED:
        deepspeed = plan_dir(args) / DS_CONFIG
        if not deepspeed.is_file():
            raise UserError(f"plan {args.plan} is a DeepSpeed plan but {deepspeed} is missing; "
                            "emit it with `toolkit emit` next to plan.json")
        check_ds_config_agrees(plan, args, deepspeed)
        deepspeed = str(deepspeed)
        if plan.grid.autoep:
            from toolkit.patches.autoep import autoep_ready

            deepspeed = autoep_ready(deepspeed, on_cpu)
    if plan.precision == "fp16" and on_cpu:
        raise UserError("fp16 cannot run on a CPU (DeepSpeed refuses it and accelerate ignores it); "
                        "rehearse fp16 plans as bf16 (`toolkit launch --rehearse` does)")
    report_to = ["tensorboard"] if _has_tensorboard() else []
    if report_to:
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(args.log_dir or output / "runs")
    eval_steps = args.eval_steps or args.save_steps
    # The plan's numbers (batch, accumulation, precision, optimizer, clipping, checkpointing): the same dict a user's
    # script gets in training_args.json.
    kwargs = dict(training_arguments(plan))
    kwargs.update(
        output_dir=str(output),
        max_steps=args.max_steps,
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        lr_scheduler_type=args.lr_scheduler,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        logging_steps=args.logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=None,  # rotation is ours: see toolkit.train.checkpoints
        eval_strategy="steps",  # set to "no" by _make_trainer when the data has no held-out blocks
        eval_steps=eval_steps,
        seed=args.seed,
        data_seed=args.seed,
        report_to=report_to,
        deepspeed=deepspeed,
        dataloader_drop_last=True,
        remove_unused_columns=False,
        # On CPU this also lifts transformers' GPU-only bf16 check (is_torch_bf16_gpu_available), which refuses
        # bf16 with DeepSpeed otherwise; the engines themselves run on the gloo state configured before.
        use_cpu=on_cpu,
    )
    if (parallelism := dimensions.parallelism_config(plan, _attention(plan))) is not None:
        kwargs["parallelism_config"] = parallelism
    if args.compile:
        kwargs["torch_compile"] = True
    if plan.dpo:
        kwargs.update(dpo_config_kwargs(plan))
    elif plan.grpo:
        from toolkit.train.grpo import grpo_config_kwargs

        kwargs.update(grpo_config_kwargs(plan))
    kwargs.update(user_trainer_flags(plan, args.trainer_flags, kwargs))
    accelerator_config: dict = dict(kwargs.pop("accelerator_config", {}))
    if on_cpu:
        # The state made by configure_cpu_state: without it the Trainer would make its own, without gloo.
        accelerator_config["use_configured_state"] = True
    if accelerator_config:
        kwargs["accelerator_config"] = accelerator_config
    if on_cpu and plan.engine == Engine.DDP:
        kwargs["ddp_backend"] = "gloo"
    try:
        return config_class(**kwargs)
    except ValueError as exc:
        raise UserError(f"training arguments rejected: {exc}") from None


PLAN_OWNED_FLAGS = ("deepspeed", "fsdp", "fsdp_config", "use_cpu", "accelerator_config", "parallelism_config",
                    "gradient_checkpointing",
                    "gradient_checkpointing_kwargs", "activation_checkpointing", "activation_checkpointing_kwargs")
"""TrainingArguments the plan (or toolkit.train's engine set-up) decides, besides training_arguments(plan)'s keys."""


def user_trainer_flags(plan: Plan, flags: dict, kwargs: dict) -> dict:
    """The TrainingArguments flags a user gave (e.g. --report_to wandb) that toolkit.train passes on: all of them,
    except a value for a plan-owned setting that differs from the plan's, which is dropped with a warning."""
    owned = set(training_arguments(plan)) | set(PLAN_OWNED_FLAGS)
    if plan.grpo:
        owned |= set(plan.grpo_spec.grpo_config_kwargs())  # num_generations, lengths, beta: the plan's memory
    passed = {}
    for name, value in flags.items():
        if name in owned:
            if value != kwargs.get(name) and _is_rank_zero():
                print(f"warning: --{name} {value} ignored: the plan sets {name}={kwargs.get(name)!r} (its memory and "
                      "batch arithmetic depend on it; re-plan to change it)", flush=True)
            continue
        passed[name] = value
    return passed


def _write_rank_summary(trainer, seen_dtypes: dict) -> None:
    """Test and debugging hook: with TOOLKIT_RANK_SUMMARY_DIR set, every rank writes what it trained
    (its log history and a checksum of the parameters it holds), so a test can check that replicas agree."""
    folder = os.environ.get("TOOLKIT_RANK_SUMMARY_DIR")
    if not folder:
        return
    import torch
    from toolkit.inputs.moe import is_expert_param
    from toolkit.train.callbacks import ProbeAtSave, probe_logits
    from toolkit.train.grpo import reward_model_numel

    rank = trainer.args.process_index
    model = trainer.model
    was_training = model.training
    model.eval()
    with torch.no_grad():
        checksum = local_param_abs_sum(model)
        # QLoRA: elements of the 4-bit weights (packed codes) this rank holds, and in all (whole on every rank
        # unless FSDP2 / ZeRO-3 shard them: toolkit.inputs.lora.quantized_base_sharded).
        four_bit = [m.weight for m in model.modules() if type(m).__name__ == "Linear4bit"]
        four_bit_numel = [sum(getattr(p, "_local_tensor", p).numel() for p in four_bit),
                          sum(p.numel() for p in four_bit)]
        # Routed experts' parameters: elements this rank holds, and in all (expert parallelism splits them).
        experts = [p for name, p in model.named_parameters() if is_expert_param(name)]
        expert_numel = [sum(getattr(p, "_local_tensor", p).numel() for p in experts), sum(p.numel() for p in experts)]
        param_bytes, optimizer_bytes = held_state_bytes(model, trainer.optimizer)  # the plan's figures a rank
    model.train(was_training)
    probe, logits = probe_logits(model, trainer.args.device)
    at_save = next((c.logits for c in trainer.callback_handler.callbacks if isinstance(c, ProbeAtSave)), {})
    summary = {"rank": rank, "world": trainer.args.world_size, "node": launcher_node_rank(),
               "global_step": trainer.state.global_step,
               "log_history": trainer.state.log_history, "local_param_abs_sum": checksum,
               "probe_input_ids": probe, "probe_logits": logits, "saved_probe_logits": at_save, **seen_dtypes,
               "compiled_graphs": _compiled_graphs(), "tiled_chunks": _tiled_chunks(),
               "activation_offloaded": _activation_offloaded(),
               "reference_model": getattr(trainer, "ref_model", None) is not None,  # DPO / GRPO: one is held
               "reward_model_numel": reward_model_numel(trainer),  # GRPO --reward-model: its elements on this rank
               "image_tokens_seen": imagedata.SEEN.get("image_tokens"),  # per image, by the image collator
               **param_dtypes(model),
               "four_bit_numel": four_bit_numel, "expert_numel": expert_numel, "param_bytes": param_bytes,
               "optimizer_bytes": optimizer_bytes,
               "toolkit_plan_dir": os.environ.get("TOOLKIT_PLAN_DIR"),
               # modules ZeRO-3 fetched whole: DeepSpeed's flag (deepspeed/utils/z3_leaf_module.py z3_leaf_module)
               "z3_leaf_modules": sorted({type(m).__name__ for m in model.modules() if getattr(m, "_z3_leaf", False)})}
    write_rank_summary(folder, rank, summary)


def local_param_abs_sum(module) -> float:
    """The rank summaries' parameter checksum: the sum of |x| over the parameters this rank holds, in float64 (a
    DTensor's local shard under tensor parallelism), equal on replicas that hold the same values."""
    return sum(float(getattr(p, "_local_tensor", p).detach().double().abs().sum()) for p in module.parameters())


def write_rank_summary(folder: str, rank: int, summary: dict) -> None:
    """folder/rankN.json: what rank N trained (both runners write one; toolkit.run.rehearsal compares them)."""
    import json

    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(summary) + "\n")


def read_rank_summaries(folder) -> list[dict]:
    """The summaries write_rank_summary wrote in `folder`, in rank order (rank10 after rank9)."""
    import json

    ranks = sorted(Path(folder).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in ranks]


def _tiled_chunks() -> dict:
    """The chunk counts ALST tiling last ran (empty when it did not run)."""
    from toolkit.patches.tiling import LAST_CHUNKS

    return dict(LAST_CHUNKS)


def _activation_offloaded() -> dict:
    """Tensors and bytes TRL's offloading moved to the host in the last micro-step (empty when it did not run)."""
    from toolkit.patches.actoffload import LAST_OFFLOADED

    return dict(LAST_OFFLOADED)


def launcher_node_rank() -> int | None:
    """The node this process was started on, as its launcher numbered it: torchrun's GROUP_RANK (accelerate
    launch --machine_rank), DeepSpeed launch's CROSS_RANK (--node_rank); None when neither launcher said."""
    for name in ("GROUP_RANK", "CROSS_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def _compiled_graphs() -> int:
    """Graphs torch.compile (Dynamo) compiled in this process: 0 when nothing ran compiled."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _make_trainer(plan, args, model, tokenizer, training_args, train_data, eval_data, *, ref_model=None,
                  adapter=None, rewards=None, collator=None):
    from transformers import Trainer, default_data_collator
    from transformers.trainer_utils import IntervalStrategy

    from toolkit.patches.actoffload import OffloadedSteps
    from toolkit.train.autoep_export import AutoEPSaves
    from toolkit.train.callbacks import CheckpointMarker, ProbeAtSave, ThroughputLog

    class PlanTrainer(AutoEPSaves, OffloadedSteps, dimensions.SequenceParallelGradient, Trainer):
        """Adds tokens/s, per-rank peak memory and perplexity to every log line (stdout and TensorBoard)."""

        def log(self, logs, *a, **kw):
            throughput.add_to(logs, self)
            if "eval_loss" in logs:
                logs["eval_perplexity"] = math.exp(min(logs["eval_loss"], 50.0))
            super().log(logs, *a, **kw)

    if eval_data is None:
        training_args.eval_strategy = IntervalStrategy.NO
    # A DPO step runs each pair's chosen and rejected sequences (padded to the plan's max_length).
    throughput = ThroughputLog(tokens_per_step=plan.global_batch * plan.seq_len * (2 if plan.dpo else 1),
                               **_predicted_step(plan))
    callbacks = [CheckpointMarker(args.output, args.save_total_limit)]
    callbacks += [ProbeAtSave()] if os.environ.get("TOOLKIT_RANK_SUMMARY_DIR") else []  # _write_rank_summary's
    if plan.grpo:
        from toolkit.train.grpo import make_grpo_trainer

        return make_grpo_trainer(plan, model=model, ref_model=ref_model, rewards=rewards, adapter=adapter,
                                 tokenizer=tokenizer, training_args=training_args, train_data=train_data,
                                 callbacks=callbacks, throughput=throughput)
    if plan.dpo:
        from toolkit.train.dpo import make_dpo_trainer

        return make_dpo_trainer(plan, model=model, ref_model=ref_model, adapter=adapter, tokenizer=tokenizer,
                                training_args=training_args, train_data=train_data, eval_data=eval_data,
                                callbacks=callbacks, throughput=throughput)
    sequence_parallel = plan.sequence_parallel > 1
    collator = collator or default_data_collator  # an image plan's: toolkit.train.imagedata.image_collator
    if sequence_parallel:  # Ulysses: position_ids in every batch, each epoch from the loader's start
        collator = dimensions.sequence_parallel_collator(collator)
        dimensions.close_each_pass()
    trainer = PlanTrainer(model=model, args=training_args, train_dataset=train_data,
                          eval_dataset=eval_data if eval_data is not None else None,
                          data_collator=collator, processing_class=tokenizer, callbacks=callbacks)
    if plan.activation_offloading:
        from toolkit.patches.actoffload import step_offload

        # As SFTTrainer builds it: after Trainer.__init__ (the model on its device), before accelerate wraps it.
        trainer.offload = step_offload(plan, trainer.model, on_cpu=cpu.on_cpu())
    return trainer


def _predicted_step(plan: Plan) -> dict:
    """The plan's predicted step time and its band, for the time to finish, where they apply to this run: on the
    GPUs it was planned for, as many as planned, or for a `2xcpu` plan on the CPU and thread count its rates were
    measured at (a run elsewhere says so once and times itself), from a prediction that is not stale."""
    from toolkit.inputs.hardware import find_gpu
    from toolkit.train.callbacks import cpu_here, device_here, off_planned_hardware

    predicted = plan.predicted.get("step_time_s")
    if not predicted or plan.prediction_is_stale:
        return {}
    device = device_here()
    elsewhere = off_planned_hardware(find_gpu(plan.gpu), plan.world_size, device,
                                     int(os.environ.get("WORLD_SIZE", "1")),
                                     planned_cpu=(plan.predicted.get("cpu_model"), plan.predicted.get("cpu_threads")),
                                     cpu=cpu_here() if device is None else None)
    if elsewhere:
        if _is_rank_zero():
            print(f"note: the plan predicts a {predicted:.3f} s step on {plan.world_size}x {plan.gpu}; {elsewhere}, "
                  "and the prediction holds only on the planned GPUs: this run logs its time left at its own "
                  "measured step (time_left_s), not against that prediction", flush=True)
        return {}
    return {"predicted_step_s": float(predicted), "band": plan.predicted.get("step_time_band")}


def save_final(trainer, tokenizer, output: Path) -> None:
    """The final model in HF format (ZeRO-3 gathered, FSDP2 full state dict) + tokenizer, loadable by from_pretrained."""
    accelerator = trainer.accelerator
    if trainer.is_deepspeed_enabled:
        # Without this flag a ZeRO-3 save comes out empty (a top user complaint): force the gather for the final save.
        zero = accelerator.deepspeed_config.get("zero_optimization", {})
        if zero.get("stage") == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
            trainer.model_wrapped._config.zero_config.gather_16bit_weights_on_model_save = True
    if trainer.is_fsdp_enabled:
        accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(str(output))  # an AutoEP model in its transformers layout (autoep_export.AutoEPSaves)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(str(output))
        if hasattr(trainer.model, "peft_config"):
            print(f"saved the trained adapter (PEFT format) and tokenizer to {output} (load with "
                  "PeftModel.from_pretrained onto the base model)", flush=True)
        else:
            print(f"saved the trained model and tokenizer to {output} (load with from_pretrained)", flush=True)


def _check_world(plan: Plan, world: int) -> None:
    if world != plan.world_size and (plan.grid.model_parallel > 1 or plan.grid.expert > 1):
        raise UserError(f"the plan is for {plan.world_size} processes ({plan.grid.describe()}) but {world} were "
                        "started; its tensor / sequence / context / expert groups need exactly that many "
                        "(start it with `toolkit launch`, or re-plan for this GPU count)")
    if world != plan.world_size and plan.engine == Engine.DEEPSPEED:
        raise UserError(f"the plan is for {plan.world_size} processes but {world} were started; its DeepSpeed "
                        f"train_batch_size {plan.global_batch} assumes {plan.data_parallel} data-parallel ranks "
                        "(start it with `toolkit launch`, or re-plan for this GPU count)")
    if world != plan.world_size and _is_rank_zero():
        print(f"note: running on {world} process(es), the plan was made for {plan.world_size}; the global batch "
              f"is {plan.micro_batch} x {plan.grad_accum} x {world} = {_global_batch(plan, world)} instead of "
              f"{plan.global_batch}", flush=True)


def _global_batch(plan: Plan, world: int) -> int:
    """The batch a launch of `world` processes really steps with (the plan's grid at that world size)."""
    from toolkit.inputs.grid import ParallelGrid

    if world == plan.world_size:
        return plan.grid.global_batch(plan.micro_batch, plan.grad_accum)
    return ParallelGrid(1, world, dp_shard=world).global_batch(plan.micro_batch, plan.grad_accum)


def _degrees(plan: Plan) -> str:
    return f"{plan.grid.describe()}, " if plan.grid.model_parallel > 1 or plan.grid.expert > 1 else ""


def _data_parallel(plan: Plan, world: int) -> int:
    return plan.grid.data_parallel if world == plan.world_size else world


def _attention(plan: Plan) -> str:
    if plan.attention == "flash_attention_2" and cpu.on_cpu():
        # Flash-attention kernels exist only on GPUs: transformers' default for the model instead, same math (sdpa,
        # or eager where the class has no sdpa: Gemma-2, GPT-OSS run flash on a GPU and eager here).
        from toolkit.inputs.attention import config_attention, default_attention

        found = config_attention({**plan.model_config, "model_type": plan.model_type}, plan.model)
        return default_attention(found[1]) if found else "sdpa"
    return plan.attention


def _banner(plan, args, training_args, n_train, eval_data) -> str:
    unit = ("pairs", "pairs") if plan.dpo else ("completions", "prompts") if plan.grpo else ("sequences", "blocks")
    return (f"toolkit.train: {plan.strategy} ({plan.engine}), {plan.model_type} {plan.num_layers} layers, "
            f"{_degrees(plan)}seq {plan.seq_len}, micro {plan.micro_batch} x accum {plan.grad_accum} x dp "
            f"{_data_parallel(plan, training_args.world_size)}"
            f" = {_global_batch(plan, training_args.world_size)} {unit[0]}/step, "
            f"{plan.precision}, {n_train} train {unit[1]}, "
            f"{len(eval_data) if eval_data is not None else 0} eval {unit[1]}{_method_words(plan)}")


def _method_words(plan: Plan) -> str:
    from toolkit.inputs.grpo import grpo_words
    from toolkit.inputs.preference import reference_words

    return reference_words(plan.dpo_spec) + grpo_words(plan.grpo_spec) \
        + (", TRL's chunked NLL (TRL's fused LM head)" if plan.loss == TRL_LOSS else "")


def _is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True
