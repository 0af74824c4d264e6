"""`toolkit check`: every problem in an accelerate YAML, a DeepSpeed JSON, or a plan directory, each with its fix.

    check_paths(["run/accelerate_config.yaml", "ds_config.json", "plans/llama7b/"]) -> [Problem, ...]

A YAML is checked alone, then with the DeepSpeed JSON it names; a plan directory is checked file by file and
then across files against its plan.json (batch arithmetic, precision, process counts, runner). Our own checks
come first and say what to change; then the engines' own validation runs (accelerate's launch checks, transformers'
"auto" filling, DeepSpeed's DeepSpeedConfig) and reports what they refuse that we did not already name.

Unreadable input (a missing file, malformed YAML or JSON) is a UserError, not a Problem.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

from toolkit.emit.deepspeed import auto_keys, ds_zero_stage
from toolkit.errors import UserError
from toolkit.plan import Plan, load_plan

Severity = Literal["error", "warning"]

Runner = Literal["trainer", "pipeline", "unknown"]
"""Who reads a DeepSpeed JSON: the HF Trainer (fills "auto"), toolkit.train's pipeline path (fills nothing)."""


@dataclass(frozen=True)
class Problem:
    file: str
    severity: Severity
    message: str
    """What is wrong and how to fix it, in one line."""

    def __str__(self) -> str:
        return f"{self.file}: {self.severity}: {self.message}"


# --- what the engines accept -----------------------------------------------------------------------------------------

DS_FILE_IGNORED_KEYS: dict[str, str] = {
    "gradient_accumulation_steps": "\"gradient_accumulation_steps\"",
    "gradient_clipping": "\"gradient_clipping\"",
    "zero_stage": "\"zero_optimization\": {\"stage\": ...}",
    "offload_optimizer_device": "\"zero_optimization\": {\"offload_optimizer\": {\"device\": ...}}",
    "offload_param_device": "\"zero_optimization\": {\"offload_param\": {\"device\": ...}}",
    "offload_optimizer_nvme_path": "\"zero_optimization\": {\"offload_optimizer\": {\"nvme_path\": ...}}",
    "offload_param_nvme_path": "\"zero_optimization\": {\"offload_param\": {\"nvme_path\": ...}}",
    "zero3_save_16bit_model": "\"zero_optimization\": {\"stage3_gather_16bit_weights_on_model_save\": true}",
}
"""YAML deepspeed_config keys accelerate refuses next to deepspeed_config_file (DeepSpeedPlugin._deepspeed_config_checks),
with where each belongs in the JSON."""

TRAINER_FILLS: frozenset[str] = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.total_num_steps",
    "scheduler.params.warmup_num_steps", "fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size",
})
""""auto" keys the HF Trainer fills (transformers integrations/deepspeed.py trainer_config_process/_finalize)."""

TRAINER_FILLS_AT_ZERO3: frozenset[str] = frozenset({
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
})
"""Filled only when the config is ZeRO-3."""

DS_TOP_LEVEL_KEYS: frozenset[str] = frozenset({
    # read by deepspeed 0.19 runtime/config.py DeepSpeedConfig._initialize_params and its getters
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "managed_gradient_accumulation", "steps_per_print", "dump_state", "disable_python_gc", "disable_allgather",
    "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "gradient_allreduce_op", "zero_optimization", "activation_checkpointing",
    "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet", "gradient_clipping", "fp16", "bf16", "bfloat16",
    "torch_autocast", "amp", "optimizer", "scheduler", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "flops_profiler", "wall_clock_breakdown", "memory_breakdown", "autotuning", "use_data_before_expert_parallelism",
    "hybrid_engine", "pipeline", "data_efficiency", "checkpoint", "data_types", "aio", "dataloader_drop_last",
    "log_level", "datastates", "weight_quantization", "compile", "timers", "tensor_parallel", "expert_parallel",
    "vocabulary_size", "sparse_gradients", "sparse_attention", "elasticity", "compression_training",
    "curriculum_learning", "eigenvalue", "progressive_layer_drop", "quantize_training", "nebula",
    "sequence_parallel_size", "zenflow", "graph_harvesting", "mics_shard_size", "gradient_checkpointing",
})


