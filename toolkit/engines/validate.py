"""Validate emitted files with the engines' own code, the way the runners will read them, without launching.

- accelerate YAML: accelerate's launch parser and `_validate_launch_command` (which loads the file with its config
  loader and rejects unknown keys), then the environment the launcher would hand the processes
  (`prepare_deepspeed_cmd_env` / `prepare_multi_gpu_env`), under which the plugin the Accelerator builds is
  constructed: `DeepSpeedPlugin` (refuses keys that a JSON file makes ignored, a JSON without zero_optimization,
  a missing JSON file) or `FullyShardedDataParallelPlugin` (wrap policy, FSDP2 options).
- DeepSpeed JSON: "auto" values are first resolved with transformers' own `HfTrainerDeepSpeedConfig` (the code the
  HF Trainer runs; it also reports values that mismatch the TrainingArguments), then DeepSpeed's `DeepSpeedConfig`
  checks the result at the planned data-parallel world size.

DeepSpeedConfig reads its world size from deepspeed.comm (runtime/config.py: `dist.get_rank()` fails when no
process group exists and the world size silently becomes 1). `deepspeed_config_at` runs DeepSpeed's own constructor
as rank 0 of N ranks (deepspeed.comm answered for it), with the mpu the runner passes (pipeline_mpu, ulysses_mpu),
so the data-parallel world, sequence parallelism included, is DeepSpeed's own arithmetic.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

from toolkit.emit.deepspeed import auto_keys
from toolkit.inputs.strategy import Engine

log = logging.getLogger(__name__)


class ConfigRejected(Exception):
    """An engine refused a config; the message is the engine's own (first line) plus what we checked."""


# --- accelerate ------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """Expose the launcher's environment to the plugins being built, then restore os.environ exactly."""
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if os.environ.get(k) != v})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def accelerate_launch_check(config_file: str | Path, extra_args: list[str] | None = None) -> SimpleNamespace:
    """Run accelerate's launch-time validation of `config_file` (plus launch flags) without starting anything.

    Returns the parsed launch arguments; raises ConfigRejected with accelerate's message.
    """
    return accelerate_launch_plugins(config_file, extra_args)[0]


# FSDP1 `sync_module_states` (forced on by `cpu_ram_efficient_loading`) makes FullyShardedDataParallelPlugin ask the
# accelerator for its current device (accelerate utils/dataclasses.py __post_init__), which raises on a machine
# without one. The flag only picks the device for param_init_fn; every other rule is checked without it.
_NO_DEVICE_ENV = {"FSDP_SYNC_MODULE_STATES": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}


def accelerate_launch_plugins(config_file: str | Path, extra_args: list[str] | None = None
                              ) -> tuple[SimpleNamespace, Any, dict[str, str]]:
    """accelerate's launch validation of `config_file`, and the plugin the Accelerator would build from it.

    Returns (launch arguments, DeepSpeedPlugin / FullyShardedDataParallelPlugin / None, the processes' environment);
    raises ConfigRejected with accelerate's message. Never touches a device.
    """
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    # Port 0: pick a free port, so a port in use on this machine does not fail the check of a file.
    argv = ["--config_file", str(config_file), *(extra_args or []), "--main_process_port", "0",
            "-m", "toolkit.train"]
    plugin = None
    env: dict[str, str] = {}
    try:
        args = launch_command_parser().parse_args(argv)
        args, defaults, mp_from_config = _validate_launch_command(args)
        if args.use_deepspeed:
            # What launch_command passes to the processes (commands/launch.py).
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            if mp_from_config:
                fields.append("mixed_precision")
            args.deepspeed_fields_from_accelerate_config = ",".join(fields)
            _, env = prepare_deepspeed_cmd_env(args)
            with _environment(env):
                plugin = DeepSpeedPlugin()
                plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
        elif args.use_fsdp or args.multi_gpu:
            env = prepare_multi_gpu_env(args)
            if args.use_fsdp:
                with _environment({**env, **_NO_DEVICE_ENV}):
                    plugin = FullyShardedDataParallelPlugin()
        if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true":
            # What Accelerator() builds from the launcher's variables when the script passes no config.
            from accelerate.parallelism_config import ParallelismConfig

            with _environment(env):
                pc = ParallelismConfig()
            fsdp2 = bool(args.use_fsdp) and str(getattr(args, "fsdp_version", "1")) == "2"
            engine = "deepspeed" if args.use_deepspeed else "fsdp2" if fsdp2 else "fsdp1" if args.use_fsdp else "ddp"
            check_parallelism_config(pc, world_size=int(args.num_processes or 1), engine=engine)
    except SystemExit as exc:  # argparse
        raise ConfigRejected(f"accelerate launch refused the arguments (exit {exc.code})") from None
    except (ValueError, TypeError, KeyError, FileNotFoundError, OSError) as exc:
        raise ConfigRejected(first_line(exc)) from exc
    except (AttributeError, IndexError) as exc:  # accelerate's own code tripping over a value of the wrong type
        raise ConfigRejected(f"accelerate fails on a value of the wrong type ({type(exc).__name__}: {exc})") from exc
    return args, plugin, env


