"""`toolkit check`'s files: what each runner would do with an accelerate YAML, a DeepSpeed JSON, or a plan directory.

    check_paths(["run/accelerate_config.yaml", "ds_config.json", "plans/llama7b/"]) -> [Problem, ...]

Every finding names the runner it concerns - the HF Trainer, an accelerate script, a script started by the deepspeed
launcher (or toolkit.train's pipeline engine), accelerate launch itself - and is an error only when that runner
would fail or silently misbehave; otherwise a warning or a note. A JSON on its own may be read by several runners:
a failure that only some of them hit is a warning naming them (`--runner` says which one you use, and makes it an
error).

The knowledge comes from the installed engines (toolkit.engines), so the check follows their versions.

Unreadable input (missing, binary, malformed, nested too deep, an alias bomb) is a UserError, not a Problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


from toolkit.errors import UserError
from toolkit.plan.schema import Plan, load_plan
from toolkit.inputs.strategy import Engine
from toolkit.check.accelerate import yaml_problems
from toolkit.check.deepspeed import ds_problems, Readers, readers_of_json
from toolkit.check.findings import DEEPSPEED, EVERY, HF_RUNNERS, LAUNCH, PIPELINE, Problem, RUNNER_CHOICES, TRAINER
from toolkit.check.read import is_plan_json, read_config
from toolkit.engines.readers import _mapping, concrete_int, engine_output, quiet_engines
from toolkit.emit.deepspeed import plan_disagreements
from toolkit.plan.files import (ACCELERATE_CONFIG, DS_CONFIG, DS_CONFIG_CONCRETE, HOSTFILE, LAUNCH_SH, PLAN_JSON,
                                SLURM_SBATCH)


# --- plan directory ----------------------------------------------------------------------------------------------------

def plan_readers(plan: Plan) -> Readers:
    """toolkit.train runs the HF Trainer, or hands the file to the pipeline engine unchanged."""
    runner = PIPELINE if plan.engine == Engine.PIPELINE else TRAINER
    return Readers(frozenset({runner}), plan.world_size, plan.pipeline_stages, plan.sequence_parallel)


def json_file_problems(config: dict[str, Any], file: str, readers: Readers, plan: Plan | None = None) -> list[Problem]:
    found = ds_problems(config, file, readers)
    if plan is not None:
        found += plan_json_consistency(config, file, plan)
        if (moe := plan_leaf_problem(config, file, plan)) is not None:
            found.append(moe)
        if not any(p.severity == "error" for p in found):
            from toolkit.engines.validate import ConfigRejected, validate_ds_config_for_plan

            try:
                with quiet_engines():
                    validate_ds_config_for_plan(config, plan)
            except ConfigRejected as exc:
                found.append(Problem(file, "error", f"DeepSpeed/transformers refuse it: {exc}",
                                     next(iter(readers.runners))))
    return found


def plan_leaf_problem(config: dict[str, Any], file: str, plan: Plan) -> Problem | None:
    """The MoE leaf-module finding for a plan's DeepSpeed JSON: the block from its model where ZeRO-3 needs it as a
    leaf (toolkit.inputs.modelspec `leaf_module_needed`, through the cached spec; only built for a ZeRO-3 JSON)."""
    from toolkit.check.moe import leaf_module_problem

    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") != 3:
        return None
    from toolkit.inputs.modelspec import spec_from_config_dict

    block = spec_from_config_dict(plan.model_config, name=plan.model).leaf_module_needed
    return leaf_module_problem(config, file, model=plan.model, moe_block=block)


def plan_quantized_problems(plan: Plan, plan_path: Path) -> list[Problem]:
    """The quantized-checkpoint finding (toolkit.check.quantized) for the plan's model and method."""
    from toolkit.check.quantized import quantized_checkpoint_problem

    found = quantized_checkpoint_problem(plan.model_config, str(plan_path), model=plan.model, params=plan.params,
                                         method=plan.method,
                                         zero3=plan.engine == Engine.DEEPSPEED and plan.zero_stage == 3)
    return [found] if found else []


