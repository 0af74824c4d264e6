"""`toolkit plan`: every strategy ranked for a model and cluster; the chosen one's files written with --out."""

from __future__ import annotations

import json
from typing import Any

from toolkit import bounds
from toolkit.bounds import int_arg, text_arg
from toolkit.errors import UserError
from toolkit.inputs.choices import CHECKPOINTING_OP, COMPILE_BLOCKS, PLAN_CHECKPOINTING_MODES
from toolkit.inputs.job import BLOCKS_COMPILE_PROBLEM, OP_CHECKPOINTING_PROBLEM, loss_problem
from toolkit.inputs.strategy import ALL_STRATEGY_NAMES
from toolkit.commands.common import (add_calibration_flags, calibration_json, calibration_words, adapter_of, allocator_of, add_rope_flags, dpo_of, grpo_of, add_hardware_flags,
                                     images_of,
                                     add_job_flags,
                                     add_model_flags, add_output_flags, add_run_size_flags, GIB, hardware_of, human,
                                     longest_line, model_spec, print_note, run_size_flag, run_size_of, seq_len_of,
                                     trainable_params)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="rank every strategy; write the chosen one's files")
    add_search_flags(p)
    p.add_argument("--choose", dest="strategy_choice", type=text_arg("--choose"),
                   help="emit this strategy (a name as in --strategies) instead of the fastest")
    p.add_argument("--top", type=int_arg("--top", bounds.TOP), default=10,
                   help="table rows shown (default %(default)s; --json lists every candidate)")
    add_run_size_flags(p)
    add_calibration_flags(p)
    p.add_argument("--explain", action="store_true",
                   help="after the table, the chosen row's estimate with where every term comes from (estimate "
                        "--explain of that row)")
    add_output_flags(p, "directory for the emitted files")
    p.add_argument("--json", action="store_true", help="print only JSON: every candidate and the chosen one")
    p.set_defaults(func=cmd_plan)


def add_search_flags(p, *, model_positional: bool = True) -> None:
    """The model, hardware and job flags the planner's search reads (toolkit plan's; toolkit tune MODEL's)."""
    add_model_flags(p, positional=model_positional)
    add_hardware_flags(p)
    add_job_flags(p, seq_max=True, tiled_auto=True)
    add_rope_flags(p)
    p.add_argument("--global-batch", type=int_arg("--global-batch", bounds.BATCH),
                   help="samples per optimizer step over all GPUs (required unless --micro-batch is given)")
    p.add_argument("--micro-batch", type=int_arg("--micro-batch", bounds.BATCH),
                   help="samples per GPU per forward (instead of --global-batch)")
    p.add_argument("--accumulation", type=int_arg("--accumulation", bounds.BATCH), help="gradient accumulation steps")
    p.add_argument("--checkpointing", choices=PLAN_CHECKPOINTING_MODES, default="auto", nargs="?", const="on",
                   help="activation checkpointing: auto (the planner decides), on (also the bare flag, as in "
                        "estimate), off (default %(default)s); op (per-op selective) is estimate's only")
    p.add_argument("--strategies", type=text_arg("--strategies"),
                   help=f"comma-separated subset to consider of {', '.join(ALL_STRATEGY_NAMES)} (default: all)")


TILED = {"auto": None, "on": True, "off": False}
"""plan --tiled: the Request's tiled (None: the planner decides, toolkit.estimate.search)."""


