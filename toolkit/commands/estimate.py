"""`toolkit estimate`: per-GPU memory and step time of one strategy (a table, or --json)."""

from __future__ import annotations

import json
from dataclasses import replace

from toolkit import bounds
from toolkit.bounds import int_arg
from toolkit.errors import UserError
from toolkit.inputs.job import checkpointing_words, compile_words
from toolkit.inputs.strategy import ALL_STRATEGY_NAMES
from toolkit.commands.common import (add_calibration_flags, add_checkpointing_flag, calibration_json, calibration_words, adapter_of, allocator_of, add_rope_flags, dpo_of, grpo_of,
                                     images_of,
                                     add_hardware_flags, add_job_flags, add_model_flags, add_run_size_flags, gib,
                                     hardware_of, longest_line, model_spec, print_note, run_size_flag, run_size_of,
                                     seq_len_of, trainable_params)


def add_parser(sub) -> None:
    p = sub.add_parser("estimate", help="per-GPU memory and step time of one strategy")
    add_model_flags(p)
    add_hardware_flags(p)
    add_job_flags(p, seq_max=True)
    add_rope_flags(p)
    p.add_argument("--strategy", default="ddp", help=f"one of {', '.join(ALL_STRATEGY_NAMES)} (default %(default)s)")
    p.add_argument("--micro-batch", type=int_arg("--micro-batch", bounds.BATCH), default=1,
                   help="samples per GPU per forward (default %(default)s)")
    p.add_argument("--accumulation", type=int_arg("--accumulation", bounds.BATCH), default=1,
                   help="gradient accumulation steps (default %(default)s)")
    add_checkpointing_flag(p, "activation checkpointing of every layer (the bare flag means on; op: torchtitan's per-op "
                           "selective policy)")
    p.add_argument("--chunked-loss", type=int_arg("--chunked-loss", bounds.SEQ), default=0, metavar="N",
                   help="torchtune's chunked cross-entropy: logits and loss in N sequence chunks, each upcast to fp32 "
                        "apart (torchtune's default 8; no runner here exposes it)")
    p.add_argument("--expert-shared-batch", action="store_true",
                   help="with --expert-parallel N: the N ranks share one batch and keep the dense modules whole "
                        "(TRL's MoE guide: DistributedConfig(tp_size=N, enable_expert_parallel=True), which "
                        "transformers 5.24 no longer loads); default: every rank its own batch")
    add_run_size_flags(p)
    add_calibration_flags(p)
    p.add_argument("--explain", action="store_true", help="show where every term comes from")
    p.add_argument("--trace-world", action="store_true",
                   help="trace one rank of an FSDP2 / FSDP2 x TP / HSDP row in a fake world of the plan's size (the "
                        "real wrapping, one process, no GPU) and take its model states from it; slower, cached")
    p.add_argument("--json", action="store_true", help="print only JSON")
    p.add_argument("--require-fit", action="store_true", help="exit 1 when it does not fit (for scripts)")
    p.set_defaults(func=cmd_estimate)