def plan_json_consistency(config: dict[str, Any], file: str, plan: Plan, *, runner: str | None = None
                          ) -> list[Problem]:
    out: list[Problem] = []
    runner = runner or next(iter(plan_readers(plan).runners))
    for key, (value, planned) in plan_disagreements(config, plan).items():
        if key == "precision":
            out.append(Problem(file, "error", f"ds_config trains in {value} but plan.json plans {planned}; "
                               "toolkit.train passes the plan's precision and the Trainer will refuse the mismatch",
                               runner))
        elif key == "sequence_parallel_size":
            from toolkit.engines.validate import json_text, sequence_parallel_problem

            divides = sequence_parallel_problem({"sequence_parallel_size": value}, plan.world_size) is None
            heads = _sequence_parallel_model_problem(plan, value) if divides else None
            fix = (f"set it to {planned}; {heads}" if heads else
                   f"set it to {planned} or re-plan with --sequence-parallel {value}" if divides else
                   f"{json_text(value)} does not even divide the {plan.world_size} processes (DeepSpeed would count "
                   f"{plan.world_size} / {json_text(value)} data-parallel ranks); set it to {planned}")
            out.append(Problem(file, "error", f"sequence_parallel_size {json_text(value)} but plan.json plans sequence "
                               f"parallel {planned} (the YAML's parallelism_config and the memory prediction assume "
                               f"it); {fix}", runner))
        elif key == "zero_optimization.stage":
            out.append(Problem(file, "error", f"ZeRO stage {value} but plan.json plans {plan.strategy} "
                               f"(stage {planned}); the memory prediction assumes the plan's stage", runner))
        else:
            out.append(Problem(file, "error", f"{key} {value} but plan.json plans {planned}; re-emit the plan "
                               "directory or make them agree", runner))
    return out


def _sequence_parallel_model_problem(plan: Plan, sp: Any) -> str | None:
    """Whether the plan's model and grid take sequence parallel `sp` (the grid's rules: heads and KV heads per
    Ulysses rank, toolkit.inputs.grid.ParallelGrid.check_model); None when they do or the model cannot be read."""
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.modelspec import spec_from_config_dict

    try:
        grid = ParallelGrid.for_strategy(plan.strategy_spec, nodes=plan.num_machines,
                                         gpus_per_node=plan.gpus_per_node, sequence=sp)
        grid.check_model(spec_from_config_dict(plan.model_config, name=plan.model))
    except UserError as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - a model_config transformers cannot build: the fit check (--model) says so
        return None
    return None


def yaml_plan_consistency(config: dict[str, Any], file: str, plan: Plan) -> list[Problem]:
    out: list[Problem] = []
    if config.get("num_processes") != plan.world_size or config.get("num_machines", 1) != plan.num_machines:
        out.append(Problem(file, "error", f"num_machines {config.get('num_machines', 1)} / num_processes "
                           f"{config.get('num_processes')} but plan.json plans {plan.num_machines} node(s) x "
                           f"{plan.gpus_per_node} = {plan.world_size} processes; set them to match", LAUNCH))
    from toolkit.emit.parallelism import sharded_at_load

    expected = {"ddp": ("MULTI_GPU", "NO"), "deepspeed": ("DEEPSPEED",), "fsdp2": ("FSDP",),
                "pipeline": ("MULTI_GPU", "NO")}[plan.engine]
    if sharded_at_load(plan):  # transformers shards and runs FSDP2 itself: a plain launch
        expected = ("MULTI_GPU",)
    kind = config.get("distributed_type")
    if kind not in expected and not (kind == "DEEPSPEED" and plan.engine == Engine.PIPELINE):
        out.append(Problem(file, "error", f"distributed_type {kind} but plan.json plans {plan.strategy} "
                           f"(needs {expected[0]}); re-emit the plan directory", LAUNCH))
    if plan.engine in (Engine.DDP, Engine.FSDP2):
        from toolkit.emit.accelerate import ACCELERATE_MIXED_PRECISION

        mp = config.get("mixed_precision") or "no"
        if mp != ACCELERATE_MIXED_PRECISION[plan.precision]:
            out.append(Problem(file, "error", f"mixed_precision {mp} but plan.json plans {plan.precision}; set "
                               f"mixed_precision: {ACCELERATE_MIXED_PRECISION[plan.precision]}", LAUNCH))
    return out


