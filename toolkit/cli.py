"""`toolkit` command line: estimate, plan, check, launch, profile, demo.

Parse, compute, format: each subcommand parses its flags here, calls pure functions, and formats the result.
Bad input anywhere raises UserError: one line on stderr, exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from toolkit import bounds
from toolkit.bounds import float_arg, int_arg, text_arg
from toolkit.errors import EXIT_USER_ERROR, UserError

GIB = 1024**3


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line with exit 2 (its default usage dump is noise here)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message} (see --help)")


# ----------------------------------------------------------------------------------------------------------------
# Shared flag groups


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", type=text_arg("model"),
                   help="catalog name (see `toolkit models`), local dir/config.json, or hub id")
    g = p.add_argument_group("model by numbers (instead of a name)")
    g.add_argument("--params", type=_count, help="parameter count, e.g. 7e9 or 7B (shape guessed Llama-like)")
    g.add_argument("--layers", type=int_arg("--layers", bounds.LAYERS))
    g.add_argument("--hidden", type=int_arg("--hidden", bounds.HIDDEN))
    g.add_argument("--heads", type=int_arg("--heads", bounds.HEADS))
    g.add_argument("--kv-heads", type=int_arg("--kv-heads", bounds.HEADS))
    g.add_argument("--ffn", type=int_arg("--ffn", bounds.FFN))
    g.add_argument("--vocab", type=int_arg("--vocab", bounds.VOCAB))
    g.add_argument("--trust-remote-code", action="store_true", help="allow hub models with custom code")


def _add_hardware_flags(p: argparse.ArgumentParser, default: str | None = "8xH100-80GB") -> None:
    g = p.add_argument_group("hardware")
    g.add_argument("--gpus", default=default, type=text_arg("--gpus"),
                   help="e.g. 8xH100-80GB, 2x8xA100-80GB, 1xRTX-4090 (default %(default)s)")
    g.add_argument("--nodes", type=int_arg("--nodes", bounds.NODES),
                   help="number of nodes (or write NxGxGPU in --gpus)")
    g.add_argument("--inter-node-gbps", type=float_arg("--inter-node-gbps", bounds.INTER_NODE_GBPS),
                   help="network bandwidth per node, GB/s (default 50 = 400 Gb/s)")
    g.add_argument("--cpu-ram-gib", type=float_arg("--cpu-ram-gib", bounds.CPU_RAM_GIB),
                   help="host RAM per node, GiB (default 1024)")


def _add_job_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job")
    from toolkit.job import ATTENTIONS, DEVICE_KINDS, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS

    g.add_argument("--seq", type=int_arg("--seq", bounds.SEQ),
                   help="sequence length (default 2048, or the model's maximum if shorter)")
    g.add_argument("--precision", default="bf16", choices=PRECISIONS, help="(default %(default)s)")
    g.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="(default %(default)s)")
    g.add_argument("--attention", default="sdpa", choices=ATTENTIONS, help="(default %(default)s)")
    g.add_argument("--device-kind", default="cuda", choices=DEVICE_KINDS,
                   help="whose kernels' saved tensors to model (default %(default)s)")
    g.add_argument("--pipeline-stages", type=int_arg("--pipeline-stages", bounds.STAGES),
                   help="pipeline / hybrid stage count")
    g.add_argument("--optimizer-impl", default="fused", choices=OPTIMIZER_IMPLS,
                   help="torch optimizer step (default %(default)s, the Trainer's)")
    g.add_argument("--activation-offloading", action="store_true",
                   help="decoder layers' saved activations in host RAM (TRL activation_offloading)")
    g.add_argument("--liger", action="store_true",
                   help="Liger kernels as the Trainer's use_liger_kernel applies them (fused linear cross-entropy: "
                        "no logits; RMSNorm, SwiGLU, RoPE); llama, mistral, qwen2, qwen3")
    _add_adapter_flags(p)


def _add_adapter_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA / QLoRA (toolkit.lora)")
    g.add_argument("--method", default="full", help="full | lora | qlora (default %(default)s)")
    g.add_argument("--lora-r", type=int, default=16, help="adapter rank (default %(default)s)")
    g.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha (default %(default)s)")
    g.add_argument("--lora-dropout", type=float, default=0.05, help="dropout on each target's input (default %(default)s)")
    g.add_argument("--lora-targets", default="all-linear", help="all-linear or comma-separated module names, "
                                                                 "e.g. q_proj,v_proj (default %(default)s)")
    g.add_argument("--lora-modules-to-save", default="", help="modules trained in full beside the adapters, "
                                                              "e.g. lm_head,embed_tokens")
    g.add_argument("--qlora-quant-type", default="nf4", help="nf4 | fp4 (default %(default)s)")
    g.add_argument("--qlora-no-double-quant", action="store_true", help="do not quantise the absmax constants")
    g.add_argument("--qlora-compute-dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    g.add_argument("--qlora-quant-storage", default="uint8",
                   help="uint8 | bfloat16 | float16 | float32: a floating storage lets FSDP2 / ZeRO-3 shard the "
                        "4-bit base (default %(default)s)")


def _adapter(args):
    from toolkit.lora import Adapter

    return Adapter(method=args.method, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                   targets=args.lora_targets, modules_to_save=args.lora_modules_to_save,
                   quant_type=args.qlora_quant_type, double_quant=not args.qlora_no_double_quant,
                   compute_dtype=args.qlora_compute_dtype, quant_storage=args.qlora_quant_storage)


def _trainable_params(spec, adapter) -> int:
    if not adapter.is_adapter:
        return spec.params
    from toolkit.lora import counts_for_spec

    return counts_for_spec(spec, adapter).trainable_params


def _add_output_flags(p: argparse.ArgumentParser, out_help: str) -> None:
    p.add_argument("--out", type=text_arg("--out"), help=out_help)
    p.add_argument("--force", action="store_true", help="overwrite files in --out")
    p.add_argument("--nvme-path", type=text_arg("--nvme-path"), help="local NVMe directory for ZeRO-Infinity plans")
    p.add_argument("--hosts", type=_hosts, help="comma-separated node host names (multi-node hostfile)")


def _count(text: str) -> int:
    t = text.strip().upper().replace(",", "").replace("_", "")
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], None)
    try:
        value = float(t[:-1]) * scale if scale else float(t)
    except ValueError:
        raise UserError(f"--params '{text}' is not a count (write 7e9 or 7B)") from None
    bounds.check_number("--params", value, bounds.PARAMS)
    return int(value)


def _hosts(text: str) -> list[str]:
    """Comma-separated host names; each must be a plain host name (it reaches the hostfile and scripts)."""
    import re

    names = [h.strip() for h in text.split(",")]
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*", name):
            raise UserError(f"--hosts entry {name!r} is not a host name; give names like node1,node2 (letters, "
                            "digits, '.', '-', '_')")
    return names


def _refuse_model_contradictions(args) -> None:
    """A model name fixes the shape; numbers beside it would be silently ignored, so they are refused."""
    given = [f"--{k.replace('_', '-')}" for k in ("params", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
             if getattr(args, k, None) is not None]
    if args.model and given:
        raise UserError(f"{given[0]} cannot be combined with the model name '{args.model}'; give the name or the "
                        "numbers, not both")
    if args.params is not None and len(given) > 1:
        raise UserError(f"--params cannot be combined with {given[1]}; give the count or the shape, not both")


def _spec(args):
    from toolkit.cli_help import status
    from toolkit.modelspec import resolve_model

    _refuse_model_contradictions(args)
    with status(f"reading {args.model or 'the model'} (tracing its layers the first time)"):
        return resolve_model(args.model, params=args.params, layers=args.layers, hidden=args.hidden,
                             heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab,
                             trust_remote_code=args.trust_remote_code)


def _hardware(args):
    from toolkit.hardware import parse_hardware

    return parse_hardware(args.gpus, nodes=args.nodes, inter_node_gbps=args.inter_node_gbps,
                          cpu_ram_gib=args.cpu_ram_gib)


def _note(text: str) -> None:
    """Warnings and notes go to stderr, so stdout holds only the result (a table, JSON)."""
    print(f"note: {text}", file=sys.stderr)


def _human(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


# ----------------------------------------------------------------------------------------------------------------
# estimate


def cmd_estimate(args) -> int:
    from toolkit.grid import ParallelGrid
    from toolkit.job import Job, check_job
    from toolkit.planner import evaluate
    from toolkit.errorband import band_for
    from toolkit.strategy import parse_strategy

    spec = _spec(args)
    hw = _hardware(args)
    strategy = parse_strategy(args.strategy)
    seq_len, seq_note = _seq(spec, args)
    job = Job(seq_len=seq_len, micro_batch=args.micro_batch, grad_accum=args.accumulation,
              precision=args.precision, optimizer=args.optimizer, checkpointing=args.checkpointing,
              attention=args.attention, device_kind=args.device_kind, optimizer_impl=args.optimizer_impl,
              activation_offloading=args.activation_offloading, liger=args.liger, adapter=_adapter(args))
    grid = ParallelGrid.for_strategy(strategy, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                     pipeline_stages=args.pipeline_stages)
    check_job(spec, job, hw, strategy, pipeline_stages=grid.pipeline_stages)
    c = evaluate(spec, hw, strategy, job, grid, prune=False)
    b, t, partition = c.memory, c.timing, c.partition
    band = band_for(strategy.engine, job.checkpointing)
    if args.json:
        out = {"model": spec.summary(), "params": spec.params,
               "trainable_params": _trainable_params(spec, job.adapter), "hardware": hw.spec, "strategy": strategy.name,
               "job": {"seq_len": job.seq_len, "micro_batch": job.micro_batch, "grad_accum": job.grad_accum,
                       "precision": job.precision, "optimizer": job.optimizer, "checkpointing": job.checkpointing,
                       "attention": job.attention, "device_kind": job.device_kind, "liger": job.liger,
                       "method": job.method, **({"adapter": job.adapter.to_dict()} if job.adapter.is_adapter else {})},
               "per_gpu": b.to_dict(), "fits": b.fits, "timing": t.to_dict(),
               "error_band": {"fraction": band.fraction, "cases": band.cases, "kind": band.kind, "text": band.text()},
               "terms": [{"name": x.name, "bytes": x.bytes, "source": x.source} for x in b.terms],
               "notes": ([seq_note] if seq_note else []) + list(b.notes) + list(t.assumptions)}
        if partition:
            out["partition"] = partition
        print(json.dumps(out, indent=2))
        return _fit_exit(args, b.fits)
    if seq_note:
        _note(seq_note)
    cap = b.capacity_bytes
    active = f", {spec.active_params:,} active per token" if spec.active_params != spec.params else ""
    print(f"{spec.name}: {spec.params:,} parameters{active} ({spec.num_layers} x {spec.layer_class}"
          f"{', tied embeddings' if spec.tied else ''}) | {strategy.name} on {hw.spec} | seq {job.seq_len}, "
          f"micro-batch {job.micro_batch}, accumulation {job.grad_accum}, {job.precision}, {job.optimizer}"
          f"{', checkpointing' if job.checkpointing else ''}{', Liger kernels' if job.liger else ''}")
    if job.adapter.is_adapter:
        a = job.adapter
        print(f"{a.method}: r {a.r}, alpha {a.alpha:g}, dropout {a.dropout:g}, targets {a.targets}"
              f"{', 4-bit ' + a.quant_type if a.method == 'qlora' else ''}: "
              f"{_trainable_params(spec, a):,} trainable parameters")
    rows = [(t_.name, t_.bytes, t_.source) for t_ in b.terms]
    width = max(len(r[0]) for r in rows) + 2
    print(f"\n{'per GPU':<{width}}{'GiB':>9}{'of GPU':>9}")
    for name, value, source in rows:
        print(f"{name:<{width}}{_gib(value):>9}{value / cap:>9.1%}")
        if args.explain:
            print(f"{'':<{width}}  <- {source}")
    print(f"{'peak (tensors)':<{width}}{_gib(b.peak_bytes):>9}{b.peak_bytes / cap:>9.1%}   at {b.peak_phase}")
    print(f"{'required':<{width}}{_gib(b.required_bytes):>9}{b.required_bytes / cap:>9.1%}   of "
          f"{_gib(cap)} GiB: {'fits' if b.fits else 'DOES NOT FIT'}")
    print(f"error band: {band.text()}" + (f"; required + band = {_gib(b.required_bytes + band.headroom_bytes(b.peak_bytes))}"
                                          f" GiB" if band.cases else ""))
    if b.stage_required_bytes:
        print("per stage required GiB: " + ", ".join(_gib(x) for x in b.stage_required_bytes))
    if b.host is not None:
        print(f"host RAM per node: load {_gib(b.host.load_bytes_per_node)} GiB, save "
              f"{_gib(b.host.save_bytes_per_node)} GiB on top of {_gib(b.host.resident_bytes_per_node)} GiB resident; "
              f"peak {_gib(b.host.peak_bytes_per_node)} of {_gib(hw.cpu_ram_bytes_per_node)} GiB")
        if args.explain:
            print(f"  <- load: {b.host.load_source}; save: {b.host.save_source}")
    if b.cpu_bytes_per_node:
        print(f"host RAM per node for offload: {_gib(b.cpu_bytes_per_node)} GiB "
              f"of {_gib(hw.cpu_ram_bytes_per_node)}")
    if b.nvme_bytes_per_node:
        print(f"NVMe per node: {_gib(b.nvme_bytes_per_node)} GiB")
    print(f"\npredicted step {t.step_time_s:.3f} s, {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.0%} "
          f"(compute {t.compute_s:.3f} s, exposed comm {t.communication_s:.3f} s, bubble {t.bubble_s:.3f} s, "
          f"offload {t.offload_s:.3f} s)")
    if args.explain:
        for note in list(b.notes) + list(t.assumptions):
            print(f"  note: {note}")
    return _fit_exit(args, b.fits)


def _fit_exit(args, fits: bool) -> int:
    """estimate --require-fit: exit 1 when the configuration does not fit (for scripts); 0 otherwise."""
    return 1 if args.require_fit and not fits else 0


def _seq(spec, args) -> tuple[int, str | None]:
    """--seq as given (checked against the model), or the default adapted to the model's positions."""
    from toolkit.job import check_seq_len, default_seq_len

    seq_len, note = default_seq_len(spec, args.seq)
    check_seq_len(spec, seq_len)
    return seq_len, note