# --- reading -----------------------------------------------------------------------------------------------------------

def read_mapping(path: Path) -> dict[str, Any]:
    """A YAML or JSON file as a dict; UserError for anything unreadable."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except OSError as exc:
        raise UserError(f"{path} cannot be read ({exc.strerror})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path} is not valid YAML ({getattr(exc, 'problem', None) or 'parse error'}{where})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a mapping of keys to values")
    return data


def is_plan_json(data: dict[str, Any]) -> bool:
    return "strategy" in data and "version" in data and "model_config" in data


# --- DeepSpeed JSON ----------------------------------------------------------------------------------------------------

def enabled(block: Any) -> bool:
    return isinstance(block, dict) and str(block.get("enabled", False)).lower() == "true"


def concrete_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def ds_problems(config: dict[str, Any], file: str, *, runner: Runner = "unknown", world_size: int | None = None,
                pipeline_stages: int = 1) -> list[Problem]:
    """Problems of one DeepSpeed JSON. world_size: total processes, if known; the DP degree is world / stages."""
    out: list[Problem] = []

    def err(message: str) -> None:
        out.append(Problem(file, "error", message))

    def warn(message: str) -> None:
        out.append(Problem(file, "warning", message))

    pipeline = runner == "pipeline"
    zero = config.get("zero_optimization")
    if zero is None:
        err("no \"zero_optimization\" block: accelerate refuses the file; add \"zero_optimization\": {\"stage\": 0} "
            "(or the stage you want)")
        zero = {}
    elif not isinstance(zero, dict):
        err("\"zero_optimization\" must be an object like {\"stage\": 2}")
        zero = {}
    stage = zero.get("stage", 0)
    stage = stage if isinstance(stage, int) else 0

    for key in sorted(set(config) - DS_TOP_LEVEL_KEYS):
        close = difflib.get_close_matches(key, DS_TOP_LEVEL_KEYS, n=1)
        hint = f"did you mean \"{close[0]}\"? " if close else ""
        err(f"unknown key \"{key}\": DeepSpeed ignores it silently; {hint}remove or rename it")

    if enabled(config.get("bf16")) and enabled(config.get("fp16")):
        err("bf16 and fp16 are both enabled: DeepSpeed refuses this; set \"enabled\": false in one of them")

    out += batch_problems(config, file, world_size=world_size, pipeline_stages=pipeline_stages)

    autos = auto_keys(config)
    if autos and pipeline:
        err(f"\"auto\" in {', '.join(autos)}: a pipeline run calls deepspeed.initialize itself and nothing fills "
            "\"auto\"; write concrete values (toolkit emit does)")
    elif autos:
        unfillable = [k for k in autos if k not in TRAINER_FILLS and not (k in TRAINER_FILLS_AT_ZERO3 and stage == 3)]
        for key in unfillable:
            why = (f"the HF Trainer fills it only at ZeRO-3 (this file is ZeRO-{stage}); remove the key"
                   if key in TRAINER_FILLS_AT_ZERO3 else "no runner fills it; write a concrete value")
            err(f"\"{key}\" is \"auto\": {why}")

    if pipeline and stage >= 2:
        err(f"ZeRO-{stage} with pipeline parallelism: DeepSpeed's pipeline engine refuses stages 2 and 3; "
            "use \"stage\": 1 (or 0)")
    if pipeline and enabled(config.get("bf16")):
        accum = (config.get("data_types") or {}).get("grad_accum_dtype")
        if accum != "fp32":
            warn("bf16 pipeline accumulates gradients in bf16 (not numerically safe over many micro-batches); add "
                 "\"data_types\": {\"grad_accum_dtype\": \"fp32\"} with ZeRO stage 1")
        elif stage == 0:
            err("bf16 with \"grad_accum_dtype\": \"fp32\" at ZeRO-0: DeepSpeed refuses this mix; use "
                "\"zero_optimization\": {\"stage\": 1}")

    for name, min_stage, what in (("offload_optimizer", 1, "ZeRO 1-3"), ("offload_param", 3, "ZeRO-3")):
        block = zero.get(name)
        if not isinstance(block, dict) or block.get("device", "none") in ("none", None):
            continue
        if stage < min_stage:
            err(f"zero_optimization.{name} at ZeRO-{stage}: {name.replace('_', ' ')} needs {what}; "
                f"set \"stage\": {min_stage if min_stage == 3 else 2} or remove {name}")
        if block.get("device") == "nvme" and not block.get("nvme_path"):
            err(f"zero_optimization.{name} goes to nvme without \"nvme_path\": set it to a directory on a local "
                "NVMe drive of every node")
    if stage == 3 and not zero.get("stage3_gather_16bit_weights_on_model_save", False):
        warn("ZeRO-3 without \"stage3_gather_16bit_weights_on_model_save\": true: save_model writes an empty model; "
             "add it to zero_optimization")
    return out


def batch_problems(config: dict[str, Any], file: str, *, world_size: int | None, pipeline_stages: int) -> list[Problem]:
    batch = concrete_int(config.get("train_batch_size"))
    micro = concrete_int(config.get("train_micro_batch_size_per_gpu"))
    accum = concrete_int(config.get("gradient_accumulation_steps", 1))
    if batch is None or micro is None or accum is None:
        return []
    if world_size is not None:
        dp = world_size // pipeline_stages
        if batch != micro * accum * dp:
            stages = f" / {pipeline_stages} pipeline stages" if pipeline_stages > 1 else ""
            return [Problem(file, "error",
                            f"train_batch_size {batch} != micro {micro} x accum {accum} x data-parallel {dp} "
                            f"({world_size} processes{stages}) = {micro * accum * dp}; set train_batch_size to "
                            f"{micro * accum * dp} or change the accumulation")]
    elif batch % (micro * accum):
        return [Problem(file, "error",
                        f"train_batch_size {batch} is not a multiple of micro {micro} x accum {accum} = "
                        f"{micro * accum}: no GPU count satisfies DeepSpeed's batch identity; fix one of the three")]
    return []


def engine_problems(config: dict[str, Any], file: str, *, runner: Runner, world_size: int | None,
                    pipeline_stages: int, hidden: int | None, precision: str | None) -> list[Problem]:
    """What the engines' own validation refuses (transformers' "auto" filling, DeepSpeedConfig)."""
    from toolkit.emit.validate import ConfigRejected, deepspeed_config_at, resolve_like_trainer

    dp = (world_size or 1) // pipeline_stages
    trial = json.loads(json.dumps(config))
    try:
        if runner == "trainer" and world_size is not None:
            micro = concrete_int(trial.get("train_micro_batch_size_per_gpu")) or 1
            accum = concrete_int(trial.get("gradient_accumulation_steps")) or 1
            trial = resolve_like_trainer(trial, world_size=world_size, micro_batch=micro, grad_accum=accum,
                                         hidden_size=hidden or 1024, precision=precision or _json_precision(trial))
        else:
            # Our own checks report batch arithmetic and "auto"; here DeepSpeed judges everything else.
            trial = _without_auto(trial)
            if world_size is None:
                trial.pop("train_batch_size", None)
            trial.setdefault("train_micro_batch_size_per_gpu", 1)
        deepspeed_config_at(trial, dp if world_size is not None else 1)
    except ConfigRejected as exc:
        return [Problem(file, "error", f"DeepSpeed/transformers refuse it: {exc}")]
    return []


def _without_auto(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_auto(v) for k, v in value.items() if not (isinstance(v, str) and v == "auto")}
    return value


def _json_precision(config: dict[str, Any]) -> str:
    if enabled(config.get("bf16")):
        return "bf16"
    return "fp16" if enabled(config.get("fp16")) else "fp32"


# --- accelerate YAML ---------------------------------------------------------------------------------------------------

def yaml_problems(config: dict[str, Any], path: Path, *, gpus: tuple[int, int] | None = None,
                  plan: Plan | None = None, launcher_names_ds_file: bool = False) -> tuple[list[Problem], Path | None]:
    """Problems of one accelerate YAML, and the DeepSpeed JSON it names (if it exists).

    launcher_names_ds_file: the directory's launch script passes --deepspeed_config_file itself (emitted
    directories do), so a relative deepspeed_config_file in the YAML is not a trap.
    """
    file = str(path)
    out: list[Problem] = []

    def err(message: str) -> None:
        out.append(Problem(file, "error", message))

    from accelerate.commands.config.config_args import ClusterConfig

    from toolkit.emit.accelerate import inline_ds_config

    known = set(ClusterConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}
    for key in sorted(set(config) - known):
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean \"{close[0]}\"? " if close else ""
        err(f"unknown key \"{key}\": accelerate refuses the file; {hint}remove or rename it")

    kind = str(config.get("distributed_type", ""))
    machines = config.get("num_machines", 1)
    processes = config.get("num_processes")
    if isinstance(machines, int) and isinstance(processes, int) and machines > 0:
        if processes % machines:
            err(f"num_processes {processes} is not a multiple of num_machines {machines}: num_processes counts the "
                "processes of all nodes (nodes x GPUs per node)")
        if gpus is not None and (machines, processes) != (gpus[0], gpus[0] * gpus[1]):
            err(f"num_machines {machines} x num_processes {processes} does not match {gpus[0]} node(s) x {gpus[1]} "
                f"GPUs: set num_machines: {gpus[0]} and num_processes: {gpus[0] * gpus[1]}")
        if kind in ("MULTI_CPU",) or config.get("use_cpu") is True:
            out.append(Problem(file, "warning", f"{kind or 'use_cpu'} with num_processes {processes}: accelerate "
                               "starts one process on this path; use MULTI_GPU (with ACCELERATE_USE_CPU=1 on CPUs)"))

    ds_path = None
    if kind == "DEEPSPEED":
        ds_section = config.get("deepspeed_config") or {}
        ds_file = ds_section.get("deepspeed_config_file")
        if ds_file:
            for key in sorted(set(ds_section) & set(DS_FILE_IGNORED_KEYS)):
                err(f"deepspeed_config.{key} next to deepspeed_config_file: accelerate refuses it (\"will be "
                    f"ignored\"); remove it and set {DS_FILE_IGNORED_KEYS[key]} in the JSON")
            inline = inline_ds_config(ds_file)
            if inline is not None:  # emitted YAMLs carry the JSON itself (toolkit.emit.accelerate)
                ds_path = path.parent / "ds_config.json"
                if not ds_path.is_file():
                    ds_path = None
                elif read_mapping(ds_path) != inline:
                    out.append(Problem(file, "warning", "deepspeed_config_file (inline JSON) differs from "
                                       f"{ds_path}: accelerate launch uses the YAML's; re-emit with `toolkit emit`"))
            else:
                ds_path = resolve_ds_file(str(ds_file), path, out, quiet=launcher_names_ds_file)
            if "mixed_precision" in config and config["mixed_precision"] not in (None, "no"):
                json_precision = _json_precision(read_mapping(ds_path)) if ds_path else None
                if json_precision not in (None, config["mixed_precision"]):
                    err(f"mixed_precision {config['mixed_precision']} in the YAML but ds_config enables "
                        f"{json_precision if json_precision != 'fp32' else 'neither bf16 nor fp16'}: remove "
                        "mixed_precision from the YAML; the JSON's bf16/fp16 blocks decide")
                else:
                    err(f"mixed_precision {config['mixed_precision']} next to deepspeed_config_file: accelerate "
                        "refuses it (\"will be ignored\"); remove it and enable the JSON's bf16 or fp16 block")
        if plan is not None and plan.engine == "pipeline":
            err("distributed_type DEEPSPEED for a pipeline plan: accelerate cannot run DeepSpeed pipelines; use a "
                "MULTI_GPU config (accelerate only starts the processes, toolkit.train runs the pipeline engine)")
    if kind == "FSDP":
        fsdp = config.get("fsdp_config") or {}
        policy = str(fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP")).upper()
        if policy == "TRANSFORMER_BASED_WRAP" and not fsdp.get("fsdp_transformer_layer_cls_to_wrap"):
            layer = f" ({plan.layer_class})" if plan else ", e.g. LlamaDecoderLayer"
            err("FSDP TRANSFORMER_BASED_WRAP without fsdp_transformer_layer_cls_to_wrap: set it to the model's "
                f"decoder-layer class{layer}; HF models list it in _no_split_modules")
        elif policy == "NO_WRAP":
            out.append(Problem(file, "warning", "FSDP without an auto-wrap policy shards the whole model as one "
                               "unit (no memory saving during forward); set fsdp_auto_wrap_policy: "
                               "TRANSFORMER_BASED_WRAP and fsdp_transformer_layer_cls_to_wrap"))
    if not out:
        out += accelerate_problems(path, ds_path)
    return out, ds_path


def resolve_ds_file(name: str, yaml_path: Path, out: list[Problem], *, quiet: bool = False) -> Path | None:
    """accelerate opens deepspeed_config_file relative to the launch directory; we also look beside the YAML."""
    candidate = Path(name)
    beside = yaml_path.parent / name
    if candidate.is_file() and (candidate.is_absolute() or not beside.is_file()):
        return candidate
    if not candidate.is_absolute() and beside.is_file():
        if quiet:
            return beside
        out.append(Problem(str(yaml_path), "warning",
                           f"deepspeed_config_file {name} is relative: accelerate opens it from the directory you "
                           f"launch in; launch from {yaml_path.parent} or pass --deepspeed_config_file {beside}"))
        return beside
    out.append(Problem(str(yaml_path), "error", f"deepspeed_config_file {name} does not exist; emit it with "
                       "`toolkit plan --out DIR` or fix the path"))
    return None


def accelerate_problems(path: Path, ds_path: Path | None) -> list[Problem]:
    """accelerate's own launch validation, for what our checks do not name."""
    from toolkit.emit.validate import ConfigRejected, accelerate_launch_check

    extra = ["--deepspeed_config_file", str(ds_path)] if ds_path is not None else []
    try:
        accelerate_launch_check(path, extra)
    except ConfigRejected as exc:
        return [Problem(str(path), "error", f"accelerate launch refuses it: {exc}")]
    return []


