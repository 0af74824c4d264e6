"""Per-GPU memory of one training step: model states (toolkit.estimate.states) + traced activations
(toolkit.estimate.traces), composed phase by phase. The peak is the highest live total over the phases of a
steady-state step, not a sum of every component:

  forward   states + grads kept while accumulating + saved activations so far + the region's temporaries
  backward  regions in reverse: what is still saved + gradients produced so far + the region's backward temporaries
  step      states + all gradients + optimizer-step temporaries

Every term carries where it came from, so `--explain` can show it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from toolkit.estimate.activations import ActivationTrace, RegionTrace
from toolkit.errors import UserError
from toolkit.inputs.choices import DTYPE_BYTES, GIB, compute_bytes, weight_bytes
from toolkit.inputs.hardware import Hardware
from toolkit.inputs.grid import ParallelGrid, grid_of
from toolkit.estimate.hostram import host_ram
from toolkit.estimate.reward import reward_weights_bytes, with_reward
from toolkit.inputs.job import Job, checkpointing_words
from toolkit.inputs.modelspec import ModelSpec
from toolkit.inputs.spreduce import zero_reduce_bytes
from toolkit.estimate.savers import layer_input_bytes, offload_layer_activations, optimizer_step_temporary_bytes
from toolkit.estimate.states import (States, adapter_states, ddp_states, expert_parallel_states, fsdp2_states,
                                     liger_head_gathered, pipeline_states, zero_states)
from toolkit.estimate.traces import scaled_trace
from toolkit.inputs.strategy import Engine, Strategy

from toolkit.estimate.breakdown import (  # noqa: F401  (the memory model's names, spelled once in breakdown)
    ALLOCATOR_MARGIN, CUDA_CONTEXT_BYTES, Breakdown, Term, reserved_bytes)
from toolkit.estimate.devicememory import device_terms
from toolkit.estimate.expertrows import BUSIEST_EXPERT_RANK, on_the_busiest_expert_rank  # noqa: F401  (its Term's name)


VISION_ACTIVATIONS = "  of which vision encoder"
"""The activations term's share an image-and-text job's vision tower keeps (its Term name)."""


# --------------------------------------------------------------------------------------------------------------
# Phase simulation


@dataclass
class _Region:
    name: str
    params: int
    trace: RegionTrace

    @property
    def is_layer(self) -> bool:
        return self.name.startswith("layer ")


def _regions(spec: ModelSpec, trace: ActivationTrace, first: int, last: int, with_embedding: bool,
             with_head: bool) -> list[_Region]:
    out = []
    if with_embedding:
        out.append(_Region("embedding", spec.pre_layer_params, trace.embedding))
    for i in range(first, last):
        out.append(_Region(f"layer {i}", spec.layer_params[i], trace.layers[i]))
    if with_head:
        out.append(_Region("head + loss", spec.post_layer_params, trace.head))
    return out


@dataclass
class _Peak:
    bytes: float = 0.0
    phase: str = ""
    transient: float = 0.0
    by_phase: dict[str, float] = field(default_factory=dict)
    """Each phase's own highest total ("backward (layer 3)" counts as "backward"), in the order first offered."""

    def offer(self, value: float, phase: str, transient: float) -> None:
        kind = phase.split(" (")[0] if phase.startswith(("forward (", "backward (")) else phase
        self.by_phase[kind] = max(self.by_phase.get(kind, 0.0), value)
        if value > self.bytes:
            self.bytes, self.phase, self.transient = value, phase, transient