# ----------------------------------------------------------------------------------------------------------------
# plan


def cmd_plan(args) -> int:
    from pathlib import Path

    from toolkit.planner import Request, plan_candidates, to_plan

    spec = _spec(args)
    hw = _hardware(args)
    seq_len, seq_note = _seq(spec, args)
    from toolkit.job import job_problem

    unfit = job_problem(args.precision, hw.gpu)  # true of every strategy: one refusal, not one per candidate
    if unfit:
        raise UserError(unfit)
    if seq_note:
        _note(seq_note)
    strategies = tuple(s.strip() for s in args.strategies.split(",")) if args.strategies else None
    if strategies:
        from toolkit.strategy import parse_strategy

        strategies = tuple(parse_strategy(s).name for s in strategies)
        if args.pipeline_stages is not None and not any(parse_strategy(s).is_pipeline for s in strategies):
            raise UserError("--pipeline-stages applies to pipeline and hybrid strategies, and --strategies names "
                            "none; drop it or add pipeline / hybrid to --strategies")
    ckpt = {"auto": None, "on": True, "off": False}[args.checkpointing]
    req_kwargs: dict[str, Any] = dict(seq_len=seq_len, global_batch=args.global_batch, micro_batch=args.micro_batch,
                                      grad_accum=args.accumulation, precision=args.precision,
                                      optimizer=args.optimizer, attention=args.attention,
                                      device_kind=args.device_kind, checkpointing=ckpt,
                                      optimizer_impl=args.optimizer_impl,
                                      activation_offloading=args.activation_offloading, liger=args.liger,
                                      pipeline_stages=args.pipeline_stages, adapter=_adapter(args))
    if strategies:
        req_kwargs["strategies"] = strategies
    req = Request(**req_kwargs)
    if args.out:
        _refuse_existing(Path(args.out), args.force)
    from toolkit.cli_help import status

    with status("planning: every strategy, batch split and checkpointing choice"):
        candidates = plan_candidates(spec, hw, req)
    feasible = [c for c in candidates if c.feasible]
    chosen = feasible[0] if feasible else None
    if args.strategy_choice:
        from toolkit.strategy import parse_strategy

        wanted = parse_strategy(args.strategy_choice).name
        match = [c for c in candidates if c.strategy.name == wanted]
        if not match or not match[0].feasible:
            why = match[0].reason if match else "not among the planned strategies"
            raise UserError(f"--choose {wanted} cannot run: {why}")
        chosen = match[0]
    rows = [c.row() for c in candidates]
    if args.json:
        out = {"model": spec.summary(), "params": spec.params,
               "trainable_params": _trainable_params(spec, req.adapter), "method": req.adapter.method,
               "hardware": hw.spec, "candidates": rows, "chosen": chosen.row() if chosen else None}
    else:
        _print_plan_table(spec, hw, req, candidates, args.top)
    written: list[str] = []
    if chosen and args.out:
        from toolkit.emit import emit_files

        plan = to_plan(chosen, spec, hw, _recorded_model(args.model) or spec.name)
        hosts = args.hosts
        written = [str(p) for p in emit_files(plan, Path(args.out), force=args.force, candidates=rows,
                                              nvme_path=args.nvme_path, hosts=hosts)]
    if args.json:
        out["written"] = written
        print(json.dumps(out, indent=2))
    elif chosen is None:
        print("\nno strategy fits: see the reasons above (more GPUs, a shorter --seq, or offload)")
    elif written:
        print(f"\nchosen: {chosen.name}; wrote {len(written)} files to {args.out}: "
              + ", ".join(Path(w).name for w in written))
        print(f"run it:  toolkit launch {args.out}  (rehearse on CPU first: toolkit launch {args.out} --rehearse)")
    return 0 if chosen else 1