# --- plan directory ----------------------------------------------------------------------------------------------------

def plan_runner(plan: Plan | None) -> Runner:
    if plan is None:
        return "unknown"
    return "pipeline" if plan.engine == "pipeline" else "trainer"


def json_file_problems(config: dict[str, Any], file: str, *, plan: Plan | None, world_size: int | None) -> list[Problem]:
    runner = plan_runner(plan)
    stages = plan.pipeline_stages if plan else 1
    world = plan.world_size if plan else world_size
    found = ds_problems(config, file, runner=runner, world_size=world, pipeline_stages=stages)
    if plan is not None:
        found += plan_json_consistency(config, file, plan)
    if not any(p.severity == "error" for p in found):
        from toolkit.emit.deepspeed import hidden_size

        hidden = hidden_size(plan) if plan else None
        found += engine_problems(config, file, runner=runner if world else "unknown", world_size=world,
                                 pipeline_stages=stages, hidden=hidden, precision=plan.precision if plan else None)
    return found


def plan_json_consistency(config: dict[str, Any], file: str, plan: Plan) -> list[Problem]:
    out: list[Problem] = []
    for key, planned in (("train_batch_size", plan.global_batch), ("train_micro_batch_size_per_gpu", plan.micro_batch),
                         ("gradient_accumulation_steps", plan.grad_accum)):
        value = config.get(key)
        if concrete_int(value) is not None and value != planned:
            out.append(Problem(file, "error", f"{key} {value} but plan.json plans {planned}; re-emit the plan "
                               "directory or make them agree"))
    json_precision = _json_precision(config)
    planned_precision = {"bf16-pure": "bf16"}.get(plan.precision, plan.precision)
    if json_precision != planned_precision:
        out.append(Problem(file, "error", f"ds_config trains in {json_precision} but plan.json plans {plan.precision}; "
                           "toolkit.train passes the plan's precision and the Trainer will refuse the mismatch"))
    stage = (config.get("zero_optimization") or {}).get("stage")
    if isinstance(stage, int) and stage != ds_zero_stage(plan):
        out.append(Problem(file, "error", f"ZeRO stage {stage} but plan.json plans {plan.strategy} "
                           f"(stage {ds_zero_stage(plan)}); the memory prediction assumes the plan's stage"))
    return out


