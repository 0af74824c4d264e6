"""Your own training script with a plan, on the cluster and on a smaller box (a dev machine, a laptop, a CPU).

The one toolkit import a user's script needs (public, documented in PLAN.md and examples/own_script/):

    from toolkit.train.own_script import training_arguments      # or sft_config / dpo_config / accelerate_loop
    args = TrainingArguments(output_dir="out", learning_rate=2e-5, **training_arguments())

LoRA / QLoRA: `model = peft_model(AutoModelForCausalLM.from_pretrained(MODEL, **model_kwargs()))`.

Started by `toolkit launch PLAN_DIR [--processes N] [--cpu] -- my_train.py ARGS`. Each function returns the plan's
settings (training_args.json of the folder launch ran the script with: TOOLKIT_PLAN_DIR, or `plan=`), adjusted for
the box the script runs on. `toolkit launch --processes N` already kept the global batch by accumulation in that
file; what this module adds is what only a machine without a GPU needs: accelerate's shared state over gloo,
created before TrainingArguments (or the Accelerator) exist, and `use_cpu` / `use_configured_state` for the Trainer
to use it (docs/ENGINE_FACTS.md "Running the engines without a GPU"). On a GPU the settings are the plan's, as they
are.

`python -m toolkit.train.own_script SCRIPT ARGS` is how `toolkit launch` runs the script on every rank: as
`python SCRIPT ARGS` would, except that a rank that fails first writes one line saying why for the launcher
(toolkit.train.failures), so a failure reads as one line with the log's path, not one traceback per rank.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PLAN_DIR_ENV = "TOOLKIT_PLAN_DIR"
"""Set by `toolkit launch` and the plan's launch.sh: the plan folder this run uses (for --processes / --cpu, the
folder made for this box)."""


def plan_settings(plan: str | Path | None = None) -> dict[str, Any]:
    """training_args.json of `plan` (a plan folder), else of $TOOLKIT_PLAN_DIR."""
    folder = plan or os.environ.get(PLAN_DIR_ENV)
    if not folder:
        raise SystemExit(f"no plan folder: start the script with `toolkit launch PLAN_DIR -- SCRIPT` (which sets "
                         f"{PLAN_DIR_ENV}) or pass plan=PLAN_DIR")
    from toolkit.plan.files import TRAINING_ARGS

    path = Path(folder) / TRAINING_ARGS
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot read {path} ({type(exc).__name__}); re-emit the plan with `toolkit emit`") from None


def training_arguments(plan: str | Path | None = None) -> dict[str, Any]:
    """transformers.TrainingArguments keyword arguments: the plan's, for this box."""
    return _for_this_box(plan_settings(plan)["training_arguments"])


def sft_config(plan: str | Path | None = None) -> dict[str, Any]:
    """trl.SFTConfig keyword arguments: the plan's (TrainingArguments' plus max_length, packing, PEFT), for this
    box."""
    settings = plan_settings(plan)
    if "sft_config" not in settings:
        raise SystemExit("this plan is a DPO / GRPO plan (training_args.json holds dpo_config / grpo_config, not "
                         "sft_config); use dpo_config() with TRL's DPOTrainer or grpo_config() with GRPOTrainer")
    return _for_this_box(settings["sft_config"])


def grpo_config(plan: str | Path | None = None) -> dict[str, Any]:
    """trl.GRPOConfig keyword arguments of a GRPO plan (TrainingArguments' plus num_generations,
    max_completion_length, beta, the vLLM settings, generation_batch_size), for this box."""
    settings = plan_settings(plan)
    if "grpo_config" not in settings:
        raise SystemExit("this plan is not a GRPO plan (no grpo_config in training_args.json); use sft_config() or "
                         "training_arguments(), or re-plan with --method grpo")
    return _for_this_box(settings["grpo_config"])


def reward_funcs(plan: str | Path | None = None) -> list[Any]:
    """GRPOTrainer's reward_funcs of a GRPO plan: its reward model by name (TRL loads it with
    AutoModelForSequenceClassification, num_labels=1), or [] for a plan planned with rule-based rewards only; add
    your own reward functions to the list."""
    return list(plan_settings(plan).get("reward_funcs", []))