def cmd_plan(args) -> int:
    from pathlib import Path

    from toolkit.estimate.duration import duration
    from toolkit.estimate.errorband import time_band
    from toolkit.estimate.ranking import speed_ties, why_first
    from toolkit.estimate.request import Request
    from toolkit.estimate.search import candidate_named, plan_candidates, to_plan
    from toolkit.inputs.hardware import power_json

    _refuse_what_seq_max_ignores(args)
    run_size_flag(args)
    spec = model_spec(args)  # a config that is wrong is named first
    if args.out and args.model:  # a folder meant to launch: the model must be able to train (seconds, not after)
        from toolkit.run.preflight import check_model_to_plan

        check_model_to_plan(args.model)
    hw = hardware_of(args)
    seq_max = args.seq == "max"
    if seq_max:
        from toolkit.estimate.longest import seq_cap

        args.seq = seq_cap(spec)
    seq_len, seq_note = seq_len_of(spec, args)
    if seq_max and (args.images_per_sample or args.image_size):
        raise UserError("--images-per-sample / --image-size are planned at one text length, not --seq max; give "
                        "--seq N (text tokens)")
    from toolkit.estimate.mostimages import searched_by

    searched = searched_by(args.images_per_sample, args.image_size)
    seq_len, images = images_of(args, spec, seq_len)
    from toolkit.inputs.job import job_problem

    # True of every strategy: one refusal, not one per candidate (--seq max included).
    unfit = job_problem(args.precision, hw.gpu) or spec.attention_problem(args.attention)
    if unfit:
        raise UserError(unfit)
    if seq_note:
        print_note(seq_note)
    strategies = tuple(s.strip() for s in args.strategies.split(",")) if args.strategies else None
    if strategies:
        from toolkit.inputs.strategy import parse_strategy

        strategies = tuple(parse_strategy(s).name for s in strategies)
        if args.pipeline_stages is not None and not any(parse_strategy(s).is_pipeline for s in strategies):
            raise UserError("--pipeline-stages applies to pipeline and hybrid strategies, and --strategies names "
                            "none; drop it or add pipeline / hybrid to --strategies")
    if args.checkpointing == CHECKPOINTING_OP:
        raise UserError(OP_CHECKPOINTING_PROBLEM)
    if args.compile == COMPILE_BLOCKS:
        raise UserError(BLOCKS_COMPILE_PROBLEM)
    if problem := loss_problem(args.loss, tiled=TILED[args.tiled], compile=args.compile,
                               preference=dpo_of(args) is not None or grpo_of(args) is not None):
        raise UserError(problem)
    ckpt = {"auto": None, "on": True, "off": False}[args.checkpointing]
    req_kwargs: dict[str, Any] = dict(seq_len=seq_len, global_batch=args.global_batch, micro_batch=args.micro_batch,
                                      grad_accum=args.accumulation, precision=args.precision,
                                      optimizer=args.optimizer, attention=args.attention,
                                      device_kind=args.device_kind, checkpointing=ckpt,
                                      optimizer_impl=args.optimizer_impl,
                                      activation_offloading=args.activation_offloading, liger=args.liger,
                                      loss=args.loss, vision_tower=args.vision_tower,
                                      compile=args.compile, tiled=TILED[args.tiled], savers=args.savers == "auto", pipeline_stages=args.pipeline_stages, adapter=adapter_of(args, spec),
                                      dpo=dpo_of(args), grpo=grpo_of(args),
                                      tensor_parallel=args.tensor_parallel, context_parallel=args.context_parallel,
                                      sequence_parallel=args.sequence_parallel,
                                      expert_parallel=args.expert_parallel, **images)
    if strategies:
        req_kwargs["strategies"] = strategies
    if seq_max or searched:
        req_kwargs.update(global_batch=None, micro_batch=1)
    req_kwargs["allocator_conf"] = allocator_of(args, hw, req_kwargs["grpo"]).conf
    req = Request(**req_kwargs)
    if req.images_per_sample:
        from toolkit.inputs.images import image_words

        print_note(image_words(req))
    from toolkit.inputs.job import vision_tower_problem

    if problem := vision_tower_problem(spec, req.vision_tower):
        raise UserError(problem)
    if (req.expert_parallel or 1) > 1:  # the grid and model rules estimate applies, before any work
        from toolkit.estimate.expertgrids import check_fixed_expert

        check_fixed_expert(spec, hw, req)
    _refuse_an_empty_grid(spec, hw, req, seq_max or bool(searched))
    if args.out:
        _refuse_existing(Path(args.out), args.force)
    run = run_size_of(args, seq_len)  # --data: counted here, after every refusal that reads no data
    if seq_max:
        return _plan_seq_max(args, spec, hw, req)
    if searched:
        return _plan_most_images(args, spec, hw, req, searched)
    from toolkit.commands.help import status

    with status("planning: every strategy, batch split and checkpointing choice"):
        candidates = plan_candidates(spec, hw, req)
    from toolkit.estimate.placement import placements, window_problem

    if problem := window_problem(candidates, hw.spec):  # bad input, before anything is printed or written
        raise UserError(problem)
    feasible = [c for c in candidates if c.feasible]
    chosen = feasible[0] if feasible else None
    if args.strategy_choice:
        chosen = candidate_named(args.strategy_choice, candidates)
    def row(c) -> dict[str, Any]:
        out = c.row()
        if run is not None and c.feasible:
            out["time_to_train"] = duration(run, c, hw.world_size).to_dict()
        return out

    rows = [row(c) for c in candidates]
    placed = placements(spec, hw, req, candidates)
    why = why_first(candidates) if chosen is not None and chosen is (feasible[0] if feasible else None) else None
    if args.json:
        out = {"model": spec.summary(), "params": spec.params,
               "trainable_params": trainable_params(spec, req.adapter), "method": req.adapter.method,
               "hardware": hw.spec, "attention": spec.effective_attention(req.attention),
               **power_json(hw.gpu, req.precision),
               **({"images": {"images_per_sample": req.images_per_sample, "image_size": req.image_size,
                              "image_tokens": req.image_tokens, "seq_len": req.seq_len,
                              "text_tokens": req.seq_len - req.images_per_sample * req.image_tokens}}
                  if req.images_per_sample else {}),
               "candidates": rows, "chosen": row(chosen) if chosen else None,
               "chosen_because": why or (f"--choose {args.strategy_choice}" if chosen else None),
               "time_error_band": time_band(hw.gpu).to_dict(), "speed_ties": [c.name for c in speed_ties(candidates)],
               **({"chosen_explained": _explained(spec, chosen)} if args.explain and chosen else {}),
               **({"generation_placements": [p.to_dict() for p in placed]} if placed else {}),
               **calibration_json(args)}
    else:
        _print_plan_table(spec, hw, req, candidates, args.top, run, placed)
        if words := calibration_words(args):
            print(words)
        if args.explain and chosen:
            _print_explained(spec, hw, chosen)
    written: list[str] = []
    if chosen and args.out:
        from toolkit.emit import emit_files
        from toolkit.inputs.resolve import recorded_model

        plan = to_plan(chosen, spec, hw, recorded_model(args.model) or spec.name,
                       why=why or f"chosen with --choose {args.strategy_choice}", run=run)
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
        from toolkit.emit.user_settings import sp_gradient_note
        from toolkit.run.rehearsal import rehearsal_problem

        if (note := sp_gradient_note(plan)) is not None:
            print(f"note: {note}")
        problem = rehearsal_problem(plan)
        print(f"run it:  toolkit launch {args.out}  " + (f"(no CPU rehearsal: {problem})" if problem else
                                                         f"(rehearse on CPU first: toolkit launch {args.out} --rehearse)"))
    return 0 if chosen else 1