def _simulate(regions: list[_Region], states: States, *, in_flight: int, accumulating: bool, autocast: bool,
              traced_grad_bytes_per_param: float, stash_bytes: float = 0.0, reference_bytes: float = 0.0,
              reference_forward_bytes: float = 0.0, reference_scoring_bytes: float = 0.0
              ) -> tuple[_Peak, float, float]:
    """Walk one micro-step forward and backward, then the optimizer step; return the peak, the activations
    held at the end of forward, and the autocast copies held.

    `in_flight` micro-batches' activations are alive at once (1F1B pipeline stage i: min(P - i, M)); the
    earlier ones add their saved bytes as a constant. A DPO reference's weights (`reference_bytes`) stay the whole
    step; its no_grad forward (`reference_forward_bytes`) runs once the policy's forward has saved everything. A GRPO
    reference's no_grad scoring (`reference_scoring_bytes`) runs first, beside what the step holds between steps.
    """
    persistent = states.persistent + reference_bytes
    step_grads_total = states.step_gradients
    kept_grads = (step_grads_total + states.accumulation_gradients + states.backward_gradients) if accumulating \
        else 0.0
    # Alive only once backward has started (and, for the gradient partitions, until the step).
    partition = 0.0 if accumulating else states.backward_gradients  # from its region's reduction (partition_region)
    saved_total = sum(r.trace.saved_bytes for r in regions)
    copies_total = sum(r.trace.autocast_copy_bytes for r in regions) if autocast else 0.0
    earlier = saved_total * (in_flight - 1) + stash_bytes
    # Step gradients appear region by region as backward reaches each one's parameters (full-size grads for DDP,
    # ZeRO-1 and pipeline stages; FSDP2's sharded grads after each reduce-scatter; none for ZeRO-2/3, whose
    # partitions are persistent buffers).
    region_params = sum(r.params for r in regions)
    grad_bytes_per_param = step_grads_total / region_params if region_params else 0.0
    grad_scale = grad_bytes_per_param / traced_grad_bytes_per_param
    peak = _Peak()
    if reference_scoring_bytes:
        from toolkit.estimate.preference import REFERENCE_SCORING_PHASE

        peak.offer(persistent - states.gathered + reference_scoring_bytes, REFERENCE_SCORING_PHASE,
                   reference_scoring_bytes)

    base = persistent + kept_grads + earlier
    # early: gradients made in forward (Liger's fused linear cross-entropy: the LM head's, in the traced parameter
    # dtype, which is the dtype the engine computes with), live until their region's backward.
    saved = copies = cache = early = 0.0
    for r in regions:
        extra = r.trace.forward_extra_bytes + (states.layer_transient if r.is_layer else 0.0)
        early += r.trace.forward_grad_bytes
        saved += r.trace.saved_bytes
        copies += r.trace.autocast_copy_bytes if autocast else 0.0
        # Weight casts autocast caches until the forward ends without saving them for backward (checkpointed layers).
        cache += r.trace.autocast_cache_bytes if autocast else 0.0
        peak.offer(base + saved + copies + cache + early + extra, f"forward ({r.name})", extra)
    if reference_forward_bytes:
        from toolkit.estimate.preference import REFERENCE_FORWARD_PHASE

        peak.offer(base + saved + copies + early + reference_forward_bytes, REFERENCE_FORWARD_PHASE,
                   reference_forward_bytes)

    grads_done, remaining, remaining_copies = 0.0, saved, copies
    for k, r in enumerate(reversed(regions)):
        extra = r.trace.backward_extra_bytes + (states.layer_transient if r.is_layer else 0.0)
        # Engine gradient buffers (ZeRO-2's partition and bucket, FSDP2's unsharded grads) appear once the first
        # region's weight gradients exist: after the loss/logits gradient peak of the head (measured on CPU).
        engine_now = states.backward_buffers + (partition if k >= states.partition_region else 0.0) if k else 0.0
        in_backward = states.backward_buffers + (partition if k >= states.partition_region else 0.0)
        # The region's weight gradients that exist at its backward peak, and all it creates, as traced (a tied
        # head creates the embedding matrix's gradient), scaled from the traced parameter dtype to the bytes of
        # gradient this engine creates per parameter.
        if r.trace.grad_bytes or r.trace.forward_grad_bytes:
            at_peak = r.trace.backward_grad_bytes * grad_scale
            created = (r.trace.grad_bytes + r.trace.forward_grad_bytes) * grad_scale
        else:
            at_peak, created = 0.0, r.params * grad_bytes_per_param
        # ZeRO-2's head gradient (whole, above the bucket) lives until the next hook copies it into the partition,
        # beside it; at the head's backward peak too where the trace has its weight gradient there (grad_scale is 0).
        held = states.head_gradient if k == 0 and r.name == "head + loss" else 0.0
        before = 0.0 if accumulating else grads_done + at_peak + (held if r.trace.backward_grad_bytes else 0.0)
        peak.offer(base + engine_now + remaining + remaining_copies + early + before + extra,
                   f"backward ({r.name})", extra)
        grads_done += created
        early -= r.trace.forward_grad_bytes
        after = 0.0 if accumulating else grads_done
        peak.offer(base + in_backward + remaining - r.trace.saved_bytes + remaining_copies + early + after + held,
                   f"backward ({r.name})", 0.0)
        remaining -= r.trace.saved_bytes
        remaining_copies -= r.trace.autocast_copy_bytes if autocast else 0.0

    # At the step, forward/backward are over: gathered parameters are resharded and no activations remain.
    step_live = persistent - states.gathered + step_grads_total + states.backward_gradients + states.step_transient
    peak.offer(step_live, "optimizer step", states.step_transient)
    return peak, saved_total * in_flight + stash_bytes, copies_total