def cmd_estimate(args) -> int:
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.grpo import generation_batch
    from toolkit.inputs.job import Job, check_job
    from toolkit.estimate.duration import duration
    from toolkit.estimate.search import evaluate
    from toolkit.estimate.errorband import band_for
    from toolkit.inputs.hardware import power_json
    from toolkit.inputs.strategy import parse_strategy

    _refuse_run_only_dpo_settings(args)
    sized_by = run_size_flag(args)
    if sized_by is not None and args.seq == "max":
        raise UserError(f"{sized_by} times a run at one sequence length, not --seq max; give --seq a number or "
                        f"drop {sized_by}")
    spec = model_spec(args)
    hw = hardware_of(args)
    strategy = parse_strategy(args.strategy)
    degrees = dict(tensor=args.tensor_parallel or 1, context=args.context_parallel or 1,
                   sequence=args.sequence_parallel or 1, expert=args.expert_parallel or 1)
    if args.expert_shared_batch and (degrees["expert"] <= 1 or args.seq == "max"):
        raise UserError("--expert-shared-batch prices an expert-parallel row at one sequence length; give it with "
                        "--expert-parallel N and --seq N")
    grpo = grpo_of(args)
    if args.seq == "max" and (args.images_per_sample or args.image_size):
        raise UserError("--images-per-sample / --image-size are estimated at one text length, not --seq max; give "
                        "--seq N (text tokens)")
    if args.seq == "max" and grpo is None:
        return _estimate_seq_max(args, spec, hw, strategy, degrees)
    from toolkit.estimate.mostimages import searched_by

    searched = searched_by(args.images_per_sample, args.image_size)
    if searched and (sized_by or args.trace_world):
        flag = sized_by or "--trace-world"
        raise UserError(f"{flag} prices one image count and size, not a `max` search; give --images-per-sample and "
                        f"--image-size values, or drop {flag}")
    seq_len, seq_note = seq_len_of(spec, args)
    run = run_size_of(args, seq_len)
    seq_len, images = images_of(args, spec, seq_len)
    job = Job(seq_len=seq_len, **images, micro_batch=args.micro_batch, grad_accum=args.accumulation,
              precision=args.precision, optimizer=args.optimizer, checkpointing=args.checkpointing,
              attention=args.attention, device_kind=args.device_kind, optimizer_impl=args.optimizer_impl,
              activation_offloading=args.activation_offloading, liger=args.liger, vision_tower=args.vision_tower,
              adapter=adapter_of(args, spec, training_only_read=False), compile=args.compile, tiled=args.tiled,
              chunked_loss=args.chunked_loss, loss=args.loss, dpo=dpo_of(args), grpo=grpo,
              allocator_conf=allocator_of(args, hw, grpo).conf)
    grid = ParallelGrid.for_strategy(strategy, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                     pipeline_stages=args.pipeline_stages, **degrees,
                                     expert_shared_batch=args.expert_shared_batch)
    check_job(spec, job, hw, strategy, pipeline_stages=grid.pipeline_stages)
    if grid.autoep:
        from toolkit.inputs.autoep import autoep_optimizer_problem

        if problem := autoep_optimizer_problem(job.optimizer):
            raise UserError(problem)
    if grpo is not None:
        from toolkit.inputs.grpo import MODEL_PARALLEL_GRPO_PROBLEM, batch_problem

        problem = MODEL_PARALLEL_GRPO_PROBLEM if grid.model_parallel > 1 or grid.expert > 1 else \
            batch_problem(grpo, job.micro_batch, grid.data_parallel, job.grad_accum)
        if problem:
            raise UserError(problem)
    attention = spec.effective_attention(job.attention)
    grid.check_model(spec)
    grid.check_sequence(job.seq_len, attention, spec)
    if args.trace_world:
        from toolkit.estimate.fakeworld import untraceable_reason

        reason = untraceable_reason(strategy, grid, job)
        if reason:
            raise UserError(f"--trace-world cannot trace {strategy.name}: {reason}; drop --trace-world")
    if searched:
        return _estimate_most_images(args, spec, hw, strategy, grid, job, searched)
    c = evaluate(spec, hw, strategy, job, grid, prune=False)
    from toolkit.estimate.placement import window_problem

    if problem := window_problem([c], hw.spec):
        raise UserError(problem)
    b, t, partition = c.memory, c.timing, c.partition
    world = None
    if args.trace_world:
        from toolkit.estimate.fakeworld import trace_world, traced_terms

        world = trace_world(spec, strategy, job, grid)
        b = replace(b, terms=traced_terms(b.terms, world))
    band = band_for(strategy.engine, job.checkpointing, gpu=hw.gpu)
    if args.json:
        out = {"model": spec.summary(), "params": spec.params,
               "trainable_params": trainable_params(spec, job.adapter), "hardware": hw.spec,
               **power_json(hw.gpu, job.precision),
               "strategy": strategy.name,
               **({"rope_scaling": {**spec.rope_scaling, "positions": spec.max_positions}} if spec.rope_scaling
                  else {}),
               "job": {"seq_len": job.seq_len, "micro_batch": job.micro_batch, "grad_accum": job.grad_accum,
                       "precision": job.precision, "optimizer": job.optimizer, "checkpointing": job.checkpointing,
                       "attention": attention, "device_kind": job.device_kind, "liger": job.liger,
                       **({"compile": job.compile} if job.compile else {}), **({"tiled": True} if job.tiled else {}),
                       **({"chunked_loss": job.chunked_loss} if job.chunked_loss else {}),
                       **({"loss": job.loss} if job.loss != "model" else {}),
                       **({"images_per_sample": job.images_per_sample, "image_size": job.image_size,
                           "image_tokens": job.image_tokens, "text_tokens": job.seq_len - job.image_sequence_tokens}
                          if job.images_per_sample else {}),
                       "method": job.method, **({"adapter": job.adapter.to_dict()} if job.adapter.is_adapter else {}),
                       **({"dpo": job.dpo.to_dict()} if job.dpo else {}),
                       **({"grpo": job.grpo.to_dict()} if job.grpo else {})},
               **({"grpo_step": generation_batch(job.grpo, job.micro_batch, c.data_parallel, job.grad_accum)}
                  if job.grpo else {}),
               "per_gpu": b.to_dict(), "host_ram_bytes_per_node": hw.cpu_ram_bytes_per_node, "fits": b.fits,
               "timing": t.to_dict(),
               "error_band": band.to_dict(),
               "time_error_band": {**c.time_band.to_dict(),
                                   "evidenced_here": c.time_band.covers(strategy.name, hw.world_size)},
               "terms": [x.to_dict() for x in b.terms],
               **({"vision_share": vision_share(spec, b, c)} if spec.multimodal else {}),
               **({"fake_world": world.to_dict()} if world else {}), **calibration_json(args),
               "notes": ([seq_note] if seq_note else []) + list(b.notes) + list(t.assumptions)}
        if partition:
            out["partition"] = partition
        if run is not None:
            out["time_to_train"] = duration(run, c, hw.world_size).to_dict()
        print(json.dumps(out, indent=2))
        return _fit_exit(args, b.fits)
    if seq_note:
        print_note(seq_note)
    print_estimate(spec, hw, c, b, explain=args.explain, world=world)
    if words := calibration_words(args):
        print(words)
    if run is not None:
        print(duration(run, c, hw.world_size).text())
    return _fit_exit(args, b.fits)


