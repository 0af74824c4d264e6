"""The engines' own allocations around each region's traced events, in the order and on the streams the installed
engines make them: the rules toolkit.estimate.reserved's replay follows for FSDP2 and ZeRO-3 (one class each, the
one place each engine's rules live). Sizes come from the memory model (toolkit.estimate.reserved.StepSizes).

FSDP2 (torch 2.13 distributed/fsdp/_fully_shard):
- unshard (_fsdp_param_group.py wait_for_unshard): each parameter's unsharded tensor is allocated on the compute
  stream (init_all_gather_outputs / alloc_storage run where the copy-out runs), one block per parameter. Over one
  rank there is no all-gather: unshard only records an event, so nothing is prefetched, and each parameter's
  `all_gather_inputs` casts its fp32 shard to param_dtype, a temporary freed after the copy. Over N ranks
  foreach_all_gather's output (the group's unsharded bytes) is made on the all-gather copy-in stream and, in
  forward, freed after the next group's copy-out (all_gather_state); in backward after its own copy-out, while the
  next group is prefetched (_backward_prefetch). Event waits, not record_stream: a freed block is reusable at once.
- reshard after forward frees the unsharded tensors (the root group, embeddings + final norm + head, stays until
  its post_backward at the end of backward). Without it (reshard_after_forward=False, fsdp2-grad-op) a group keeps
  its unsharded tensors from its forward until its own post_backward reshards them; no unshard in backward. Under
  TP, transformers wraps the model from its fsdp_plan (distributed/fsdp.py apply_fully_sharded_data_parallelism): no
  root group, the keep_full_weight tail (final norm + LM head) is one group kept from its forward to its own
  post_backward, the embedding and every layer their own, each of the rank's 1/tp of the parameters, all-gathered
  over the shard group (StepSizes.fsdp_root False).
- post_backward: autograd's unsharded gradients (param_dtype, one per parameter, compute stream) are copied into
  the reduce-scatter input (foreach_reduce: reduce_scatter_comm.allocate on the current, compute, stream; the
  reduce dtype, accelerate's MixedPrecisionPolicy reduce_dtype = param_dtype) and freed; the input is kept until
  the next group's post_backward (reduce_scatter_states, reduce_scatter_max_input_buffers 1) or the end of backward
  (_root_post_backward_final_callback). The output, the group's sharded gradient, is allocated inside the
  reduce-scatter stream's context, in the reduce dtype, cast there to the sharded parameters' fp32
  (_to_dtype_if_needed), and is the sharded parameters' .grad (as_strided views) until zero_grad: one block per
  group in the reduce-scatter stream's pool, which the compute stream's activations never reuse.

ZeRO-3 (DeepSpeed 0.19.8 runtime/zero/stage3.py, contiguous_gradients and overlap_comm on, reduce_scatter on):
- autograd makes each parameter's whole gradient (its dtype, compute stream); the hook
  (reduce_independent_p_g_buckets_and_remove_grads) first reduces the bucket when this gradient would overflow
  reduce_bucket_size, then (__add_grad_to_ipg_bucket) copies a gradient that fits into the persistent IPG buffer on
  the reduce stream, record_stream(reduce stream), and drops it: freed once the reduce stream passes the copy. A
  gradient larger than the bucket stays as it is until its own reduction.
- __reduce_and_partition_ipg_grads, on the reduce stream: reduce_scatter_coalesced cats the bucket's gradients
  (padded to the world) into one new buffer (not for a lone gradient the world divides), partition_grads copies
  each partition into grad_partitions_flat_buffer, record_stream(reduce stream) and drops the gradients left as
  they were. Under Ulysses SP the bucket is in the engine's fp32 communication dtype (toolkit.inputs.spreduce): a
  gradient is cast as it is copied in, the cat is fp32, a gradient the bucket did not take is cast to fp32 first
  (`__avg_scatter_grads`: g.to(communication_data_type)), and the reduced partitions are cast back to the
  gradients' dtype (.to(gradient_accumulation_dtype)) before partition_grads copies them. Before a reduction the
  host waits for the one three back (max_param_reduce_events 2): the latest the engine lets it finish. The caching allocator frees a block recorded on another stream once that stream's event
  has completed, checked at the next malloc (CUDACachingAllocator.cpp process_events), so a gradient is released at
  the first hook after its reduction ends: the reduce stream runs the buckets one after another, each for its
  reduce-scatter's time (toolkit.estimate.collectives ring_s over the partition group), while backward's clock
  advances by each region's share of the time model's backward compute (by parameters). Over one rank the
  reduction is a local copy: released at the next gradient's malloc. Where the time model was not asked
  (StepSizes.backward_s 0) the engine's wait alone releases them. The epilogue reduces the rest and synchronizes.
- step: _get_norm_groups turns each gradient partition to fp64 for its norm (get_grad_norm_direct,
  get_norm_dtype()), one at a time; each sub-group's fp32 gradient is made by flattening the bf16 partitions
  (_prepare_fp32_grad_for_sub_group: flatten(...).to(fp32)), the flat copy freed after the cast.
"""