def adapter_job_states(spec: ModelSpec, strategy: Strategy, job: Job, grid: ParallelGrid) -> States:
    from toolkit.inputs.lora import (base_storage_bytes_per_param, counts_for_spec, frozen_base_bytes,
                                     layer_sharded_base_bytes, saved_dtype_name, sharded_base_bytes)
    from toolkit.estimate.timing import data_parallel_gather_bytes

    if strategy.is_pipeline:
        raise UserError(f"{job.adapter.method} runs on the HF Trainer path (ddp, zero1/2/3, fsdp2 and their "
                        "offload variants), not the pipeline engine; choose one of those strategies")
    counts = counts_for_spec(spec, job.adapter)
    storage = base_storage_bytes_per_param(job.precision, job.adapter.base_dtype)
    compute = compute_bytes(job.precision)  # FSDP2 gathers base and adapters in MixedPrecisionPolicy's param_dtype
    layers, stored = (layer_sharded_base_bytes(counts, job.adapter, b, spec.layer_params) for b in (compute, storage))
    root_trainable = counts.pre_layer_trainable + counts.post_layer_trainable
    return adapter_states(
        counts.trainable_params, frozen_base_bytes(counts, job.adapter, storage), job, strategy,
        dp=grid.data_parallel, hidden=spec.hidden, total_params=counts.all_params,
        largest_layer=spec.largest_layer_params,
        base_sharded_bytes=sharded_base_bytes(counts, job.adapter, storage),
        gather_bytes=data_parallel_gather_bytes(counts, job),
        layer_gathered_bytes=max(b + t * compute for b, t in zip(layers, counts.per_layer)),
        root_gathered_bytes=(spec.pre_layer_params + spec.post_layer_params) * compute + root_trainable * compute,
        layer_stored_bytes=max(b + t * compute for b, t in zip(stored, counts.per_layer)),
        layer_trainable_params=max(counts.per_layer), root_trainable_params=root_trainable,
        shard=grid.shard_group, prefetch_layers=2 if job.device_kind == "cuda" else 1,
        dequantized_bytes=counts.largest_quantized_params * DTYPE_BYTES[job.adapter.compute_dtype],
        saved_params=counts.saved_module_params, saved_bytes_per_param=DTYPE_BYTES[saved_dtype_name(
            job.precision, job.adapter.base_dtype, job.adapter.saved_dtype)],
        load_warmup_bytes=counts.quantized_packed_bytes + counts.unquantized_frozen_params * storage)


def states_for(spec: ModelSpec, strategy: Strategy, job: Job, grid: ParallelGrid, *, params: int,
               rank: int | None = None) -> States:
    if job.adapter.is_adapter:
        return adapter_job_states(spec, strategy, job, grid)
    frozen = frozen_params(spec, job)
    params -= frozen
    s = _engine_states(spec, strategy, job, grid, params=params, rank=rank)
    if frozen:
        from toolkit.estimate.states import frozen_weight_bytes

        weights = frozen_weight_bytes(frozen, job, strategy, shard=grid.shard_group)
        s.parameters += weights
        if strategy.zero_stage == 3 and strategy.offload_params != "none":
            s.cpu += frozen * compute_bytes(job.precision) / grid.shard_group
        s.sources.insert(0, f"vision tower frozen: {frozen:,} parameters of weights only ({weights / GIB:.2f} GiB per "
                            "GPU), no gradients or optimizer states; the rest as the engine holds it")
    if strategy.engine in (Engine.DDP, Engine.FSDP2):  # torch's optimizer; DeepSpeed runs its own fused / CPU Adam
        shard = grid.shard_group
        state_bytes = weight_bytes(job.precision)
        # A rank's parameter group: params / shard, except under expert parallelism with a shared batch, where it
        # holds the dense modules whole (s.parameters counts the rank's own share either way).
        group = params / shard if grid.expert <= 1 else s.parameters / state_bytes
        extra = optimizer_step_temporary_bytes(
            impl=job.optimizer_impl, optimizer=job.optimizer, group_state_bytes=group * state_bytes,
            largest_param_state_bytes=spec.embedding_params * state_bytes / shard)
        if strategy.offloads:  # FSDP2's CPUOffloadPolicy: the step runs on the CPU parameters, its temporaries too
            s.cpu += extra
        else:
            s.step_transient += extra
    return s


def frozen_params(spec: ModelSpec, job: Job) -> int:
    """Parameters of a multimodal class that full fine-tuning leaves frozen (--vision-tower freeze): the vision
    encoder's and the projector's; 0 otherwise (LoRA freezes the whole base in adapter_job_states)."""
    if job.vision_tower != "freeze" or job.adapter.is_adapter:
        return 0
    return spec.vision_params + spec.projector_params