def _refuse_what_seq_max_ignores(args) -> None:
    """--seq max searches each strategy at micro-batch 1 and writes the one that fits longest: a batch, a row or a
    run size (timed at one sequence length) given beside it would be dropped silently, so it is refused."""
    from toolkit.estimate.mostimages import COUNT, searched_by

    searched = searched_by(args.images_per_sample, args.image_size)
    if args.seq != "max" and searched is None:
        return
    given = [flag for flag, value in (("--global-batch", args.global_batch), ("--micro-batch", args.micro_batch),
                                      ("--choose", args.strategy_choice), ("--dataset-tokens", args.dataset_tokens),
                                      ("--data", args.data)) if value is not None]
    if given and args.seq == "max":
        raise UserError(f"{given[0]} does not apply to --seq max (it finds each strategy's longest sequence at "
                        f"micro-batch 1 and writes the one that fits longest); drop {given[0]} or give --seq N")
    if given:
        flag, what = (("--images-per-sample", "most images a sample") if searched == COUNT else
                      ("--image-size", "largest image"))
        raise UserError(f"{given[0]} does not apply to {flag} max (it finds the {what} each strategy fits at "
                        f"micro-batch 1 and writes the row that fits the most); drop {given[0]} or give {flag} a "
                        "value")


def _refuse_an_empty_grid(spec, hw, req, seq_max: bool) -> None:
    """Flags that leave no strategy to try (`--strategies pipeline --tensor-parallel 2`, `--tiled on --strategies
    ddp,pipeline`) are bad input, not a plan that does not fit: one line naming the rule that removed each strategy,
    exit 2, before any trace (the planner's own rules: toolkit.estimate.search.options_for)."""
    from toolkit.estimate.search import options_for

    options = list(options_for(spec, hw, req, sequence_rule=not seq_max))
    if any(grids and not isinstance(grids, str) for _, _, grids in options):
        return
    reasons = [grids for _, _, grids in options if isinstance(grids, str)]
    if len(reasons) == 1:
        raise UserError(reasons[0])
    keyed = [f"{key}: {grids}" for key, _, grids in options if isinstance(grids, str)]
    raise UserError("no strategy can be planned with these flags: "
                    + ("; ".join(keyed) if keyed else _dropped_by_degree(hw, req)))


