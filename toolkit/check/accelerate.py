"""Findings of one accelerate YAML: accelerate launch's own validation and the plugin the Accelerator would
build (toolkit.engines.validate), ParallelismConfig's size checks, and the DeepSpeed JSON the YAML names."""

from __future__ import annotations

import difflib
import functools
from pathlib import Path
from typing import Any


from toolkit.plan.schema import Plan
from toolkit.inputs.strategy import Engine
from toolkit.emit.deepspeed import json_precision
from toolkit.check.findings import HF_RUNNERS, LAUNCH, TRAINER, Problem
from toolkit.check.read import read_mapping
from toolkit.engines.readers import _mapping, concrete_int, quiet_engines, zero_settings
from toolkit.plan.files import DS_CONFIG


# --- accelerate YAML ---------------------------------------------------------------------------------------------------

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
"""Where each YAML deepspeed_config key that accelerate refuses next to deepspeed_config_file belongs in the JSON
(the keys are those of DeepSpeedPlugin._deepspeed_config_checks; the test checks that accelerate refuses each)."""


def yaml_problems(config: dict[str, Any], path: Path, *, gpus: tuple[int, int] | None = None,
                  plan: Plan | None = None, launcher_names_ds_file: bool = False) -> tuple[list[Problem], Path | None]:
    """Findings of one accelerate YAML (they concern `accelerate launch`, so every script it starts), and the
    DeepSpeed JSON it names (if it exists).

    launcher_names_ds_file: the directory's launch script passes --deepspeed_config_file itself (emitted
    directories do), so a relative deepspeed_config_file in the YAML is not a trap.
    """
    file = str(path)
    out: list[Problem] = []

    def err(message: str) -> None:
        out.append(Problem(file, "error", message, LAUNCH))

    def warn(message: str) -> None:
        out.append(Problem(file, "warning", message, LAUNCH))

    from toolkit.emit.accelerate import inline_ds_config

    from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig

    if str(config.get("compute_environment")) == "AMAZON_SAGEMAKER":
        # load_config_from_file picks SageMakerConfig; the launch itself happens on SageMaker, not here.
        known = set(SageMakerConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}
        out += [Problem(file, "error", f"unknown key \"{key}\": accelerate refuses the file", LAUNCH)
                for key in sorted(set(config) - known, key=str)]
        out.append(Problem(file, "note", "a SageMaker config: its keys were checked; the launch runs on SageMaker "
                           "and is not rehearsed here", LAUNCH))
        return out, None
    out += fsdp1_keys_under_fsdp2(config, file)
    known = set(ClusterConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}
    for key in sorted(set(config) - known, key=str):
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean \"{close[0]}\"? " if close else ""
        err(f"unknown key \"{key}\": accelerate refuses the file; {hint}remove or rename it")
    out += parallelism_config_key_problems(config, file)
    if str(config.get("distributed_type", "")) == "DEEPSPEED":
        out += deepspeed_config_key_problems(config, file)
    for key, wanted in sorted(_cluster_config_shapes().items()):
        value = config.get(key)
        if value is None:
            continue
        if wanted is dict and not isinstance(value, dict):
            err(f"{key} must be a mapping of keys to values, not {type(value).__name__}")
        elif wanted is list and not isinstance(value, list):
            err(f"{key} must be a list, not {type(value).__name__}")
        elif wanted is None and isinstance(value, (dict, list)):
            # accelerate's launch code calls string methods on these and fails with an AttributeError.
            err(f"{key} must be a single value, not a {type(value).__name__}; accelerate launch crashes on it")

    kind = str(config.get("distributed_type", ""))
    machines = config.get("num_machines", 1)
    processes = config.get("num_processes")
    if concrete_int(machines) and concrete_int(processes) and machines > 0:
        if processes % machines:
            err(f"num_processes {processes} is not a multiple of num_machines {machines}: num_processes counts the "
                "processes of all nodes (nodes x GPUs per node)")
        if gpus is not None and (machines, processes) != (gpus[0], gpus[0] * gpus[1]):
            err(f"num_machines {machines} x num_processes {processes} does not match {gpus[0]} node(s) x {gpus[1]} "
                f"GPUs: set num_machines: {gpus[0]} and num_processes: {gpus[0] * gpus[1]}")
        # accelerate's launch_command: CPU runs go to simple_launcher, one process unless mpirun starts them.
        mpirun = _mapping(config.get("mpirun_config")).get("mpirun_hostfile")
        if (kind in ("MULTI_CPU",) or config.get("use_cpu") is True) and not mpirun:
            warn(f"{kind or 'use_cpu'} with num_processes {processes}: accelerate starts one process on this path; "
                 "use MULTI_GPU (with ACCELERATE_USE_CPU=1 on CPUs)")

    ds_path = None
    if kind == "DEEPSPEED":
        ds_section = _mapping(config.get("deepspeed_config"))
        ds_file = ds_section.get("deepspeed_config_file")
        if ds_file:
            for key in sorted(set(ds_section) & set(DS_FILE_IGNORED_KEYS)):
                err(f"deepspeed_config.{key} next to deepspeed_config_file: accelerate refuses it (\"will be "
                    f"ignored\"); remove it and set {DS_FILE_IGNORED_KEYS[key]} in the JSON")
            inline = inline_ds_config(ds_file)
            if inline is not None:  # emitted YAMLs carry the JSON itself (toolkit.emit.accelerate)
                ds_path = path.parent / DS_CONFIG
                if not ds_path.is_file():
                    ds_path = None
                elif read_mapping(ds_path) != inline:
                    # toolkit.run.launcher passes --deepspeed_config_file DIR/ds_config.json and toolkit.train hands
                    # it to the Trainer; a plain `accelerate launch --config_file` reads the YAML's own copy.
                    warn(f"{ds_path.name} differs from the copy this YAML carries in deepspeed_config_file: `toolkit "
                         f"launch` and toolkit.train use {ds_path}, but a script of yours under launch.sh or "
                         "`accelerate launch --config_file` gets the YAML's copy; re-emit with `toolkit emit` (or "
                         "make the two agree)")
            else:
                ds_path = resolve_ds_file(str(ds_file), path, out, quiet=launcher_names_ds_file)
            if config.get("mixed_precision") not in (None, "no"):
                mp = config["mixed_precision"]
                precision = json_precision(read_mapping(ds_path)) if ds_path else None
                if precision not in (None, mp):
                    err(f"mixed_precision {mp} in the YAML but ds_config enables "
                        f"{precision if precision != 'fp32' else 'neither bf16 nor fp16'}: remove mixed_precision "
                        "from the YAML; the JSON's bf16/fp16 blocks decide")
                else:
                    err(f"mixed_precision {mp} next to deepspeed_config_file: accelerate refuses it (\"will be "
                        "ignored\"); remove it and enable the JSON's bf16 or fp16 block")
        if plan is not None and plan.engine == Engine.PIPELINE:
            err("distributed_type DEEPSPEED for a pipeline plan: accelerate cannot run DeepSpeed pipelines; use a "
                "MULTI_GPU config (accelerate only starts the processes, toolkit.train runs the pipeline engine)")
    if kind == "FSDP":
        fsdp = _mapping(config.get("fsdp_config"))
        policy = str(fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP")).upper()
        if policy == "TRANSFORMER_BASED_WRAP" and not fsdp.get("fsdp_transformer_layer_cls_to_wrap"):
            # FullyShardedDataParallelPlugin.set_auto_wrap_policy falls back to model._no_split_modules.
            layer = f" ({plan.layer_class})" if plan else ""
            out.append(Problem(file, "note", "FSDP TRANSFORMER_BASED_WRAP without fsdp_transformer_layer_cls_to_wrap: "
                               "accelerate wraps the classes the model lists in _no_split_modules (its decoder "
                               f"layer{layer}); set the key only to wrap something else", LAUNCH))
        elif policy == "NO_WRAP":
            warn("FSDP without an auto-wrap policy shards the whole model as one unit (no memory saving during "
                 "forward); set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP")
    launch_flags = []
    if "num_processes" not in config and kind not in ("", "NO"):
        # accelerate launch: "You need to manually pass in `--num_processes` using this config yaml" (SLURM
        # templates do, from the job's node count); the rest of the file is checked as if it were passed.
        warn("no num_processes: accelerate launch refuses to start unless the command passes --num_processes "
             "(nodes x GPUs per node); add it here or to the launch command")
        launch_flags = ["--num_processes", str(concrete_int(machines) or 1)]
    if not any(p.severity == "error" for p in out):
        out += accelerate_problems(path, ds_path, launch_flags)
    return out, ds_path


def parallelism_config_key_problems(config: dict[str, Any], file: str) -> list[Problem]:
    """Keys of parallelism_config that accelerate launch does not read (toolkit.engines.validate
    .parallelism_config_keys): it ignores them silently, so a misspelt sp_size runs without sequence parallelism."""
    from toolkit.engines.validate import parallelism_config_keys

    block = config.get("parallelism_config")
    if not isinstance(block, dict):
        return []
    known = parallelism_config_keys()
    out = []
    for key in sorted(set(block) - known, key=str):
        prefixed = f"parallelism_config_{key}"
        close = [prefixed] if prefixed in known else difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean \"{close[0]}\"? " if close else f"the keys it reads: {', '.join(sorted(known))}; "
        out.append(Problem(file, "error", f"unknown key parallelism_config.{key}: accelerate launch ignores it "
                           f"silently (the run gets the default); {hint}rename or remove it", LAUNCH))
    return out


def deepspeed_config_key_problems(config: dict[str, Any], file: str) -> list[Problem]:
    """Keys of deepspeed_config that accelerate launch does not read (toolkit.engines.validate
    .launch_argument_names): it drops them silently, so a DeepSpeed-JSON spelling such as `offload_optimizer:
    {device: cpu}` leaves the optimizer on the GPU (accelerate's key is offload_optimizer_device)."""
    from toolkit.engines.validate import launch_argument_names

    block = config.get("deepspeed_config")
    if not isinstance(block, dict):
        return []
    known = launch_argument_names()
    out = []
    for key in sorted(set(block) - known, key=str):
        value = block[key]
        flat = [f"{key}_{sub}: {v}" for sub, v in value.items() if f"{key}_{sub}" in known] \
            if isinstance(value, dict) else []
        close = difflib.get_close_matches(str(key), [k for k in known if k.startswith(("zero", "offload",
                                                                                        "deepspeed", "gradient"))], n=1)
        hint = (f"write {', '.join(flat)} instead" if flat else f"did you mean \"{close[0]}\"?" if close
                else "set it in a deepspeed_config_file JSON instead")
        out.append(Problem(file, "error", f"unknown key deepspeed_config.{key}: accelerate launch ignores it "
                           f"silently (DeepSpeed never sees it and keeps its default); {hint}", LAUNCH))
    return out


def fsdp1_keys_under_fsdp2(config: dict[str, Any], file: str) -> list[Problem]:
    """FSDP1 keys in an fsdp_version 2 config, each with what accelerate does with it, read from accelerate's own
    conversion table (`accelerate to-fsdp2`, commands/to_fsdp2.py ARGUMENT_KEY_MAPPING / ARGUMENT_VALUE_MAPPING):
    a removed key is dropped with a deprecation warning at launch (FullyShardedDataParallelPlugin.__post_init__), a
    not-yet-implemented one makes the plugin raise, and a renamed one (fsdp_sharding_strategy) is still read, with
    a warning, as the FSDP2 key it maps to."""
    fsdp = config.get("fsdp_config")
    if not isinstance(fsdp, dict) or str(fsdp.get("fsdp_version", "1")) != "2":
        return []
    from accelerate.commands.to_fsdp2 import ARGUMENT_KEY_MAPPING, ARGUMENT_VALUE_MAPPING, ConversionStatus

    out = []
    for key in sorted(k for k in fsdp if isinstance(k, str)):
        target = ARGUMENT_KEY_MAPPING.get(key)
        if key == "fsdp_sync_module_states" and str(fsdp.get("fsdp_cpu_ram_efficient_loading")).lower() == "true":
            continue  # accelerate launch still demands it next to cpu_ram_efficient_loading (utils/launch.py)
        if target is ConversionStatus.REMOVED:
            out.append(Problem(file, "warning", f"fsdp_config.{key} is an FSDP1 key: under fsdp_version 2 accelerate "
                               "ignores it (a deprecation warning at launch; FSDP2 has no such setting); remove it",
                               LAUNCH))
        elif target is ConversionStatus.NOT_YET_IMPLEMENTED:
            out.append(Problem(file, "error", f"fsdp_config.{key} is an FSDP1 key that FSDP2 does not implement: "
                               "accelerate refuses it under fsdp_version 2; remove it (or use fsdp_version 1)",
                               LAUNCH))
        elif isinstance(target, str) and target != key:
            value = ARGUMENT_VALUE_MAPPING.get(key, {}).get(str(fsdp[key]).upper())
            becomes = f"{target}: {str(value).lower()}" if value is not None else target
            out.append(Problem(file, "warning", f"fsdp_config.{key} is an FSDP1 key: under fsdp_version 2 accelerate "
                               f"reads it as {target} with a deprecation warning; write {becomes} instead "
                               "(`accelerate to-fsdp2` converts a file)", LAUNCH))
    return out


@functools.lru_cache(maxsize=1)
def _cluster_config_shapes() -> dict[str, type | None]:
    """accelerate's ClusterConfig field types, reduced to dict / list / None (a single value)."""
    import typing

    from accelerate.commands.config.config_args import ClusterConfig

    shapes: dict[str, type | None] = {}
    for name, hint in typing.get_type_hints(ClusterConfig).items():
        union = typing.get_origin(hint) is typing.Union
        args = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
        origins = {typing.get_origin(a) or a for a in args}
        shapes[name] = dict if origins == {dict} else list if origins == {list} else None
    return shapes


def resolve_ds_file(name: str, yaml_path: Path, out: list[Problem], *, quiet: bool = False) -> Path | None:
    """accelerate opens deepspeed_config_file relative to the launch directory; we also look beside the YAML."""
    candidate = Path(name)
    beside = yaml_path.parent / name
    if candidate.is_file() and (candidate.is_absolute() or not beside.is_file()):
        return candidate
    if not candidate.is_absolute() and beside.is_file():
        if not quiet:
            out.append(Problem(str(yaml_path), "note", f"deepspeed_config_file {name} is relative: accelerate opens "
                               f"it from the directory you launch in; launch from {yaml_path.parent} or pass "
                               f"--deepspeed_config_file {beside}", LAUNCH))
        return beside
    out.append(Problem(str(yaml_path), "error", f"deepspeed_config_file {name} does not exist; emit it with "
                       "`toolkit plan --out DIR` or fix the path", LAUNCH))
    return None


def accelerate_problems(path: Path, ds_path: Path | None, flags: list[str] | None = None) -> list[Problem]:
    """accelerate's own launch validation and plugin, then its ParallelismConfig rules, for what ours do not name."""
    from toolkit.engines.validate import ConfigRejected, accelerate_launch_plugins, first_line

    extra = (["--deepspeed_config_file", str(ds_path)] if ds_path is not None else []) + (flags or [])
    try:
        with quiet_engines():
            args, plugin, env = accelerate_launch_plugins(path, extra)
    except ConfigRejected as exc:
        return [Problem(str(path), "error", f"accelerate launch refuses it: {exc}", LAUNCH)]
    except (RuntimeError, ImportError) as exc:
        # e.g. "FP8 is not available on this machine": a property of the machine running the check.
        return [Problem(str(path), "note", f"accelerate's launch check stops on this machine ({first_line(exc)}); "
                        "the rest of its checks did not run here", LAUNCH)]
    found: list[Problem] = []  # parallelism_config: checked inside accelerate_launch_plugins (accelerate's code)
    tp = env.get("PARALLELISM_CONFIG_TP_SIZE", "1")
    if args.use_fsdp and tp.isdigit() and int(tp) > 1:
        # transformers 5.2x: the Trainer runs TP only for a model transformers sharded at load; with accelerate's
        # FSDP2 plugin it prepares the model without its optimizer, which accelerate refuses (issue 17, measured).
        found.append(Problem(str(path), "note", f"parallelism_config tp_size {tp} under the FSDP plugin: the HF "
                             "Trainer cannot prepare it (\"When using FSDP2, a model and optimizer must be passed "
                             "together\"); for a Trainer script load the model with from_pretrained(..., "
                             "distributed_config=DistributedConfig(tp_size=..., fsdp_size=...)) and launch without "
                             "the FSDP plugin (toolkit plan --tensor-parallel writes such a folder); an accelerate "
                             "loop that prepares model and optimizer together runs it", TRAINER))
    if args.use_deepspeed and ds_path is None and plugin is not None:
        found += inline_deepspeed_problems(path, plugin.deepspeed_config)
        sp = env.get("PARALLELISM_CONFIG_SP_SIZE", "1")
        if sp.isdigit() and int(sp) > 1:
            found += inline_sp_gradient_problems(path, plugin.deepspeed_config, int(sp), args.num_processes)
    return found


def inline_sp_gradient_problems(path: Path, built: dict[str, Any], sp: int, processes: int | None) -> list[Problem]:
    """A YAML's own deepspeed_config under Ulysses SP: its keys cannot set gradient_predivide_factor, so ZeRO-1/2
    (and ZeRO-3 without reduce-scatter) leave a Trainer / TRL script sp x the gradient (toolkit.emit.deepspeed.
    sp_gradient_multiple; docs/ENGINE_FACTS.md, "ZeRO-1/2 x Ulysses SP")."""
    from toolkit.emit.deepspeed import sp_gradient_multiple

    if sp_gradient_multiple(built, sp=sp, group_ranks=processes) == 1:
        return []
    stage = _mapping(built.get("zero_optimization")).get("stage")
    factor = processes or "the process count"
    return [Problem(str(path), "warning", f"ZeRO-{stage} x Ulysses SP {sp}: a Trainer / TRL script trains on {sp} x "
                    "the gradient and clips that (transformers' SP loss sums the SP ranks' gradients; ZeRO-1/2 "
                    "divide by dp only), and the YAML's deepspeed_config keys cannot change it; give a "
                    f"deepspeed_config_file whose JSON has \"gradient_predivide_factor\": {factor} and "
                    "\"zero_optimization\": {\"reduce_scatter\": false} (toolkit plan --sequence-parallel writes "
                    "one)", ", ".join(sorted(HF_RUNNERS)))]


def inline_deepspeed_problems(path: Path, built: dict[str, Any]) -> list[Problem]:
    """A YAML's own deepspeed_config fields, as the DeepSpeed config DeepSpeedPlugin builds from them."""
    settings = zero_settings(_mapping(built.get("zero_optimization")))
    if settings is None:
        return []
    out = []
    both = ", ".join(sorted(HF_RUNNERS))
    if settings.offload_params != "none" and settings.stage < 3:
        out.append(Problem(str(path), "error", f"offload_param_device {settings.offload_params} at zero_stage "
                           f"{settings.stage}: DeepSpeed offloads parameters only at ZeRO-3 and ignores it; set "
                           "zero_stage: 3 or offload_param_device: none", both))
    if settings.offload_optimizer != "none" and settings.stage < 1:
        out.append(Problem(str(path), "error", f"offload_optimizer_device {settings.offload_optimizer} at zero_stage "
                           "0: DeepSpeed offloads the optimizer only at ZeRO 1-3 and ignores it; set zero_stage: 2",
                           both))
    if settings.stage == 3 and not settings.gather_16bit_on_save:
        out.append(Problem(str(path), "warning", "ZeRO-3 without zero3_save_16bit_model: true: save_model writes an "
                           "empty model (the HF Trainer keeps only the DeepSpeed checkpoint, to be merged with "
                           "zero_to_fp32.py; accelerate's save_model raises); add zero3_save_16bit_model: true to "
                           "deepspeed_config", both))
    return out