def _engine_states(spec: ModelSpec, strategy: Strategy, job: Job, grid: ParallelGrid, *, params: int,
                   rank: int | None = None) -> States:
    fe = int(params * spec.factored_state_fraction)
    dp = grid.data_parallel
    if strategy.engine == Engine.DDP:
        return ddp_states(params, job, world=grid.world, factored_elems=fe)
    if strategy.engine == Engine.DEEPSPEED:
        if grid.autoep:
            from toolkit.estimate.states import autoep_states

            return autoep_states(spec, params, job, strategy, grid=grid, factored_elems=fe, rank=rank)
        # ZeRO partitions over the sequence-data-parallel group: dp, times sp under Ulysses.
        from toolkit.estimate.zeropartition import zero_gradient_partition

        return zero_states(params, job, strategy, dp=grid.shard_group, hidden=spec.hidden,
                           largest_layer=spec.largest_layer_params, factored_elems=fe,
                           gradient_partition=zero_gradient_partition(spec, params, grid.shard_group, rank=rank)
                           if strategy.zero_stage == 2 else None, head_params=spec.head_matmul_params,
                           reduce_bytes=zero_reduce_bytes(job.precision, grid.sequence))
    if strategy.engine == Engine.FSDP2:
        # toolkit.train syncs every micro-batch under FSDP2 (sync_each_batch): no unsharded accumulation grads.
        if grid.expert > 1:
            return expert_parallel_states(spec, strategy, job, grid, params=params, factored_elems=fe)
        return fsdp2_states(params, job, strategy, shard=grid.shard_group, layer_params=max(spec.layer_params),
                            root_params=spec.pre_layer_params + spec.post_layer_params, accumulating=False,
                            factored_elems=fe, prefetch_layers=2 if job.device_kind == "cuda" else 1)
    return pipeline_states(params, job, dp=dp, factored_elems=fe)


def states_floor_bytes(spec: ModelSpec, strategy: Strategy, job: Job, hw: Hardware, *, pipeline_stages: int = 1,
                       partition: list[int] | None = None, grid: ParallelGrid | None = None) -> int:
    """A lower bound on the required bytes without tracing: persistent model states, a DPO / GRPO reference and a GRPO
    reward model, and the CUDA context. The planner refuses candidates above capacity on this alone, which saves
    their traces. `grid`: the grid to use (default: the strategy's plain grid on hw)."""
    grid = grid or grid_of(strategy, hw, pipeline_stages)
    if grid.tensor > 1:
        from toolkit.inputs.tensorplan import per_rank_spec

        spec = per_rank_spec(spec, grid.tensor)
    outside = device_terms(hw.gpu, grid)
    context = outside.context_bytes + outside.nccl_bytes
    params = max(grid.stage_params(spec, partition)) if strategy.is_pipeline else spec.params
    s = states_for(spec, strategy, job, grid, params=params)
    reference = 0
    if job.dpo is not None or job.grpo is not None:
        from toolkit.estimate.preference import reference_of

        ref = reference_of(spec, strategy, job, grid)
        reference = (ref.weights_bytes if ref is not None else 0) + reward_weights_bytes(strategy, job, grid)
    return int(s.parameters + s.gradients + s.master + s.optimizer) + reference + context


def estimate_memory(spec: ModelSpec, strategy: Strategy, job: Job, hw: Hardware, *, pipeline_stages: int = 1,
                    partition: list[int] | None = None, grid: ParallelGrid | None = None,
                    rank: int | None = None) -> Breakdown:
    """Per-GPU memory of `strategy` running `job` on `hw`. For pipeline plans every stage is computed and the
    breakdown of the stage that needs the most is returned (partition None: the grid's balanced one). `grid`:
    the grid to use, with its tensor / context / sequence degrees (default: the strategy's plain grid on hw).
    `rank`: that rank's own ZeRO-2 gradient partition (toolkit.estimate.zeropartition); None: the worst rank's."""
    grid = grid or grid_of(strategy, hw, pipeline_stages)
    b = _training_memory(spec, strategy, job, hw, pipeline_stages=pipeline_stages, partition=partition, grid=grid,
                         rank=rank)
    if job.grpo is None:
        return b
    from toolkit.estimate.grpo import generation_sequences, with_generation

    return with_generation(with_reward(b, strategy, job, grid, generation_sequences(job)), spec, strategy, job)


