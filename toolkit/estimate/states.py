"""Model states: the bytes each engine really holds per parameter, and where (GPU, CPU, NVMe).

One function per engine family, each citing the engine source it follows (DeepSpeed 0.19, torch 2.13,
transformers 5.2x, accelerate 1.15). Inputs are counts, outputs are bytes; nothing here imports torch.

Notation: P = parameters this rank's model part holds (a pipeline stage's, or the whole model), N = the degree
the states are sharded over (data-parallel ranks; FSDP hybrid: GPUs per node).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolkit.inputs.choices import GIB, compute_bytes, weight_bytes
from toolkit.inputs.job import Job
from toolkit.inputs.strategy import Engine, Strategy

# Optimizer state bytes per parameter when states are fp32 (torch keeps states in the parameter dtype, so
# bf16-pure halves them). adamw-8bit: bitsandbytes blockwise 8-bit exp_avg and exp_avg_sq (1 byte each) plus one
# fp32 absmax per 256-element block per state; adafactor: factored second moment, no first moment (HF defaults).
_STATE_BYTES_FP32 = {"adamw": 8.0, "adamw-8bit": 2.0 + 2 * 4 / 256, "sgd": 4.0, "adafactor": 0.0}


def optimizer_state_bytes(params: int, job: Job, factored_elems: int | None = None, *,
                          param_bytes: int | None = None) -> float:
    """Optimizer states of `params` parameters (no master weights) held in `param_bytes` per element (default: the
    job's weights, weight_bytes)."""
    param_bytes = weight_bytes(job.precision) if param_bytes is None else param_bytes
    if job.optimizer == "adafactor":
        # Row + column statistics per matrix, full second moment for vectors (~ (r + c) / (r x c) of params).
        elems = factored_elems if factored_elems is not None else params * 0.002
        return elems * param_bytes
    per = _STATE_BYTES_FP32[job.optimizer]
    if job.optimizer in ("adamw", "sgd"):
        per *= param_bytes / 4
    return params * per


@dataclass
class States:
    """Per-rank model-state bytes by component, plus what lives off the GPU."""

    parameters: float = 0.0
    """Weights the GPU holds for compute (bf16/fp16 copies for DeepSpeed mixed precision, fp32 for AMP)."""
    gradients: float = 0.0
    """Gradient bytes that persist across steps (partition buffers)."""
    step_gradients: float = 0.0
    """Gradient bytes created by backward and freed after the optimizer step (param.grad with set_to_none)."""
    accumulation_gradients: float = 0.0
    """Extra gradient bytes held between micro-steps when accumulating (FSDP2 without sync: unsharded grads)."""
    master: float = 0.0
    """fp32 master weights (mixed precision engines that keep them apart from the compute weights)."""
    optimizer: float = 0.0
    buffers: float = 0.0
    """Engine buffers that persist across steps (DDP buckets, ZeRO-3's reduce bucket)."""
    backward_buffers: float = 0.0
    """Buffers that exist only during backward (ZeRO-2's reduce bucket, FSDP2's unsharded gradients)."""
    backward_gradients: float = 0.0
    """Gradient partitions created in backward and freed by the step (ZeRO-2's grads_in_partition); while
    accumulating they persist between micro-steps."""
    partition_region: int = 0
    """ZeRO-2: the backward region (0: the head's, 1: the last layer's, ...) whose reduction first copies one of the
    rank's tensors into its partition, which allocates `backward_gradients` (toolkit.estimate.zeropartition); 0 on
    the rank that holds the head, and for the plan's worst rank."""
    head_gradient: float = 0.0
    """ZeRO-2: the LM head's whole gradient, alive from the head's backward until the next parameter's hook reduces
    it and copies it into the gradient partition, which that copy allocates beside it (a tensor above
    reduce_bucket_size skips the IPG bucket: stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads)."""
    gathered: float = 0.0
    """ZeRO-3 / FSDP2 unsharded parameters live at a time during forward/backward."""
    held_gathered: float = 0.0
    """ZeRO-3 with Liger's fused loss: the LM head's whole weight, gathered from the start of forward to the end of
    backward (`liger_head_gathered`); within `gathered`."""
    step_transient: float = 0.0
    """Extra bytes only during the optimizer step (DeepSpeed's fp32 gradient partition, foreach temporaries)."""
    layer_transient: float = 0.0
    """Extra bytes only while a decoder layer runs, forward or backward: expert parallelism's token exchange (the
    all-to-all's send and receive buffers, freed when the layer's combine returns; nothing of it is alive between
    steps or in the head's loss: benchmarks/results/moe_distributed_memory.md)."""
    flat_partitions: tuple[int, ...] = ()
    """DeepSpeed's flat fp32 partitions a rank's optimizer steps one after another (elements; `flat_partitions`):
    the optimizer states are one tensor per partition and state, the fp32 gradient one per partition at a time.
    Empty for torch's optimizers (per parameter)."""
    loaded: float = 0.0
    """The frozen base as the model load leaves it on each GPU before the engine partitions it (ZeRO-3 QLoRA), freed
    by the partitioning; cached, not live, during the step (toolkit.estimate.reserved replays it)."""
    load_warmup: float = 0.0
    """transformers' caching_allocator_warmup block before that load (modeling_utils.py get_total_byte_count: 0.5 B
    per 4-bit weight element, the rest in its dtype); capped by the caller at the GPU's memory less 1.2 GiB."""
    cpu: float = 0.0
    """Host RAM per rank for offloaded states and their pinned buffers."""
    nvme: float = 0.0
    """NVMe bytes per rank (ZeRO-Infinity)."""
    autocast: bool = False
    """Whether activations are traced with fp32 weights under torch.autocast (AMP) rather than low-precision weights."""
    fsdp_plan_groups: bool = False
    """FSDP2 groups as transformers wraps a tensor-parallel model (toolkit.estimate.memory._fsdp_plan_groups): every
    region its own group, no root; the unsharded bytes are in the regions' traces, not in `gathered`."""
    sources: list[str] = field(default_factory=list)

    @property
    def persistent(self) -> float:
        """Held from one optimizer step to the next, before backward makes the step's gradients: what a GRPO step
        generates beside (with ZeRO-3 / FSDP2's gathered parameters of a layer)."""
        return self.parameters + self.gradients + self.master + self.optimizer + self.buffers + self.gathered


def _param_bytes(job: Job) -> int:
    return compute_bytes(job.precision)


def frozen_weight_bytes(frozen: int, job: Job, strategy: Strategy, *, shard: int) -> float:
    """Per-GPU bytes of `frozen` parameters that train nowhere (a multimodal class's vision encoder and projector under
    --vision-tower freeze): weights only. The HF Trainer hands the optimizer only parameters that require grad
    (Trainer.create_optimizer), so no engine keeps gradients or optimizer states for them; DDP's Reducer buckets only
    parameters that require grad. Where the weights sit, per engine: DDP keeps them whole as loaded (fp32 under AMP);
    DeepSpeed casts the whole module to the compute dtype (engine.py _configure_distributed_model), ZeRO-1/2 keep it
    whole, ZeRO-3 partitions every parameter, frozen ones included; FSDP2 shards every floating parameter, leaving the
    frozen ones in their loaded dtype (accelerate fsdp2_prepare_model upcasts only those that require grad)."""
    if strategy.engine == Engine.DDP:
        return frozen * weight_bytes(job.precision)
    if strategy.engine == Engine.DEEPSPEED:
        whole = frozen * _param_bytes(job)
        if strategy.zero_stage != 3:
            return whole
        return 0.0 if strategy.offload_params != "none" else whole / shard
    if strategy.engine == Engine.FSDP2:
        return frozen * weight_bytes(job.precision) / shard
    raise ValueError("a frozen vision tower runs on the HF Trainer path (DDP, ZeRO, FSDP2), not the pipeline engine")


def ddp_states(P: int, job: Job, *, world: int, factored_elems: int | None = None) -> States:
    """torch DDP (through accelerate / the HF Trainer) with AMP.

    AMP keeps fp32 weights and fp32 grads (torch.amp: weights are cast per op, the copies live until backward);
    bf16-pure keeps everything in bf16. The Trainer's default optimizer is fused AdamW (transformers
    training_args.py: adamw_torch_fused for torch >= 2.8): no step temporaries. DDP's Reducer allocates flat bucket
    tensors as large as all gradients (torch reducer.cpp initialize_buckets) unless gradient_as_bucket_view=True,
    which accelerate leaves False (accelerate utils/dataclasses.py).
    """
    pb = weight_bytes(job.precision)
    s = States(parameters=P * pb, step_gradients=P * pb, optimizer=optimizer_state_bytes(P, job, factored_elems),
               autocast=job.mixed)
    if world > 1:
        s.buffers = P * pb
        s.sources.append("DDP gradient buckets = one more copy of the gradients (gradient_as_bucket_view=False)")
    s.sources.append(f"{pb} B/param weights + {pb} B/param grads; optimizer {job.optimizer} "
                     f"{optimizer_state_bytes(1, job):.3g} B/param (fused AdamW: no step temporaries)")
    return s


def ddp_saved_module_states(s: States, P: int, job: Job, *, param_bytes: int, world: int) -> None:
    """Adds to DDP's states `s` the trainable modules_to_save copies (P parameters) held in `param_bytes` per
    element (toolkit.inputs.lora.saved_dtype_name): DDP keeps each parameter as the model holds it, its gradient in
    the same dtype, and torch's optimizers their states in the parameter's dtype (zeros_like); the Reducer's
    buckets (one per dtype, reducer.cpp) hold another copy of the gradients."""
    s.parameters += P * param_bytes
    s.step_gradients += P * param_bytes
    s.optimizer += optimizer_state_bytes(P, job, param_bytes=param_bytes)
    if world > 1:
        s.buffers += P * param_bytes
    s.sources.append(f"modules_to_save copies: {P:,} parameters in {param_bytes} B (weights, grads, optimizer "
                     "states in their dtype)")


def zero_states(P: int, job: Job, strategy: Strategy, *, dp: int, hidden: int, largest_layer: int,
                factored_elems: int | None = None, gradient_partition: tuple[int, int] | None = None,
                head_params: int = 0, reduce_bytes: int | None = None) -> States:
    """DeepSpeed ZeRO stage 1/2/3 with the HF Trainer's "auto" bucket sizes (reduce_bucket_size = h*h,
    stage3_prefetch_bucket_size = 0.9*h*h; accelerate/transformers fill formulas), or the config's own
    reduce_bucket_size (job.zero_reduce_bucket).

    Mixed precision: the module is cast to bf16/fp16 (2 B/param), fp32 master partition 4P/N, optimizer states
    /N, and the fp32 gradient partition (stage_1_and_2.py step(): flat_grad_partition.to(fp32), freed per group
    after its step; stage3.py _prepare_fp32_grad_for_sub_group, per sub-group of at most 1e9 elements).
    Stage 2 keeps a low-precision gradient partition (grads_in_partition): `gradient_partition` (elements, the
    backward region that allocates it), the rank's whole parameters touching its partition
    (toolkit.estimate.zeropartition), P/N from the head's region where it is None; stage 3 its
    grad_partitions_flat_buffer (2P/N) and the parameter partitions (2P/N). Offload moves master, optimizer and
    fp32 grads to host RAM (pinned) and runs the step there (DeepSpeedCPUAdam). `reduce_bytes`: bytes of an element
    of ZeRO-3's reduce bucket, its communication dtype (fp32 under Ulysses SP: toolkit.inputs.spreduce); None: the
    gradients' own.
    """
    N = dp
    stage = strategy.zero_stage
    pb = _param_bytes(job)
    opt = optimizer_state_bytes(P, job, factored_elems) / N
    master = 0.0 if job.precision == "bf16-pure" else 4 * P / N
    # fp32 runs still clone an fp32 partition (single_partition_of_fp32_groups is a .clone().float()).
    fp32_grad = 4 * P / N if job.precision != "bf16-pure" else 0.0
    bucket = float(job.zero_reduce_bucket or hidden * hidden)
    bucket_words = f"{job.zero_reduce_bucket:.3g}-element" if job.zero_reduce_bucket else "h^2"
    s = States(autocast=False)
    off_opt = strategy.offload_optimizer != "none"
    off_par = strategy.offload_params != "none"
    if stage in (1, 2):
        s.parameters = P * pb
        if stage == 1:
            s.step_gradients = P * pb
            s.sources.append(f"ZeRO-1: {pb} B/param weights, full {pb} B/param grads until the step")
        else:
            # grads_in_partition appears at the first bucket reduction in backward (stage_1_and_2.py
            # reduce_independent_p_g_buckets_and_remove_grads) and is freed by step(); the ipg bucket of
            # reduce_bucket_size elements lives only during backward (setup_buckets: one buffer, two under
            # overlap_comm, which the emitted JSON leaves off for stage 2). Measured on CPU:
            # benchmarks/results/distributed_memory.md; the second buffer: tests/test_estimate.py.
            # grads_in_partition counts whole parameters (copy_grads_in_partition sums the numels of
            # params_in_partition), so the worst rank's is larger than P/N by the tensors straddling its borders.
            buffers = 2 if job.zero_overlap_comm else 1
            whole, s.partition_region = (P / N, 0) if gradient_partition is None else gradient_partition
            s.backward_gradients = 0.0 if off_opt else whole * pb
            s.backward_buffers = buffers * bucket * pb
            s.head_gradient = 0.0 if off_opt or head_params <= bucket else head_params * pb
            held = f"{pb}P/N" if gradient_partition is None else (
                f"{pb} B x {whole:,} (the rank's whole parameters, {whole / (P / N):.3g}x P/N)")
            s.sources.append(f"ZeRO-2: {pb} B/param weights, {held} grad partition from backward to the step, "
                             f"{('one', 'two (overlap_comm)')[buffers - 1]} {bucket_words} reduce bucket(s) in "
                             "backward")
    else:
        s.parameters = 0.0 if off_par else P * pb / N
        s.gradients = 0.0 if off_opt else P * pb / N
        # Gathered parameters: DeepSpeed keeps a parameter gathered from forward to backward when its reuse
        # distance is under stage3_max_reuse_distance (1e9 elements in the emitted JSON), which holds for the
        # parameters used in the last max_reuse_distance / 2 elements of forward, plus the layer being computed,
        # capped by stage3_max_live_parameters (1e9) and the model (partitioned_param_coordinator.py; measured
        # on CPU: the whole small model stays gathered, benchmarks/results/distributed_memory.md).
        s.gathered = min(float(P), 1e9, 0.5e9 + largest_layer + 0.9 * hidden * hidden) * pb
        if N == 1 and not off_par:
            # A partition world of one gathers nothing: all_gather_coalesced hands such parameters to
            # _no_gather_coalesced, whose NoGatherHandle points param.data at the partition itself (ds_tensor
            # .to(current device): the same tensor). With offload_param that .to copies the partition to the GPU.
            s.gathered = 0.0
        # One persistent reduce bucket: the IPG buffer, torch.empty(reduce_bucket_size) in the communication dtype,
        # made at engine start when contiguous_gradients (default True; DeepSpeed 0.19.8 stage3.py __init__).
        rb = reduce_bytes or pb
        s.buffers = bucket * rb
        kept = "gathered params kept for reuse (up to 1e9)" if s.gathered else "nothing gathered (one rank)"
        in_dtype = f" in {'fp32' if rb == 4 else '16-bit'} (Ulysses SP's reduction dtype)" if rb != pb else ""
        s.sources.append(f"ZeRO-3: {pb}P/N params + {pb}P/N grads, {kept}, one {bucket_words} reduce bucket"
                         f"{in_dtype}")
    if off_opt:
        host = master + opt + fp32_grad
        if off_par:
            host += P * pb / N
        if strategy.offload_optimizer == "nvme":
            s.nvme = host
            # Pinned swap buffers (buffer_count 4 x buffer_size 1e8 elements fp32) in host RAM.
            s.cpu = 4 * 1e8 * 4
        else:
            s.cpu = host
        s.sources.append(f"offload: master + optimizer + fp32 grads ({host / max(P, 1):.3g} B/param) in "
                         f"{strategy.offload_optimizer.upper()}")
    else:
        s.master = master
        s.optimizer = opt
        # fp32 grad partition during the step: stage 1/2 per param group (Trainer: 2 groups, decay/no-decay,
        # the decay one holds almost everything); stage 3 per sub-group of <= 1e9 elements.
        s.step_transient = min(fp32_grad, 4 * SUB_GROUP_ELEMS) if stage == 3 else fp32_grad
        s.flat_partitions = flat_partitions(P / N, stage)
    return s


def liger_head_gathered(s: States, spec: Any, strategy: Strategy, job: Job) -> None:
    """ZeRO-3 under Liger's fused linear cross-entropy, as DeepSpeed 0.19.8 runs it (read in runtime/engine.py,
    runtime/zero/parameter_offload.py and partitioned_param_coordinator.py; run on 2 CPU ranks,
    tests/test_liger.py): lce_forward reads lm_head.weight outside the lm_head module, and ZeROOrderedDict's getter
    gathers it there (the engine's _forward_prologue marks every module in forward) and registers it as an external
    parameter of the module then in forward, the CausalLM root. From the second step on (the coordinator's recorded
    trace) the root's own fetch gathers it at the start of forward; the root's post-forward release keeps it (its
    backward fetch is next in the trace, within stage3_max_reuse_distance), and nothing frees it until the ZeRO-3
    optimizer's backward_epilogue (release_backward_leftovers: the root's post-backward hook never fires, its inputs
    need no gradient). So every rank holds the head's whole weight in the compute dtype from the start of forward
    to the end of backward, beside the layer computing and the prefetch bucket; none at the step. One gather a
    micro-step, as without Liger. Nothing is gathered over a partition world of one."""
    if not (job.liger and strategy.engine == Engine.DEEPSPEED and strategy.zero_stage == 3 and s.gathered):
        return
    pb = compute_bytes(job.precision)
    s.held_gathered = spec.head_matmul_params * pb
    beside = min(spec.params, spec.head_matmul_params + max(spec.layer_params) + 0.9 * spec.hidden * spec.hidden)
    s.gathered = max(s.gathered, beside * pb)
    s.sources.append(f"Liger under ZeRO-3: the LM head's weight read outside its module, gathered whole "
                     f"({s.held_gathered / GIB:.2f} GiB) from the start of forward to the end of backward")


SUB_GROUP_ELEMS = int(1e9)
"""ZeRO-3's sub_group_size default (DeepSpeed 0.19.8 runtime/zero/config.py); toolkit's JSON does not set it."""


def flat_partitions(elements: float, stage: int) -> tuple[int, ...]:
    """The flat fp32 partitions (elements) a rank's DeepSpeed optimizer steps: ZeRO-1/2 one per parameter group
    (stage_1_and_2.py single_partition_of_fp32_groups; the Trainer's decay group holds almost every element), ZeRO-3
    sub-groups closed once they reach sub_group_size elements (stage3.py _create_fp16_sub_groups). torch's Adam makes
    each state with zeros_like of the partition at the first step: one block per partition and state, not one per
    layer, so the states do not fit the activations' freed blocks as per-layer pieces would."""
    whole = int(elements)
    if stage != 3 or whole <= SUB_GROUP_ELEMS:
        return (whole,) if whole else ()
    full, rest = divmod(whole, SUB_GROUP_ELEMS)
    return (SUB_GROUP_ELEMS,) * full + ((rest,) if rest else ())


def fsdp2_states(P: int, job: Job, strategy: Strategy, *, shard: int, layer_params: int, root_params: int,
                 accumulating: bool, factored_elems: int | None = None, prefetch_layers: int = 2) -> States:
    """torch FSDP2 (fully_shard) with MixedPrecisionPolicy(param_dtype=bf16) as accelerate sets it.

    Sharded fp32 params and grads, optimizer states sharded; no separate master copy (REFERENCE: 4P/N + 4P/N +
    8P/N). Unsharded low-precision params: the layer being computed plus, on GPUs, the next one prefetched on
    the all-gather stream (prefetch_layers 2; 1 on CPU/gloo, measured); the root module (embeddings, head)
    stays unsharded after forward; reshard_after_forward=False (grad-op) keeps every layer's
    unsharded params from forward to backward. Accumulating: by default the Trainer wraps non-final micro-steps
    in accelerator.no_sync, which for FSDP2 is set_requires_gradient_sync(False) and keeps every layer's
    unsharded gradient (P x compute bytes) until the last micro-step; toolkit.train sets sync_each_batch for
    FSDP2 plans instead (reduce-scatter every micro-step, grads stay sharded), so `accumulating` is False for
    runs through toolkit.train.
    """
    N = shard
    full = weight_bytes(job.precision)
    compute = compute_bytes(job.precision)
    s = States(parameters=P * full / N, step_gradients=P * full / N,
               optimizer=optimizer_state_bytes(P, job, factored_elems) / N, autocast=False)
    s.gathered = fsdp2_gathered_bytes(strategy, whole=P * compute, layer=layer_params * compute,
                                      root=root_params * compute, prefetch_layers=prefetch_layers)
    # Unsharded gradients of the layers being reduce-scattered, freed after each reduce-scatter
    # (_fsdp_param_group.py post_backward): backward only.
    s.backward_buffers = prefetch_layers * layer_params * compute
    if accumulating:
        s.accumulation_gradients = P * compute
    s.sources.append(f"FSDP2: {full}P/N params + {full}P/N grads + optimizer/N; unsharded {compute} B/param "
                     f"params of {'all layers (no reshard)' if strategy.fsdp_mode == 'grad_op' else f'{prefetch_layers} layer(s) + root'}")
    if strategy.offloads:
        fsdp2_offload(s, sharded_bytes=P * full / N, layer_shard_bytes=prefetch_layers * layer_params * full / N)
    return s


def fsdp2_kept_dtype_states(s: States, P: int, job: Job, *, param_bytes: int, shard: int, offloads: bool) -> None:
    """Adds to FSDP2's states `s` P trainable parameters that accelerate leaves in their own dtype: a QLoRA model's
    modules_to_save copies (accelerate utils/fsdp_utils.py fsdp2_prepare_model upcasts trainable parameters to fp32
    only when the model holds no Params4bit). Sharded weights and gradients in `param_bytes` per element, torch's
    optimizer states in the same dtype (zeros_like), all / `shard`; with CPUOffloadPolicy in host RAM."""
    weights, states = P * param_bytes / shard, optimizer_state_bytes(P, job, param_bytes=param_bytes) / shard
    if offloads:
        s.cpu += 2 * weights + states
    else:
        s.parameters += weights
        s.step_gradients += weights
        s.optimizer += states
    s.sources.append(f"modules_to_save copies beside a 4-bit base: {P:,} parameters kept in {param_bytes} B "
                     "(accelerate upcasts no trainable parameter of a model with Params4bit)")


def fsdp2_offload(s: States, *, sharded_bytes: float, layer_shard_bytes: float) -> None:
    """FSDP2 with CPUOffloadPolicy (accelerate's fsdp_offload_params: true builds CPUOffloadPolicy(), pin_memory
    True): moves what `s` holds sharded on the GPU to host RAM. torch _fully_shard/_fsdp_param.py keeps each
    sharded parameter on the CPU (pinned) in its own dtype; all_gather_inputs copies a unit's shard to the GPU
    (`.to(device, non_blocking=True)`, in its stored dtype, cast to param_dtype after) before every all-gather, in
    forward and again in backward; _fsdp_collectives.py foreach_reduce copies each reduce-scattered gradient shard
    to the CPU (pinned) and accumulates there; the optimizer's states follow the CPU parameters and its step runs
    on the CPU. `sharded_bytes`: the sharded parameters as stored (the gradients take the same); `layer_shard_bytes`:
    the shards of the units in flight, whose GPU staging copies live until their all-gather has copied them in."""
    host = s.parameters + s.step_gradients + s.optimizer + s.master
    s.cpu += host
    s.parameters = s.step_gradients = s.optimizer = s.master = 0.0
    s.gathered += layer_shard_bytes
    s.sources.append(f"CPUOffloadPolicy: sharded params + grads + optimizer ({host / max(sharded_bytes, 1):.3g}x the "
                     "sharded params) in pinned host RAM, the optimizer step on the CPU; the GPU holds the gathered "
                     "units and their shards' H2D staging copies")


def fsdp2_gathered_bytes(strategy: Strategy, *, whole: float, layer: float, root: float,
                         prefetch_layers: int) -> float:
    """FSDP2's unsharded parameters live at a time (fsdp2_states), from the bytes each group gathers: `whole` (every
    sharded parameter), `layer` (the largest decoder layer), `root` (embeddings, final norm, head)."""
    if strategy.fsdp_mode == "grad_op":
        return whole
    return prefetch_layers * layer + root


def pipeline_states(P: int, job: Job, *, dp: int, factored_elems: int | None = None) -> States:
    """DeepSpeed pipeline engine, one stage holding P parameters, ZeRO 0/1 over `dp` ranks.

    bf16: BF16_Optimizer (selected by grad_accum_dtype fp32): bf16 weights and grads, a full fp32 gradient
    accumulation buffer (bf16_optimizer.py: torch.zeros_like(bf16_groups_flat, dtype=grad_acc_dtype)), fp32
    master and optimizer partitions /dp. fp16: FP16 optimizer (ZeRO-0) or ZeRO-1 partitions; fp32: plain.
    """
    opt = optimizer_state_bytes(P, job, factored_elems) / dp
    if job.precision == "fp32":
        s = States(parameters=4 * P, step_gradients=4 * P, optimizer=opt)
        s.master = 4 * P / dp if dp > 1 else 0.0
    elif job.precision == "bf16-pure":
        s = States(parameters=2 * P, step_gradients=2 * P, optimizer=opt)
    else:
        s = States(parameters=2 * P, step_gradients=2 * P, gradients=4 * P, master=4 * P / dp, optimizer=opt)
        s.sources.append("bf16/fp16 pipeline: fp32 gradient accumulation buffer for the whole stage (4P)")
    s.sources.append(f"pipeline stage: {P:,} params, optimizer sharded over dp={dp}")
    return s


def adapter_states(trainable: int, base_bytes: float, job: Job, strategy: Strategy, *, dp: int, hidden: int,
                   total_params: int, largest_layer: int, base_sharded_bytes: float, gather_bytes: float,
                   layer_gathered_bytes: float, root_gathered_bytes: float, layer_trainable_params: int, root_trainable_params: int, shard: int,
                   prefetch_layers: int, dequantized_bytes: float = 0.0, saved_params: int = 0,
                   saved_bytes_per_param: int = 4, layer_stored_bytes: float | None = None,
                   load_warmup_bytes: float = 0.0) -> States:
    """LoRA / QLoRA: the trainable adapters carry the engine's usual states (weights, gradients, master, optimizer:
    the functions above with P = trainable), the frozen base only its weights, `base_bytes` in its storage dtype
    (4-bit weights with their constants for QLoRA), of which ZeRO-3 / FSDP2 shard and gather `base_sharded_bytes`
    (toolkit.inputs.lora.sharded_base_bytes: the 4-bit codes without their constants; the rest stays whole on every
    GPU). `gather_bytes`: what one all-gather pass over the whole model moves, that sharded base and the adapters
    (toolkit.estimate.timing.data_parallel_gather_bytes). `layer_gathered_bytes` / `root_gathered_bytes`: the
    largest layer's and the root's gathered bytes, frozen and trainable, as FSDP2 unshards them: in
    MixedPrecisionPolicy's param_dtype (torch _fsdp_param.py all_gather_inputs casts each shard before the
    all-gather), also for a base stored in fp32 (--base-dtype fp32), whose shards stay fp32 (`base_sharded_bytes`
    at its stored bytes). `layer_stored_bytes`: the largest layer as stored (default `layer_gathered_bytes`), whose
    shards CPUOffloadPolicy copies to the GPU before the cast.

    Where the base lives, per engine:
    - DDP: whole on every GPU. toolkit.train loads it in the compute dtype; PEFT keeps adapters in fp32
      (get_peft_model(autocast_adapter_dtype=True)); DDP's Reducer buckets only parameters that require grad.
      The `saved_params` modules_to_save copies train in `saved_bytes_per_param` (ddp_saved_module_states). Under
      ZeRO they are trainable parameters like the adapters; under FSDP2 accelerate upcasts them to fp32 with them,
      except beside a 4-bit base, where they keep `saved_bytes_per_param` (fsdp2_kept_dtype_states).
    - ZeRO-1/2: whole on every GPU; DeepSpeed casts the whole module to bf16/fp16 (engine.py _configure_distributed_model)
      and partitions only the optimizer's (trainable) parameters.
    - ZeRO-3: every parameter is partitioned, frozen ones included (DeepSpeed partitions each parameter's data at
      engine start: transformers skips zero.Init for quantised models), and gathered for compute like the others.
      A quantised base is first loaded whole onto every GPU (bitsandbytes' update_device_map: {"": current
      device}), after `load_warmup_bytes` of caching_allocator_warmup: `loaded` and `load_warmup`, whose segments
      stay reserved (toolkit.estimate.reserved).
    - FSDP2: every floating parameter is sharded; accelerate upcasts the trainable ones to fp32 (not when the model
      holds Params4bit) and leaves the frozen base in its dtype (accelerate utils/fsdp_utils.py fsdp2_prepare_model),
      gathered in param_dtype (an fp32 base: fp32 shards, bf16 unsharded parameters);
      4-bit weights stored as uint8 are left out of sharding (same function: "non-floating frozen Params4bit"), so
      they stay whole on every GPU unless bnb_4bit_quant_storage is a floating dtype.
    """
    from toolkit.inputs.lora import quantized_base_sharded

    whole_bytes = base_bytes - base_sharded_bytes  # on every GPU whatever the engine
    base_per_gpu = base_bytes
    if strategy.engine == Engine.DDP:
        from dataclasses import replace

        from toolkit.estimate.traces import adapter_in_fp32

        # bf16-pure: PEFT keeps the adapters (not the modules_to_save copies) in fp32, with fp32 grads and states
        s = ddp_states(trainable - saved_params, replace(job, precision="fp32") if adapter_in_fp32(strategy, job)
                       else job, world=dp)
        if saved_params:
            ddp_saved_module_states(s, saved_params, job, param_bytes=saved_bytes_per_param, world=dp)
    elif strategy.engine == Engine.DEEPSPEED:
        s = zero_states(trainable, job, strategy, dp=dp, hidden=hidden, largest_layer=largest_layer)
        if strategy.zero_stage == 3:
            pb = _param_bytes(job)
            whole = zero_states(total_params, job, strategy, dp=dp, hidden=hidden, largest_layer=largest_layer)
            s.gathered = whole.gathered * gather_bytes / max(total_params * pb, 1)
            base_per_gpu = base_sharded_bytes / dp + whole_bytes
            if job.adapter.method == "qlora":
                s.loaded, s.load_warmup = base_bytes, load_warmup_bytes
            if strategy.offload_params != "none":
                s.cpu += base_sharded_bytes / dp
                base_per_gpu = whole_bytes
    elif strategy.engine == Engine.FSDP2:
        kept = saved_params if job.adapter.method == "qlora" else 0  # not upcast beside Params4bit
        s = fsdp2_states(trainable - kept, job, strategy, shard=shard, layer_params=layer_trainable_params,
                         root_params=root_trainable_params, accumulating=False, prefetch_layers=prefetch_layers)
        if kept:
            fsdp2_kept_dtype_states(s, kept, job, param_bytes=saved_bytes_per_param, shard=shard,
                                    offloads=strategy.offloads)
        s.gathered = fsdp2_gathered_bytes(strategy, whole=gather_bytes, layer=layer_gathered_bytes,
                                          root=root_gathered_bytes, prefetch_layers=prefetch_layers)
        base_per_gpu = base_sharded_bytes / shard + whole_bytes
        if strategy.offloads:
            # The frozen base's shards join the trainable ones in host RAM; what accelerate leaves out of
            # sharding (uint8 4-bit codes) is not FSDP2's to offload and stays whole on every GPU.
            s.cpu += base_sharded_bytes / shard
            s.gathered += prefetch_layers * (layer_stored_bytes or layer_gathered_bytes) / shard
            base_per_gpu = whole_bytes
        if job.adapter.method == "qlora" and not quantized_base_sharded(job.adapter):
            s.sources.append("4-bit base stored as uint8: accelerate leaves it out of FSDP2 sharding (whole per GPU); "
                             "set --qlora-quant-storage bfloat16 to shard it")
    else:
        raise ValueError("LoRA / QLoRA runs on the HF Trainer path (DDP, ZeRO, FSDP2), not the pipeline engine")
    s.parameters += base_per_gpu
    if dequantized_bytes:
        # bitsandbytes MatMul4Bit dequantises the whole 4-bit weight to the compute dtype for each matmul, in
        # forward and again in backward for the input gradient (bitsandbytes autograd/_functions.py), freed after.
        s.backward_buffers += dequantized_bytes
        s.sources.append(f"QLoRA: one dequantised weight ({dequantized_bytes / 2**20:.0f} MiB) live during each "
                         "4-bit matmul")
    s.sources.insert(0, f"{job.adapter.method}: frozen base {base_bytes / GIB:.2f} GiB in all"
                        f"{' (4-bit + constants)' if job.adapter.method == 'qlora' else ''}, "
                        f"{base_per_gpu / GIB:.2f} GiB per GPU; {trainable:,} trainable parameters with "
                        "gradients and optimizer states")
    return s


def autoep_states(spec: Any, P: int, job: Job, strategy: Strategy, *, grid: Any,
                  factored_elems: int | None = None, rank: int | None = None) -> States:
    """DeepSpeed AutoEP (toolkit.inputs.autoep): a rank holds the P - experts dense parameters and experts /
    `expert` of the routed ones (its AutoEPMoELayers' w1/w2/w3); ZeRO partitions each parameter group over its own
    data-parallel group (runtime/zero/stage_1_and_2.py, the expert groups over the expert-data-parallel group; under
    ZeRO-3 each parameter's ds_process_group, measured: 91,008 dense elements / 4 + 98,304 expert / 2 / 2 = 47,328 a
    rank, docs/ENGINE_FACTS.md): the dense group over the `world` ranks, the expert group over world / expert. Both
    groups' states are summed, except the fp32 gradient partition, which the step creates and frees group by group
    (the larger one). ZeRO-3's gathered parameters: one coordinator for both groups (partitioned_param_coordinator.py),
    so its reuse window and live cap count once, over a layer's dense part gathered from every rank plus its local
    experts gathered from the expert-data-parallel group; a group of one rank (autoep_size = world) gathers nothing,
    as zero_states on one rank (measured: benchmarks/results/moe_distributed_memory.md). Adds the token exchange's
    buffers as transformers' all-to-all holds them (toolkit.inputs.moe .ep_exchange_buffer_bytes) while a MoE layer
    runs. `rank`: ZeRO-2's gradient partition of that rank (zeropartition.zero_gradient_partition); None: the worst."""
    from toolkit.inputs.moe import ep_exchange_buffer_bytes, expert_layer_params, expert_params

    experts, world, expert = expert_params(spec), grid.shard_group, grid.expert
    hidden, largest_layer = spec.hidden, spec.largest_layer_params
    dense_elems = P - experts
    local = experts // expert
    layer_experts = expert_layer_params(spec)
    dense_layer = int(largest_layer - layer_experts)
    local_layer = int(layer_experts / expert)
    dense_fe = None if factored_elems is None else int(factored_elems * dense_elems / P) if P else 0
    dense = zero_states(dense_elems, job, strategy, dp=world, hidden=hidden, largest_layer=dense_layer,
                        factored_elems=dense_fe, head_params=spec.head_matmul_params)
    mine = zero_states(local, job, strategy, dp=world // expert, hidden=hidden, largest_layer=local_layer,
                       factored_elems=None if dense_fe is None else factored_elems - dense_fe)
    s = States(autocast=False)
    for name in ("parameters", "gradients", "step_gradients", "accumulation_gradients", "master", "optimizer",
                 "backward_gradients", "cpu", "nvme"):
        setattr(s, name, getattr(dense, name) + getattr(mine, name))
    if strategy.zero_stage == 3:
        # A group of one rank gathers nothing (the parameter's data is its partition: NoGatherHandle, zero_states)
        copied = strategy.offload_params != "none"  # offload_param's .to copies the partition to the GPU
        dense_share, local_share = float(copied or world > 1), float(copied or world // expert > 1)
        s.gathered = min(dense_share * dense_elems + local_share * local, 1e9,
                         0.5e9 + dense_share * dense_layer + local_share * local_layer + 0.9 * hidden * hidden
                         ) * _param_bytes(job)
    if strategy.zero_stage == 2 and strategy.offload_optimizer == "none":
        from toolkit.estimate.zeropartition import zero_gradient_partition

        whole = zero_gradient_partition(spec, P, world, expert=expert, rank=rank)
        if whole is not None:  # one grads_in_partition over both groups, whole parameters each
            s.backward_gradients, s.partition_region = whole[0] * _param_bytes(job), whole[1]
    s.buffers, s.backward_buffers = dense.buffers, dense.backward_buffers  # one reduce bucket serves both groups
    s.head_gradient = dense.head_gradient
    s.step_transient = max(dense.step_transient, mine.step_transient)
    s.flat_partitions = dense.flat_partitions + mine.flat_partitions
    exchange = ep_exchange_buffer_bytes(spec, job.micro_batch * job.seq_len, compute_bytes(job.precision))
    s.layer_transient += exchange
    s.sources = [f"DeepSpeed AutoEP {expert}: {dense_elems + local:,} parameters a rank ({dense_elems:,} dense + "
                 f"{local:,} of {experts:,} expert ones); ZeRO-{strategy.zero_stage} partitions the dense states over "
                 f"{world} ranks, the experts' over {world // expert}; all-to-all send + receive "
                 f"{exchange / GIB:.2f} GiB", *dense.sources]
    return s


def expert_parallel_states(spec: Any, strategy: Strategy, job: Job, grid: Any, *, params: int,
                           factored_elems: int) -> States:
    """FSDP2 x EP (transformers' DistributedConfig): a rank holds the dense parameters / shard group and its
    experts / ep of each MoE layer / efsdp (every rank its own batch: efsdp x ep = fsdp, so the same params / fsdp
    FSDP2 holds without EP; a shared batch: efsdp = fsdp, so the rank's dense share is ep times larger). FSDP2
    gathers the dense part of a layer and only the rank's own experts (toolkit.inputs.moe.ep_gathered_layer_params);
    with one shard (fsdp_size 1) transformers applies no FSDP and nothing is gathered. The token exchange's buffers
    (toolkit.inputs.moe.ep_exchange_buffer_bytes) live while a MoE layer runs (States.layer_transient)."""
    from toolkit.inputs.moe import ep_exchange_buffer_bytes, ep_gathered_layer_params, ep_token_exchange, expert_params

    experts = expert_params(spec)
    shard = grid.shard_group
    per_rank = (params - experts) / shard + experts / (grid.expert * grid.expert_shard_group)
    fsdp = shard > 1
    s = fsdp2_states(int(round(per_rank * shard)), job, strategy, shard=shard,
                     layer_params=ep_gathered_layer_params(spec, grid.expert) if fsdp else 0,
                     root_params=spec.pre_layer_params + spec.post_layer_params if fsdp else 0, accumulating=False,
                     factored_elems=int(factored_elems * per_rank * shard / params) if params else 0,
                     prefetch_layers=2 if job.device_kind == "cuda" else 1)
    tokens = job.micro_batch * job.seq_len // grid.seq_split
    route = ep_token_exchange(spec, grid.expert_shared_batch)
    exchange = ep_exchange_buffer_bytes(spec, tokens, compute_bytes(job.precision), route=route,
                                        sharers=grid.batch_sharers)
    s.layer_transient += exchange
    sent = tokens // grid.batch_sharers
    what = (f"all-reduce of {tokens} tokens x hidden {spec.hidden}" if route == "all_reduce" else
            f"all-to-all send + receive {sent} tokens x top-{spec.moe_top_k} x hidden {spec.hidden}")
    held = (f"unsharded layer holds {spec.moe_experts // grid.expert} of {spec.moe_experts} experts" if fsdp else
            f"{spec.moe_experts // grid.expert} of {spec.moe_experts} experts a layer, no FSDP (fsdp_size 1)")
    dense = "the dense modules whole" if shard == 1 else f"the dense modules sharded over fsdp {shard} only"
    shared = f" sharing one batch ({per_rank / 1e9:.2f}B parameters a rank, {dense})" if grid.expert_shared_batch else ""
    s.sources.append(f"expert parallel {grid.expert}{shared}: {held}; {what} = {exchange / GIB:.2f} GiB")
    return s