from __future__ import annotations

from math import ceil

ROOT_REGIONS = ("embedding", "head + loss")
"""The traced regions FSDP2's root group holds (fully_shard on the model itself: what no layer group owns)."""
COMPUTE, GATHER, REDUCE = 0, 1, 2
"""Streams: the default (compute) stream, the all-gather (copy-in) stream, the reduce(-scatter) stream."""
_USES = 1 << 20
"""Stream ids from here on name ZeRO-3's reduce-stream work per reduction (record_stream / sync), so that the
replay can let one reduction's work finish before the next (toolkit.estimate.allocator's sync is per stream)."""
NORM_BYTES = 8
"""DeepSpeed's get_norm_dtype(): fp64 on a device that has it (every CUDA GPU)."""
REDUCE_EVENTS = 2
"""stage3.py max_param_reduce_events: more reductions in flight than this and the host waits for the oldest."""


class _Counting:
    """The replay's sink, counting the events passed to it."""

    def __init__(self, sink) -> None:
        self.sink, self.count = sink, 0

    def malloc(self, key, size: int, stream: int = COMPUTE) -> None:
        if stream == COMPUTE:
            self.sink.malloc(key, size)
        else:
            self.sink.malloc(key, size, stream)
        self.count += 1

    def free(self, key) -> None:
        self.sink.free(key)
        self.count += 1

    def record_stream(self, key, stream: int) -> None:
        self.sink.record_stream(key, stream)
        self.count += 1

    def sync(self, stream: int) -> None:
        self.sink.sync(stream)
        self.count += 1


def _split(total: int, numels: tuple[int, ...]) -> list[int]:
    """`total` bytes over a region's parameter tensors in proportion to their elements (one block without them)."""
    whole = sum(numels)
    return [int(total * n / whole) for n in numels] if whole else [total]


class EngineRules:
    """No engine rules: the replay's own (toolkit.estimate.reserved)."""

    def __init__(self, regions, sizes, sink) -> None:
        self.regions, self.sizes, self.out = regions, sizes, _Counting(sink)

    @property
    def emitted(self) -> int:
        return self.out.count

    def owns_gathers(self) -> bool:
        """Whether these rules make the unsharded parameters and gradients (the replay's own gathers stand down)."""
        return False

    def before_forward(self, step: int, j: int) -> None:
        """Before region j's forward events."""

    def after_forward(self, step: int, j: int) -> None:
        """After region j's forward events."""

    def end_forward(self, step: int) -> None:
        """Forward is over."""

    def before_backward(self, step: int, j: int) -> None:
        """Before region j's backward events."""

    def after_backward(self, step: int, j: int) -> None:
        """After region j's backward events: its parameters' gradients exist."""

    def end_backward(self, step: int) -> None:
        """Backward is over (FSDP2's final callback, ZeRO-3's epilogue)."""

    def step_temporaries(self, step: int) -> bool:
        """The optimizer step's engine temporaries; False where the replay's own are kept."""
        return False

    def zero_grad(self, step: int) -> None:
        """After the optimizer step: the gradients these rules made are dropped."""


