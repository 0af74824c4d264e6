"""`toolkit profile`: predicted vs measured memory and time of real steps of the model on this machine."""

from __future__ import annotations

import json

from toolkit import bounds
from toolkit.bounds import int_arg
from toolkit.errors import UserError
from toolkit.inputs.choices import COMPILE_BLOCKS
from toolkit.inputs.job import checkpointing_words
from toolkit.commands.common import (adapter_of, dpo_of, grpo_of, add_checkpointing_flag, add_job_flags, add_model_flags, model_spec,
                                     print_note, seq_len_of)
from toolkit.inputs.choices import GIB


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="predicted vs measured memory of real steps on this machine")
    add_model_flags(p)
    add_job_flags(p, one_device=True)
    p.add_argument("--micro-batch", type=int_arg("--micro-batch", bounds.BATCH), default=1,
                   help="samples per forward (default %(default)s)")
    add_checkpointing_flag(p, "activation checkpointing (the bare flag means on; op: torchtitan's per-op selective policy)")
    p.add_argument("--device", default="cpu", type=_device, help="cpu or cuda[:N] (default %(default)s)")
    p.add_argument("--steps", type=int_arg("--steps", bounds.PROFILE_STEPS), default=3,
                   help="timed steps after the measured one (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print only JSON: the job, predicted and measured")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args) -> int:
    """Predicted vs measured for one real single-device step of the model (random weights, this process)."""
    from toolkit.estimate.profile import measure_step, predict_step

    if args.tiled:
        raise UserError("profile measures one plain step; --tiled is measured against live tensors by "
                        "benchmarks/dimension_memory.py, not by profile yet: drop --tiled")
    if args.compile:
        flag = "--compile-blocks" if args.compile == COMPILE_BLOCKS else "--compile"
        raise UserError(f"profile measures an eager step; {flag} is checked against real compiled CPU steps in "
                        f"tests/test_compiled.py, not by profile yet: drop {flag}")
    if args.activation_offloading:
        raise UserError("profile measures a step with its activations on the device; --activation-offloading (TRL's "
                        "offload to host RAM) is modelled by estimate and plan only: drop --activation-offloading")
    adapter = adapter_of(args, training_only_read=False)
    if dpo_of(args) is not None:
        raise UserError("profile measures a supervised step; a DPO step (policy on chosen + rejected, reference "
                        "forward) is modelled by estimate and plan only: drop --method dpo")
    if grpo_of(args) is not None:
        raise UserError("profile measures a supervised step; a GRPO step (generation, scoring, the policy's step) is "
                        "modelled by estimate and plan only: drop --method grpo")
    if adapter.method == "qlora":
        raise UserError("profile builds its base in the compute dtype; a QLoRA base is 4-bit (bitsandbytes), which "
                        "tests/test_lora.py measures, not profile yet: use --method lora or full")
    spec = model_spec(args)
    args.seq, seq_note = seq_len_of(spec, args)
    if seq_note:
        print_note(seq_note)
    device = args.device
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if kind == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= count:
            raise UserError(f"--device {device}: this machine has {count or 'no'} CUDA device"
                            f"{'s' if count != 1 else ''} (torch {torch.__version__}"
                            f"{'' if torch.version.cuda else ', built without CUDA'}); use --device cpu or run it "
                            "where the GPU is")
    attention = spec.effective_attention(args.attention)
    if args.liger:
        from toolkit.inputs.job import liger_problem

        problem = liger_problem(spec.model_type)
        if problem:
            raise UserError(problem)
    kwargs = dict(seq_len=args.seq, micro_batch=args.micro_batch, precision=args.precision, attention=attention,
                  checkpointing=args.checkpointing, optimizer=args.optimizer, optimizer_impl=args.optimizer_impl,
                  liger=args.liger)
    predicted = predict_step(spec.hf_config(), device_kind=kind, adapter=adapter, **kwargs)
    measured = measure_step(spec.hf_config(), device=device, steps=args.steps, adapter=adapter, **kwargs)
    rows = {"activations_bytes": (predicted["activations_bytes"], measured.activations_bytes),
            "peak_bytes": (predicted["peak_bytes"], measured.peak_bytes)}
    if args.json:
        print(json.dumps({"model": spec.name, "device": device, **kwargs, "method": adapter.method,
                          "predicted": predicted, "measured": measured.__dict__}, indent=2))
        return 0
    method = "" if adapter.method == "full" else f", {adapter.method} r={adapter.r}"
    print(f"{spec.name} on {device}: one process, seq {args.seq}, micro-batch {args.micro_batch}, {args.precision}, "
          f"{args.optimizer}, {attention}{checkpointing_words(args.checkpointing)}{', liger' if args.liger else ''}"
          f"{method}")
    print(f"{'':<20}{'predicted GiB':>15}{'measured GiB':>15}{'ratio':>9}")
    for name, (p, m) in rows.items():
        print(f"{name:<20}{p / GIB:>15.3f}{m / GIB:>15.3f}{p / m:>9.3f}")
    print(f"measured step {measured.step_time_s:.3f} s, {measured.tokens_per_s:,.0f} tokens/s (mean of "
          f"{measured.timed_steps} step{'s' if measured.timed_steps != 1 else ''})")
    return 0


def _device(text: str) -> str:
    import re

    if not re.fullmatch(r"cpu|cuda(:\d{1,3})?", text.strip()):
        raise UserError(f"--device '{text}' is not known; give cpu, cuda or cuda:N")
    return text.strip()
