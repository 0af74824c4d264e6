"""Validate emitted files with the engines' own code, the way the runners will read them, without launching.

- accelerate YAML: accelerate's launch parser and `_validate_launch_command` (which loads the file with its config
  loader and rejects unknown keys), then the environment the launcher would hand the processes
  (`prepare_deepspeed_cmd_env` / `prepare_multi_gpu_env`), under which the plugin the Accelerator builds is
  constructed: `DeepSpeedPlugin` (refuses keys that a JSON file makes ignored, a JSON without zero_optimization,
  a missing JSON file) or `FullyShardedDataParallelPlugin` (wrap policy, FSDP2 options).
- DeepSpeed JSON: "auto" values are first resolved with transformers' own `HfTrainerDeepSpeedConfig` (the code the
  HF Trainer runs; it also reports values that mismatch the TrainingArguments), then DeepSpeed's `DeepSpeedConfig`
  checks the result at the planned data-parallel world size.

DeepSpeedConfig reads its world size from torch.distributed (runtime/config.py: `dist.get_rank()` fails when no
process group exists and the world size silently becomes 1). `DeepSpeedConfigAtWorldSize` runs the same
constructor steps as DeepSpeed 0.19 (`_initialize_params`, `_configure_train_batch_size`, `_do_sanity_check`)
with a given world size; a test checks it agrees with DeepSpeedConfig at world size 1.
"""

from __future__ import annotations

import contextlib
import copy
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

def deepspeed_config_at(config: dict[str, Any], world_size: int):
    """DeepSpeed's DeepSpeedConfig of `config` at a data-parallel world size; raises ConfigRejected."""
    from deepspeed.runtime.config import DeepSpeedConfig

    class DeepSpeedConfigAtWorldSize(DeepSpeedConfig):
        def __init__(self, param_dict: dict[str, Any], world: int) -> None:  # noqa: D401 - mirrors the base
            import deepspeed.runtime.config as ds_config_module

            self._param_dict = param_dict
            reject = getattr(ds_config_module, "_reject_removed_config_keys", None)
            if reject is not None:
                reject(param_dict)
            self.global_rank = 0
            self.world_size = world
            self._initialize_params(copy.copy(param_dict))
            self._configure_train_batch_size()
            self._do_sanity_check()

    left = auto_keys(config)
    if left:
        raise ConfigRejected(f"\"auto\" left in {', '.join(left)}: DeepSpeed reads the file as it is")
    try:
        return DeepSpeedConfigAtWorldSize(copy.deepcopy(config), world_size)
    except Exception as exc:  # noqa: BLE001 - DeepSpeed raises AssertionError, ValueError, pydantic errors
        raise ConfigRejected(first_line(exc)) from exc


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
        # toolkit.train hands the file to deepspeed.initialize unchanged; the pipeline engine's data-parallel
        # world is world / stages (its mpu), which is what its batch assertion uses.
        return deepspeed_config_at(config, plan.data_parallel)
    # Under Ulysses the data-parallel world is world / sp: accelerate sets train_batch_size from
    # ParallelismConfig.data_parallel_size at prepare time, and DeepSpeed's world is world / sp (its mpu).
    resolved = resolve_like_trainer(config, world_size=plan.data_parallel, micro_batch=plan.micro_batch,
                                    grad_accum=plan.grad_accum, hidden_size=hidden_size(plan),
                                    precision=plan.precision)
    return deepspeed_config_at(resolved, plan.data_parallel)


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