@functools.lru_cache(maxsize=1)
def parallelism_config_keys() -> frozenset[str]:
    """The keys accelerate launch reads from a YAML's parallelism_config: its launch parser's
    --parallelism_config_* options (commands/launch.py). _validate_launch_command copies every key of the block onto
    the parsed arguments by name, so any other key is set on nothing that is read, silently."""
    from accelerate.commands.launch import launch_command_parser

    return frozenset(action.dest for action in launch_command_parser()._actions
                     if action.dest.startswith("parallelism_config_"))


def launch_argument_names() -> frozenset[str]:
    """Every option accelerate launch parses (commands/launch.py launch_command_parser). _validate_launch_command
    copies each key of a YAML's deepspeed_config (like its other mapping blocks) onto the parsed arguments by name,
    and the launcher reads only these, so a key of another name is set on nothing that is read, silently: DeepSpeed
    never sees it (a DeepSpeed-JSON spelling such as `offload_optimizer: {device: cpu}` included)."""
    from accelerate.commands.launch import launch_command_parser

    return frozenset(action.dest for action in launch_command_parser()._actions)


def first_line(exc: BaseException) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):  # pydantic ValidationError: name the offending fields
        try:
            return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors())
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    text = str(exc).strip() or type(exc).__name__
    lines = text.splitlines()
    # transformers/accelerate list mismatches as "- ds key=value vs hf arg=value" lines under a heading
    details = [line.strip()[2:] for line in lines[1:] if line.strip().startswith("- ")]
    return lines[0] + (" " + "; ".join(details) if details else "")


# --- DeepSpeed -------------------------------------------------------------------------------------------------------

def pipeline_mpu(data_parallel: int) -> SimpleNamespace:
    """The model-parallel unit DeepSpeed's pipeline engine passes (PipelineModule.mpu(): a PipeDataParallelTopology
    grid); DeepSpeedConfig asks it for get_data_parallel_world_size (world / stages)."""
    return SimpleNamespace(get_data_parallel_world_size=lambda: data_parallel)


def ulysses_mpu(sequence_parallel: int) -> SimpleNamespace:
    """The mpu accelerate passes under ALST / Ulysses (UlyssesSPAttentionHF.register_with_transformers returns
    deepspeed.runtime.sequence_parallel.parallel_state_sp, which has get_sequence_parallel_world_size and no
    get_data_parallel_world_size): DeepSpeedConfig then divides the world by its degree."""
    return SimpleNamespace(get_sequence_parallel_world_size=lambda: sequence_parallel)


class _Ranks:
    """deepspeed.comm as DeepSpeedConfig asks it (get_rank, get_world_size) for a run of `processes` ranks, with
    the data-parallel group of a device mesh (`group` is the mesh dimension's size)."""

    def __init__(self, processes: int) -> None:
        self.processes = processes

    def get_rank(self, group: Any = None) -> int:
        return 0

    def get_world_size(self, group: Any = None) -> int:
        return self.processes if group is None else group


class _Mesh:
    """The (data_parallel, sequence_parallel) device mesh deepspeed.initialize builds when the config holds both
    data_parallel_size and sequence_parallel_size (deepspeed/__init__.py initialize: dist.initialize_mesh_device)."""

    def __init__(self, data_parallel: int) -> None:
        self.data_parallel = data_parallel

    def get_group(self, mesh_dim: str) -> int:
        return self.data_parallel


@contextlib.contextmanager
def _ranks(processes: int) -> Iterator[None]:
    """Run DeepSpeedConfig's own constructor as rank 0 of `processes` ranks: it reads the world from deepspeed.comm
    (without a process group it silently takes world size 1)."""
    import deepspeed.runtime.config as ds_config_module

    saved = ds_config_module.dist
    ds_config_module.dist = _Ranks(processes)
    try:
        yield
    finally:
        ds_config_module.dist = saved