def yaml_plan_consistency(config: dict[str, Any], file: str, plan: Plan) -> list[Problem]:
    out: list[Problem] = []
    if config.get("num_processes") != plan.world_size or config.get("num_machines", 1) != plan.num_machines:
        out.append(Problem(file, "error", f"num_machines {config.get('num_machines', 1)} / num_processes "
                           f"{config.get('num_processes')} but plan.json plans {plan.num_machines} node(s) x "
                           f"{plan.gpus_per_node} = {plan.world_size} processes; set them to match"))
    expected = {"ddp": ("MULTI_GPU", "NO"), "deepspeed": ("DEEPSPEED",), "fsdp2": ("FSDP",),
                "pipeline": ("MULTI_GPU", "NO")}[plan.engine]
    kind = config.get("distributed_type")
    if kind not in expected and not (kind == "DEEPSPEED" and plan.engine == "pipeline"):
        out.append(Problem(file, "error", f"distributed_type {kind} but plan.json plans {plan.strategy} "
                           f"(needs {expected[0]}); re-emit the plan directory"))
    if plan.engine in ("ddp", "fsdp2"):
        from toolkit.emit.accelerate import ACCELERATE_MIXED_PRECISION

        mp = config.get("mixed_precision") or "no"
        if mp != ACCELERATE_MIXED_PRECISION[plan.precision]:
            out.append(Problem(file, "error", f"mixed_precision {mp} but plan.json plans {plan.precision}; set "
                               f"mixed_precision: {ACCELERATE_MIXED_PRECISION[plan.precision]}"))
    return out