def dpo_config(plan: str | Path | None = None) -> dict[str, Any]:
    """trl.DPOConfig keyword arguments of a DPO plan (TrainingArguments' plus beta, loss_type, max_length,
    precompute_ref_log_probs), for this box."""
    settings = plan_settings(plan)
    if "dpo_config" not in settings:
        raise SystemExit("this plan is not a DPO plan (no dpo_config in training_args.json); use sft_config() or "
                         "training_arguments(), or re-plan with --method dpo")
    return _for_this_box(settings["dpo_config"])


def accelerate_loop(plan: str | Path | None = None) -> dict[str, Any]:
    """A custom accelerate loop's numbers (batch size, accumulation, clipping, mixed_precision, ...). Call it before
    creating the Accelerator: on a machine without a GPU it creates accelerate's state over gloo first."""
    settings = dict(plan_settings(plan)["accelerate_loop"])
    prepare_this_box()
    return settings


def model_kwargs(plan: str | Path | None = None) -> dict[str, Any]:
    """from_pretrained keyword arguments the plan assumes: the dtype to load in, for QLoRA the 4-bit
    quantization_config (transformers.BitsAndBytesConfig), and for tensor / expert parallelism the
    distributed_config (transformers.distributed.DistributedConfig) with which transformers shards the model as it
    loads it (call it after training_arguments(), which sets up this box's process group); a plan's RoPE scaling
    adds its model_config_overrides (config keys from_pretrained sets on the config it loads)."""
    import torch

    settings = plan_settings(plan)
    adapter = settings.get("adapter")
    sharding: dict[str, Any] = dict(settings.get("model_config_overrides", {}))  # RoPE scaling: config keys
    if settings.get("distributed_config"):
        from transformers.distributed import DistributedConfig

        sharding["distributed_config"] = DistributedConfig(**settings["distributed_config"])
    if adapter is None:
        return {"dtype": getattr(torch, settings["accelerate_loop"]["model_dtype"]), **sharding}
    out: dict[str, Any] = {"dtype": getattr(torch, adapter["model_dtype"]), **sharding}
    if "bnb_config" in adapter:
        from toolkit.train.adapters import bnb_config

        out["quantization_config"] = bnb_config(adapter["bnb_config"])
    return out


def lora_config(plan: str | Path | None = None):
    """The plan's peft.LoraConfig (for get_peft_model, or TRL's SFTTrainer(peft_config=...)); None for a full
    fine-tuning plan."""
    adapter = plan_settings(plan).get("adapter")
    if adapter is None:
        return None
    from peft import LoraConfig

    return LoraConfig(**adapter["lora_config"])


def peft_model(model, plan: str | Path | None = None):
    """The plan's PEFT model of a base loaded with model_kwargs(), wrapped as toolkit.train wraps it
    (toolkit.train.adapters.peft_wrap): the embedding's output made to require grad when the plan checkpoints
    activations, peft.get_peft_model with lora_config(), and PEFT's modules_to_save copies cast to the plan's
    modules_to_save dtype (toolkit.inputs.lora.apply_saved_dtype). Give the result to the Trainer, or to TRL's
    SFTTrainer without peft_config."""
    from peft import LoraConfig

    from toolkit.inputs.choices import BASE_DTYPE_NAMES
    from toolkit.train.adapters import peft_wrap

    adapter = plan_settings(plan).get("adapter")
    if adapter is None:
        raise SystemExit("this plan fine-tunes the whole model (no adapter in training_args.json): train the loaded "
                         "model itself, or re-plan with --method lora / qlora")
    flag_of = {name: flag for flag, name in BASE_DTYPE_NAMES.items()}  # training_args.json holds torch's name
    saved_dtype = flag_of[adapter["modules_to_save_dtype"]] if "modules_to_save_dtype" in adapter else "auto"
    return peft_wrap(model, LoraConfig(**adapter["lora_config"]), saved_dtype,
                     checkpointing=bool(adapter.get("gradient_checkpointing_needs_input_grads")))