def _refuse_run_only_dpo_settings(args) -> None:
    """--dpo-beta and --dpo-loss are settings of the run (plan writes them to training_args.json's dpo_config); they
    move neither the memory nor the step time estimate prints, so estimate refuses them rather than ignore them
    (after the DPO flags' own checks, so a wrong value is named as such)."""
    if dpo_of(args) is None:
        return
    given = [f for f, v in (("--dpo-beta", args.dpo_beta), ("--dpo-loss", args.dpo_loss)) if v is not None]
    if given:
        one = len(given) == 1
        raise UserError(f"{' and '.join(given)} change{'s' if one else ''} neither memory nor step time: "
                        f"{'it is a setting' if one else 'they are settings'} of the run, which `toolkit plan --out` "
                        f"writes to training_args.json's dpo_config; drop {'it' if one else 'them'} here")


def print_estimate(spec, hw, c, b, *, explain: bool = False, world=None) -> None:
    """The estimate of one candidate as text: the header, every memory term (with its source under `explain`), the
    peak, the error bands, host RAM and the step time (plan --explain prints its chosen row through this too).
    `b`: the candidate's memory, or the fake world's terms in its place (estimate --trace-world)."""
    from toolkit.estimate.errorband import band_for
    from toolkit.inputs.grpo import generation_batch, grpo_words
    from toolkit.inputs.preference import reference_words
    from toolkit.inputs.hardware import power_words

    strategy, job, t = c.strategy, c.job, c.timing
    band = band_for(strategy.engine, job.checkpointing, gpu=hw.gpu)
    attention = spec.effective_attention(job.attention)
    cap = b.capacity_bytes
    active = f", {spec.active_params:,} active per token" if spec.active_params != spec.params else ""
    print(f"{spec.name}: {spec.params:,} parameters{active} ({spec.num_layers} x {spec.layer_class}"
          f"{', tied embeddings' if spec.tied else ''}) | {c.name} on {hw.spec}{power_words(hw.gpu, job.precision)} | "
          f"seq {job.seq_len}, "
          f"micro-batch {job.micro_batch}, accumulation {job.grad_accum}, {job.precision}, {job.optimizer}, "
          f"{attention} attention"
          f"{checkpointing_words(job.checkpointing)}{', Liger kernels' if job.liger else ''}"
          f"{compile_words(job.compile)}{', tiled MLP + loss' if job.tiled else ''}"
          f"{f', cross-entropy in {job.chunked_loss} chunks' if job.chunked_loss else ''}"
          f"{', TRL chunked NLL' if job.loss != 'model' else ''}"
          f"{reference_words(job.dpo)}{rope_words(spec)}{grpo_words(job.grpo)}"
          f"{', vision tower frozen' if job.vision_tower == 'freeze' else ''}")
    if spec.multimodal:
        print(f"parts: {spec.parts_words()}")
    if job.images_per_sample:
        from toolkit.inputs.images import image_words

        print(image_words(job))
    if job.grpo is not None:
        g = generation_batch(job.grpo, job.micro_batch, c.data_parallel, job.grad_accum)
        print(f"GRPO step: a generation batch of {g['generation_batch_size']} completions = {g['prompts_per_step']} "
              f"prompts x {job.grpo.num_generations} generations (GRPOConfig generation_batch_size)")
    if job.adapter.is_adapter:
        a = job.adapter
        print(f"{a.method}: r {a.r}, alpha {a.alpha:g}, dropout {a.dropout:g}, targets {a.targets}"
              f"{', 4-bit ' + a.quant_type if a.method == 'qlora' else ''}: "
              f"{trainable_params(spec, a):,} trainable parameters")
    rows = [(t_.name, t_.bytes, t_.source) for t_ in b.terms]
    width = max(len(r[0]) for r in rows) + 2
    print(f"\n{'per GPU':<{width}}{'GiB':>9}{'of GPU':>9}")
    for name, value, source in rows:
        print(f"{name:<{width}}{gib(value):>9}{value / cap:>9.1%}")
        if explain:
            print(f"{'':<{width}}  <- {source}")
    print(f"{'peak (tensors)':<{width}}{gib(b.peak_bytes):>9}{b.peak_bytes / cap:>9.1%}   at {b.peak_phase}")
    if explain:
        print(f"{'':<{width}}  <- allocated: what torch.cuda.max_memory_allocated reports")
        print(f"{'reserved':<{width}}{gib(b.reserved_bytes):>9}{b.reserved_bytes / cap:>9.1%}   "
              f"fragmentation costs {gib(b.margin_bytes)} GiB over allocated")
        print(f"{'':<{width}}  <- max_memory_reserved: the caching allocator's segments"
              f"{' with PYTORCH_CUDA_ALLOC_CONF=' + b.allocator_conf if b.allocator_conf else ''}")
    print(f"{'required':<{width}}{gib(b.required_bytes):>9}{b.required_bytes / cap:>9.1%}   of "
          f"{gib(cap)} GiB: {'fits' if b.fits else 'DOES NOT FIT'}")
    if explain:
        print(f"{'':<{width}}  <- what nvidia-smi shows: reserved + CUDA context + NCCL buffers; fits is judged here")
    if b.refusal:
        print(f"DOES NOT FIT: {b.refusal}")
    allocator = allocator_of(None, hw, job.grpo, device_kind=job.device_kind)
    if allocator.conf == b.allocator_conf:
        print(f"allocator: {allocator.words}")
    elif job.grpo is not None and job.grpo.generation != "generate":
        print(b.notes[0])  # where GRPO generates: vLLM colocate's window, or the server's GPUs
    if world is not None:
        from toolkit.estimate.fakeworld import peak_line

        print(peak_line(world, b.peak_bytes))
    print(f"error band: {band.text()}" + (f"; required + band = {gib(b.required_bytes + band.headroom_bytes(b.peak_bytes))}"
                                          f" GiB" if band.cases else "") + _routing_band(b))
    if b.stage_required_bytes:
        print("per stage required GiB: " + ", ".join(gib(x) for x in b.stage_required_bytes))
    if b.host is not None:
        print(f"host RAM per node: load {gib(b.host.load_bytes_per_node)} GiB, save "
              f"{gib(b.host.save_bytes_per_node)} GiB on top of {gib(b.host.resident_bytes_per_node)} GiB resident; "
              f"peak {gib(b.host.peak_bytes_per_node)} of {gib(hw.cpu_ram_bytes_per_node)} GiB")
        if explain:
            print(f"  <- load: {b.host.load_source}; save: {b.host.save_source}")
    if b.cpu_bytes_per_node:
        print(f"host RAM per node for offload: {gib(b.cpu_bytes_per_node)} GiB "
              f"of {gib(hw.cpu_ram_bytes_per_node)}")
    if b.nvme_bytes_per_node:
        print(f"NVMe per node: {gib(b.nvme_bytes_per_node)} GiB")
    print(f"\npredicted step {t.step_time_s:.3f} s, {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.0%} "
          f"({step_terms_words(t)})")
    tband = c.time_band
    from toolkit.estimate.visiontime import vision_band_words

    print(f"time band: {tband.text()}"
          + ("" if tband.covers(strategy.name, hw.world_size) or not tband.known else
             f"; no published {strategy.name} run on {hw.world_size} GPU(s) on {hw.gpu.architecture.capitalize()} in "
             "the corpus: this engine's terms are unverified")
          + ("; not for expert parallelism: one published expert-parallel step is scored (TRL's Qwen3-30B-A3B "
             "ep=8, benchmarks/results/moe_ep.md: within 35% on the route it ran, its host's dispatch of the route "
             "measured on CPU; its 8-node row about 3x slower than this model), so the expert-parallel "
             "speed and its terms are unverified"
             if c.grid is not None and c.grid.expert > 1 else
             "; not for a mixture of experts: no published MoE step is scored within it (its host dispatch is "
             "measured on CPU only), so its speed is unverified" if t.host_s and t.moe else "")
          + ("; GRPO generation and scoring: no band (no published GRPO step is scored)" if t.generation_s else "")
          + (f"; {vision_band_words(t.vision_s)}" if t.vision_s else ""))
    from toolkit.estimate.savers import UNMODELLED_SPEED

    for key in t.unmodelled:
        print(f"speed not modelled: {UNMODELLED_SPEED[key]}")
    if c.job.activation_offloading and not strategy.is_pipeline:
        from toolkit.estimate.savers import offload_traffic_line

        print(offload_traffic_line(spec, c.job, strategy, hw, t.compute_s, c.grid))
    if explain and spec.multimodal:
        print(f"  vision encoder's share: {vision_share_words(spec, b, c)}")
    if explain:
        for note in list(b.notes) + list(t.assumptions):
            print(f"  note: {note}")