def _recorded_model(model: str | None) -> str | None:
    """A local model path as an absolute path (a plan launched from another folder still finds it); catalog names
    and hub ids as given. A catalog name wins over a same-named folder, as in modelspec.load_config."""
    from pathlib import Path

    from toolkit.paths import MODEL_CATALOG_DIR

    if not model or (MODEL_CATALOG_DIR / f"{model.lower()}.json").is_file():
        return model
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


EMITTED_NAMES = ("accelerate_config.yaml", "ds_config.json", "ds_config.deepspeed.json", "training_args.json",
                 "launch.sh", "slurm.sbatch", "deepspeed.sh", "hostfile", "plan.json", "PLAN.md")


def _refuse_existing(out, force: bool) -> None:
    """Refuse before planning, so a long plan never ends in a refusal."""
    from toolkit.fileio import refuse_overwrite

    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    refuse_overwrite([out / n for n in EMITTED_NAMES], force)


def _print_plan_table(spec, hw, req, candidates, top: int) -> None:
    print(f"{spec.name} ({_human(spec.params)} params, {spec.num_layers} layers) on {hw.spec} "
          f"({hw.gpu.memory_bytes / GIB:.1f} GiB each) | seq {req.seq_len}, "
          + (f"global batch {req.global_batch}" if req.global_batch else f"micro-batch {req.micro_batch}")
          + f", {req.precision}, {req.optimizer}{', Liger kernels' if req.liger else ''}"
          + (f", {req.adapter.method} r={req.adapter.r} ({_trainable_params(spec, req.adapter):,} trainable)"
             if req.adapter.is_adapter else "") + "\n")
    header = f"{'#':>2}  {'strategy':<28}{'micro':>6}{'accum':>6}{'ckpt':>5}{'GiB/GPU':>9}{'host GiB':>9}" \
             f"{'step s':>9}{'tokens/s':>11}{'MFU':>6}"
    print(header)
    print("-" * len(header))
    shown = 0
    for c in candidates:
        if not c.feasible:
            continue
        shown += 1
        if shown > top:
            continue
        m, t = c.memory, c.timing
        host = f"{m.cpu_bytes_per_node / GIB:.0f}" if m.cpu_bytes_per_node else "-"
        print(f"{shown:>2}  {c.name:<28}{c.job.micro_batch:>6}{c.job.grad_accum:>6}"
              f"{'yes' if c.job.checkpointing else 'no':>5}{m.required_bytes / GIB:>9.1f}{host:>9}"
              f"{t.step_time_s:>9.2f}{t.tokens_per_s:>11,.0f}{t.mfu:>6.0%}")
    if shown > top:
        print(f"    ... {shown - top} more (raise --top)")
    chosen = next((c for c in candidates if c.feasible), None)
    if chosen is not None:
        from toolkit.errorband import band_for

        band = band_for(chosen.strategy.engine, chosen.job.checkpointing)
        print(f"\nerror band of #1: {band.text()}; kept as headroom (a candidate within it is refused); host RAM "
              f"per node peaks at {chosen.memory.host.peak_bytes_per_node / GIB:.0f} GiB (load / save)")
    _note_adapter_ddp(req, [c for c in candidates if c.feasible])
    refused = [c for c in candidates if not c.feasible]
    if refused:
        print("\nnot possible:")
        for c in refused:
            print(f"  {c.strategy.name}: {c.reason}")