def _dropped_by_degree(hw, req) -> str:
    """Why a fixed --tensor / --context / --sequence-parallel degree left no strategy (options_for plans a fixed
    dimension alone, under its own family of strategies only)."""
    from toolkit.estimate.search import MODEL_PARALLEL_FAMILIES

    families = dict(MODEL_PARALLEL_FAMILIES)
    for dimension, flag, value in (("tp", "--tensor-parallel", req.tensor_parallel),
                                   ("cp", "--context-parallel", req.context_parallel),
                                   ("sp", "--sequence-parallel", req.sequence_parallel)):
        if value in (None, 1):
            continue
        names = families[dimension]
        if hw.world_size == 1:
            return f"{flag} {value} needs more than one GPU; give more GPUs or drop {flag}"
        if not any(n in req.strategies for n in names):
            return (f"{flag} {value} is planned under {', '.join(names)} only (x {dimension.upper()}), and "
                    f"--strategies {','.join(req.strategies)} names none of them; add one of them to --strategies "
                    f"or drop {flag}")
        if req.adapter.is_adapter or req.activation_offloading:
            other = f"--method {req.adapter.method}" if req.adapter.is_adapter else "--activation-offloading"
            return f"{flag} {value} is not planned with {other}; drop one of them"
        if hw.nodes < 2 and all(n == "fsdp2-hybrid" for n in names if n in req.strategies):
            return f"{flag} {value} under fsdp2-hybrid needs 2+ nodes; use fsdp2 on one node"
    return "no strategy of --strategies is planned with these flags; drop a degree or widen --strategies"


def _plan_seq_max(args, spec, hw, req) -> int:
    """plan --seq max: the longest sequence per strategy, the memory-vs-length chart, and (--out) the plan of the
    strategy that fits longest (fastest among equals) at that length, with the chart as an SVG beside it."""
    from pathlib import Path

    from toolkit.commands.help import status
    from toolkit.estimate.longest import longest_sequences, svg_chart, text_chart
    from toolkit.inputs.hardware import power_json, power_words
    from toolkit.estimate.search import to_plan

    with status("--seq max: the longest sequence each strategy fits"):
        results = longest_sequences(spec, hw, req)
    from toolkit.estimate.longest import tiling_could_reach_further

    tileable = tiling_could_reach_further(spec, req, results)
    if tileable:
        print_note(f"no strategy reaches the model's {spec.max_positions} positions; {', '.join(tileable[:3])}"
                   f"{' and more' if len(tileable) > 3 else ''} may reach further with ALST tiling, which --seq max "
                   "searches only with --tiled (its traces at long lengths cost about 2x)")
    best = next((r for r in results if r.seq_len), None)
    from toolkit.estimate.levers import ladder_json, ladder_strategy, lever_ladder

    on = ladder_strategy(req, best)
    rungs = []
    if on is not None:
        with status(f"--seq max: the long-context levers, one at a time, on {on}"):
            rungs = lever_ladder(spec, hw, req, on)
    if args.json:
        print(json.dumps({"model": spec.summary(), "hardware": hw.spec,
                          **power_json(hw.gpu, req.precision),
                          "strategies": [
            {"name": r.name, "longest_seq": r.seq_len, "capped_by_positions": r.capped_by_positions,
             "reason": r.reason, "candidate": r.candidate.row() if r.candidate else None,
             "curve": [{"seq": s, "required_bytes": b} for s, b in r.curve]} for r in results],
                          **({"levers": ladder_json(on, rungs)} if rungs else {}),
                          **({"chosen_explained": _explained(spec, best.candidate)} if args.explain and best else {})},
                         indent=2))
    else:
        print(f"{spec.name} ({human(spec.params)} params, positions {spec.max_positions}) on {hw.spec} "
              f"({hw.gpu.memory_bytes / GIB:.1f} GiB each{power_words(hw.gpu, req.precision)}) | longest sequence per strategy, micro-batch 1, "
              f"{req.precision}, {spec.effective_attention(req.attention)} attention\n")
        for r in results:
            print("  " + longest_line(r, spec))
        chart = text_chart(results, hw.gpu.memory_bytes, top=args.top)
        if chart:
            print("\n" + chart)
        if rungs:
            from toolkit.estimate.levers import ladder_text

            print("\n" + ladder_text(on, rungs, hw.gpu.memory_bytes))
        if args.explain and best is not None:
            _print_explained(spec, hw, best.candidate)
    if best is not None and args.out:
        from toolkit.emit import emit_files
        from toolkit.inputs.resolve import recorded_model
        from toolkit.estimate.levers import ladder_curves, ladder_markdown
        from toolkit.plan.files import LEVERS_CHART, MEMORY_CHART

        plan = to_plan(best.candidate, spec, hw, recorded_model(args.model) or spec.name)
        title = f"{spec.name} on {hw.spec}: per-GPU memory vs sequence length (micro-batch 1)"
        charts = {MEMORY_CHART: svg_chart(results, hw.gpu.memory_bytes, title)}
        if rungs:
            charts[LEVERS_CHART] = svg_chart(ladder_curves(rungs), hw.gpu.memory_bytes,
                                             f"{spec.name} on {hw.spec}, {on}: per-GPU memory by lever added",
                                             top=len(rungs))
        written = emit_files(plan, Path(args.out), force=args.force, candidates=[best.candidate.row()],
                             nvme_path=args.nvme_path, hosts=args.hosts, extra=charts,
                             plan_md_tail=ladder_markdown(on, rungs) if rungs else "")
        if not args.json:
            print(f"\nchosen: {best.name} at seq {best.seq_len:,}; wrote {len(written)} files to {args.out} "
                  f"({MEMORY_CHART}: the chart)")
            from toolkit.emit.user_settings import sp_gradient_note

            if (note := sp_gradient_note(plan)) is not None:
                print(f"note: {note}")
    return 0 if best is not None else 1