def _training_memory(spec: ModelSpec, strategy: Strategy, job: Job, hw: Hardware, *, pipeline_stages: int,
                     partition: list[int] | None, grid: ParallelGrid, rank: int | None = None) -> Breakdown:
    """estimate_memory's training step (GRPO's generation is added by its caller)."""
    reference = None
    if job.dpo is not None or job.grpo is not None:  # the policy's step (DPO: the concatenated batch), the reference
        from toolkit.estimate.preference import reference_of
        from toolkit.inputs.job import policy_job

        reference, job = reference_of(spec, strategy, job, grid), policy_job(job)
    if grid.model_parallel > 1:
        return _model_parallel_memory(spec, strategy, job, hw, grid)
    if job.adapter.is_adapter:
        from toolkit.inputs.lora import counts_for_spec

        # Counts first: they check the adapter against the model (one clear error for unknown target modules).
        counts = counts_for_spec(spec, job.adapter)
        states = adapter_job_states(spec, strategy, job, grid)
        trace = scaled_trace(spec, job, strategy)
        trace, offloaded = offload_layer_activations(trace, job, layer_input_bytes(spec, job))
        states.cpu += offloaded  # pinned host buffers per rank, one micro-batch at a time
        # Gradients exist only for the trainable parameters: regions carry those counts.
        regions = [_Region("embedding", counts.pre_layer_trainable, trace.embedding),
                   *(_Region(f"layer {i}", counts.per_layer[i], trace.layers[i]) for i in range(spec.num_layers)),
                   _Region("head + loss", counts.post_layer_trainable, trace.head)]
        return _compose(spec, strategy, job, hw, trace, regions, states, in_flight=1, reference=reference, grid=grid)
    trace = scaled_trace(spec, job, strategy)
    if not strategy.is_pipeline:
        trace, offloaded = offload_layer_activations(trace, job, layer_input_bytes(spec, job))
        states = states_for(spec, strategy, job, grid, params=spec.params, rank=rank)
        if grid.expert > 1 and grid.shard_group > 1 and not grid.autoep:  # transformers' own FSDP2 groups (distributed/fsdp.py)
            from toolkit.inputs.moe import ep_gathered_layer_params
            from toolkit.inputs.tensorplan import tensor_split

            layers = [ep_gathered_layer_params(spec, grid.expert) if p == max(spec.layer_params) else p
                      for p in spec.layer_params]
            trace = _fsdp_plan_groups(spec, tensor_split(spec, 1).rank_kept_outside_params, layers, trace, states,
                                      job)
        regions = _regions(spec, trace, 0, spec.num_layers, True, True)
        states.cpu += offloaded  # pinned host buffers per rank, one micro-batch at a time
        out = _compose(spec, strategy, job, hw, trace, regions, states, in_flight=1, reference=reference, grid=grid)
        if grid.expert <= 1:
            return out
        from toolkit.estimate.experttime import expert_rows_per_rank

        return on_the_busiest_expert_rank(out, spec, job, expert_rows_per_rank(spec, job, grid))
    if job.activation_offloading:
        raise UserError("activation offloading is not available with the pipeline engine; use a ZeRO or FSDP2 "
                        "strategy, or drop --activation-offloading")

    bounds = partition if partition is not None else grid.partition(spec)
    stage_params = grid.stage_params(spec, bounds)
    breakdowns = []
    stages = len(bounds) - 1
    for i in range(stages):
        first, last = bounds[i], bounds[i + 1]
        regions = _regions(spec, trace, first, last, i == 0, i == stages - 1)
        tied_copy = stage_params[i] - sum(r.params for r in regions)
        if tied_copy:  # TiedLayerSpec: the last stage holds its own copy of the tied matrix
            regions[-1] = _Region(regions[-1].name, regions[-1].params + tied_copy, regions[-1].trace)
        states = states_for(spec, strategy, job, grid, params=stage_params[i])
        in_flight = max(1, min(stages - i, job.grad_accum))
        breakdowns.append(_compose(spec, strategy, job, hw, trace, regions, states, in_flight=in_flight,
                                   stage=i, grid=grid))
    worst = max(breakdowns, key=lambda b: b.required_bytes)
    return replace(worst, stage_required_bytes=tuple(b.required_bytes for b in breakdowns))


def _model_parallel_memory(spec: ModelSpec, strategy: Strategy, job: Job, hw: Hardware,
                           grid: ParallelGrid) -> Breakdown:
    """One rank of a tensor / context / sequence-parallel grid: the trace and the states at the per-rank shapes
    (toolkit.estimate.dimensions), with the communication buffers tracing cannot see."""
    from toolkit.estimate.dimensions import apply_to_trace, rank_view

    view = rank_view(spec, job, grid)
    trace = apply_to_trace(scaled_trace(view.spec, view.job, strategy), view, job.checkpointing)
    # a rank moves its own tokens' saves (rank_view)
    trace, offloaded = offload_layer_activations(trace, job, layer_input_bytes(view.spec, view.job))
    states = states_for(view.spec, strategy, view.job, grid, params=view.spec.params)
    states.cpu += offloaded  # pinned host buffers per rank, one micro-batch at a time
    if view.fsdp_kept_outside_params is not None and strategy.engine == Engine.FSDP2 \
            and strategy.fsdp_mode != "grad_op" and not view.fsdp_layers_kept:
        trace = _fsdp_plan_groups(view.spec, view.fsdp_kept_outside_params, view.spec.layer_params, trace, states,
                                  job)
    regions = _regions(view.spec, trace, 0, view.spec.num_layers, True, True)
    out = _compose(view.spec, strategy, view.job, hw, trace, regions, states, in_flight=1, grid=grid)
    terms = list(out.terms)
    where = next(i for i, t in enumerate(terms) if t.name == "activations")
    terms[where] = Term("activations", terms[where].bytes,
                        terms[where].source + f"; one rank's share: {grid.describe()}, {view.job.seq_len} of "
                        f"{job.seq_len} tokens per sample")
    extra = [Term(f"  {name} (per layer)", n, source) for name, n, source in view.terms]
    return replace(out, terms=tuple(terms[:where + 2] + extra + terms[where + 2:]),
                   notes=tuple(dict.fromkeys(view.notes + out.notes)))