def check_plan_dir(directory: Path, *, gpus: tuple[int, int] | None) -> list[Problem]:
    plan_path = directory / "plan.json"
    plan = load_plan(plan_path) if plan_path.exists() else None
    out: list[Problem] = []
    if plan is None:
        out.append(Problem(str(directory), "warning", "no plan.json: files checked without the plan they belong to"))
    yaml_path = directory / "accelerate_config.yaml"
    json_path = directory / "ds_config.json"
    checked_json: Path | None = None
    if yaml_path.exists():
        config = read_mapping(yaml_path)
        scripts = [directory / name for name in ("launch.sh", "slurm.sbatch")]
        overrides = any(p.exists() and "--deepspeed_config_file" in p.read_text() for p in scripts)
        found, ds_path = yaml_problems(config, yaml_path, gpus=gpus, plan=plan, launcher_names_ds_file=overrides)
        out += found
        if plan is not None:
            out += yaml_plan_consistency(config, str(yaml_path), plan)
        if ds_path is not None:
            world = config.get("num_processes") if isinstance(config.get("num_processes"), int) else None
            out += json_file_problems(read_mapping(ds_path), str(ds_path), plan=plan, world_size=world)
            checked_json = ds_path.resolve()
    elif plan is not None:
        out.append(Problem(str(directory), "error", "no accelerate_config.yaml: `accelerate launch --config_file` "
                           "needs it; re-emit the plan directory"))
    if json_path.exists() and json_path.resolve() != checked_json:
        out += json_file_problems(read_mapping(json_path), str(json_path), plan=plan,
                                  world_size=plan.world_size if plan else None)
    elif plan is not None and plan.engine in ("deepspeed", "pipeline") and checked_json is None:
        out.append(Problem(str(directory), "error", f"no ds_config.json for a {plan.strategy} plan; re-emit the "
                           "plan directory"))
    return out