def _plan_most_images(args, spec, hw, req, searched: str) -> int:
    """plan --images-per-sample max / --image-size max: the largest count or size per row at micro-batch 1, and
    (--out) the plan of the row that fits the most image tokens (fastest among equals) with that value."""
    from pathlib import Path

    from toolkit.commands.common import image_folder
    from toolkit.commands.help import status
    from toolkit.estimate.mostimages import COUNT, most_images_per_row
    from toolkit.estimate.search import to_plan

    what = "most images a sample" if searched == COUNT else "largest image"
    with status(f"the {what} each strategy fits"):
        results, skipped = most_images_per_row(spec, hw, req, searched, image_folder(args))
    best = next((r for r in results if r.found), None)
    if args.json:
        print(json.dumps({"model": spec.summary(), "hardware": hw.spec, "searched": searched, "strategies": [
            {"name": r.candidate.name, **r.to_dict(), "candidate": r.candidate.row()} for r in results],
            "not_searched": [{"name": key, "reason": why} for key, why in skipped],
            "chosen": best.candidate.name if best else None}, indent=2))
    else:
        print(f"{spec.name} on {hw.spec} | the {what} per strategy, micro-batch 1, {req.precision}\n")
        for r in results:
            print("  " + r.words())
        for key, why in skipped:
            print(f"  {key}: not searched ({why})")
    if best is not None and args.out:
        from toolkit.emit import emit_files
        from toolkit.inputs.resolve import recorded_model

        plan = to_plan(best.candidate, spec, hw, recorded_model(args.model) or spec.name)
        written = emit_files(plan, Path(args.out), force=args.force, candidates=[best.candidate.row()],
                             nvme_path=args.nvme_path, hosts=args.hosts)
        if not args.json:
            print(f"\nchosen: {best.candidate.name} with {best.flag} {best.value}; wrote {len(written)} files "
                  f"to {args.out}")
    return 0 if best is not None else 1


def _print_explained(spec, hw, chosen) -> None:
    """plan --explain: the chosen row as estimate --explain prints it (one printer, toolkit.commands.estimate)."""
    from toolkit.commands.estimate import print_estimate

    print("\nthe chosen row, explained (as estimate --explain prints it):\n")
    print_estimate(spec, hw, chosen, chosen.memory, explain=True)