def deepspeed_config_at(config: dict[str, Any], processes: int, *, mpu: Any = None):
    """DeepSpeed's DeepSpeedConfig of `config` in a run of `processes` ranks; raises ConfigRejected.

    DeepSpeed's constructor itself picks the data-parallel world the batch identity uses (runtime/config.py): the
    mpu's get_data_parallel_world_size (the pipeline engine: pipeline_mpu), the world / the mpu's sequence-parallel
    size (accelerate's Ulysses: ulysses_mpu), the mesh's data-parallel group when the file holds data_parallel_size
    and sequence_parallel_size (deepspeed.initialize builds it), else the world / the file's sequence_parallel_size
    when it has one (the deepspeed launcher's scripts, the HF zero.Init path), else the world."""
    from deepspeed.runtime.config import DeepSpeedConfig

    left = auto_keys(config)
    if left:
        raise ConfigRejected(f"\"auto\" left in {', '.join(left)}: DeepSpeed reads the file as it is")
    mesh = None
    if mpu is None and "sequence_parallel_size" in config and "data_parallel_size" in config:
        mesh = _Mesh(config["data_parallel_size"])
    # Ours only where DeepSpeed's own words would mislead: it divides by a degree that does not divide the world
    # (a float world, then a batch refusal or none at all), and fails on 0 with a ZeroDivisionError.
    problem = sequence_parallel_problem(config, processes) if mpu is None else None
    try:
        with _ranks(processes):
            parsed = DeepSpeedConfig(copy.deepcopy(config), mpu, mesh_device=mesh)
    except Exception as exc:  # noqa: BLE001 - DeepSpeed raises AssertionError, ValueError, pydantic errors
        raise ConfigRejected(problem or first_line(exc)) from exc
    if problem:
        raise ConfigRejected(problem)
    return parsed