def _fsdp_plan_groups(spec: ModelSpec, kept_outside_params: int, layer_params, trace: ActivationTrace,
                      states: States, job: Job) -> ActivationTrace:
    """FSDP2 as transformers wraps a tensor-parallel model (distributed/fsdp.py apply_fully_sharded_data_parallelism,
    from the model's fsdp_plan), instead of the root-holds-the-rest wrapping `fsdp2_states` models: the
    keep_full_weight modules outside the layers (final norm + LM head) are one group, unsharded from the head's
    forward to the end of its backward (resharded there, as every group is: reshard_after_backward,
    _fsdp_param_group.py post_backward), so not while the layers' backward runs; every layer and the embedding
    are their own groups, resharded after forward (and after backward), so a layer's or the embedding's unsharded
    parameters exist only while that region computes.
    In forward FSDP2 also holds each group's all-gather output until the next group's all-gather has been copied
    out or the root's forward ends (_fsdp_param_group.py wait_for_unshard, all_gather_state): one more copy of the
    group being computed, the head's included. Moves those bytes from the constant `gathered` into the regions.
    `kept_outside_params`: one rank's keep_full_weight parameters outside the layers; `layer_params`: what each
    layer unshards (under expert parallelism its dense part and the rank's own experts, their own group on efsdp)."""
    per_param = compute_bytes(job.precision)  # unsharded in the compute dtype, as fsdp2_states
    prefetch = 2 if job.device_kind == "cuda" else 1
    kept = kept_outside_params * per_param
    embedding = max(0, spec.pre_layer_params + spec.post_layer_params - kept_outside_params) * per_param
    states.gathered = 0.0  # every group, the tail too, is resharded after its backward (FSDP2's post_backward)
    states.fsdp_plan_groups = True
    states.sources[:] = [x.replace("layer(s) + root", "layer(s) while it computes + the fsdp_plan's "
                                   "keep_full_weight modules (transformers' FSDP2 groups)") for x in states.sources]

    def grow(r: RegionTrace, unsharded: int, buffer: int) -> RegionTrace:
        return replace(r, forward_extra_bytes=r.forward_extra_bytes + unsharded + buffer,
                       backward_extra_bytes=r.backward_extra_bytes + unsharded)

    layers = tuple(grow(r, prefetch * p * per_param, p * per_param) for r, p in zip(trace.layers, layer_params))
    return replace(trace, embedding=grow(trace.embedding, embedding, embedding), layers=layers,
                   head=grow(trace.head, kept, kept))


