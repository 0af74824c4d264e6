"""Findings of one DeepSpeed JSON for the runners that may read it (the HF Trainer, an accelerate script, a
script under the deepspeed launcher, toolkit.train's pipeline engine): "auto" nobody fills, keys DeepSpeed ignores,
ZeRO settings, the batch identity."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any


from toolkit.emit.deepspeed import auto_keys, ds_bool, is_auto
from toolkit.check.findings import ACCELERATE, DEEPSPEED, EVERY, HF_RUNNERS, PIPELINE, Problem, Severity, TRAINER
from toolkit.engines.validate import sequence_parallel_problem
from toolkit.engines.readers import (_mapping, accelerate_view, concrete_int, deepspeed_reads_all, enabled, trainer_view,
                                     unfilled, without_auto, zero_settings)


# --- DeepSpeed JSON ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Readers:
    """Who reads a DeepSpeed JSON, and at what scale."""
    runners: frozenset[str]
    """The runners that may read it: a failure of all of them is an error, of some a warning naming them."""
    world_size: int | None = None
    pipeline_stages: int = 1
    sequence_parallel: int | None = 1
    """The launch's own sequence-parallel degree (accelerate's ParallelismConfig sp_size: the Ulysses mpu it hands
    DeepSpeed, which then divides the world by it and ignores the file's sequence_parallel_size); None: unknown (a
    lone JSON: the user's script may build its own ParallelismConfig)."""

    @property
    def pipeline(self) -> bool:
        return PIPELINE in self.runners

    def mpu(self, runner: str) -> Any:
        """The mpu `runner` hands deepspeed.initialize (None: DeepSpeed reads the file's own degrees)."""
        from toolkit.engines.validate import pipeline_mpu, ulysses_mpu

        if runner == PIPELINE and self.world_size is not None:
            return pipeline_mpu(self.world_size // max(self.pipeline_stages, 1))
        if runner in HF_RUNNERS and (self.sequence_parallel or 1) > 1:
            return ulysses_mpu(self.sequence_parallel)
        return None

    @property
    def direct(self) -> str:
        """The runner that hands the file to deepspeed.initialize unchanged."""
        return PIPELINE if self.pipeline else DEEPSPEED


def readers_of_json(config: dict[str, Any], *, world_size: int | None, runner: str | None,
                    named_by_yaml: bool = False, sequence_parallel: int | None = None) -> Readers:
    """sequence_parallel: the launch's ParallelismConfig sp_size when a YAML says it (None: unknown)."""
    if runner is not None:
        runners = frozenset({runner})
    elif named_by_yaml or auto_keys(config):
        # "auto" is filled only by the HF Trainer and accelerate; a YAML's JSON is read through accelerate.
        runners = HF_RUNNERS
    else:
        runners = HF_RUNNERS | {DEEPSPEED}
    return Readers(runners, world_size, sequence_parallel=sequence_parallel)


class _Findings:
    """Collects findings of one file, grading each by the runners it concerns."""

    def __init__(self, file: str, readers: Readers) -> None:
        self.file, self.readers, self.out = file, readers, []

    def fail(self, runners: frozenset[str] | set[str], message: str, *, at_most: Severity = "error") -> None:
        """`runners` would fail or silently misbehave: an error when that is every runner that may read the file."""
        concerned = frozenset(runners) & self.readers.runners
        if not concerned:
            return
        severity: Severity = "error" if concerned == self.readers.runners else "warning"
        severity = min(severity, at_most, key=["note", "warning", "error"].index)
        label = EVERY if concerned >= HF_RUNNERS | {self.readers.direct} else ", ".join(sorted(concerned))
        self.out.append(Problem(self.file, severity, message, label))

    def note(self, message: str, runner: str = EVERY) -> None:
        self.out.append(Problem(self.file, "note", message, runner))

    @property
    def has_error(self) -> bool:
        return any(p.severity == "error" for p in self.out)


def ds_problems(config: dict[str, Any], file: str, readers: Readers) -> list[Problem]:
    """Findings of one DeepSpeed JSON for the runners that may read it."""
    f = _Findings(file, readers)
    direct = readers.direct
    everyone = HF_RUNNERS | {direct}
    zero = config.get("zero_optimization")
    if zero is None:
        # accelerate's DeepSpeedPlugin.__post_init__: "Please specify the ZeRO optimization config". DeepSpeed itself
        # defaults to stage 0, so a file without "auto" (likely a deepspeed-launcher file) gets a note; the DeepSpeed
        # autotuner writes the block into each experiment's config.
        tuned = enabled(config.get("autotuning"))
        f.fail(HF_RUNNERS, "no \"zero_optimization\" block: accelerate refuses the file; add \"zero_optimization\": "
               "{\"stage\": 0} (or the stage you want)" + ("; the DeepSpeed autotuner adds it to each experiment it "
                                                           "runs" if tuned else ""),
               at_most="note" if tuned or DEEPSPEED in readers.runners else "error")
        zero = {}
    elif not isinstance(zero, dict):
        f.fail(everyone, "\"zero_optimization\" must be an object like {\"stage\": 2}")
        zero = {}
    stage_auto = zero.get("stage") == "auto"
    if stage_auto and HF_RUNNERS & readers.runners:
        # DeepSpeedPlugin fills it from `accelerate launch --zero_stage` (default 2) through fill_match.
        view, _ = accelerate_view(config)
        filled = _mapping(_mapping(view).get("zero_optimization")).get("stage")
        f.note(f"zero_optimization.stage is \"auto\": accelerate fills it from `accelerate launch --zero_stage` "
               f"(here {filled}); checked as ZeRO-{filled}", ", ".join(sorted(HF_RUNNERS & readers.runners)))
        zero = {**zero, "stage": filled} if isinstance(filled, int) else zero
    settings = zero_settings(zero)
    stage = settings.stage if settings else (zero.get("stage") if isinstance(zero.get("stage"), int) else 0)
    for name, new in settings.deprecated if settings else ():
        f.note(f"zero_optimization.{name} is a deprecated name that DeepSpeed still honours; the current one is "
               f"\"{new}\"")

    if enabled(config.get("bf16")) and enabled(config.get("fp16")):
        f.fail(everyone, "bf16 and fp16 are both enabled: DeepSpeed refuses this; set \"enabled\": false in one of them")
    batch_found = batch_problems(config, readers)
    for runners, message in batch_found:
        f.fail(runners, message)
    _sequence_parallel_problems(config, f, stage)
    _sp_gradient_problem(config, f, stage)
    _auto_problems(config, f, stage)

    if readers.pipeline and stage >= 2:
        f.fail({PIPELINE}, f"ZeRO-{stage} with pipeline parallelism: DeepSpeed's pipeline engine refuses stages 2 "
               "and 3; use \"stage\": 1 (or 0)")
    if readers.pipeline and enabled(config.get("bf16")):
        accum = _mapping(config.get("data_types")).get("grad_accum_dtype")
        if accum != "fp32":
            f.fail({PIPELINE}, "bf16 pipeline accumulates gradients in bf16 (not numerically safe over many "
                   "micro-batches); add \"data_types\": {\"grad_accum_dtype\": \"fp32\"} with ZeRO stage 1",
                   at_most="warning")
        elif stage == 0:
            f.fail({PIPELINE}, "bf16 with \"grad_accum_dtype\": \"fp32\" at ZeRO-0: DeepSpeed refuses this mix; use "
                   "\"zero_optimization\": {\"stage\": 1}")

    if settings is not None:
        for name, device, path, min_stage, what in (
                ("offload_optimizer", settings.offload_optimizer, settings.offload_optimizer_nvme_path, 1, "ZeRO 1-3"),
                ("offload_param", settings.offload_params, settings.offload_params_nvme_path, 3, "ZeRO-3")):
            if device == "none":
                continue
            if stage < min_stage:  # DeepSpeed ignores the block below these stages: no offload, silently
                f.fail(everyone, f"zero_optimization.{name} at ZeRO-{stage}: {name.replace('_', ' ')} needs {what}; "
                       f"set \"stage\": {min_stage if min_stage == 3 else 2} or remove {name}",
                       at_most="warning" if stage_auto else "error")  # "auto": the launch command may say 3
            if device == "nvme" and not path:
                f.fail(everyone, f"zero_optimization.{name} goes to nvme without \"nvme_path\": set it to a "
                       "directory on a local NVMe drive of every node")
    if stage == 3 and _autoep_enabled(config):
        _autoep_zero3_problems(config, zero, f)
    elif _autoep_enabled(config):
        f.fail(everyone | {DEEPSPEED}, AUTOEP_SAVED_LAYOUT, at_most="note")
    elif stage == 3:
        _zero3_save_problem(config, zero, f)
    _engine_problems(config, f, said_batch=bool(batch_found))
    return f.out


def _auto_problems(config: dict[str, Any], f: _Findings, stage: int) -> None:
    autos = auto_keys(config)
    if not autos:
        return
    if f.readers.pipeline:
        f.fail({PIPELINE}, f"\"auto\" in {', '.join(autos)}: a pipeline run calls deepspeed.initialize itself and "
               "nothing fills \"auto\"; write concrete values (toolkit emit does)")
        return
    f.fail({DEEPSPEED}, f"\"auto\" in {len(autos)} value(s) ({', '.join(autos[:3])}{', ...' if len(autos) > 3 else ''})"
           ": deepspeed.initialize fills nothing, only the HF Trainer and accelerate do; write values for a "
           "deepspeed-launcher script")
    left: dict[str, set[str]] = {}
    refused: dict[str, str] = {}
    if TRAINER in f.readers.runners:
        trainer, why = trainer_view(config, f.readers.world_size)
        if why is not None:
            refused[TRAINER] = why
        else:
            view, why = accelerate_view(trainer)  # the Trainer hands its filled config to accelerate
            if why is not None:
                refused[TRAINER] = why
            for key in unfilled(view):
                left.setdefault(key, set()).add(TRAINER)
    if ACCELERATE in f.readers.runners:
        view, why = accelerate_view(config)
        if why is not None:
            refused[ACCELERATE] = why
        for key in unfilled(view):
            left.setdefault(key, set()).add(ACCELERATE)
    for runner, why in refused.items():
        if "ZeRO optimization config" not in why:  # named above
            f.fail({runner}, f"{'transformers' if runner == TRAINER else 'accelerate'} refuses it: {why}")
    for key, runners in left.items():
        fillers = sorted((HF_RUNNERS & f.readers.runners) - runners)
        if not fillers:
            why = "no runner fills it; write a concrete value"
            from deepspeed.runtime.constants import BFLOAT16, BFLOAT16_OLD

            if key.startswith(f"{BFLOAT16_OLD}."):  # DeepSpeed's old block name; the runners fill only the new one
                why = f"no runner fills it; rename the block to \"{BFLOAT16}\" (DeepSpeed's current name; they fill it)"
            if key.startswith("zero_optimization.stage3_") and stage != 3 and TRAINER in runners:
                why = (f"the HF Trainer fills it only at ZeRO-3 (this file is ZeRO-{stage}); remove the key or "
                       "write a value")
        else:
            why = f"the {' and '.join(fillers)} fills it but the {' and '.join(sorted(runners))} does not; write a value"
        f.fail(runners, f"\"{key}\" is \"auto\": {why}")


def _zero3_save_problem(config: dict[str, Any], zero: dict[str, Any], f: _Findings) -> None:
    """ZeRO-3 keeps each weight in pieces; a full model file needs gather_16bit_weights_on_model_save (DeepSpeed's
    name; stage3_gather_16bit_weights_on_model_save is its alias, stage3_gather_fp16_... the deprecated one)."""
    view, _ = accelerate_view(config) if HF_RUNNERS & f.readers.runners else (None, None)
    gathered = zero_settings(_mapping((view or config).get("zero_optimization")) or zero)
    if gathered is None or gathered.gather_16bit_on_save:
        return
    auto = view is not None and any(zero.get(k) == "auto" for k in ("stage3_gather_16bit_weights_on_model_save",
                                                                      "gather_16bit_weights_on_model_save"))
    said = ("is \"auto\", which accelerate's DeepSpeedPlugin fills from `accelerate launch --zero3_save_16bit_model` "
            "(default false)") if auto else "is not true"
    # transformers Trainer.save_model: catches accelerate's ValueError, keeps only the DeepSpeed checkpoint. "auto"
    # leaves the choice to the launch command, so it is a note; false or missing is a warning.
    f.fail(HF_RUNNERS, f"ZeRO-3 and \"stage3_gather_16bit_weights_on_model_save\" {said}: save_model writes an empty "
           "model (the HF Trainer keeps only the DeepSpeed checkpoint, to be merged with zero_to_fp32.py; accelerate's "
           "save_model raises); " + ("launch with --zero3_save_16bit_model true or write true here" if auto else
                                     "add \"stage3_gather_16bit_weights_on_model_save\": true to zero_optimization"),
           at_most="note" if auto else "warning")


AUTOEP_SAVED_LAYOUT = (
    "DeepSpeed AutoEP: a plain Trainer's save_model (the final folder and the model file of every checkpoint-N), "
    "like any state_dict of the trained model, holds AutoEP's layers (experts.w1 / w2 / w3, router.gate: one rank's "
    "experts, under names from_pretrained does not read, so it fills the experts and router at random); resuming "
    "is unaffected (it reads the engine's global_stepN). toolkit.train saves transformers' layout; a script of your "
    "own does the same with toolkit.train.autoep_export.AutoEPSaves first in its Trainer's bases "
    "(class MyTrainer(AutoEPSaves, Trainer)), or without the Trainer by calling "
    "toolkit.train.autoep_export.save_autoep_model(model, engine._config.expert_parallel_config, OUT, "
    "write=rank == 0) on every rank")
"""What a ZeRO-0/1/2 AutoEP run's own saves hold and how to save them for transformers (measured: docs/ENGINE_FACTS.md,
the AutoEP entries; toolkit/train/autoep_export.py)."""


def _autoep_enabled(config: dict[str, Any]) -> bool:
    """Whether the file turns DeepSpeed AutoEP on (its own reading of the expert_parallel section)."""
    from deepspeed.runtime.config import get_expert_parallel_config

    if not isinstance(config.get("expert_parallel"), dict):
        return False
    try:
        return bool(get_expert_parallel_config(config).enabled)
    except (ValueError, TypeError):  # DeepSpeed's own refusal of the section; _engine_problems reports it
        return False


def _autoep_zero3_problems(config: dict[str, Any], zero: dict[str, Any], f: _Findings) -> None:
    """DeepSpeed AutoEP under ZeRO-3: what deepspeed.initialize refuses (runtime/engine.py
    _validate_zero3_moe_compatibility), and a plain HF Trainer's save, which refuses AutoEP's expert partitions
    whatever the file (toolkit.inputs.autoep.AUTOEP_ZERO3_SAVE); ZeRO-3's usual advice, gathering 16-bit weights on
    save, is what raises here. toolkit.train.autoep_export.AutoEPSaves gathers the partitions itself (measured,
    tests/test_moe.py): the fix named."""
    from toolkit.inputs.autoep import AUTOEP_ZERO3_SAVE

    everyone = HF_RUNNERS | {f.readers.direct}
    refused = "DeepSpeed AutoEP with ZeRO-3: deepspeed.initialize refuses"
    if ds_bool(zero.get("zero_quantized_gradients")):
        f.fail(everyone, f"{refused} zero_quantized_gradients (runtime/engine.py _validate_zero3_moe_compatibility); "
               "set it to false, or use ZeRO-1/2 for AutoEP")
    hpz = concrete_int(zero.get("zero_hpz_partition_size"))
    if hpz and hpz > 1:
        f.fail(everyone, f"{refused} zero_hpz_partition_size {hpz} (hpZ's secondary groups, runtime/engine.py "
               "_validate_zero3_moe_compatibility); set it to 1, or use ZeRO-1/2 for AutoEP")
    sp = concrete_int(config.get("sequence_parallel_size"))
    if sp and sp > 1:
        f.fail(everyone, f"{refused} sequence_parallel_size {sp} (runtime/engine.py "
               "_validate_zero3_moe_compatibility); remove it, or use ZeRO-1/2 for AutoEP")
    view, _ = accelerate_view(config) if HF_RUNNERS & f.readers.runners else (None, None)
    gathered = zero_settings(_mapping((view or config).get("zero_optimization")) or zero)
    if gathered is not None and gathered.gather_16bit_on_save:
        f.fail(HF_RUNNERS, "DeepSpeed AutoEP with ZeRO-3 and stage3_gather_16bit_weights_on_model_save true: it "
               f"trains, but {AUTOEP_ZERO3_SAVE}, so the first checkpoint ends the run; {AUTOEP_ZERO3_FIX}, or use "
               "ZeRO-1/2 for AutoEP, or ZeRO-3 without expert_parallel (the MoE block as a leaf module)")
    elif gathered is not None:  # measured: the HF Trainer's checkpoint-N then holds global_stepN alone
        f.fail(HF_RUNNERS, "DeepSpeed AutoEP with ZeRO-3: a plain HF Trainer's saves hold the DeepSpeed checkpoint "
               "only (no model file: the 16-bit gather is refused for AutoEP's expert partitions); "
               f"{AUTOEP_ZERO3_FIX}, or convert the checkpoint with DeepSpeed's ds_to_universal.py", at_most="note")


AUTOEP_ZERO3_FIX = ("toolkit.train.autoep_export.AutoEPSaves first in the Trainer's bases "
                    "(class MyTrainer(AutoEPSaves, Trainer)) gathers each partition over its own group and saves "
                    "transformers' layout")


def _sequence_parallel_problems(config: dict[str, Any], f: _Findings, stage: int) -> None:
    """The file's own sequence_parallel_size, for the runners whose DeepSpeed reads it: a run without an mpu (the
    deepspeed launcher's scripts; accelerate without a ParallelismConfig) divides the world by it, and the HF zero.Init
    of ZeRO-3 always does (it builds DeepSpeedConfig without accelerate's mpu)."""
    if "sequence_parallel_size" not in config:
        return
    sp = config["sequence_parallel_size"]
    launch_sp = f.readers.sequence_parallel
    readers = {f.readers.direct} - {PIPELINE}  # the pipeline engine hands its own mpu
    if launch_sp is None or launch_sp == 1 or stage == 3:
        readers |= HF_RUNNERS
    world = f.readers.world_size
    problem = sequence_parallel_problem(config, world) if world is not None else None
    if problem is None and not (concrete_int(sp) and sp >= 1):
        problem = sequence_parallel_problem(config, sp if concrete_int(sp) else 1)
    if problem:
        f.fail(readers, problem)
    elif stage == 3 and world is not None and is_auto(config.get("train_batch_size")) and TRAINER in f.readers.runners:
        from toolkit.engines.readers import deepspeed_data_parallel

        # zero.Init builds DeepSpeedConfig without an mpu (the file's degree divides the world) after the Trainer
        # filled train_batch_size over every process (trainer_config_process): measured in issue 17 as "8 != 2 * 2".
        dp = deepspeed_data_parallel(config, world)
        if dp != world:
            f.fail({TRAINER}, f"sequence_parallel_size {sp} in a ZeRO-3 file whose train_batch_size the HF Trainer "
                   f"fills: it fills it over all {world} processes, then ZeRO-3's zero.Init (no mpu) divides the "
                   f"world by {sp} and refuses the batch; remove the key (accelerate's ParallelismConfig carries the "
                   "degree)")
    if not problem and launch_sp is not None and sp != launch_sp and HF_RUNNERS & f.readers.runners:
        launch = (f"the launch runs sequence parallel {launch_sp} (accelerate's ParallelismConfig sp_size; its "
                  "Ulysses mpu decides at deepspeed.initialize)" if launch_sp > 1 else
                  "the launch runs no sequence parallelism (no parallelism_config sp_size): DeepSpeed counts "
                  f"world / {sp} data-parallel ranks that are not Ulysses groups")
        f.fail(HF_RUNNERS, f"sequence_parallel_size {sp} but {launch}; ZeRO-3's zero.Init divides the world by the "
               f"file's value; remove the key (or set it to {launch_sp})")


def _sp_gradient_problem(config: dict[str, Any], f: _Findings, stage: int) -> None:
    """Ulysses SP under a ZeRO reduction that sums the SP ranks (toolkit.emit.deepspeed.sp_gradient_multiple): the HF
    Trainer's SP loss (and an accelerate loop computing it as accelerate documents, a differentiable all_gather of
    the ranks' losses) trains on sp x the gradient, clipped as such (docs/ENGINE_FACTS.md, "ZeRO-1/2 x Ulysses SP")."""
    from toolkit.emit.deepspeed import sp_gradient_multiple

    launch_sp = f.readers.sequence_parallel
    sp = launch_sp if launch_sp is not None else concrete_int(config.get("sequence_parallel_size"))
    if not sp or sp <= 1 or not isinstance(stage, int):
        return
    world = f.readers.world_size  # dp x sp: ZeRO under Ulysses has no other model-parallel ranks
    factor = config.get("gradient_predivide_factor")
    group = world if world is not None else factor if isinstance(factor, int) and factor % sp == 0 else None
    if sp_gradient_multiple(config, sp=sp, group_ranks=group) == 1:
        return
    if stage in (1, 2):
        fix = (f"add \"gradient_predivide_factor\": {group or 'dp x sp (every process)'} and \"zero_optimization\": "
               "{\"reduce_scatter\": false} (contiguous_gradients on, prescale_gradients off): ZeRO then divides by "
               "dp x sp")
    elif stage == 3:
        fix = "set zero_optimization.reduce_scatter to true (its reduce-scatter divides by dp x sp)"
    else:
        fix = ("use ZeRO-1/2 with the fix `toolkit check` names for them, or multiply the loss's gradient by 1/sp "
               "(toolkit.train.dimensions.SequenceParallelGradient)")
    f.fail(HF_RUNNERS, f"ZeRO-{stage} x Ulysses SP {sp}: a Trainer / TRL script trains on {sp} x the gradient and "
           f"clips that (transformers' SP loss all-gathers the ranks' losses, whose backward sums the {sp} SP ranks' "
           "gradients; this reduction divides by dp only); " + fix, at_most="warning")


def _engine_problems(config: dict[str, Any], f: _Findings, *, said_batch: bool = False) -> None:
    """DeepSpeedConfig judges the file ("auto" values and batch arithmetic are ours to report); then the top-level
    keys it never read are the ones DeepSpeed ignores."""
    trial = without_auto(json.loads(json.dumps(config)))
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    processes = f.readers.world_size
    if processes is None or any(config.get(k) == "auto" for k in batch_keys):
        for key in batch_keys:
            trial.pop(key, None)
        trial["train_micro_batch_size_per_gpu"] = 1
    if processes is None:  # the smallest run the file's own degrees allow
        sp, dp = concrete_int(config.get("sequence_parallel_size")), concrete_int(config.get("data_parallel_size"))
        processes = (sp if sp and sp > 0 else 1) * (dp if dp and dp > 0 and "sequence_parallel_size" in config else 1)
    runner = f.readers.direct if f.readers.direct in f.readers.runners else min(f.readers.runners)
    if sequence_parallel_problem(config, processes):  # named by _sequence_parallel_problems; the rest still judged
        trial.pop("sequence_parallel_size", None)
        trial.pop("data_parallel_size", None)
    seen, refusals = deepspeed_reads_all(trial, processes, mpu=f.readers.mpu(runner))
    everyone = HF_RUNNERS | {f.readers.direct}
    for refusal, names_a_field in refusals:  # every problem DeepSpeed names, each its own finding
        repeated = f.has_error or (said_batch and "train_batch_size" in refusal)
        if names_a_field or not repeated:  # a whole-file refusal usually repeats a finding of ours
            f.fail(everyone, f"DeepSpeed/transformers refuse it: {refusal}")
    known = sorted(k for k in seen if isinstance(k, str))
    for key in sorted(set(config) - set(seen)):
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        if key.startswith("_"):
            f.note(f"\"{key}\" is not a DeepSpeed key; DeepSpeed ignores it (fine for a comment)")
        elif close:
            f.fail(everyone, f"unknown key \"{key}\": DeepSpeed ignores it silently; did you mean \"{close[0]}\"? "
                   "remove or rename it")
        else:
            f.fail(everyone, f"\"{key}\" is not read by the installed DeepSpeed; it has no effect", at_most="warning")


def batch_problems(config: dict[str, Any], readers: Readers) -> list[tuple[frozenset[str], str]]:
    """DeepSpeed's batch identity train_batch_size == micro x accumulation x its data-parallel world, the world as
    each runner's DeepSpeed counts it (toolkit.engines.readers.deepspeed_data_parallel: DeepSpeedConfig's own
    constructor with the runner's mpu, the file's sequence_parallel_size included); the HF Trainer also checks a
    concrete train_batch_size against every process (transformers trainer_config_process). Findings as (runners,
    message)."""
    from toolkit.engines.readers import deepspeed_data_parallel
    from toolkit.engines.validate import ConfigRejected

    batch = concrete_int(config.get("train_batch_size"))
    micro = concrete_int(config.get("train_micro_batch_size_per_gpu"))
    accum = concrete_int(config.get("gradient_accumulation_steps", 1))
    everyone = frozenset(HF_RUNNERS | {readers.direct})
    if batch is None or micro is None or accum is None or micro <= 0 or accum <= 0:
        return []
    world, stages = readers.world_size, readers.pipeline_stages
    if world is None:
        if batch % (micro * accum):
            return [(everyone, f"train_batch_size {batch} is not a multiple of micro {micro} x accum {accum} = "
                     f"{micro * accum}: no GPU count satisfies DeepSpeed's batch identity; fix one of the three")]
        return []
    if readers.pipeline and (stages < 1 or world % stages):
        return [(everyone, f"{stages} pipeline stages do not divide {world} processes")]
    found: dict[str, set[str]] = {}
    for runner in sorted(readers.runners):
        mpu = readers.mpu(runner)
        if mpu is None and sequence_parallel_problem(config, world):
            continue  # _sequence_parallel_problems names it
        try:
            dp = deepspeed_data_parallel(config, world, mpu=mpu)
        except ConfigRejected:
            continue  # DeepSpeed refuses the degrees themselves: _engine_problems reports its words
        expected, trainer = micro * accum * dp, micro * accum * world
        how = _how(world, dp, stages, config, mpu)
        if runner == TRAINER and trainer != expected:
            # HfTrainerDeepSpeedConfig.trainer_config_process fill_match("train_batch_size", world x micro x
            # accum) refuses any other concrete value; DeepSpeed then divides by the sequence-parallel degree.
            message = (f"train_batch_size {batch}: the HF Trainer requires {micro} x {accum} x {world} processes = "
                       f"{trainer} but DeepSpeed {micro} x {accum} x data-parallel {_number(dp)} ({how}) = "
                       f"{_number(expected)}; no number satisfies both: write \"auto\" (the Trainer and accelerate "
                       "fill it)")
        elif batch != expected:
            message = (f"train_batch_size {batch} != micro {micro} x accum {accum} x data-parallel {_number(dp)} "
                       f"({how}) = {_number(expected)}; set train_batch_size to {_number(expected)} or change the "
                       "accumulation")
        else:
            continue
        found.setdefault(message, set()).add(runner)
    return [(frozenset(runners), message) for message, runners in found.items()]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def _how(world: int, dp: float, stages: int, config: dict[str, Any], mpu: Any) -> str:
    """How DeepSpeed came to its data-parallel world, in the file's words."""
    if dp == world:
        return f"{world} processes"
    if stages > 1 and dp * stages == world:
        return f"{world} processes / {stages} pipeline stages"
    if mpu is not None:
        return f"{world} processes / sequence parallel {_number(world / dp)} of the launch's ParallelismConfig"
    if "data_parallel_size" in config and "sequence_parallel_size" in config:
        return f"data_parallel_size {config['data_parallel_size']} of the device mesh over {world} processes"
    return f"{world} processes / sequence_parallel_size {config.get('sequence_parallel_size')}"