def _note_adapter_ddp(req, feasible) -> None:
    """LoRA / QLoRA: gradients and optimizer states are the adapters' only, so sharding them saves little and DDP
    (no gathers) is usually as fast as the best; say so when it is."""
    if not req.adapter.is_adapter or not feasible:
        return
    ddp = next((c for c in feasible if c.strategy.name == "ddp"), None)
    best = feasible[0]
    if ddp is not None and ddp.timing.tokens_per_s >= 0.99 * best.timing.tokens_per_s:
        print(f"\nnote: with {req.adapter.method} only the adapters have gradients and optimizer states; DDP is "
              f"within 1% of the fastest ({best.name}) and needs {ddp.memory.required_bytes / GIB:.1f} GiB vs "
              f"{best.memory.required_bytes / GIB:.1f}: choose it with --choose ddp for the simplest run")


# ----------------------------------------------------------------------------------------------------------------
# check / launch / models


def cmd_emit(args) -> int:
    """Write a plan's files from its plan.json (after editing it, or into another directory)."""
    from pathlib import Path

    from toolkit.emit import emit_files
    from toolkit.plan import load_plan

    plan = load_plan(args.plan)
    out = Path(args.out) if args.out else (Path(args.plan) if Path(args.plan).is_dir() else Path(args.plan).parent)
    hosts = args.hosts
    from toolkit.job import check_job
    from toolkit.planner import plan_job, predict_plan

    try:  # the model, GPU and job the plan describes (a plan for a GPU outside the catalog is emitted as is)
        spec, hw, job = plan_job(plan, check=False)
    except UserError as exc:
        spec = None
        if plan.prediction_is_stale:
            _note(f"plan.json was edited after its prediction and it could not be re-predicted ({exc}); PLAN.md "
                  "says the prediction is stale")
    if spec is not None:
        check_job(spec, job, hw, plan.strategy_spec, pipeline_stages=plan.pipeline_stages)  # estimate's rules
        if plan.prediction_is_stale:
            plan = predict_plan(plan)
            _note("plan.json was edited after its prediction: memory and step time re-predicted for the new values")
    written = emit_files(plan, out, force=args.force, nvme_path=args.nvme_path, hosts=hosts)
    print(f"wrote {len(written)} files to {out}: " + ", ".join(p.name for p in written))
    return 0