def plan_adapter_problems(plan: Plan, plan_path: Path) -> list[Problem]:
    """The adapter rule plan, estimate, emit and toolkit.train apply (toolkit.inputs.job.adapter_problem) on the
    plan.json's own method and strategy: an edited or older plan the runner would refuse is an error here too.
    (The rest of check_job runs with --model, in the fit check.)"""
    from toolkit.inputs.job import adapter_problem, base_dtype_problem

    problem = adapter_problem(plan.adapter_spec, plan.strategy_spec) or base_dtype_problem(
        plan.adapter_spec, plan.precision, plan.strategy_spec, objective=bool(plan.dpo or plan.grpo))
    return [Problem(str(plan_path), "error", problem, EVERY)] if problem else []


def plan_dpo_problems(plan: Plan, directory: Path) -> list[Problem]:
    """A DPO plan: the rule plan and estimate apply (toolkit.inputs.preference.dpo_problem) on its strategy, and the
    dpo_config of training_args.json built as TRL's own DPOConfig, with the plan's DPO settings in it."""
    if not plan.dpo:
        return []
    from toolkit.engines.validate import validate_dpo_config
    from toolkit.inputs.preference import dpo_problem

    return _trl_config_problems(directory, "DPO", "dpo_config", dpo_problem(plan.dpo_spec, plan.strategy_spec),
                                validate_dpo_config, plan.dpo_spec.dpo_config_kwargs(plan.seq_len))


def plan_grpo_problems(plan: Plan, directory: Path) -> list[Problem]:
    """A GRPO plan: toolkit.inputs.grpo.grpo_problem on its strategy, and the grpo_config of training_args.json built
    as TRL's own GRPOConfig, holding the plan's GRPO settings and its generation batch (the global batch)."""
    if not plan.grpo:
        return []
    from toolkit.engines.validate import validate_grpo_config
    from toolkit.inputs.grpo import grpo_problem

    return _trl_config_problems(directory, "GRPO", "grpo_config",
                                grpo_problem(plan.grpo_spec, plan.strategy_spec,
                                             activation_offloading=plan.activation_offloading),
                                validate_grpo_config,
                                {**plan.grpo_spec.grpo_config_kwargs(), "generation_batch_size": plan.global_batch})


def _trl_config_problems(directory: Path, method: str, key: str, problem: str | None, validate,
                         wanted: dict) -> list[Problem]:
    """A TRL method's plan folder: the planner's rule for it (`problem`), then training_args.json's `key` built by
    TRL's own config class (`validate`) and holding the plan's settings (`wanted`)."""
    from toolkit.engines.validate import ConfigRejected
    from toolkit.plan.files import TRAINING_ARGS

    if problem:
        return [Problem(str(directory / PLAN_JSON), "error", problem, EVERY)]
    path = directory / TRAINING_ARGS
    if not path.is_file():
        return []
    given = _mapping(_mapping(read_config(path)).get(key))
    if not given:
        return [Problem(str(path), "error", f"a {method} plan's training_args.json has no {key}; re-emit the plan "
                        "directory", EVERY)]
    try:
        with quiet_engines():
            validate(given)
    except ConfigRejected as exc:
        return [Problem(str(path), "error", str(exc), EVERY)]
    return [Problem(str(path), "error", f"{key} {name} is {given.get(name)!r} but plan.json's {method} settings mean "
                    f"{value!r}; re-emit the plan directory", EVERY)
            for name, value in wanted.items() if given.get(name) != value]


def plan_attention_problems(plan: Plan, directory: Path) -> list[Problem]:
    """plan.json's attention, and the sp_attn_implementation training_args.json and the YAML hand to Ulysses, against
    what transformers lets the plan's model class run (the rule estimate and plan refuse by,
    toolkit.inputs.attention.attention_support): the load of that model would be refused."""
    from toolkit.emit.parallelism import YAML_PREFIX
    from toolkit.inputs.attention import attention_problem, config_attention
    from toolkit.plan.files import TRAINING_ARGS

    said = [(directory / PLAN_JSON, plan.attention)]
    for name, read in ((TRAINING_ARGS, lambda c: _mapping(_mapping(c.get("parallelism_config")).get("sp_handler"))
                        .get("sp_attn_implementation")),
                       (ACCELERATE_CONFIG, lambda c: _mapping(c.get("parallelism_config"))
                        .get(YAML_PREFIX + "sp_attn_implementation"))):
        if (directory / name).is_file() and isinstance(value := read(_mapping(read_config(directory / name))), str):
            said.append((directory / name, value))
    try:
        found = config_attention({**plan.model_config, "model_type": plan.model_type}, plan.model)
    except UserError:  # a model_config transformers cannot read: the fit check (--model) and the runs say so
        return []
    problems = [(path, attention_problem(*found, value, name=plan.model)) for path, value in said] if found else []
    return [Problem(str(path), "error", problem, EVERY) for path, problem in problems if problem]


