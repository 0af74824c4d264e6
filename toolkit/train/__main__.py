"""Entry point: `python -m toolkit.train --plan PLAN --data DATA --output DIR ...` (under `accelerate launch`).

Pipeline and hybrid plans go to toolkit.train.pipeline (neither Accelerate nor the HF Trainer can run them); everything
else to the HF Trainer path. Bad input is one line from rank 0 and exit code 2 on every rank, with no traceback.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from toolkit.errors import EXIT_USER_ERROR, UserError
from toolkit.inputs.strategy import Engine
from toolkit.processes import on_import
from toolkit.train.failures import rank, report_failure


def main(argv: list[str] | None = None) -> int:
    import warnings

    # torch's collective-API renames warn on every ZeRO / FSDP step; nothing a user of this entry can act on.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    from toolkit.plan.schema import load_plan
    from toolkit.train.args import parse_train_args

    if "LOCAL_RANK" in os.environ:  # started by a launcher: never outlive it (it may be SIGKILLed)
        from toolkit.processes import die_with_parent

        die_with_parent(signal.SIGKILL)
        if os.getppid() == 1:  # the launcher died before the line above
            return 1
    try:
        args = parse_train_args(argv)
        plan = load_plan(args.plan)
        from toolkit.train.elastic import join_restarted_group

        join_restarted_group()
        if plan.engine == Engine.PIPELINE:
            from toolkit.train.pipeline.runner import train_pipeline

            if args.trainer_flags:
                raise UserError(f"--{next(iter(args.trainer_flags))}: TrainingArguments flags configure the HF "
                                "Trainer, which pipeline plans do not use (DeepSpeed's pipeline engine runs them)")

            return train_pipeline(plan, args) or 0
        from toolkit.train.hf_runner import train_hf

        return train_hf(plan, args)
    except UserError as exc:
        first = report_failure(exc, user_error=True)
        if rank() == 0 or first:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except Exception as exc:
        report_failure(exc, user_error=False)
        raise  # a bug: its traceback goes to the run's log


def bitsandbytes_unused(plan, qlora_flag: bool) -> bool:
    """True when the run can neither quantise its base (QLoRA: the plan's method or --qlora) nor build an 8-bit
    optimizer (adamw-8bit): the only two uses of bitsandbytes in toolkit.train."""
    return plan.method != "qlora" and not qlora_flag and plan.optimizer != "adamw-8bit"


def deepspeed_unused(plan) -> bool:
    """True when no part of the run is DeepSpeed's: the engine is DDP or FSDP2 (not ZeRO, AutoEP or the pipeline),
    the layers are not tiled (DeepSpeed's TiledMLP, toolkit.patches.tiling) and there is no Ulysses sequence
    parallelism (DeepSpeed's ulysses_sp)."""
    return plan.engine in (Engine.DDP, Engine.FSDP2) and not plan.tiled and plan.sequence_parallel == 1


def peft_unused(plan, adapter_flag: bool) -> bool:
    """True when the run trains no adapter: a full fine-tuning plan (the schema allows adapter settings only with
    method lora / qlora) without --lora / --qlora. PEFT's uses in toolkit.train are the adapter's (adapters.wrap_model,
    the merged save, TRL's peft_config)."""
    return plan.method == "full" and not adapter_flag


def leave_out_unused(argv: list[str]) -> list[str]:
    """Process entry only: the installed packages this run cannot use, marked absent (sys.modules[name] = None, so
    importlib.util.find_spec answers None and every availability check of transformers, accelerate, PEFT and TRL
    says "not installed"); returns their names. bitsandbytes: transformers.trainer_utils imports PEFT whenever it is
    installed, PEFT's helpers import bitsandbytes, and bitsandbytes' CPU ops call torch.compile at import, which
    imports inductor: about 1.2 s of CPU at every rank's start here. DeepSpeed: accelerate's unwrap_model imports it
    whenever it is installed (about 0.3-0.6 s of CPU). PEFT: transformers.trainer_utils imports it whenever it is
    installed (0.1-0.25 s of CPU). A run that uses DeepSpeed imports its Muon module with the kernels left
    uncompiled (compile_muon_never) and asks py-cpuinfo once (ask_cpuinfo_once). docs/ENGINE_FACTS.md says why
    this is consistent. An unreadable plan changes nothing (main says why)."""
    if {"-h", "--help"} & set(argv):
        return []
    from toolkit.plan.schema import load_plan
    from toolkit.train.args import build_train_parser

    try:
        ns, _ = build_train_parser().parse_known_args(argv)
        plan = load_plan(ns.plan)
    except (UserError, SystemExit):
        return []
    unused = {"bitsandbytes": bitsandbytes_unused(plan, bool(ns.qlora)), "deepspeed": deepspeed_unused(plan),
              "peft": peft_unused(plan, bool(ns.lora or ns.qlora))}
    left_out = [name for name, left in unused.items() if left and name not in sys.modules]
    for name in left_out:
        sys.modules[name] = None
    if not unused["deepspeed"]:
        ask_cpuinfo_once()
        if muon_unused(Path(ns.plan)):
            compile_muon_never()
    return left_out


MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"
"""DeepSpeed's Muon optimizer: two Newton-Schulz kernels decorated with torch.compile, imported by every ZeRO
optimizer's set-up (deepspeed.runtime.zero.utils.is_zero_supported_optimizer, the ZeRO-1/2/3 and bf16 optimizers'
__init__) whatever the optimizer is."""


def muon_unused(plan_path: Path) -> bool:
    """True when the run's DeepSpeed JSON (ds_config.json beside plan.json) names no Muon optimizer: toolkit.train's
    optimizer is the Trainer's (toolkit.inputs.choices.OPTIMIZERS holds no Muon) unless that JSON's "optimizer" says
    otherwise. An unreadable JSON answers False (the runner says what is wrong with it)."""
    import json

    from toolkit.plan.files import DS_CONFIG

    try:
        optimizer = json.loads(((plan_path if plan_path.is_dir() else plan_path.parent) / DS_CONFIG).read_text()
                               ).get("optimizer") or {}
        return str(optimizer.get("type", "")).lower() != "muon"
    except (OSError, ValueError, AttributeError):
        return False


def compile_muon_never() -> None:
    """Process entry only, for a run whose DeepSpeed builds no Muon optimizer (muon_unused): when DeepSpeed imports
    MUON_MODULE, the module runs with TORCHDYNAMO_DISABLE=1 (torch._dynamo.eval_frame._optimize: torch.compile then
    returns the function itself), set for that import only. Decorating with torch.compile resolves the inductor
    backend at once (torch._inductor.compile_fx, torch._dynamo.repro.after_dynamo): about 0.75 s of CPU at every
    ZeRO rank's optimizer set-up here, for two kernels that only a Muon optimizer calls. docs/ENGINE_FACTS.md."""

    def uncompiled(run, module) -> None:
        before = os.environ.get("TORCHDYNAMO_DISABLE")
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        try:
            run()
        finally:
            if before is None:
                os.environ.pop("TORCHDYNAMO_DISABLE", None)
            else:
                os.environ["TORCHDYNAMO_DISABLE"] = before

    on_import(MUON_MODULE, uncompiled)


CPUINFO_MODULE = "cpuinfo.cpuinfo"
"""py-cpuinfo, which DeepSpeed's CPU ops ask for the CPU's architecture and vendor."""


def ask_cpuinfo_once() -> None:
    """Process entry only: py-cpuinfo's answer kept for the process. Its get_cpu_info starts a new interpreter at
    every call (py-cpuinfo 9.0.0 get_cpu_info_json: `python cpuinfo.py --json`, about 0.4 s of CPU each here), and a
    DeepSpeed rank with its CPU Adam (ZeRO offload) asks three times: the op builder's cpu_arch and simd_width, then
    DeepSpeedCPUAdam.__init__. The CPU does not change while the process runs; each call still parses the kept JSON
    into a dict of its own. docs/ENGINE_FACTS.md."""
    import functools

    def kept(run, module) -> None:
        run()
        module.get_cpu_info_json = functools.lru_cache(maxsize=None)(module.get_cpu_info_json)

    on_import(CPUINFO_MODULE, kept)


if __name__ == "__main__":
    from toolkit.processes import pause_collector
    from toolkit.train.cpu import exit_process

    pause_collector()  # until the runner's start_up_done
    leave_out_unused(sys.argv[1:])
    exit_process(main())