def vision_share(spec, b, c) -> dict[str, int]:
    """Per-GPU bytes of the vision encoder + projector inside the model-state terms: their fraction of the parameters
    of each term, as the strategy holds it (whole under DDP / ZeRO-1 / 2, 1/N of it where ZeRO-3 / FSDP2 shard the
    flat parameters by element count). A frozen tower (--vision-tower freeze) keeps its weights only
    (toolkit.estimate.states.frozen_weight_bytes); an adapter job's base, tower included, is frozen the same way."""
    from toolkit.estimate.memory import frozen_params
    from toolkit.estimate.states import frozen_weight_bytes

    from toolkit.estimate.memory import VISION_ACTIVATIONS

    tower = spec.vision_params + spec.projector_params
    images = {"activations_bytes": t.bytes for t in b.terms if t.name == VISION_ACTIVATIONS}
    if frozen_params(spec, c.job):
        return {"weights_bytes": int(frozen_weight_bytes(tower, c.job, c.strategy, shard=c.grid.shard_group)),
                "gradients_bytes": 0, "optimizer_bytes": 0, **images}
    fraction = tower / spec.params
    trained = not c.job.adapter.is_adapter
    return {"weights_bytes": int(b.parameters_bytes * fraction),
            "gradients_bytes": int(b.gradients_bytes * fraction) if trained else 0,
            "optimizer_bytes": int(b.optimizer_bytes * fraction) if trained else 0, **images}