def prepare_this_box() -> bool:
    """On a machine without a GPU: create accelerate's shared state over gloo the way the launched engine needs it
    (DeepSpeed, FSDP2 or DDP: read from the environment `accelerate launch` sets). True when it did; on a GPU,
    nothing (False)."""
    from toolkit.train.cpu import configure_cpu_state, on_cpu

    if not on_cpu():
        return False
    engine = ("deepspeed" if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" else
              "fsdp2" if os.environ.get("ACCELERATE_USE_FSDP") == "true" else "ddp")
    sp_size = os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1")  # accelerate launch's, from the plan's YAML
    configure_cpu_state(engine, sequence_parallel=sp_size.isdigit() and int(sp_size) > 1)
    return True


def _for_this_box(kwargs: dict[str, Any]) -> dict[str, Any]:
    if not prepare_this_box():
        return dict(kwargs)
    accelerator_config = {**(kwargs.get("accelerator_config") or {}), "use_configured_state": True}
    return {**kwargs, "use_cpu": True, "accelerator_config": accelerator_config}


def run_script(argv: list[str]) -> int:
    """Run SCRIPT ARGS as `python SCRIPT ARGS` would (its folder first on sys.path, __name__ == "__main__"); a
    failure is reported for the launcher (toolkit.train.failures) and its traceback goes to the run's log."""
    import runpy
    import signal
    import sys
    import traceback

    from toolkit.train.failures import report_failure
    from toolkit.train.own_script_guard import LaunchGuard

    if not argv:
        print("usage: python -m toolkit.train.own_script SCRIPT [ARGS]", file=sys.stderr)
        return 2
    if "LOCAL_RANK" in os.environ:  # started by a launcher: never outlive it
        from toolkit.processes import die_with_parent

        die_with_parent(signal.SIGKILL)
    script = Path(argv[0])
    sys.argv = [str(script), *(_rehearsal_paths(a) for a in argv[1:])]
    sys.path[0] = str(script.resolve().parent)
    stderr = sys.stderr = _LastLine(sys.stderr)
    guard = LaunchGuard(plan_settings, prepare_this_box).install()
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            return _script_exit(script, exc.code, stderr.last)
    except BaseException as exc:  # the user's error, whatever its class: one line for the launcher, full traceback
        report_failure(exc, user_error=False)
        traceback.print_exc()
        return 1
    alone = guard.finished_alone()
    return _script_exit(script, alone, stderr.last) if alone else 0


def _script_exit(script: Path, code: int | str, last_line: str) -> int:
    """A script's SystemExit as one line for the launcher: sys.exit("why") says why; for a bare exit code, the
    script's own last line on stderr does (argparse's "prog: error: ..."), which otherwise stays in the log."""
    import sys

    from toolkit.train.failures import report_failure

    if isinstance(code, str):
        reason = code
        print(code, file=sys.stderr)
    else:
        reason = f"exited with code {code}" + (f": {last_line}" if last_line else "")
    report_failure(SystemExit(f"{script.name}: {reason}"), user_error=True)
    return code if isinstance(code, int) else 1


class _LastLine:
    """sys.stderr as it was, remembering the last non-empty line written to it (the script's own last word)."""

    def __init__(self, stream):
        self._stream = stream
        self._pending = ""
        self.last = ""

    def write(self, text: str) -> int:
        lines = [line.rsplit("\r", 1)[-1] for line in (self._pending + text).split("\n")]  # a bar's last state
        self._pending = lines.pop()[-2000:]
        for line in reversed(lines):
            if line.strip():
                self.last = line.strip()[:500]
                break
        if self._pending.strip():
            self.last = self._pending.strip()[:500]
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


REHEARSAL_NAMES = ("TOOLKIT_REHEARSAL_MODEL", "TOOLKIT_REHEARSAL_DATA")
"""Set by `toolkit launch DIR --rehearse -- SCRIPT ARGS` (toolkit.run.rehearsal): the tiny model and data folder."""


def _rehearsal_paths(arg: str) -> str:
    """'$TOOLKIT_REHEARSAL_MODEL' / '$TOOLKIT_REHEARSAL_DATA' in an argument, when a rehearsal set them."""
    for name in REHEARSAL_NAMES:
        if name in os.environ:
            arg = arg.replace(f"${{{name}}}", os.environ[name]).replace(f"${name}", os.environ[name])
    return arg


if __name__ == "__main__":
    import sys

    from toolkit.train.cpu import exit_process

    exit_process(run_script(sys.argv[1:]))