def _allocator_margin(regions: list[_Region], states: States, strategy: Strategy, job: Job, peak: int, *,
                      in_flight: int, reference_bytes: int = 0, spec: ModelSpec | None = None,
                      hw: Hardware | None = None, grid: ParallelGrid | None = None) -> tuple[int, Term]:
    """Reserved over the tensor peak: the step's events replayed through the caching-allocator model, or the
    assumed margin where the events are not recorded."""
    from toolkit.estimate.allocator import modelled_conf
    from toolkit.estimate.engineevents import ROOT_REGIONS
    from toolkit.estimate.reserved import StepSizes, replayed_reserved, tensor_sizes
    from toolkit.estimate.timing import zero3_release_timing

    conf, ignored = modelled_conf(job.allocator_conf)
    setting = (f" with PYTORCH_CUDA_ALLOC_CONF={conf}" if conf else " with torch's default settings") + (
        f" ({', '.join(ignored)} not modelled)" if ignored else "")
    result = None
    # The engine's own allocations (toolkit.estimate.engineevents) for FSDP2 and ZeRO-3 of a full model, states on the
    # GPU, one expert group; FSDP2's groups unsharded in the compute dtype, kept from their forward on: the root, every
    # group under grad_op; under TP's fsdp_plan groups (no root) the head's, to its own post_backward.
    plain = not job.adapter.is_adapter and not strategy.offloads and (grid is None or grid.expert <= 1)
    plan_groups = states.fsdp_plan_groups and plain
    fsdp2 = strategy.engine == Engine.FSDP2 and (states.gathered > 0 or plan_groups) and not job.adapter.is_adapter
    kept = () if not fsdp2 else (len(regions) - 1,) if plan_groups else \
        tuple(i for i, r in enumerate(regions) if strategy.fsdp_mode == "grad_op" or r.name in ROOT_REGIONS)
    engine = "fsdp2" if fsdp2 and plain else \
        "zero3" if strategy.zero_stage == 3 and states.flat_partitions and plain else ""
    if in_flight == 1:
        release = zero3_release_timing(spec, strategy, job, hw, grid) if engine == "zero3" else {}
        sizes = StepSizes(**tensor_sizes(spec, regions, strategy, job, states), **release, engine=engine,
            world=grid.shard_group if grid is not None else 1, param_bytes=compute_bytes(job.precision),
            reduce_bytes=zero_reduce_bytes(job.precision, grid.sequence if grid is not None else 1),
            bucket_elements=int(job.zero_reduce_bucket or (spec.hidden * spec.hidden if spec else 0)),
            gather_bytes_per_param=compute_bytes(job.precision) if fsdp2 else 0.0, kept_regions=kept, fsdp_root=not plan_groups,
            persistent=states.parameters + states.master + states.gradients + states.buffers + reference_bytes,
            optimizer=states.optimizer, gathered=states.gathered, held_gathered=states.held_gathered,
            reduce_buffers=states.backward_buffers,
            reduce_stream=strategy.engine == Engine.FSDP2, step_gradients=states.step_gradients,
            backward_gradients=states.backward_gradients, step_transient=states.step_transient, loaded=states.loaded,
            load_warmup=min(states.load_warmup, max(0, hw.gpu.memory_bytes - 1.2 * GIB)))  # transformers' own cap
        result = replayed_reserved(regions, sizes, settings=conf)
    if result is None:
        margin = reserved_bytes(peak) - peak
        return margin, Term("allocator margin", margin,
                            f"assumed {ALLOCATOR_MARGIN:.0%} of the tensor peak: this step's allocation events are "
                            "not recorded (a region traced compiled, activations offloaded, several micro-batches in "
                            "flight, or traces that differ)")
    return result.overhead, Term(
        "allocator (replayed)", result.overhead,
        f"caching-allocator segments above the tensor peak: two steps' {result.events} allocation events (the "
        "traced regions' storages, model states, engine buffers on their streams) replayed through "
        f"toolkit.estimate.allocator: reserved {result.peak_reserved / GIB:.2f} GiB over allocated "
        f"{result.peak_allocated / GIB:.2f} GiB in {result.segments} segments{setting}")