def sequence_parallel_problem(config: dict[str, Any], processes: int) -> str | None:
    """What DeepSpeed does with a file's sequence_parallel_size (and data_parallel_size) in a run of `processes`
    ranks that passes no mpu, when it cannot be right: the degree must be a whole number >= 1 that divides the
    ranks (DeepSpeedConfig divides the world by it; parallel_state_sp.initialize_sequence_parallel and Ulysses'
    groups need equal groups), and with data_parallel_size the two must multiply to the ranks (the device mesh
    deepspeed.initialize builds covers every rank)."""
    if "sequence_parallel_size" not in config:
        return None
    sp = config["sequence_parallel_size"]
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        return f"sequence_parallel_size {json_text(sp)} must be a whole number >= 1 (DeepSpeed divides the world by it)"
    if processes % sp:
        works = ", ".join(str(d) for d in divisors(processes)[:12])
        return (f"sequence_parallel_size {sp} does not divide the {processes} processes: DeepSpeed counts {processes} / "
                f"{sp} = {processes / sp:.4g} data-parallel ranks (and Ulysses needs equal groups of {sp}); use one "
                f"of {works}")
    dp = config.get("data_parallel_size")
    if "data_parallel_size" in config and (not isinstance(dp, int) or isinstance(dp, bool) or dp * sp != processes):
        return (f"data_parallel_size {json_text(dp)} x sequence_parallel_size {sp} is not the {processes} processes: "
                f"deepspeed.initialize builds a device mesh of that shape over every rank; set data_parallel_size to "
                f"{processes // sp} or remove it")
    return None


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (in sqrt(n) steps: n may be a world of millions of ranks)."""
    import math

    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def json_text(value: Any) -> str:
    import json

    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def resolve_like_trainer(config: dict[str, Any], *, world_size: int, micro_batch: int, grad_accum: int,
                         hidden_size: int, precision: str, max_grad_norm: float = 1.0,
                         learning_rate: float = 5e-5, num_training_steps: int = 1000,
                         trainer_args: dict[str, Any] | None = None, leave_auto: bool = False) -> dict[str, Any]:
    """Fill "auto" values with the HF Trainer's own code (transformers HfTrainerDeepSpeedConfig).

    The arguments are what toolkit.train passes to TrainingArguments for the plan (trainer_args: more
    TrainingArguments fields, e.g. adam_beta1). Raises ConfigRejected when the Trainer would refuse (a concrete value
    that mismatches the arguments) or, unless leave_auto, leave an "auto" unfilled.
    """
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    args = SimpleNamespace(
        world_size=world_size, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=grad_accum,
        max_grad_norm=max_grad_norm, learning_rate=learning_rate, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, weight_decay=0.0, save_on_each_node=False,
        fp16=precision == "fp16", fp16_full_eval=False, bf16=precision in ("bf16", "bf16-pure"), bf16_full_eval=False,
        get_warmup_steps=lambda steps: 0,
    )
    for name, value in (trainer_args or {}).items():
        setattr(args, name, value)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=hidden_size))
    try:
        hf_config = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
        hf_config.trainer_config_process(args)
        hf_config.trainer_config_finalize(args, model, num_training_steps)
        resolved = hf_config.config
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigRejected(first_line(exc)) from exc
    finally:
        unset_hf_deepspeed_config()  # the constructor registers a process-wide weakref (is_deepspeed_zero3_enabled)
    left = auto_keys(resolved)
    if left and not leave_auto:
        raise ConfigRejected(f"the HF Trainer does not fill \"auto\" in {', '.join(left)}; write a value")
    return resolved


def validate_ds_config_for_plan(config: dict[str, Any], plan) -> Any:
    """Check a DeepSpeed JSON the way the plan's runner reads it; returns DeepSpeed's parsed config."""
    from toolkit.emit.deepspeed import hidden_size

    if plan.engine == Engine.PIPELINE:
        # toolkit.train hands the file to deepspeed.initialize unchanged with the PipelineModule's mpu.
        return deepspeed_config_at(config, plan.world_size, mpu=pipeline_mpu(plan.data_parallel))
    # Under Ulysses accelerate sets train_batch_size from the data-parallel ranks at prepare time (world // sp,
    # Accelerator._prepare_deepspeed) and passes its mpu, so DeepSpeed's world is world / sp.
    resolved = resolve_like_trainer(config, world_size=plan.data_parallel, micro_batch=plan.micro_batch,
                                    grad_accum=plan.grad_accum, hidden_size=hidden_size(plan),
                                    precision=plan.precision)
    sp = plan.sequence_parallel
    if plan.zero_stage == 3 and "sequence_parallel_size" in config:
        # The HF zero.Init path (from_pretrained under the Trainer's ZeRO-3 config): the Trainer fills the batch over
        # every process (trainer_config_process) and DeepSpeedConfig, without accelerate's mpu, divides the world
        # by the file's degree (issue 17: "train_batch_size is not equal to ... 8 != 2 * 2 * 1.0").
        all_ranks = resolve_like_trainer(config, world_size=plan.world_size, micro_batch=plan.micro_batch,
                                         grad_accum=plan.grad_accum, hidden_size=hidden_size(plan),
                                         precision=plan.precision)
        try:
            deepspeed_config_at(all_ranks, plan.world_size)
        except ConfigRejected as exc:
            raise ConfigRejected(f"ZeRO-3's zero.Init reads sequence_parallel_size {config['sequence_parallel_size']} "
                                 f"from the file and refuses the batch the HF Trainer fills ({exc}); remove the key: "
                                 "accelerate's ParallelismConfig carries the degree") from exc
    parsed = deepspeed_config_at(resolved, plan.world_size, mpu=ulysses_mpu(sp) if sp > 1 else None)
    if plan.grid.autoep:
        autoep_config_check(parsed, plan.world_size)
    return parsed


def autoep_config_check(parsed: Any, world_size: int) -> None:
    """DeepSpeed's own AutoEP validation of a parsed config's expert_parallel section at `world_size` ranks
    (module_inject/auto_ep_config.py validate_autoep_config, what DeepSpeedEngine._configure_expert_parallel runs
    before it replaces a layer: folding over the world, ZeRO stage, offload); ConfigRejected says why not."""
    from deepspeed.module_inject.auto_ep_config import validate_autoep_config

    try:
        validate_autoep_config(parsed.expert_parallel_config, world_size, 1, 1, 1,
                               zero_stage=parsed.zero_optimization_stage,
                               zero_offload_optimizer=parsed.zero_config.offload_optimizer is not None,
                               zero_offload_param=parsed.zero_config.offload_param is not None)
    except ValueError as exc:
        raise ConfigRejected(f"DeepSpeed AutoEP refuses the expert_parallel section: {first_line(exc)}") from exc


def validate_parallelism_config(kwargs: dict[str, Any], *, world_size: int, engine: str):
    """accelerate's own checks of a ParallelismConfig given as keyword arguments (training_args.json's
    `parallelism_config`): its constructor, then `Accelerator._validate_accelerator` against a stand-in accelerator of
    `world_size` processes running `engine` ("fsdp2", "deepspeed", "ddp"). Returns the ParallelismConfig; raises
    ConfigRejected with accelerate's message."""
    from toolkit.emit.parallelism import build_parallelism_config

    try:
        pc = build_parallelism_config(kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigRejected(first_line(exc)) from exc
    check_parallelism_config(pc, world_size=world_size, engine=engine)
    return pc


def check_parallelism_config(pc, *, world_size: int, engine: str) -> None:
    """`Accelerator._validate_accelerator` of `pc` (accelerate's code), plus the two rules accelerate applies
    elsewhere: context parallelism needs the FSDP2 plugin (state.py) and DeepSpeed groups world / sp data-parallel
    ranks (parallel_state_sp.initialize_sequence_parallel asserts sp divides the world)."""
    from accelerate.utils import DistributedType

    kind = {"deepspeed": DistributedType.DEEPSPEED, "fsdp2": DistributedType.FSDP}.get(engine,
                                                                                        DistributedType.MULTI_GPU)
    accelerator = SimpleNamespace(multi_device=world_size > 1, num_processes=world_size, is_fsdp2=engine == "fsdp2",
                                  distributed_type=kind, is_main_process=True)
    try:
        with _quiet_warnings():
            pc._validate_accelerator(accelerator)
    except (ValueError, TypeError) as exc:
        raise ConfigRejected(first_line(exc)) from exc
    if (pc.tp_size > 1 or pc.cp_size > 1) and engine != "fsdp2":
        raise ConfigRejected("tp_size / cp_size > 1 need FSDP2 (accelerate: cp_size > 1 requires an FSDP2 plugin; "
                             "tensor parallelism through ParallelismConfig is applied with FSDP2)")
    if pc.sp_size > 1 and (engine != "deepspeed" or world_size % pc.sp_size
                           or pc.data_parallel_size * pc.sp_size != world_size):
        raise ConfigRejected(f"sp_size {pc.sp_size} needs DeepSpeed with dp_replicate x dp_shard x sp = "
                             f"{world_size} processes (got {pc.data_parallel_size} x {pc.sp_size})")


@contextlib.contextmanager
def _quiet_warnings() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def validate_grpo_config(kwargs: dict[str, Any]):
    """TRL's own GRPOConfig built from a GRPO plan's grpo_config (training_args.json): its __post_init__ (at least 2
    generations, a generation batch of whole groups) and TrainingArguments' checks run on these values, with
    use_cpu=True on a machine without a GPU. Returns the GRPOConfig; raises ConfigRejected with TRL's reason."""
    import tempfile

    import torch
    from trl import GRPOConfig

    here = {} if torch.cuda.is_available() else {"use_cpu": True}
    try:
        with tempfile.TemporaryDirectory() as out, _quiet_warnings():
            return GRPOConfig(output_dir=out, report_to="none", **{**kwargs, **here})
    except (TypeError, ValueError) as exc:
        raise ConfigRejected(f"TRL's GRPOConfig refuses the plan's grpo_config: {first_line(exc)}") from None


def validate_dpo_config(kwargs: dict[str, Any]):
    """TRL's own DPOConfig built from a DPO plan's dpo_config (training_args.json): its __post_init__ and
    TrainingArguments' checks run on these values; on a machine without a GPU with use_cpu=True, as
    toolkit.train.own_script hands them to a script there. Returns the DPOConfig; raises ConfigRejected with TRL's
    reason. DPOConfig leaves loss_type unchecked (DPOTrainer reads it), so that is checked against TRL's list here."""
    import tempfile

    import torch
    from trl import DPOConfig

    from toolkit.inputs.choices import DPO_LOSS_TYPES

    here = {} if torch.cuda.is_available() else {"use_cpu": True}
    try:
        with tempfile.TemporaryDirectory() as out, _quiet_warnings():
            config = DPOConfig(output_dir=out, report_to="none", **{**kwargs, **here})
    except (TypeError, ValueError) as exc:
        raise ConfigRejected(f"TRL's DPOConfig refuses the plan's dpo_config: {first_line(exc)}") from None
    unknown = [t for t in config.loss_type if t not in DPO_LOSS_TYPES]
    if unknown:
        raise ConfigRejected(f"dpo_config loss_type {unknown[0]!r} is not one of TRL's DPO losses")
    return config