def _explained(spec, chosen) -> dict[str, Any]:
    """plan --json --explain: the chosen row's memory terms with their sources and the notes behind its time; for a
    multimodal class, the vision encoder's share as estimate --json gives it."""
    from toolkit.commands.estimate import vision_share

    return {"terms": [x.to_dict() for x in chosen.memory.terms],
            "notes": list(chosen.memory.notes) + list(chosen.timing.assumptions),
            **({"vision_share": vision_share(spec, chosen.memory, chosen)} if spec.multimodal else {})}


def _refuse_existing(out, force: bool) -> None:
    """Refuse before planning, so a long plan never ends in a refusal."""
    from toolkit.fileio import refuse_overwrite
    from toolkit.plan.files import EMITTED

    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    refuse_overwrite([out / n for n in EMITTED], force)


def _print_plan_table(spec, hw, req, candidates, top: int, run=None, placed=()) -> None:
    from toolkit.estimate.candidate import resume_problem
    from toolkit.estimate.duration import duration
    from toolkit.estimate.ranking import why_first
    from toolkit.inputs.hardware import power_words
    from toolkit.inputs.grpo import grpo_words
    from toolkit.inputs.preference import reference_words

    print(f"{spec.name} ({human(spec.params)} params, {spec.num_layers} layers) on {hw.spec} "
          f"({hw.gpu.memory_bytes / GIB:.1f} GiB each{power_words(hw.gpu, req.precision)}) | seq {req.seq_len}, "
          + (f"global batch {req.global_batch}" if req.global_batch else f"micro-batch {req.micro_batch}")
          + f", {req.precision}, {req.optimizer}, {spec.effective_attention(req.attention)} attention"
          + f"{', Liger kernels' if req.liger else ''}{', TRL chunked NLL' if req.loss != 'model' else ''}"
          + f"{', torch.compile' if req.compile else ''}{', tiled MLP + loss' if req.tiled is True else ''}"
          + (f", {req.adapter.method} r={req.adapter.r} ({trainable_params(spec, req.adapter):,} trainable)"
             if req.adapter.is_adapter else "") + reference_words(req.dpo) + grpo_words(req.grpo)
          + (f"\nparts: {spec.parts_words()}" if spec.multimodal else "") + "\n")
    header = f"{'#':>2}  {'strategy':<28}{'micro':>6}{'accum':>6}{'ckpt':>5}{'GiB/GPU':>9}{'host GiB':>9}" \
             f"{'step s':>9}{'tokens/s':>11}{'MFU':>6}" + (f"{'hours':>9}" if run is not None else "")
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
        mark = "" if c.speed_evidenced else "*"
        name = c.name + (" !" if resume_problem(c) else "")
        print(f"{shown:>2}  {name:<28}{c.job.micro_batch:>6}{c.job.grad_accum:>6}"
              f"{'yes' if c.job.checkpointing else 'no':>5}{m.required_bytes / GIB:>9.1f}{host:>9}"
              f"{t.step_time_s:>9.2f}{t.tokens_per_s:>10,.0f}{mark:1}{t.mfu:>6.0%}"
              + (f"{duration(run, c, hw.world_size).seconds / 3600:>9,.1f}" if run is not None else ""))
    if shown > top:
        print(f"    ... {shown - top} more (raise --top)")
    from toolkit.estimate.savers import UNMODELLED_SPEED

    for key in dict.fromkeys(k for c in [c for c in candidates if c.feasible][:top] for k in c.timing.unmodelled):
        print(f"speed not modelled: {UNMODELLED_SPEED[key]}")
    offloading = next((c for c in [c for c in candidates if c.feasible][:top] if c.job.activation_offloading
                       and not c.strategy.is_pipeline), None)
    if offloading is not None:
        from toolkit.estimate.savers import offload_traffic_line

        line = offload_traffic_line(spec, offloading.job, offloading.strategy, hw, offloading.timing.compute_s)
        print(f"{offloading.strategy.name}: {line}")
    cannot_resume = [c for c in candidates if c.feasible and resume_problem(c)][:top]
    for c in cannot_resume:
        print(f"! {c.name} cannot resume from its checkpoints: {resume_problem(c)}")
    chosen = next((c for c in candidates if c.feasible), None)
    if chosen is not None:
        print(f"\n{why_first(candidates)}")

        band = chosen.peak_band
        print(f"error band of #1: {band.text()}; kept as headroom (a candidate within it is refused); host RAM "
              f"per node peaks at {chosen.memory.host.peak_bytes_per_node / GIB:.0f} GiB (load / save)")
        if run is not None:
            print(f"#1 {duration(run, chosen, hw.world_size).text()}")
        print(f"allocator: {allocator_of(None, hw, req.grpo, device_kind=req.device_kind).words}; memory predicted "
              "with it")
        if req.grpo is not None or req.dpo is not None:
            m = chosen.memory
            vllm = next((t for t in m.terms if t.name == "vLLM colocate reserve"), None)
            print(f"#1 memory by phase (tensors, GiB per GPU): {m.phase_words()}"
                  + (f"; vLLM colocate holds {vllm.bytes / GIB:.2f} GiB beside every phase "
                     f"({vllm.source.split(':')[0]})" if vllm else ""))
        if req.grpo is not None:  # its memory's first note: vLLM colocate's window, the server's GPUs, or generate
            t = chosen.timing
            print(f"#1 GRPO: generation {t.generation_s:.2f} s + scoring {t.reference_s:.2f} s"
                  + (f" + reward model {t.reward_s:.2f} s" if t.reward_s else "") + " of the "
                  f"{t.step_time_s:.2f} s step (no band: no published GRPO step is scored)"
                  + (f"; {chosen.memory.notes[0]}" if req.grpo.generation != "generate" else ""))
        _note_time_band(hw, candidates, top)
    _note_adapter_ddp(req, [c for c in candidates if c.feasible])
    from toolkit.estimate.placement import placement_lines, reference_line

    for line in placement_lines(list(placed), req.global_batch):
        print(line)
    if line := reference_line(spec, hw, next((c for c in candidates if c.feasible), None)):
        print(line)
    refused = [c for c in candidates if not c.feasible]
    if refused:
        print("\nnot possible:")
        for c in refused:
            print(f"  {c.name}: {c.reason}")