def _compose(spec: ModelSpec, strategy: Strategy, job: Job, hw: Hardware, trace: ActivationTrace,
             regions: list[_Region], states: States, *, in_flight: int, stage: int | None = None,
             reference=None, grid: ParallelGrid | None = None) -> Breakdown:
    accumulating = job.grad_accum > 1  # micro-steps after the first add into gradients that already exist
    traced_grad = 4.0 if (trace.autocast or trace.dtype == "float32") else 2.0
    liger_head_gathered(states, spec, strategy, job)
    ref_weights = reference.weights_bytes if reference else 0
    ref_forward = reference.forward_bytes(trace) if reference else 0
    ref_scoring = 0
    if reference is not None and reference.scores_first:  # GRPO; the adapter-disabled policy gathers as it trains
        ref_scoring = reference.working_bytes(trace) + (0 if reference.weights_bytes else states.gathered)
    peak, activations, copies = _simulate(regions, states, in_flight=in_flight, accumulating=accumulating,
                                          autocast=states.autocast, traced_grad_bytes_per_param=traced_grad,
                                          reference_bytes=ref_weights, reference_forward_bytes=ref_forward,
                                          reference_scoring_bytes=ref_scoring)
    outside = device_terms(hw.gpu, grid if grid is not None else grid_of(strategy, hw))
    context = outside.context_bytes + outside.nccl_bytes
    # cuBLAS's workspaces are allocated through the caching allocator for the whole run: allocated and reserved
    # alike (each is its own large-pool segment, a multiple of 2 MiB, so the replay's overhead is unchanged).
    workspace = outside.workspace_bytes if job.device_kind == "cuda" else 0
    margin, margin_term = _allocator_margin(regions, states, strategy, job, int(peak.bytes), in_flight=in_flight,
                                            reference_bytes=ref_weights, spec=spec, hw=hw,
                                            grid=grid if grid is not None else grid_of(strategy, hw))
    head_saved = sum(r.trace.saved_bytes for r in regions if r.name == "head + loss")
    required = int(peak.bytes) + workspace + context + margin
    grads = states.gradients + states.step_gradients + states.backward_gradients \
        + (states.accumulation_gradients if accumulating else 0)
    terms = [
        Term("parameters", int(states.parameters), "; ".join(states.sources[:1]) or "model weights"),
        Term("gradients", int(grads), "gradient buffers that exist at the peak (see sources)"),
        Term("optimizer + master", int(states.optimizer + states.master),
             f"{job.optimizer} states{' + fp32 master partition' if states.master else ''}"),
        Term("activations", int(activations),
             f"traced {spec.model_type} under FakeTensorMode ({trace.dtype}{', autocast' if trace.autocast else ''}, "
             f"{trace.attention}, {trace.device_kind} kernels, micro-batch {trace.micro_batch}"
             f"{checkpointing_words(job.checkpointing)}"
             f"{', tiled MLP: each layer keeps its MLP input, the FFN-wide tensors exist one chunk at a time' if job.tiled else ''}"
             f") x {in_flight} in flight"
             f"{'; vision encoder + projector traced alone, in the embedding region' if job.images_per_sample else ''}"),
        Term("  of which head + loss", int(head_saved),
             "final norm and the hidden states and labels the tiled logits + loss keeps for backward (its logits and "
             "fp32 log-softmax exist one chunk at a time, in forward and again in backward: peak-phase temporaries)"
             if job.tiled else
             "final norm, LM head and loss (fp32 log-softmax over the vocabulary) saved for backward"),
        Term("autocast weight copies", int(copies), "bf16/fp16 copies of weights autocast keeps for backward"),
        Term("engine buffers", int(states.buffers + states.backward_buffers + states.gathered),
             "buckets / gathered parameters (" + (", ".join(states.sources[1:])
                                                   or "the engine's rule on the parameters line") + ")"),
        Term("peak-phase temporaries", int(peak.transient), f"live only at the peak: {peak.phase}"),
        Term("cuBLAS workspaces", workspace, outside.workspace_source),
        margin_term,
        Term("CUDA context", outside.context_bytes, outside.context_source),
        Term("NCCL buffers", outside.nccl_bytes, outside.nccl_source),
    ]
    if trace.vision_bytes:
        where = next(i for i, t in enumerate(terms) if t.name == "  of which head + loss")
        terms.insert(where + 1, Term(VISION_ACTIVATIONS, int(trace.vision_bytes * in_flight),
                                     f"vision encoder + projector saved for backward: {job.images_per_sample} image(s) "
                                     f"of {job.image_size} per sample x micro-batch {job.micro_batch}, traced alone "
                                     "(toolkit.estimate.visiontower)"))
    forward_grads = sum(r.trace.forward_grad_bytes for r in regions)
    if forward_grads:
        terms.insert(5, Term("LM-head gradient made in forward", int(forward_grads),
                             "Liger's fused linear cross-entropy computes it chunk by chunk in forward and holds it "
                             "until backward (toolkit.patches.liger); part of the peak from the head's forward on"))
    if reference is not None:
        from toolkit.estimate.preference import reference_terms

        terms[3:3] = [Term(*t) for t in reference_terms(reference, ref_forward, ref_scoring)]
    ranks_per_node = hw.gpus_per_node
    notes = list(trace.notes) + list(spec.notes)
    if stage is not None:
        notes.insert(0, f"pipeline stage {stage}: {len(regions)} region(s), {in_flight} micro-batch(es) in flight")
    return Breakdown(
        parameters_bytes=int(states.parameters),
        gradients_bytes=int(grads),
        optimizer_bytes=int(states.optimizer + states.master),
        activations_bytes=int(activations),
        logits_loss_bytes=int(head_saved),
        autocast_copy_bytes=int(copies),
        buffers_bytes=int(states.buffers + states.backward_buffers + states.gathered),
        transient_bytes=int(peak.transient),
        peak_bytes=int(peak.bytes) + workspace,
        peak_phase=peak.phase,
        phase_peaks=tuple((name, int(b) + workspace) for name, b in peak.by_phase.items()),
        context_bytes=context, margin_bytes=margin, required_bytes=required, capacity_bytes=hw.gpu.memory_bytes,
        cpu_bytes_per_node=int(states.cpu * ranks_per_node),
        nvme_bytes_per_node=int(states.nvme * ranks_per_node),
        host=host_ram(params=spec.params, largest_layer_params=spec.largest_layer_params, strategy=strategy, job=job,
                      gpus_per_node=ranks_per_node, world=hw.world_size,
                      resident_bytes_per_node=int(states.cpu * ranks_per_node),
                      stage_params=sum(r.params for r in regions) if strategy.is_pipeline else None),
        terms=tuple(terms),
        notes=tuple(dict.fromkeys(notes)),
        reference_bytes=ref_weights,
        nccl_bytes=outside.nccl_bytes,
        workspace_bytes=workspace, allocator_conf=job.allocator_conf,
        # none gathered between steps (benchmarks/results/rl_distributed_memory.md)
        between_steps_bytes=int(states.persistent - states.gathered + ref_weights), gathered_bytes=int(states.gathered),
    )