class Fsdp2Rules(EngineRules):
    """torch 2.13 FSDP2 (module docstring)."""

    def __init__(self, regions, sizes, sink) -> None:
        super().__init__(regions, sizes, sink)
        tensors = sizes.tensors
        self.unsharded = [_split(int(r.params * sizes.gather_bytes_per_param), tensors[j] if j < len(tensors) else ())
                          for j, r in enumerate(regions)]
        whole = sum(r.params for r in regions) or 1
        self.sharded_grad = [int(sizes.step_gradients * r.params / whole) for r in regions]
        # The root group (embeddings, final norm, head) stays unsharded from its forward to the end of backward;
        # without reshard_after_forward (grad_op) every other group keeps its unsharded parameters from its forward
        # to its own post_backward, and is still reduce-scattered group by group.
        self.root = tuple(j for j in sizes.kept_regions if regions[j].name in ROOT_REGIONS) if sizes.fsdp_root else ()
        self.no_reshard = frozenset(sizes.kept_regions) - frozenset(self.root)
        self.world = max(1, sizes.world)
        self.gather_pending: list = []
        self.reduce_input = None
        self.grads: dict[tuple[int, ...], list] = {}
        self.sharded_grads: list = []
        # Over one rank, all_gather_inputs casts each fp32 shard to param_dtype (not a bf16-pure shard)
        self.casts = [self.world == 1 and self.sharded_grad[j] != sum(self.unsharded[j])
                      for j in range(len(regions))]

    def owns_gathers(self) -> bool:
        return True

    def _group(self, j: int) -> tuple[int, ...]:
        return self.root if j in self.root else (j,)

    def _unshard(self, step: int, phase: int, j: int) -> None:
        out, group = self.out, self._group(j)
        if self.world > 1:
            key = ("ag", step, phase, group)
            if key not in self.gather_pending:
                out.malloc(key, sum(sum(self.unsharded[g]) for g in group), GATHER)
                self.gather_pending.append(key)
        for g in group:
            for t, size in enumerate(self.unsharded[g]):
                if size <= 0:
                    continue
                if self.casts[g]:  # all_gather_inputs: the shard cast to param_dtype, freed after the copy
                    out.malloc(("cast", step, phase, g, t), size)
                out.malloc(("unsharded", step, phase, g, t), size)
                if self.casts[g]:
                    out.free(("cast", step, phase, g, t))
        if self.world > 1:  # the copy-out is done: forward frees the group before, backward this one
            keep = 1 if phase == 0 else 0
            while len(self.gather_pending) > keep:
                out.free(self.gather_pending.pop(0))

    def _reshard(self, step: int, phase: int, j: int) -> None:
        for t, size in enumerate(self.unsharded[j]):
            if size > 0:
                self.out.free(("unsharded", step, phase, j, t))

    def before_forward(self, step: int, j: int) -> None:
        if j not in self.root or j == self.root[0]:
            self._unshard(step, 0, j)

    def after_forward(self, step: int, j: int) -> None:
        if j not in self.root and j not in self.no_reshard:
            self._reshard(step, 0, j)

    def end_forward(self, step: int) -> None:
        while self.gather_pending:
            self.out.free(self.gather_pending.pop(0))

    def before_backward(self, step: int, j: int) -> None:
        if j not in self.root and j not in self.no_reshard:
            self._unshard(step, 1, j)
            following = [k for k in range(j - 1, -1, -1) if k not in self.root and k not in self.no_reshard][:1]
            if self.world > 1 and following:  # the next group's all-gather, prefetched
                k = following[0]
                key = ("ag", step, 1, (k,))
                self.out.malloc(key, sum(self.unsharded[k]), GATHER)
                self.gather_pending.append(key)

    def after_backward(self, step: int, j: int) -> None:
        out = self.out
        for t, size in enumerate(self.unsharded[j]):
            if size > 0:
                out.malloc(("ugrad", step, j, t), size)
                self.grads.setdefault(self._group(j), []).append(("ugrad", step, j, t))
        if j not in self.root:
            self._reshard(step, 0 if j in self.no_reshard else 1, j)
            self._post_backward(step, (j,))

    def _post_backward(self, step: int, group: tuple[int, ...]) -> None:
        out = self.out
        if self.reduce_input is not None:
            out.free(self.reduce_input)
        self.reduce_input = ("rs_in", step, group)
        unsharded = sum(sum(self.unsharded[g]) for g in group)
        if unsharded <= 0:
            self.reduce_input = None
            return
        out.malloc(self.reduce_input, unsharded)
        for key in self.grads.pop(group, ()):
            out.free(key)
        reduced = ("rs_out", step, group)
        out.malloc(reduced, unsharded // self.world, REDUCE)
        sharded = sum(self.sharded_grad[g] for g in group)
        if sharded != unsharded // self.world:  # cast to the sharded parameters' dtype, on the same stream
            out.malloc(("grad", step, group), sharded, REDUCE)
            out.free(reduced)
            reduced = ("grad", step, group)
        self.sharded_grads.append(reduced)

    def end_backward(self, step: int) -> None:
        if self.root:
            for j in self.root:
                self._reshard(step, 0, j)
            self._post_backward(step, self.root)
        if self.reduce_input is not None:
            self.out.free(self.reduce_input)
            self.reduce_input = None

    def zero_grad(self, step: int) -> None:
        for key in self.sharded_grads:
            self.out.free(key)
        self.sharded_grads = []


class Zero3Rules(EngineRules):
    """DeepSpeed 0.19.8 ZeRO-3 (module docstring)."""

    def __init__(self, regions, sizes, sink) -> None:
        super().__init__(regions, sizes, sink)
        self.world = max(1, sizes.world)
        tensors = sizes.tensors
        self.numels = [tensors[j] if j < len(tensors) and tensors[j] else (r.params,) for j, r in enumerate(regions)]
        self.bucket = max(1, sizes.bucket_elements)
        self.items: list = []
        self.elements = 0
        self.reductions = 0
        total = sum(r.params for r in regions) or 1
        self.region_s = [sizes.backward_s * r.params / total for r in regions]
        self.timed = self.world == 1 or sizes.backward_s > 0
        self.clock, self.ends, self.synced, self.released = 0.0, [], set(), 0

    def _sync(self, step: int, k: int) -> None:
        if k not in self.synced:
            self.synced.add(k)
            self.out.sync(_USES + step * (1 << 16) + k)

    def _release_done(self, step: int) -> None:
        """Reductions the reduce stream has finished by backward's clock: their gradients free at this malloc. A
        reduction starts once the one before it ends and the clock only advances, so the finished ones are the first
        `released` ones so far: a call looks only at those after them (a walk over every reduction of the step at
        every gradient's malloc was a fifth of a cold plan's replay time)."""
        if self.timed:
            ends = self.ends
            while self.released < len(ends) and ends[self.released] <= self.clock:
                self._sync(step, self.released)
                self.released += 1

    def _use(self, step: int) -> int:
        return _USES + step * (1 << 16) + self.reductions

    def after_backward(self, step: int, j: int) -> None:
        out, pb = self.out, self.sizes.param_bytes
        self.clock += self.region_s[j]
        for t in reversed(range(len(self.numels[j]))):
            numel = self.numels[j][t]
            if numel <= 0:
                continue
            key = ("zgrad", step, j, t)
            self._release_done(step)
            out.malloc(key, int(numel * pb))
            if self.elements + numel > self.bucket and self.elements > 0:
                self._reduce(step)
            copied = self.elements + numel <= self.bucket
            if copied:  # into the IPG buffer on the reduce stream, then dropped
                out.record_stream(key, self._use(step))
                out.free(key)
            self.items.append((key, numel, copied))
            self.elements += numel

    def _reduce(self, step: int) -> None:
        out, pb, world = self.out, self.sizes.param_bytes, self.world
        rb = self.sizes.reduce_bytes or pb
        k = self.reductions
        if k > REDUCE_EVENTS:  # the host waits for the reduction three back
            self._sync(step, k - REDUCE_EVENTS - 1)
        padded = sum(ceil(n / world) * world for _, n, _ in self.items)
        cat = len(self.items) > 1 or any(n % world for _, n, _ in self.items)
        start = max(self.clock, self.ends[-1] if self.ends else 0.0)
        self.ends.append(start + padded * rb * self.sizes.reduce_s_per_byte)
        if cat or rb != pb:
            self._release_done(step)
        cast = [(("zcast", step, k, i), n) for i, (_, n, copied) in enumerate(self.items) if rb != pb and not copied]
        for key, n in cast:  # a gradient the bucket did not take, cast to the reduction's dtype
            out.malloc(key, int(n * rb), REDUCE)
        if cat:
            out.malloc(("zcat", step, k), int(padded * rb), REDUCE)
        if rb != pb:  # each rank's reduced partitions cast back to the gradients' dtype
            out.malloc(("zback", step, k), int(padded / world * pb), REDUCE)
        for key, _, copied in self.items:
            if not copied:
                out.record_stream(key, self._use(step))
                out.free(key)
        for key, _ in cast:
            out.free(key)
        if cat:
            out.free(("zcat", step, k))
        if rb != pb:
            out.free(("zback", step, k))
        self.items, self.elements = [], 0
        self.reductions += 1

    def end_backward(self, step: int) -> None:
        if self.items:
            self._reduce(step)
        for k in range(self.reductions):  # reduce_and_partition_stream.synchronize()
            self._sync(step, k)
        self.reductions = 0
        self.clock, self.ends, self.synced, self.released = 0.0, [], set(), 0

    def step_temporaries(self, step: int) -> bool:
        out, sizes, world = self.out, self.sizes, self.world
        for j, numels in enumerate(self.numels):
            for t, numel in enumerate(numels):
                if numel > 0:
                    out.malloc(("norm", step, j, t), ceil(numel / world) * NORM_BYTES)
                    out.free(("norm", step, j, t))
        flat = sizes.flat_partitions
        for i, elements in enumerate(flat):
            if sizes.step_transient <= 0:
                break
            out.malloc(("flatten", step, i), int(elements * sizes.param_bytes))
            out.malloc(("step", step, i), int(sizes.step_transient * elements / max(flat)))
            out.free(("flatten", step, i))
            out.free(("step", step, i))
        return True


def engine_rules(regions, sizes, sink) -> EngineRules:
    """The rules of `sizes.engine` ('fsdp2', 'zero3'; '' for none) over `regions`, emitting to `sink`."""
    return {"fsdp2": Fsdp2Rules, "zero3": Zero3Rules}.get(sizes.engine, EngineRules)(regions, sizes, sink)
