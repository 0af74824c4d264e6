"""Findings of one DeepSpeed JSON for the runners that may read it (the HF Trainer, an accelerate script, a
script under the deepspeed launcher, toolkit.train's pipeline engine): "auto" nobody fills, keys DeepSpeed ignores,
ZeRO settings, the batch identity."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any


from toolkit.emit.deepspeed import auto_keys
from toolkit.check.findings import ACCELERATE, DEEPSPEED, EVERY, HF_RUNNERS, PIPELINE, Problem, Severity, TRAINER
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

    @property
    def pipeline(self) -> bool:
        return PIPELINE in self.runners

    @property
    def direct(self) -> str:
        """The runner that hands the file to deepspeed.initialize unchanged."""
        return PIPELINE if self.pipeline else DEEPSPEED


def readers_of_json(config: dict[str, Any], *, world_size: int | None, runner: str | None,
                    named_by_yaml: bool = False) -> Readers:
    if runner is not None:
        runners = frozenset({runner})
    elif named_by_yaml or auto_keys(config):
        # "auto" is filled only by the HF Trainer and accelerate; a YAML's JSON is read through accelerate.
        runners = HF_RUNNERS
    else:
        runners = HF_RUNNERS | {DEEPSPEED}
    return Readers(runners, world_size)


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
    for message in batch_problems(config, world_size=readers.world_size, pipeline_stages=readers.pipeline_stages):
        f.fail(everyone, message)
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
    if stage == 3:
        _zero3_save_problem(config, zero, f)
    _engine_problems(config, f)
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


def _engine_problems(config: dict[str, Any], f: _Findings) -> None:
    """DeepSpeedConfig judges the file ("auto" values and batch arithmetic are ours to report); then the top-level
    keys it never read are the ones DeepSpeed ignores."""
    trial = without_auto(json.loads(json.dumps(config)))
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if f.readers.world_size is None or any(config.get(k) == "auto" for k in batch_keys):
        for key in batch_keys:
            trial.pop(key, None)
        trial["train_micro_batch_size_per_gpu"] = 1
        data_parallel = 1
    else:
        data_parallel = max(f.readers.world_size // f.readers.pipeline_stages, 1)
    seen, refusals = deepspeed_reads_all(trial, data_parallel)
    everyone = HF_RUNNERS | {f.readers.direct}
    for refusal, names_a_field in refusals:  # every problem DeepSpeed names, each its own finding
        if names_a_field or not f.has_error:  # a whole-file refusal usually repeats a finding of ours
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


def batch_problems(config: dict[str, Any], *, world_size: int | None, pipeline_stages: int) -> list[str]:
    batch = concrete_int(config.get("train_batch_size"))
    micro = concrete_int(config.get("train_micro_batch_size_per_gpu"))
    accum = concrete_int(config.get("gradient_accumulation_steps", 1))
    if batch is None or micro is None or accum is None or micro <= 0 or accum <= 0:
        return []
    if world_size is not None:
        from toolkit.inputs.grid import ParallelGrid

        if pipeline_stages < 1 or world_size % pipeline_stages:
            return [f"{pipeline_stages} pipeline stages do not divide {world_size} processes"]
        grid = ParallelGrid(1, world_size, pipeline_stages=pipeline_stages, dp_shard=world_size // pipeline_stages)
        expected = grid.global_batch(micro, accum)
        if batch != expected:
            stages = f" / {pipeline_stages} pipeline stages" if pipeline_stages > 1 else ""
            return [f"train_batch_size {batch} != micro {micro} x accum {accum} x data-parallel "
                    f"{grid.data_parallel} ({world_size} processes{stages}) = {expected}; set train_batch_size to "
                    f"{expected} or change the accumulation"]
    elif batch % (micro * accum):
        return [f"train_batch_size {batch} is not a multiple of micro {micro} x accum {accum} = {micro * accum}: no "
                "GPU count satisfies DeepSpeed's batch identity; fix one of the three"]
    return []