# --- entry points ------------------------------------------------------------------------------------------------------

def check_paths(paths: list[str], *, gpus: tuple[int, int] | None = None) -> list[Problem]:
    """Problems of each path: an accelerate YAML, a DeepSpeed JSON, a plan.json, or a plan directory."""
    out: list[Problem] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            out += check_plan_dir(path, gpus=gpus)
            continue
        config = read_mapping(path)
        if path.suffix == ".json" and is_plan_json(config):
            out += check_plan_dir(path.parent, gpus=gpus)
        elif path.suffix == ".json":
            world = gpus[0] * gpus[1] if gpus else None
            out += json_file_problems(config, str(path), plan=None, world_size=world)
        else:
            found, ds_path = yaml_problems(config, path, gpus=gpus)
            out += found
            if ds_path is not None:
                world = config.get("num_processes") if isinstance(config.get("num_processes"), int) else None
                out += json_file_problems(read_mapping(ds_path), str(ds_path), plan=None, world_size=world)
    return out


def parse_gpus(text: str) -> tuple[int, int]:
    """"8" (one node of 8), "2x8" (2 nodes of 8) or a GPU spec "2x8xH100" -> (nodes, gpus per node)."""
    parts = text.lower().split("x")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if not numbers:  # a GPU spec with a type (8xH100-80GB): the grid is its node and GPU counts
        from toolkit.hardware import parse_hardware

        try:
            hw = parse_hardware(text)
        except UserError:
            raise UserError(f"--gpus '{text}' is not understood; write GPUS (one node) or NODESxGPUS, e.g. 2x8, "
                            "or a GPU spec such as 8xH100-80GB") from None
        return hw.nodes, hw.gpus_per_node
    if len(numbers) == 1:
        numbers = [1, numbers[0]]
    if len(numbers) != 2 or min(numbers) < 1:
        raise UserError(f"--gpus '{text}' is not understood; write GPUS (one node) or NODESxGPUS, e.g. 2x8")
    return numbers[0], numbers[1]


def main_check(argv_paths: list[str], *, model: str | None = None, gpus: str | None = None,
               fit: Callable[[str], list[Problem | str]] | None = None,
               print_fn: Callable[[str], None] = print) -> int:
    """The CLI: one line per problem; 0 clean, 1 problems, 2 unreadable input.

    fit: the planner's fit check (toolkit.planner.fit_problems bound to --model/--gpus by the CLI), called once
    per path; it returns Problems or one-line strings (taken as errors). Skipped when None.
    """
    try:
        grid = parse_gpus(gpus) if gpus else None
        problems = check_paths(argv_paths, gpus=grid)
        if fit is not None:
            for name in argv_paths:
                problems += [p if isinstance(p, Problem) else Problem(name, "error", str(p)) for p in fit(name)]
        elif model is not None:
            print_fn("note: no fit check was given for --model; skipped")
    except UserError as exc:
        print_fn(f"error: {exc}")
        return 2
    for problem in problems:
        print_fn(str(problem))
    if not problems:
        print_fn(f"{len(argv_paths)} path(s) checked: no problems")
    return 1 if problems else 0