def cmd_check(args) -> int:
    from toolkit.check import main_check

    fit = None
    if args.model:
        from toolkit.check_fit import Pins, fit_findings

        ckpt = {None: None, "on": True, "off": False}[args.checkpointing]
        pins = Pins(micro_batch=args.micro_batch, precision=args.precision, checkpointing=ckpt)
        fit = lambda path: fit_findings(path, model=args.model, gpus=args.gpus, seq_len=args.seq,  # noqa: E731
                                        pins=pins)
    elif args.micro_batch or args.precision or args.checkpointing:
        raise UserError("--micro-batch / --precision / --checkpointing pin the fit check; give --model and --gpus too")
    from toolkit.cli_help import status

    with status("checking with accelerate's and DeepSpeed's own validation"):
        return main_check(args.files, gpus=args.gpus, runner=args.runner, fit=fit, strict=args.strict,
                          as_json=args.json)


def cmd_launch(args) -> int:
    from toolkit.launch import launch_main

    return launch_main(args.plan_dir, args.train_args, rehearse=args.rehearse, dry_run=args.dry_run,
                       processes=args.processes, cpu=args.cpu)


def cmd_profile(args) -> int:
    """Predicted vs measured for one real single-device step of the model (random weights, this process)."""
    from toolkit.profile import measure_step, predict_step

    spec = _spec(args)
    args.seq, seq_note = _seq(spec, args)
    if seq_note:
        _note(seq_note)
    device = args.device
    kind = "cuda" if device.startswith("cuda") else "cpu"
    attention = spec.effective_attention(args.attention)
    kwargs = dict(seq_len=args.seq, micro_batch=args.micro_batch, precision=args.precision, attention=attention,
                  checkpointing=args.checkpointing)
    predicted = predict_step(spec.hf_config(), device_kind=kind, **kwargs)
    measured = measure_step(spec.hf_config(), device=device, steps=args.steps, **kwargs)
    rows = {"activations_bytes": (predicted["activations_bytes"], measured.activations_bytes),
            "peak_bytes": (predicted["peak_bytes"], measured.peak_bytes)}
    if args.json:
        print(json.dumps({"model": spec.name, "device": device, **kwargs,
                          "predicted": predicted, "measured": measured.__dict__}, indent=2))
        return 0
    print(f"{spec.name} on {device}: one process, seq {args.seq}, micro-batch {args.micro_batch}, {args.precision}, "
          f"{attention}{', checkpointing' if args.checkpointing else ''}")
    print(f"{'':<20}{'predicted GiB':>15}{'measured GiB':>15}{'ratio':>9}")
    for name, (p, m) in rows.items():
        print(f"{name:<20}{p / GIB:>15.3f}{m / GIB:>15.3f}{p / m:>9.3f}")
    print(f"measured step {measured.step_time_s:.3f} s, {measured.tokens_per_s:,.0f} tokens/s")
    return 0