def plan_position_problems(plan: Plan, plan_path: Path) -> list[Problem]:
    """The model's positions (toolkit.inputs.modelconfig.model_positions) against the plan's sequence length: the
    model is known from plan.json's model_config, so a plan toolkit.train would refuse is an error here too. A
    model_config transformers cannot read is left to the commands that load it."""
    from toolkit.inputs.job import plan_positions_problem
    from toolkit.inputs.modelconfig import config_dict_positions

    try:
        positions = config_dict_positions(plan.model_config, f"{plan_path}: model_config")
    except UserError:
        return []
    problem = plan_positions_problem(plan.seq_len, plan.model, positions,
                                     rotary=bool(plan.model_config.get("rope_parameters")))
    return [Problem(str(plan_path), "error", problem, EVERY)] if problem else []


def plan_sharding_problems(plan: Plan, directory: Path) -> list[Problem]:
    """A tensor- or expert-parallel plan (transformers shards the model at load): its degrees against the plan's
    model (the grid's rules estimate and plan refuse by: an expert degree that does not divide the experts, a dense
    model, a model without the ep_plan's token dispatch), and training_args.json's distributed_config, which a
    user's script hands to from_pretrained, against the plan's (toolkit.emit.parallelism.distributed_config)."""
    from toolkit.emit.parallelism import distributed_config, sharded_at_load
    from toolkit.inputs.modelspec import spec_from_config_dict
    from toolkit.plan.files import TRAINING_ARGS

    if not sharded_at_load(plan):
        return []
    out = []
    try:
        plan.grid.check_model(spec_from_config_dict(plan.model_config, name=plan.model))
    except UserError as exc:
        out.append(Problem(str(directory / PLAN_JSON), "error", str(exc), EVERY))
    except Exception:  # noqa: BLE001 - a model_config transformers cannot build: the fit check (--model) says so
        pass
    args_path = directory / TRAINING_ARGS
    if args_path.is_file():
        given = _mapping(read_config(args_path)).get("distributed_config")
        if given != distributed_config(plan):
            out.append(Problem(str(args_path), "error", f"distributed_config {given} but plan.json plans "
                               f"{distributed_config(plan)} (the DistributedConfig your script passes to "
                               "from_pretrained); re-emit the plan directory", EVERY))
    return out


def plan_rope_problems(plan: Plan, directory: Path) -> list[Problem]:
    """training_args.json's model_config_overrides (the RoPE scaling a user's script passes to from_pretrained,
    toolkit.train.own_script.model_kwargs) against the plan's: without them the script trains the model as it ships,
    whose positions stop before the plan's sequence."""
    from toolkit.plan.files import TRAINING_ARGS

    args_path = directory / TRAINING_ARGS
    if not args_path.is_file():
        return []
    given = _mapping(read_config(args_path)).get("model_config_overrides") or {}
    if given == plan.model_config_overrides:
        return []
    return [Problem(str(args_path), "error", f"model_config_overrides {given} but plan.json plans "
                    f"{plan.model_config_overrides} (the RoPE scaling your script passes to from_pretrained); "
                    "re-emit the plan directory", EVERY)]


