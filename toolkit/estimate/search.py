"""The planner: every strategy the engines support x micro-batch x accumulation x checkpointing x pipeline
stages, each costed by the memory and step-time models, ranked by predicted tokens/s. Candidates whose speeds differ
by less than the step-time error band (toolkit.estimate.errorband.time_band) are ties, ordered by robustness
(toolkit.estimate.ranking: resumable, memory headroom in units of the peak error band, then simplicity), then speed.

ALST tiling (toolkit.patches.tiling) by default ("auto", Request.tiled None) is tried where the engines run it
(toolkit.inputs.job.tiled_problem, model_feature_problem) on a grid that fits no configuration untiled, for the
configurations refused for GPU memory: tiling only adds recompute to a job that fits, and trying it on grids that
already fit (where it could only drop checkpointing or raise the micro-batch) cost 1.6x the planning time of a 70B
plan on 64 GPUs. A row's tiled best replaces its untiled best (e.g. at a larger sequence-parallel degree) only when
the untiled one does not fit, or is slower by more than the step-time band.

Memory savers (auto_savers: Liger kernels, activation offloading, both, least intrusive first) are tried the same
way, on a grid where a row fits neither untiled nor tiled, for the configurations refused for GPU memory; never on
a row that fits (the 64-GPU Llama-3-70B plan tries none). Rows are tagged +liger / +act-offload and the emitted plan
turns the saver on; their speed effect is not modelled (toolkit.estimate.savers.UNMODELLED_SPEED). Offloading on
context / sequence ranks is tried last, only where no degree of the row fits plainly, tiled or with another saver.

An MoE model's FSDP2 x EP row (transformers' DistributedConfig ep_size) costs every expert degree the grid admits
(_expert_parallel_grids) and keeps the best; it is ranked like a tensor-parallel row (no resume, speed unverified),
and #1's explanation says how it compares with EP and with ZeRO-3 / FSDP2 gathering every expert
(toolkit.estimate.ranking._expert_clause).

A candidate that cannot run says why: it does not fit ("needs 93.1 GiB of 79.1"), the batch does not divide, the
layers do not split into the stages, the GPU lacks the precision, the node lacks host RAM for offload.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from toolkit.estimate.autoeprows import autoep_options, autoep_strategies
from toolkit.estimate.expertgrids import fixed_expert_grid
from toolkit.estimate.errorband import band_for, time_band
from toolkit.estimate.candidate import Candidate
from toolkit.estimate.reserved import replays_asked, replays_left_out
from toolkit.estimate.retries import at_capacity
from toolkit.estimate.slots import Deferred, Slots, slower
from toolkit.estimate.ranking import need_bytes, rank
from toolkit.estimate.request import Request
from toolkit.errors import UserError
from toolkit.inputs.choices import GIB
from toolkit.inputs.cpudevice import CPU_NAME, cpu_rates
from toolkit.inputs.hardware import Hardware
from toolkit.inputs.grid import ParallelGrid, stage_options
from toolkit.inputs.job import Job, job_problem, model_feature_problem
from toolkit.estimate.memory import Breakdown, estimate_memory, states_floor_bytes
from toolkit.estimate.traces import priced_step_time
from toolkit.inputs.modelspec import ModelSpec
from toolkit.inputs.preference import MODEL_PARALLEL_DPO_PROBLEM
from toolkit.estimate.preference import dpo_step_time
from toolkit.estimate.grpo import grpo_step_time
from toolkit.inputs.grpo import MODEL_PARALLEL_GRPO_PROBLEM, batch_problem
from toolkit.inputs.strategy import Kind, Strategy, parse_strategy
from toolkit.estimate.timing import step_time

if TYPE_CHECKING:
    from toolkit.plan.schema import Plan  # pydantic: imported only where a plan is built (estimate never needs it)

CPU_RAM_RESERVE = 0.10
"""Share of host RAM left to the OS, dataloaders and the Python processes when offloading."""


def _grids(strategy: Strategy, spec: ModelSpec, hw: Hardware, req: Request) -> list[ParallelGrid] | str:
    """The grids to try for a strategy, or the reason there are none."""
    options = [req.pipeline_stages] if (req.pipeline_stages is not None and strategy.is_pipeline) else \
        stage_options(strategy, hw.nodes, hw.gpus_per_node)
    if not strategy.is_pipeline and req.pipeline_stages not in (None, 1):
        return f"no pipeline stages in {strategy.name}"
    grids, problems = [], []
    for stages in options:
        try:
            grid = ParallelGrid.for_strategy(strategy, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                             pipeline_stages=stages if strategy.is_pipeline else None)
            grid.check_model(spec)
        except UserError as exc:
            problems.append(str(exc))
            continue
        grids.append(grid)
    if grids:
        return grids
    if not problems:
        return f"{hw.world_size} GPUs leave no pipeline stage count between 1 and {hw.world_size}"
    return "; ".join(dict.fromkeys(problems))


def short_of_gpu_memory(memory: Breakdown, strategy: Strategy, job: Job, gpu=None) -> bool:
    """Whether the per-GPU memory is over the GPU's capacity once the estimate's error band (`gpu`'s) is kept."""
    band = band_for(strategy.engine, job.checkpointing, gpu=gpu)
    return not memory.fits or memory.required_bytes + band.headroom_bytes(memory.peak_bytes) > memory.capacity_bytes


def evaluate(spec: ModelSpec, hw: Hardware, strategy: Strategy, job: Job, grid: ParallelGrid,
             partition: list[int] | None = None, *, prune: bool = True) -> Candidate:
    """Memory and step time of one configuration (estimate and plan both call it); `prune`: refuse on the states
    floor alone when it exceeds the GPU (saves the trace). An MoE model's step counts its host dispatch (hosttime)."""
    stages, dp = grid.pipeline_stages, grid.data_parallel
    if strategy.is_pipeline and partition is None:
        partition = grid.partition(spec)
    floor = states_floor_bytes(spec, strategy, job, hw, pipeline_stages=stages, partition=partition,
                               grid=grid) if prune else 0
    if floor > hw.gpu.memory_bytes:
        return Candidate(strategy=strategy, job=job, pipeline_stages=stages, data_parallel=dp,
                         global_batch=grid.global_batch(job.micro_batch, job.grad_accum), partition=partition,
                         grid=grid, gpu=hw.gpu, reason=f"needs over {floor / GIB:.1f} GiB of {hw.gpu.memory_bytes / GIB:.1f} "
                                           "per GPU for model states alone")
    with replays_asked() as asked:
        memory = estimate_memory(spec, strategy, job, hw, pipeline_stages=stages, partition=partition, grid=grid)
    timing = priced_step_time(grpo_step_time if job.grpo else dpo_step_time if job.dpo else step_time,
                              spec, strategy, job, hw, pipeline_stages=stages, partition=partition, grid=grid)
    memory, timing = at_capacity(memory, timing, asked, spec, strategy, job, hw, pipeline_stages=stages,
                                 partition=partition, grid=grid)
    reason = (batch_problem(job.grpo, job.micro_batch, dp, job.grad_accum) if job.grpo else None) \
        or memory.refusal or None
    if reason:
        pass  # GRPO's own rules, named before the bytes
    elif not memory.fits:
        reason = (f"needs {memory.required_bytes / GIB:.1f} GiB of {memory.capacity_bytes / GIB:.1f} per GPU"
                  + (" (largest stage)" if strategy.is_pipeline else ""))
    elif memory.cpu_bytes_per_node > hw.cpu_ram_bytes_per_node * (1 - CPU_RAM_RESERVE):
        reason = (f"offload needs {memory.cpu_bytes_per_node / GIB:.0f} GiB host RAM per node of "
                  f"{hw.cpu_ram_bytes_per_node / GIB:.0f} (keep {CPU_RAM_RESERVE:.0%} free)")
    elif memory.host.peak_bytes_per_node > hw.cpu_ram_bytes_per_node * (1 - CPU_RAM_RESERVE):
        h = memory.host
        when = "loading the model" if h.load_bytes_per_node >= h.resident_bytes_per_node + h.save_bytes_per_node \
            else "saving the model"
        reason = (f"needs {h.peak_bytes_per_node / GIB:.0f} GiB host RAM per node while {when} of "
                  f"{hw.cpu_ram_bytes_per_node / GIB:.0f} (keep {CPU_RAM_RESERVE:.0%} free; more --cpu-ram-gib, "
                  "or a strategy that loads once per node: fsdp2, zero3)")
    elif short_of_gpu_memory(memory, strategy, job, hw.gpu):
        band = band_for(strategy.engine, job.checkpointing, gpu=hw.gpu)
        reason = (f"needs {memory.required_bytes / GIB:.1f} GiB of {memory.capacity_bytes / GIB:.1f} per GPU, inside "
                  f"the estimate's error band ({band.text()})")
    return Candidate(strategy=strategy, job=job, pipeline_stages=stages, data_parallel=dp,
                     global_batch=grid.global_batch(job.micro_batch, job.grad_accum), partition=partition,
                     memory=memory, timing=timing, reason=reason, grid=grid, gpu=hw.gpu)


def _evaluate_or_defer(spec: ModelSpec, hw: Hardware, strategy: Strategy, job: Job, grid: ParallelGrid,
                       partition: list[int] | None, best: Candidate | None) -> Candidate | Deferred:
    """evaluate, or Deferred where the configuration cannot be its slot's best while `best` (the slot's so far) or
    another fits: short of GPU memory before its allocator replays (toolkit.estimate.reserved.replays_left_out), or
    slower than a `best` that fits. Pipeline stages: over the capacity (the largest stage, and so its error band, may
    change with the replays). Not for GRPO or expert-parallel grids, whose bytes are more than the step's."""
    if job.grpo is not None or grid.expert > 1:
        return evaluate(spec, hw, strategy, job, grid, partition)
    with replays_left_out() as left_out:
        lower = evaluate(spec, hw, strategy, job, grid, partition)
    if not left_out[0]:
        return lower  # every replay was known: exact
    short = lower.memory.required_bytes > lower.memory.capacity_bytes if strategy.is_pipeline \
        else short_of_gpu_memory(lower.memory, strategy, job, hw.gpu)
    if short or slower(lower, best):
        return Deferred(lower, lambda: evaluate(spec, hw, strategy, job, grid, partition))
    return evaluate(spec, hw, strategy, job, grid, partition)


def plan_candidates(spec: ModelSpec, hw: Hardware, req: Request) -> list[Candidate]:
    """One best candidate per strategy (and per stage count for pipeline plans), feasible first by tokens/s."""
    problem = model_feature_problem(spec, liger=req.liger, tiled=req.tiled is True, attention=req.attention)
    if problem:  # true of every strategy: one refusal, not one per candidate
        raise UserError(problem)
    _check_stages([parse_strategy(s) for s in req.strategies], hw, req.pipeline_stages)
    slots = Slots()
    refused: dict[str, Candidate] = {}
    batch_refusals: list[str] = []
    ckpt_options = [False, True] if req.checkpointing is None else [req.checkpointing]
    for key, strategy, grids in options_for(spec, hw, req):
        dimension = key.split(" x ")[1] if " x " in key else None
        if isinstance(grids, str):
            refused[key] = refusal(strategy, req, hw, grids, dimension=dimension)
            continue
        _search(spec, hw, strategy, grids, req, key, slots, refused, ckpt_options, dimension=dimension,
                batch_refusals=batch_refusals)
    best = slots.settled()
    if not best and batch_refusals and all(c.reason in batch_refusals for c in refused.values()):
        raise UserError(batch_refusals[0])  # the batch itself, not the strategies: one line names it (exit 2)
    ranked = rank(list(_untiled_unless_needed(best).values()))
    return ranked + [c for k, c in refused.items() if k not in best]


def options_for(spec: ModelSpec, hw: Hardware, req: Request, *, sequence_rule: bool = True):
    """(row key, strategy, grids to try or the reason there are none) for every strategy the request allows and
    every model-parallel family (FSDP2 x TP, FSDP2 x CP, ZeRO x SP). `sequence_rule` False: do not hold the
    grids to req.seq_len's divisibility (a search over lengths picks lengths that divide)."""
    if (req.expert_parallel or 1) > 1:  # a degree the user fixed: plan the FSDP2 x EP row alone
        strategy = parse_strategy("fsdp2")
        problem = _expert_job_problem(strategy, hw, req, "drop --expert-parallel, or those")
        if "fsdp2" in req.strategies or not autoep_strategies(req.strategies):
            yield "fsdp2 x ep", strategy, problem or fixed_expert_grid(spec, hw, req)
        yield from autoep_options(spec, hw, req, [req.expert_parallel], sequence_rule, _expert_job_problem,
                                  _degree_problems)
        return
    strategies = [parse_strategy(s) for s in req.strategies]
    if hw.world_size == 1:
        strategies = [s for s in strategies if s.kind == Kind.DDP or s.offloads] or strategies
    fixed = (req.tensor_parallel, req.context_parallel, req.sequence_parallel)
    if any(v not in (None, 1) for v in fixed):
        strategies = []  # a degree the user fixed: plan that dimension alone
    for strategy in strategies:
        # compile=False: with --compile the search offers each strategy eager too (_search), compiled where it can.
        problem = job_problem(req.precision, hw.gpu, strategy, activation_offloading=req.activation_offloading,
                              liger=req.liger, adapter=req.adapter, tiled=req.tiled is True, dpo=req.dpo,
                              grpo=req.grpo, loss=req.loss)
        yield strategy.name, strategy, (_grids(strategy, spec, hw, req) if problem is None else problem)
    if hw.world_size > 1:
        for dimension, strategy, grids in _model_parallel_options(spec, hw, req, sequence_rule):
            yield f"{strategy.name} x {dimension}", strategy, grids
        if spec.moe_experts and "fsdp2" in req.strategies and req.expert_parallel is None \
                and not any(v not in (None, 1) for v in fixed):
            strategy = parse_strategy("fsdp2")
            problem = _expert_job_problem(strategy, hw, req, "so this plan ranks no ep row")
            yield "fsdp2 x ep", strategy, problem or _expert_parallel_grids(spec, hw, req, sequence_rule)
        if spec.moe_experts and req.expert_parallel is None and not any(v not in (None, 1) for v in fixed):
            yield from autoep_options(spec, hw, req, None, sequence_rule, _expert_job_problem, _degree_problems)


def _expert_job_problem(strategy: Strategy, hw: Hardware, req: Request, fix: str) -> str | None:
    """Why the request's job cannot run FSDP2 x EP, or None: the engines' rules for fsdp2 (job_problem), and what
    the expert-parallel model does not cover (adapters, activation offloading, DPO's reference placement)."""
    problem = job_problem(req.precision, hw.gpu, strategy, liger=req.liger, compile=req.compile,
                          attention=req.attention, tiled=req.tiled is True, adapter=req.adapter,
                          activation_offloading=req.activation_offloading, loss=req.loss)
    if problem is None and (req.adapter.is_adapter or req.activation_offloading):
        problem = ("expert parallelism is planned for full fine-tuning without activation offloading (neither "
                   f"is modelled with it); {fix}")
    if problem is None and req.images_per_sample:
        problem = f"expert parallelism of an image-and-text job is not modelled (the vision tower per rank); {fix}"
    if problem is None and (req.dpo or req.grpo):
        problem = MODEL_PARALLEL_DPO_PROBLEM if req.dpo else MODEL_PARALLEL_GRPO_PROBLEM
    return problem


def _expert_parallel_grids(spec: ModelSpec, hw: Hardware, req: Request,
                           sequence_rule: bool = True) -> list[ParallelGrid] | str:
    """The FSDP2 x EP grids (transformers' DistributedConfig ep_size) an MoE model runs on: every degree that divides
    the world and that the grid admits (ParallelGrid.check_model: DistributedConfig's rules, the expert count, the
    ep_plan's dispatch), rising; or why no degree runs. The search costs each (_search: a larger degree holds fewer
    experts per rank, so unlike tp / cp / sp it is not stopped at the first degree that fits)."""
    attention = spec.effective_attention(req.attention)
    grids, problems = [], []
    for degree in (d for d in range(2, hw.world_size + 1) if hw.world_size % d == 0):
        try:
            grid = ParallelGrid.for_strategy(parse_strategy("fsdp2"), nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                             expert=degree)
            grid.check_model(spec)
            grid.check_sequence(req.seq_len if sequence_rule else grid.sequence_multiple(), attention, spec)
        except UserError as exc:
            problems.append((degree, str(exc)))
            continue
        grids.append(grid)
    return grids or _degree_problems(problems)


def _search(spec: ModelSpec, hw: Hardware, strategy: Strategy, grids: list[ParallelGrid], req: Request, key: str,
            slots: Slots, refused: dict[str, Candidate], ckpt_options: list[bool], *,
            dimension: str | None = None, batch_refusals: list[str] | None = None) -> None:
    """The best (micro-batch, accumulation, checkpointing) of `strategy` over `grids`, kept under `key`.
    Model-parallel grids come in rising degree and the search stops at the first degree that fits: a larger degree
    only adds communication inside the sample and takes ranks from data parallelism (and costs a trace at its
    own per-rank shapes). A batch the grid cannot split is added to batch_refusals.
    Auto tiling (req.tiled None): on a grid where no configuration fits untiled, those refused for GPU memory are
    tried tiled, kept under "<slot> +tiled" (its own first fitting degree); _untiled_unless_needed picks between
    the two. Memory savers (auto_savers) likewise, on a grid where neither untiled nor tiled fits, under
    "<slot> +savers"."""
    tiling, savers = auto_tiling(spec, strategy, req), auto_savers(spec, hw, strategy, req)
    split_later = []  # (grid, partition, slot, short): offloading on context / sequence ranks, tried last
    for grid in grids:
        if dimension and dimension != "ep" and slots.fits(key):
            break  # ep: every degree is costed (_expert_parallel_grids)
        tiled_found = bool(dimension) and slots.fits(f"{key}{TILED_SLOT}")
        saver_found = bool(dimension) and slots.fits(f"{key}{SAVER_SLOT}")
        try:
            batches = grid.batch_splits(req.global_batch, micro_batch=req.micro_batch, grad_accum=req.grad_accum)
        except UserError as exc:
            refused.setdefault(key, refusal(strategy, req, hw, str(exc), dimension=dimension))
            if batch_refusals is not None:
                batch_refusals.append(str(exc))
            continue
        partition = grid.partition(spec) if strategy.is_pipeline else None
        for compiled in _compile_options(strategy, grid, req):
            slot = f"{key} +compile" if compiled else key
            short: list[Job] = []  # refused for GPU memory: the ones tiling may fit
            for micro, accum in sorted(batches, reverse=True):
                for ckpt in ckpt_options:
                    job = req.job(micro_batch=micro, grad_accum=accum, checkpointing=ckpt, compile=compiled,
                                  tiled=req.tiled is True)
                    cand = _evaluate_or_defer(spec, hw, strategy, job, grid, partition, slots.best.get(slot))
                    slots.keep(slot, cand, dimension)
                    if isinstance(cand, Deferred):  # its activations decide alike (a pipeline's largest stage may not)
                        cand = cand.cost() if strategy.is_pipeline and (tiling or savers) else cand.lower
                    if cand.memory is not None and short_of_gpu_memory(cand.memory, strategy, job, hw.gpu) \
                            and _activations_decide(cand.memory):
                        short.append(job)
            if tiling and not compiled and not tiled_found and not slots.fits(slot):
                for job in short:
                    slots.keep(f"{slot}{TILED_SLOT}", _evaluate_or_defer(spec, hw, strategy, replace(job, tiled=True),
                                                                         grid, partition,
                                                                         slots.best.get(f"{slot}{TILED_SLOT}")),
                               dimension)
            if savers and not compiled and not saver_found and not slots.fits(slot) \
                    and not slots.fits(f"{slot}{TILED_SLOT}"):
                for changes in savers:  # least intrusive first; the first that fits any job ends the search
                    if changes.get("activation_offloading") and (grid.model_parallel > 1 or grid.expert > 1):
                        if grid.tensor == 1 and grid.expert == 1 and (grid, slot) not in [x[::2] for x in split_later]:
                            split_later.append((grid, partition, slot, short))
                        continue  # on context / sequence ranks: below; not with tensor / expert parallelism
                    for job in short:
                        slots.keep(f"{slot}{SAVER_SLOT}", _evaluate_or_defer(
                            spec, hw, strategy, replace(job, **changes), grid, partition,
                            slots.best.get(f"{slot}{SAVER_SLOT}")), dimension)
                    if slots.fits(f"{slot}{SAVER_SLOT}"):
                        break
    # Offloading on context / sequence ranks (rank_view) only where no degree fits without it, smallest degree first.
    offloads = [c for c in savers if c.get("activation_offloading")]
    for grid, partition, slot, short in split_later:
        for changes in offloads:
            if any(slots.fits(f"{key}{s}") for s in ("", TILED_SLOT, SAVER_SLOT)):
                return
            for job in short:
                slots.keep(f"{slot}{SAVER_SLOT}", _evaluate_or_defer(spec, hw, strategy, replace(job, **changes),
                                                                     grid, partition,
                                                                     slots.best.get(f"{slot}{SAVER_SLOT}")), dimension)


TILED_SLOT = " +tiled"
SAVER_SLOT = " +savers"


def auto_savers(spec: ModelSpec, hw: Hardware, strategy: Strategy, req: Request) -> list[dict[str, bool]]:
    """The memory savers the planner tries by itself for `strategy`, least intrusive first, as Job changes: Liger
    kernels, activation offloading, both; each only where the request leaves it off and the engines and the model
    take it (job_problem, model_feature_problem: not pipeline stages, Liger not on model types it is not modelled
    for). Not with --tiled (tiling is modelled without either). Per-op selective checkpointing is
    not tried: no runner applies it (toolkit.inputs.job.OP_CHECKPOINTING_PROBLEM)."""
    if req.tiled or not req.savers:
        return []

    def takes(liger: bool, offloading: bool) -> bool:
        return job_problem(req.precision, hw.gpu, strategy, activation_offloading=offloading, liger=liger,
                           adapter=req.adapter, dpo=req.dpo, grpo=req.grpo) is None \
            and model_feature_problem(spec, liger=liger) is None

    liger = not req.liger and takes(True, req.activation_offloading)
    offloading = not req.activation_offloading and takes(req.liger, True)
    return ([{"liger": True}] if liger else []) + ([{"activation_offloading": True}] if offloading else []) \
        + ([{"liger": True, "activation_offloading": True}] if liger and offloading and takes(True, True) else [])


def _activations_decide(memory: Breakdown) -> bool:
    """Whether the GPU would hold the rest without the activations and the peak's temporaries (and the allocator's
    margin on them): all that tiling can take away. Model states, engine buffers and the context it leaves; when
    they alone are over the capacity, no tiling fits and none is traced."""
    rest = memory.required_bytes - memory.activations_bytes - memory.transient_bytes - memory.margin_bytes
    return rest <= memory.capacity_bytes


def auto_tiling(spec: ModelSpec, strategy: Strategy, req: Request) -> bool:
    """Whether the planner tries `strategy` tiled by itself: the request leaves tiling to it (Request.tiled None) and
    the engines and the model take it (the rules --tiled is refused by: toolkit.inputs.job.tiled_problem and
    model_feature_problem)."""
    if req.tiled is not None or req.loss != "model" or req.dpo or req.grpo:  # TRL's chunked heads (NLL, DPO, GRPO)
        return False  # replace the tiled logits + loss, and dpo_problem / grpo_problem refuse --tiled
    from toolkit.inputs.job import tiled_problem

    return tiled_problem(strategy, liger=req.liger, adapter=req.adapter) is None \
        and model_feature_problem(spec, tiled=True) is None


def prefer_untiled(plain: Candidate | None, tiled: Candidate | None) -> Candidate | None:
    """The untiled candidate unless it does not fit and the tiled one does, or the tiled one is faster by more than
    the step-time band (tiling adds recompute and DeepSpeed's tiled code path: within the band, untiled is the simpler
    and more robust). Neither fitting: the one closer to fitting (it explains best)."""
    if plain is None or tiled is None:
        return plain or tiled
    if plain.feasible and tiled.feasible:
        faster, slower = tiled.timing.tokens_per_s, plain.timing.tokens_per_s
        return tiled if faster > slower and not tiled.time_band.ties(faster, slower) else plain
    if plain.feasible != tiled.feasible:
        return plain if plain.feasible else tiled
    return plain if need_bytes(plain) <= need_bytes(tiled) else tiled


def _untiled_unless_needed(best: dict[str, Candidate]) -> dict[str, Candidate]:
    """One candidate per slot: each "<slot> +tiled" folded into its slot by prefer_untiled, then each
    "<slot> +savers" where it fits and the slot does not, or is faster beyond the step-time band (a saver row that
    does not fit either never replaces the slot's own reason)."""
    out = {k: c for k, c in best.items() if not k.endswith((TILED_SLOT, SAVER_SLOT))}
    for k, c in best.items():
        if k.endswith(TILED_SLOT):
            base = k[: -len(TILED_SLOT)]
            out[base] = prefer_untiled(out.get(base), c)
    for k, c in best.items():
        if k.endswith(SAVER_SLOT) and c.feasible:
            base = k[: -len(SAVER_SLOT)]
            out[base] = prefer_untiled(out.get(base), c)
    return out


def _compile_options(strategy: Strategy, grid: ParallelGrid, req: Request) -> list[bool]:
    """Eager always; with --compile also compiled, where the engines compose with compile
    (toolkit.inputs.job.compile_problem) and the grid has no model-parallel degree (the compiled trace is of the
    whole model on one rank, without the expert-parallel token dispatch)."""
    from toolkit.inputs.job import compile_problem

    if not req.compile or grid.model_parallel > 1 or grid.expert > 1 or req.tiled or req.loss != "model":  # tiled: modelled eager only (tiled_problem)
        return [False]
    problem = compile_problem(strategy, activation_offloading=req.activation_offloading, liger=req.liger,
                              adapter=req.adapter, attention=req.attention)
    return [False] if problem else [True, False]


MODEL_PARALLEL_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tp", ("fsdp2", "fsdp2-hybrid")), ("cp", ("fsdp2",)), ("sp", ("zero3", "zero2", "zero1")))
"""Which data-parallel strategies each model-parallel dimension runs under (toolkit.inputs.grid: accelerate's
ParallelismConfig rules): FSDP2 x TP (HSDP across nodes), FSDP2 x CP, ZeRO x Ulysses SP."""


def _model_parallel_options(spec: ModelSpec, hw: Hardware, req: Request, sequence_rule: bool = True):
    """(dimension, strategy, grids or the reason there are none) for every model-parallel family the request
    allows. Degrees the user fixed are tried alone; otherwise every degree the grid's rules admit."""
    fixed = {"tp": req.tensor_parallel, "cp": req.context_parallel, "sp": req.sequence_parallel}
    attention = spec.effective_attention(req.attention)
    for dimension, names in MODEL_PARALLEL_FAMILIES:
        if fixed[dimension] == 1 or req.adapter.is_adapter or req.images_per_sample \
                or (req.activation_offloading and dimension == "tp"):
            continue  # rank_view refuses these: not modelled per rank
        if any(v not in (None, 1) for d, v in fixed.items() if d != dimension):
            continue  # a degree fixed for another dimension: plan that one alone
        for name in names:
            if name not in req.strategies:
                continue
            strategy = parse_strategy(name)
            if strategy.fsdp_mode == "hybrid" and hw.nodes < 2:
                continue
            problem = job_problem(req.precision, hw.gpu, strategy, liger=req.liger, compile=req.compile,
                                  attention=req.attention, tiled=req.tiled is True, dpo=req.dpo,
                                  grpo=req.grpo, loss=req.loss, activation_offloading=req.activation_offloading) \
                or (MODEL_PARALLEL_DPO_PROBLEM if req.dpo else MODEL_PARALLEL_GRPO_PROBLEM if req.grpo else None)
            if problem:
                yield dimension, strategy, problem
                continue
            degrees = [fixed[dimension]] if fixed[dimension] else \
                [d for d in range(2, hw.world_size + 1) if hw.world_size % d == 0]
            grids, problems = [], []
            for degree in degrees:
                try:
                    grid = ParallelGrid.for_strategy(strategy, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                                     **{_DEGREE_ARG[dimension]: degree})
                    grid.check_model(spec)
                    grid.check_sequence(req.seq_len if sequence_rule else grid.sequence_multiple(), attention, spec)
                except UserError as exc:
                    problems.append((degree, str(exc)))
                    continue
                grids.append(grid)
            yield dimension, strategy, grids or _degree_problems(problems)


_DEGREE_ARG = {"tp": "tensor", "cp": "context", "sp": "sequence"}


def _degree_problems(problems: list[tuple[int, str]]) -> str:
    """Why no degree of a dimension runs: the first and the last degree's reasons, or one reason when every degree
    tried fails for the same one (a model-level reason, e.g. the model's attention)."""
    same = {message.replace(f" {degree} ", " N ") for degree, message in problems}
    if len(same) == 1 and len(problems) > 1:
        return f"{problems[0][1]} (the same for every degree tried: {', '.join(str(d) for d, _ in problems)})"
    return "; ".join(dict.fromkeys(message for _, message in problems[:1] + problems[-1:]))


def _check_stages(strategies: list[Strategy], hw: Hardware, stages: int | None) -> None:
    """--pipeline-stages against the GPUs, by the grid's rule that estimate applies (the same refusal and exit
    code in every command): refused when no pipeline strategy asked for can take that stage count."""
    if stages is None:
        return
    problems = []
    pipelines = [s for s in strategies if s.is_pipeline]
    for strategy in pipelines:
        try:
            ParallelGrid.for_strategy(strategy, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                      pipeline_stages=stages)
        except UserError as exc:
            problems.append(str(exc))
    if pipelines and len(problems) == len(pipelines):
        raise UserError(problems[0])


def refusal(strategy: Strategy, req: Request, hw: Hardware, reason: str, *, dimension: str | None = None) -> Candidate:
    """A row that cannot run, with the reason."""
    job = req.job(micro_batch=req.micro_batch or 1, grad_accum=req.grad_accum or 1)
    return Candidate(strategy=strategy, job=job, pipeline_stages=1, data_parallel=hw.world_size,
                     global_batch=req.global_batch or 0, reason=reason, dimension=dimension, gpu=hw.gpu)


def to_plan(c: Candidate, spec: ModelSpec, hw: Hardware, model_name: str, *, why: str | None = None,
            run=None) -> "Plan":
    """The chosen candidate as the Plan that emit, launch and train read, its prediction keyed to its inputs.
    `why`: the ranking's reason it is #1 (why_first), kept in the plan's notes. `run`: the data to time
    (toolkit.estimate.duration.RunSize), kept as predicted["time_to_train"]."""
    from toolkit.plan.build import build_plan

    predicted = _prediction(c)
    if c.timing and run is not None:
        from toolkit.estimate.duration import duration

        predicted["time_to_train"] = duration(run, c, hw.world_size).to_dict()
    notes = list(c.memory.notes) if c.memory else []
    if c.timing:
        notes += list(c.timing.assumptions)
    if c.timing:
        notes.append(f"step-time band: {c.time_band.text()}")
    if c.memory:
        notes.append(f"peak error band: {c.peak_band.text()}")
    if why:
        notes.append(f"ranking: {why}")
    plan = build_plan(
        model=model_name, model_config=_jsonable(spec.config_dict()), model_type=spec.model_type,
        layer_class=spec.layer_class, num_layers=spec.num_layers, params=spec.params, strategy=c.strategy,
        grid=c.grid, job=c.job, gpu=hw.gpu.name, partition=c.partition, moe_block=spec.moe_block,
        notes=[n.replace("\n", " ") for n in notes], attention=spec.effective_attention(c.job.attention),
        inter_node_gbps=hw.inter_node_gbps, cpu_ram_gib=hw.cpu_ram_bytes_per_node / GIB,
        power_limit_w=hw.gpu.power_limit_w or None,
        **({"rope_scaling": dict(spec.rope_scaling)} if spec.rope_scaling else {}),
        **({"model_parts": spec.parts()} if spec.multimodal else {}), **_adapter_fields(c.job, spec))
    return plan.with_prediction(predicted)


def _prediction(c: Candidate) -> dict[str, Any]:
    """A plan's `predicted`: the candidate's memory terms, its step time and the band around that step time (None:
    no published run backs the engine at this scale), which a run's measured step is held against."""
    from toolkit.estimate.duration import step_time_band

    predicted: dict[str, Any] = {}
    if c.memory:
        predicted.update(c.memory.to_dict())
    if c.timing:
        predicted.update(c.timing.to_dict())
        predicted["step_time_band"] = step_time_band(c)
        if c.gpu is not None and c.gpu.name == CPU_NAME:  # the CPU measured: a run elsewhere is not held to it
            predicted.update(cpu_model=cpu_rates().model, cpu_threads=cpu_rates().threads)
    return predicted


def predict_plan(plan: "Plan") -> "Plan":
    """The plan with its memory and step-time prediction recomputed from its own fields (after an edit)."""
    from toolkit.plan.job import plan_job

    spec, hw, job = plan_job(plan)
    strategy = plan.strategy_spec
    c = evaluate(spec, hw, strategy, job, plan.grid, plan.partition)
    predicted = _prediction(c)
    if c.reason:
        predicted["does_not_fit"] = c.reason
    return plan.with_prediction(predicted)


def _adapter_fields(job: Job, spec: ModelSpec) -> dict[str, Any]:
    """plan.json's count of trainable parameters (PEFT's), for an adapter job; the method and its settings are the
    job's own fields (toolkit.plan.job.job_to_plan_fields)."""
    if not job.adapter.is_adapter:
        return {}
    from toolkit.inputs.lora import counts_for_spec

    return {"trainable_params": counts_for_spec(spec, job.adapter).trainable_params}


def _jsonable(obj: Any) -> Any:
    import json

    return json.loads(json.dumps(obj, default=str))


def candidate_named(choice: str, candidates: list[Candidate], flag: str = "--choose") -> Candidate:
    """A row as the plan table prints its name (`zero3 (dp=2 x sp=4) +tiled`, spaces and case aside), or a
    strategy name (`zero3`: its plain row, else its first row): `plan --choose` and toolkit.api's PlanResult.
    Refused, with the names it takes, when it names no row or a row that cannot run."""
    from toolkit.inputs.strategy import parse_strategy

    def norm(name: str) -> str:
        return " ".join(name.lower().replace("(", " (").replace(")", ") ").split())

    match = [c for c in candidates if norm(c.name) == norm(choice)]
    if not match:
        try:
            wanted = parse_strategy(choice).name
        except UserError:
            wanted = None
        match = [c for c in candidates if c.strategy.name == wanted and c.dimension is None] or \
            [c for c in candidates if c.strategy.name == wanted]
    runnable = [c.name for c in candidates if c.feasible]
    names = "; ".join(runnable[:12]) + (f"; ... {len(runnable) - 12} more" if len(runnable) > 12 else "")
    if not match:
        raise UserError(f"{flag} {choice!r} names no row of this plan; give a row's name as the table prints it "
                        f"or a strategy: {names or 'no row fits'}")
    if not match[0].feasible:
        raise UserError(f"{flag} {match[0].name} cannot run: {match[0].reason}"
                        + (f"; rows that can: {names}" if runnable else ""))
    return match[0]