def _device(text: str) -> str:
    import re

    if not re.fullmatch(r"cpu|cuda(:\d{1,3})?", text.strip()):
        raise UserError(f"--device '{text}' is not known; give cpu, cuda or cuda:N")
    return text.strip()


def cmd_models(args) -> int:
    from toolkit.modelspec import catalog_names

    print("\n".join(catalog_names()))
    return 0


def cmd_gpus(args) -> int:
    from toolkit.hardware import gpu_catalog

    for g in gpu_catalog().values():
        # A GPU without bf16 (V100, T4) trains in fp16: show that rate, not "bf16 0.0".
        rate = f"bf16 {g.bf16_tflops:>7.1f}" if g.bf16_supported else f"fp16 {g.fp16_tflops:>7.1f}"
        print(f"{g.name:<18}{g.memory_bytes / GIB:>8.1f} GiB  {rate} TFLOP/s  "
              f"link {g.intra_node_gbps:>5.0f} GB/s ({g.interconnect})")
    return 0


def cmd_demo(args) -> int:
    from toolkit.demo import run_demo

    import time

    workdir = args.workdir or time.strftime("runs/demo-%Y%m%d-%H%M%S")
    from pathlib import Path

    if Path(workdir).exists() and not Path(workdir).is_dir():
        raise UserError(f"--workdir {workdir} is a file; give a folder (it is created if missing)")
    return run_demo(workdir, steps=args.steps, force=args.force)