def check_plan_dir(directory: Path, *, gpus: tuple[int, int] | None) -> list[Problem]:
    """A plan folder, judged on the files each route out of it passes (toolkit.run.launcher, emit/scripts.py):
    toolkit.train (`toolkit launch`, launch.sh / slurm.sbatch / deepspeed.sh without a script) hands ds_config.json
    to the HF Trainer or the pipeline engine; a user's script under launch.sh or `accelerate launch --config_file`
    gets the JSON the YAML carries inline; a deepspeed.initialize script under DeepSpeed's launcher reads
    ds_config.deepspeed.json. Each is checked once, with the readers and the world of its route."""
    plan_path = directory / PLAN_JSON
    plan = load_plan(plan_path) if plan_path.exists() or plan_path.is_symlink() else None
    if plan is None:
        names = [directory / n for n in (ACCELERATE_CONFIG, DS_CONFIG) if (directory / n).exists()]
        hostfile = [directory / HOSTFILE] if (directory / HOSTFILE).exists() else []
        if not names and not hostfile:
            raise UserError(f"{directory} holds no plan.json, accelerate_config.yaml, ds_config.json or hostfile; "
                            "give the config files themselves")
        # the YAML names its JSON, else the JSON; and the hostfile
        return check_paths([str(n) for n in names[:1] + hostfile], gpus=gpus)
    out: list[Problem] = (plan_adapter_problems(plan, plan_path) + plan_position_problems(plan, plan_path)
                          + plan_attention_problems(plan, directory) + plan_dpo_problems(plan, directory)
                          + plan_grpo_problems(plan, directory)
                          + plan_sharding_problems(plan, directory) + plan_rope_problems(plan, directory)
                          + plan_quantized_problems(plan, plan_path))
    yaml_path = directory / ACCELERATE_CONFIG
    json_path = directory / DS_CONFIG
    checked: list[dict[str, Any]] = []  # the configs already judged (one finding per problem, not per copy)
    if yaml_path.exists():
        config = read_config(yaml_path)
        scripts = [directory / name for name in (LAUNCH_SH, SLURM_SBATCH)]
        overrides = any(p.exists() and "--deepspeed_config_file" in p.read_text() for p in scripts)
        found, ds_path = yaml_problems(config, yaml_path, gpus=gpus, plan=plan, launcher_names_ds_file=overrides)
        out += found + yaml_plan_consistency(config, str(yaml_path), plan)
        if ds_path is not None:
            ds_config = read_config(ds_path)
            out += json_file_problems(ds_config, str(ds_path), plan_readers(plan), plan)
            checked.append(ds_config)
        inline = yaml_inline_json(config)
        if inline is not None and json_path.is_file() and inline not in checked + [read_config(json_path)]:
            # A user's script under launch.sh / accelerate launch reads this copy, not the edited file.
            readers = Readers(HF_RUNNERS, plan.world_size, sequence_parallel=plan.sequence_parallel)
            out += json_file_problems(inline, f"{yaml_path} (its inline deepspeed_config_file)", readers, plan)
            checked.append(inline)
    else:
        out.append(Problem(str(directory), "error", "no accelerate_config.yaml: `accelerate launch --config_file` "
                           "needs it; re-emit the plan directory", LAUNCH))
    if json_path.exists() and read_config(json_path) not in checked:
        out += json_file_problems(read_config(json_path), str(json_path), plan_readers(plan), plan)
    elif plan.engine in (Engine.DEEPSPEED, Engine.PIPELINE) and not checked:
        out.append(Problem(str(directory), "error", f"no ds_config.json for a {plan.strategy} plan; re-emit the "
                           "plan directory", next(iter(plan_readers(plan).runners))))
    concrete = directory / DS_CONFIG_CONCRETE
    if concrete.is_file() and plan.engine == Engine.DEEPSPEED:
        out += launcher_json_problems(read_config(concrete), str(concrete), plan)
    hostfile = directory / HOSTFILE
    if hostfile.exists() or hostfile.is_symlink():
        out += hostfile_file_problems(hostfile, world=plan.world_size, nodes=plan.num_machines,
                                      gpus_per_node=plan.gpus_per_node)
    return out


def hostfile_file_problems(path: Path, *, world: int | None, nodes: int | None = None,
                           gpus_per_node: int | None = None) -> list[Problem]:
    """DeepSpeed's hostfile, per host (toolkit.engines.hostfile, the rules `toolkit launch` refuses by)."""
    from toolkit.engines.hostfile import hostfile_problems, read_hostfile

    try:
        hosts = read_hostfile(path)
    except UserError as exc:
        return [Problem(str(path), "error", str(exc), DEEPSPEED)]
    return [Problem(str(path), "error", message, DEEPSPEED)
            for message in hostfile_problems(hosts, str(path), world=world, nodes=nodes, gpus_per_node=gpus_per_node)]


def yaml_inline_json(config: dict[str, Any]) -> dict[str, Any] | None:
    """The DeepSpeed config an emitted YAML carries as JSON text in deepspeed_config_file (else None)."""
    from toolkit.emit.accelerate import inline_ds_config

    ds_file = _mapping(config.get("deepspeed_config")).get("deepspeed_config_file")
    return inline_ds_config(ds_file) if ds_file else None