def vision_share_words(spec, b, c) -> str:
    share = vision_share(spec, b, c)
    activations = share.pop("activations_bytes", 0)
    total = sum(share.values())
    return (f"{gib(total)} GiB of the per-GPU model states ({spec.vision_params + spec.projector_params:,} "
            f"parameters, {(spec.vision_params + spec.projector_params) / spec.params:.1%} of the class): weights "
            f"{gib(share['weights_bytes'])}, gradients {gib(share['gradients_bytes'])}, optimizer states + master "
            f"{gib(share['optimizer_bytes'])} GiB, as {c.name} holds them"
            + (" (sharded over the data-parallel ranks)" if c.strategy.zero_stage == 3 or
               c.strategy.name.startswith("fsdp2") else "")
            + (f"; and {gib(activations)} GiB of activations for the images" if activations else "")
            + (f"; its compute {c.timing.vision_s:.3f} s of the step's {c.timing.step_time_s:.3f} s (the note "
               "'vision encoder + projector' says how it is counted)" if c.timing and c.timing.vision_s else ""))


def rope_words(spec) -> str:
    """The header's words for the job's RoPE scaling (toolkit.inputs.rope), with the positions it gives."""
    if not spec.rope_scaling:
        return ""
    from toolkit.inputs.rope import RopeScaling

    return f"{RopeScaling.from_dict(spec.rope_scaling).words()} ({spec.max_positions:,} positions)"