# ----------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from toolkit import __version__

    parser = _Parser(prog="toolkit", description="Plan, emit and run distributed training of HF causal LMs.")
    parser.add_argument("--version", action="version", version=f"toolkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("estimate", help="per-GPU memory and step time of one strategy")
    _add_model_flags(p)
    _add_hardware_flags(p)
    _add_job_flags(p)
    p.add_argument("--strategy", default="ddp", help="ddp, zero1/2/3, zero2-offload, zero3-offload, fsdp2, "
                                                     "pipeline, hybrid, ... (default %(default)s)")
    p.add_argument("--micro-batch", type=int_arg("--micro-batch", bounds.BATCH), default=1)
    p.add_argument("--accumulation", type=int_arg("--accumulation", bounds.BATCH), default=1)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every layer")
    p.add_argument("--explain", action="store_true", help="show where every term comes from")
    p.add_argument("--json", action="store_true", help="print only JSON")
    p.add_argument("--require-fit", action="store_true", help="exit 1 when it does not fit (for scripts)")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("plan", help="rank every strategy; write the chosen one's files")
    _add_model_flags(p)
    _add_hardware_flags(p)
    _add_job_flags(p)
    p.add_argument("--global-batch", type=int_arg("--global-batch", bounds.BATCH),
                   help="samples per optimizer step over all GPUs")
    p.add_argument("--micro-batch", type=int_arg("--micro-batch", bounds.BATCH),
                   help="samples per GPU per forward (instead of --global-batch)")
    p.add_argument("--accumulation", type=int_arg("--accumulation", bounds.BATCH), help="gradient accumulation steps")
    p.add_argument("--checkpointing", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--strategies", type=text_arg("--strategies"), help="comma-separated subset to consider")
    p.add_argument("--choose", dest="strategy_choice", type=text_arg("--choose"),
                   help="emit this strategy instead of the fastest")
    p.add_argument("--top", type=int_arg("--top", bounds.TOP), default=10)
    _add_output_flags(p, "directory for the emitted files")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("emit", help="write a plan's config files from its plan.json")
    p.add_argument("plan", type=text_arg("plan"), help="plan.json or the directory holding it")
    _add_output_flags(p, "directory (default: the plan's own; rewriting needs --force)")
    p.set_defaults(func=cmd_emit)

    p = sub.add_parser("check", help="check accelerate YAML / DeepSpeed JSON / plan dirs")
    p.add_argument("files", nargs="+", type=text_arg("path"))
    p.add_argument("--model", type=text_arg("--model"), help="also check the fit of this model")
    p.add_argument("--gpus", type=text_arg("--gpus"),
                   help="GPU spec, e.g. 8xH100-80GB (process counts; with --model, the fit)")
    p.add_argument("--seq", type=int_arg("--seq", bounds.SEQ),
                   help="sequence length for the fit check (plan dirs carry their own)")
    p.add_argument("--micro-batch", type=int_arg("--micro-batch", bounds.BATCH),
                   help="fit check: samples per GPU, where the files leave it to the runner")
    p.add_argument("--precision", help="fit check: fp32 | bf16 | fp16 | bf16-pure, where the files leave it open")
    p.add_argument("--checkpointing", choices=("on", "off"), help="fit check: activation checkpointing")
    p.add_argument("--runner", choices=("trainer", "accelerate", "deepspeed"),
                   help="who reads a DeepSpeed JSON: its failures become errors (default: every runner that can)")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too (notes never fail)")
    p.add_argument("--json", action="store_true", help="findings as one JSON object on stdout")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("launch", help="run (or rehearse on CPU) an emitted plan")
    p.add_argument("plan_dir", type=text_arg("plan folder"))
    p.add_argument("--rehearse", action="store_true", help="run the plan's strategy on CPU processes first")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--processes", type=int_arg("--processes", bounds.PROCESSES),
                   help="run the plan on N processes of this machine (fewer GPUs, or CPU processes with --cpu); "
                        "the global batch is kept by accumulation")
    p.add_argument("--cpu", action="store_true",
                   help="run on CPU processes over gloo (bf16 instead of fp16; your own script gets the set-up "
                        "from toolkit.train.own_script)")
    p.set_defaults(func=cmd_launch, train_args=[])
    p.epilog = "Arguments after -- go to toolkit.train: toolkit launch DIR -- --model M --data D --output OUT"

    p = sub.add_parser("profile", help="predicted vs measured memory of real steps on this machine")
    _add_model_flags(p)
    _add_job_flags(p)
    p.add_argument("--micro-batch", type=int_arg("--micro-batch", bounds.BATCH), default=1)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--device", default="cpu", type=_device, help="cpu or cuda[:N]")
    p.add_argument("--steps", type=int_arg("--steps", bounds.PROFILE_STEPS), default=3,
                   help="timed steps after the measured one")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("demo", help="estimate, plan, emit and train a tiny model end to end on CPU")
    p.add_argument("--workdir", type=text_arg("--workdir"),
                   help="where the demo writes (default: a new runs/demo-DATE-TIME)")
    p.add_argument("--steps", type=int_arg("--steps", bounds.STEPS), default=200,
                   help="training steps of the tiny model (default %(default)s)")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_demo)

    sub.add_parser("models", help="list the model catalog").set_defaults(func=cmd_models)
    sub.add_parser("gpus", help="list the GPU catalog").set_defaults(func=cmd_gpus)
    from toolkit.cli_help import add_examples

    add_examples(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `toolkit launch DIR [--rehearse] -- TRAIN ARGS`: what follows -- belongs to toolkit.train, untouched.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    previous = _finish_on_termination()
    try:
        args = build_parser().parse_args(argv)
        if passthrough and args.command != "launch":
            raise UserError("`--` passes arguments to toolkit.train and only `toolkit launch` takes them")
        if args.command == "launch":
            args.train_args = passthrough
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    except Terminated as exc:
        return 128 + exc.signum
    finally:
        import signal

        for signum, handler in previous.items():
            signal.signal(signum, handler)


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the program is, so that every `finally` runs (staging folders and locks
    are removed) before the process exits; like KeyboardInterrupt for SIGINT."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _finish_on_termination() -> dict:
    """Install the handlers; returns the previous ones (main restores them: a caller embedding main keeps its own)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}  # signal handlers can only be set from the main thread

    def raise_terminated(signum, frame):
        raise Terminated(signum)

    return {signum: signal.signal(signum, raise_terminated) for signum in (signal.SIGTERM, signal.SIGHUP)}


if __name__ == "__main__":
    raise SystemExit(main())