def yaml_sequence_parallel(config: dict[str, Any]) -> int | None:
    """The sp_size accelerate launch hands the processes from the YAML (1 when its parallelism_config has none);
    None without a parallelism_config (the script may build its own ParallelismConfig)."""
    block = config.get("parallelism_config")
    if not isinstance(block, dict) or not block:
        return None
    sp = concrete_int(block.get("parallelism_config_sp_size", 1))
    return sp if sp and sp > 0 else None


def launcher_json_problems(config: dict[str, Any], file: str, plan: Plan) -> list[Problem]:
    """ds_config.deepspeed.json: what a deepspeed.initialize script under DeepSpeed's launcher gets (no mpu
    unless the script passes one: DeepSpeed reads the file's own sequence_parallel_size)."""
    from toolkit.engines.validate import ConfigRejected, deepspeed_config_at

    readers = Readers(frozenset({DEEPSPEED}), plan.world_size, sequence_parallel=None)
    found = ds_problems(config, file, readers) + plan_json_consistency(config, file, plan, runner=DEEPSPEED)
    if not any(p.severity == "error" for p in found):
        try:
            with quiet_engines():
                deepspeed_config_at(config, plan.world_size)
        except ConfigRejected as exc:
            found.append(Problem(file, "error", f"DeepSpeed refuses it: {exc}", DEEPSPEED))
    return found


# --- entry points ------------------------------------------------------------------------------------------------------

def runner_problem(paths: list[str], runner: str | None) -> str | None:
    """--runner given where no path is a lone DeepSpeed JSON or accelerate YAML (plan folders, plan.json and
    hostfiles are read by their own runner), where it would be ignored."""
    if runner and all(Path(name).is_dir() or Path(name).name in (PLAN_JSON, HOSTFILE) for name in paths):
        return (f"--runner says who reads a lone DeepSpeed JSON (or an accelerate YAML's), and {paths[0]} is a plan, "
                "which its own runner reads (toolkit.train); drop --runner")
    return None


def check_paths(paths: list[str], *, gpus: tuple[int, int] | None = None, runner: str | None = None) -> list[Problem]:
    """Findings for each path: an accelerate YAML, a DeepSpeed JSON, a plan.json, or a plan directory.

    runner: "trainer", "accelerate" or "deepspeed" when the user says who reads a lone JSON (or a YAML's JSON).
    """
    pinned = RUNNER_CHOICES[runner] if runner else None
    out: list[Problem] = []
    with engine_output():  # the engines' import-time banners (DeepSpeed's accelerator detection) belong to no file
        import accelerate  # noqa: F401
        import deepspeed  # noqa: F401
    for name in paths:
        with engine_output() as said:  # an engine's own print, named with the file that made it speak
            found = _check_path(Path(name), gpus=gpus, pinned=pinned)
        out += found
        out += [Problem(name, "note", f"the engines said while reading it: {line[:300]}", EVERY) for line in said]
    return out


def _check_path(path: Path, *, gpus: tuple[int, int] | None, pinned) -> list[Problem]:
    out: list[Problem] = []
    if path.is_dir():
        if path.name == PLAN_JSON:
            load_plan(path)  # a folder named plan.json: load_plan's one line says so
        return check_plan_dir(path, gpus=gpus)
    if path.name == HOSTFILE:
        return hostfile_file_problems(path, world=gpus[0] * gpus[1] if gpus else None,
                                      nodes=gpus[0] if gpus else None, gpus_per_node=gpus[1] if gpus else None)
    config = read_config(path)
    if path.suffix == ".json" and is_plan_json(config):
        out += check_plan_dir(path.parent, gpus=gpus)
    elif path.suffix == ".json":
        world = gpus[0] * gpus[1] if gpus else None
        out += json_file_problems(config, str(path), readers_of_json(config, world_size=world, runner=pinned))
    else:
        found, ds_path = yaml_problems(config, path, gpus=gpus)
        out += found
        if ds_path is not None:
            ds_config = read_config(ds_path)
            world = concrete_int(config.get("num_processes"))
            # accelerate launches it: the HF Trainer or an accelerate script reads the JSON.
            readers = readers_of_json(ds_config, world_size=world, named_by_yaml=True,
                                      runner=pinned if pinned in HF_RUNNERS else None,
                                      sequence_parallel=yaml_sequence_parallel(config))
            out += json_file_problems(ds_config, str(ds_path), readers)
    return out