def step_terms_words(t) -> str:
    """Every term the step time adds (toolkit.estimate.timing.step_time sums exactly these), so the printed parts add
    up to the printed step; the optional ones only when the job has them."""
    terms = [("compute", t.compute_s), ("exposed comm", t.communication_s), ("bubble", t.bubble_s),
             ("offload", t.offload_s), ("LoRA adapters", t.lora_overhead_s), ("4-bit dequantisation", t.dequant_s),
             ("tiled recompute", t.tiled_recompute_s),
             ("GRPO scoring forwards" if t.generation_s else "DPO reference forward", t.reference_s),
             ("GRPO generation", t.generation_s), ("GRPO reward model", t.reward_s),
             ("calibrated fixed cost", t.fixed_s)]
    words = ", ".join(f"{name} {value:.3f} s" for i, (name, value) in enumerate(terms) if i < 4 or value)
    # The host's dispatch is a floor, not a term: where it binds, the step is it (toolkit.estimate.hosttime).
    bound = t.host_s and t.host_s >= t.step_time_s
    return words + (f"; host-bound: the host's dispatch, {t.host_s:.3f} s, is the step" if bound else "")


def _estimate_seq_max(args, spec, hw, strategy, degrees) -> int:
    """estimate --seq max: the longest sequence `strategy` fits on this grid, and its memory curve."""
    if args.trace_world:
        raise UserError("--trace-world traces one sequence length, not --seq max; give --seq a number or drop "
                        "--trace-world")
    if args.loss != "model":
        raise UserError("--loss trl is estimated for one sequence length, not --seq max; give --seq a number or drop "
                        "--loss trl")
    if args.chunked_loss:
        raise UserError("--chunked-loss is estimated for one sequence length, not --seq max; give --seq a number "
                        "or drop --chunked-loss")
    if args.micro_batch != 1:
        raise UserError("--micro-batch does not apply to --seq max (it finds the longest sequence at micro-batch 1); "
                        "drop --micro-batch or give --seq N")
    if problem := spec.attention_problem(args.attention):
        raise UserError(problem)
    from toolkit.estimate.longest import longest_on_grid, text_chart
    from toolkit.inputs.hardware import power_json
    from toolkit.estimate.request import Request
    from toolkit.inputs.grid import ParallelGrid

    grid = ParallelGrid.for_strategy(strategy, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                     pipeline_stages=args.pipeline_stages, **degrees)
    grid.check_model(spec)
    req = Request(seq_len=1, micro_batch=1, grad_accum=args.accumulation, precision=args.precision,
                  optimizer=args.optimizer, attention=args.attention, device_kind=args.device_kind,
                  checkpointing=args.checkpointing, optimizer_impl=args.optimizer_impl, liger=args.liger,
                  vision_tower=args.vision_tower,
                  activation_offloading=args.activation_offloading,
                  adapter=adapter_of(args, spec, training_only_read=False), compile=args.compile, tiled=args.tiled,
                  dpo=dpo_of(args), allocator_conf=allocator_of(args, hw, None).conf)
    found = longest_on_grid(spec, hw, strategy, grid, req)
    from toolkit.commands.help import status
    from toolkit.estimate.levers import ladder_json, ladder_text, lever_ladder

    with status(f"--seq max: the long-context levers, one at a time, on {strategy.name}"):
        # plan --seq max --strategies NAME's ladder: the same request on this grid's degrees.
        rungs = lever_ladder(spec, hw, replace(req, strategies=(strategy.name,), tensor_parallel=degrees["tensor"],
                                               context_parallel=degrees["context"],
                                               sequence_parallel=degrees["sequence"],
                                               expert_parallel=degrees["expert"],
                                               pipeline_stages=args.pipeline_stages), strategy.name)
    if args.json:
        print(json.dumps({"model": spec.summary(), "hardware": hw.spec,
                          **power_json(hw.gpu, args.precision),
                          **({"rope_scaling": {**spec.rope_scaling, "positions": spec.max_positions}}
                             if spec.rope_scaling else {}),
                          "strategy": found.name,
                          "longest_seq": found.seq_len, "capped_by_positions": found.capped_by_positions,
                          "reason": found.reason, "curve": [{"seq": s, "required_bytes": b} for s, b in found.curve],
                          **({"levers": ladder_json(strategy.name, rungs)} if rungs else {})},
                         indent=2))
        return 0 if found.seq_len else 1
    print(longest_line(found, spec))
    chart = text_chart([found], hw.gpu.memory_bytes)
    if chart:
        print("\n" + chart)
    if rungs:
        print("\n" + ladder_text(strategy.name, rungs, hw.gpu.memory_bytes))
    return 0 if found.seq_len else 1