def _note_time_band(hw, candidates, top: int) -> None:
    """Say which top candidates the step-time model cannot tell apart, and which speeds no published run backs."""
    from toolkit.estimate.errorband import time_band
    from toolkit.estimate.ranking import speed_ties

    band = time_band(hw.gpu)
    tied = speed_ties(candidates)
    if len(tied) > 1:
        names = ", ".join(c.name for c in tied[:top])
        where = "are within it of the fastest" if band.known else "are ties"
        print(f"{band.text()}: #1-#{len(tied)} ({names}) {where}, so they are ordered by "
              "robustness (resumable, then memory headroom in peak error bands, then simplicity: no offload, fewer "
              "sharded or pipelined parts), not by speed")
    else:
        print(f"{band.text()}: #1 is faster than the rest by more than the band")
    shown = [c for c in candidates if c.feasible][:top]
    if shown and shown[0].timing is not None and shown[0].timing.vision_s:
        from toolkit.estimate.visiontime import vision_band_words

        print(f"step time of #1: {vision_band_words(shown[0].timing.vision_s)}")
    if any(not c.speed_evidenced for c in shown):
        print("* speed unverified: no published run of this engine at this scale in the step-time corpus; its "
              "communication / bubble / offload terms are unmeasured (benchmarks/results/throughput.md)")


def _note_adapter_ddp(req, feasible) -> None:
    """LoRA / QLoRA: gradients and optimizer states are the adapters' only, so sharding them saves little and DDP
    (no gathers) is usually as fast as the best; say so when it is."""
    if not req.adapter.is_adapter or not feasible:
        return
    ddp = next((c for c in feasible if c.strategy.name == "ddp"), None)
    first = feasible[0]
    fastest = max(feasible, key=lambda c: c.timing.tokens_per_s)  # the first is not it when robustness decided
    if ddp is not None and ddp is not first and ddp.timing.tokens_per_s >= 0.99 * fastest.timing.tokens_per_s:
        speed = "the fastest predicted" if ddp is fastest else f"within 1% of the fastest ({fastest.name})"
        print(f"\nnote: with {req.adapter.method} only the adapters have gradients and optimizer states; DDP is "
              f"{speed} and needs {ddp.memory.required_bytes / GIB:.1f} GiB vs {first.memory.required_bytes / GIB:.1f}"
              f" for #1 ({first.name}): choose it with --choose ddp for the simplest run")