def _estimate_most_images(args, spec, hw, strategy, grid, job, searched: str) -> int:
    """estimate --images-per-sample max / --image-size max: the largest count or size `strategy` fits at the job's
    text tokens (toolkit.estimate.mostimages), the probes' memory, and the value to pass."""
    from toolkit.commands.common import image_folder
    from toolkit.estimate.mostimages import COUNT, most_images

    if grid.sequence_multiple() > 1:
        raise UserError(f"{'--images-per-sample' if searched == COUNT else '--image-size'} max moves the sequence, "
                        f"and {grid.describe()} splits it in multiples of {grid.sequence_multiple()}; give a value, "
                        "or drop the sequence split")
    found = most_images(spec, hw, strategy, grid, job, searched, image_folder(args))
    c = found.candidate
    if args.json:
        print(json.dumps({"model": spec.summary(), "hardware": hw.spec, "strategy": c.name, **found.to_dict(),
                          "per_gpu": c.memory.to_dict() if c.memory is not None else None, "fits": found.found},
                         indent=2))
        return 0 if found.found else 1
    print(f"{spec.name} on {hw.spec} | {c.name} | {job.seq_len - job.images_per_sample * job.image_tokens:,} text "
          f"tokens, micro-batch {job.micro_batch} | the "
          + ("most images a sample" if searched == COUNT else "largest image") + " that fits")
    print(found.words())
    width = max(len(p[0]) for p in found.probes) + 2
    print(f"\n{'probed':<{width}}{'image tokens':>14}{'GiB per GPU':>13}")
    for value, tokens, required, fits in found.probes:
        print(f"{value:<{width}}{tokens:>14,}{gib(required) if required else 'over':>13}"
              + ("" if fits else "   does not fit"))
    if args.explain and found.found:
        print()
        print_estimate(spec, hw, c, c.memory, explain=True)
    return 0 if found.found else 1


def _fit_exit(args, fits: bool) -> int:
    """estimate --require-fit: exit 1 when the configuration does not fit (for scripts); 0 otherwise."""
    return 1 if args.require_fit and not fits else 0


def _routing_band(b) -> str:
    """The band line's routing-imbalance part for an expert-parallel row (empty otherwise): the figures above are
    the busiest expert rank's, balanced routing plus its extra rows (toolkit.estimate.memory)."""
    from toolkit.estimate.expertrows import EP_WORST_RANK_SHARE
    from toolkit.estimate.memory import BUSIEST_EXPERT_RANK

    extra = next((t.bytes for t in b.terms if t.name == BUSIEST_EXPERT_RANK), None)
    return "" if extra is None else (f"; routing imbalance: the figures are the busiest expert rank's, at "
                                     f"{EP_WORST_RANK_SHARE:g}x the mean routed rows (assumed): balanced "
                                     f"{gib(b.peak_bytes - extra)} GiB peak + {gib(extra)} GiB")
