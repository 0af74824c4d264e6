"""The engines' own backward and step allocations in the allocator replay (toolkit.estimate.engineevents): FSDP2's
reduce-scatter buffers and sharded gradients, ZeRO-3's per-parameter gradients and their reduce-stream frees, on
small synthetic steps whose reserved bytes are worked out by hand."""

from __future__ import annotations

from types import SimpleNamespace

from toolkit.estimate import allocator
from toolkit.estimate.activations import RegionTrace
from toolkit.estimate.engineevents import REDUCE
from toolkit.estimate.reserved import StepSizes, step_events
from toolkit.estimate.stepevents import free_code

MIB = 1 << 20
NOTHING = dict(persistent=0, optimizer=0, gathered=0, reduce_buffers=0, reduce_stream=False, step_gradients=0,
               backward_gradients=0, step_transient=0)


def _fsdp2_step(engine: str, steps: int = 2):
    """Two layers of 10 Mi parameters sharded over one rank (bf16 compute, fp32 shards and gradients), each saving
    one 40 MiB activation for its backward."""
    trace = RegionTrace(0, 0, 0, forward_events=(40 * MIB,), backward_events=(free_code(0, 0, 0),))
    regions = [SimpleNamespace(params=10 * MIB, trace=trace) for _ in range(2)]
    sizes = StepSizes(**{**NOTHING, "reduce_stream": True, "step_gradients": 2 * 40 * MIB},
                      gather_bytes_per_param=2.0, engine=engine)
    return step_events(regions, sizes, steps=steps)


def test_fsdp2s_sharded_gradients_are_made_in_the_reduce_scatter_streams_pool():
    """foreach_reduce allocates each group's reduce-scatter output inside the reduce-scatter stream's context and
    keeps it as the sharded .grad until zero_grad: the next step's activations never reuse those segments. Here:
    compute stream 120 MiB (two 20 MiB blocks for the unsharded layer and its fp32 -> bf16 cast, two 40 MiB
    activations), reduce-scatter stream 100 MiB (the bf16 output's 20 MiB block, reused by the second layer, and
    each layer's 40 MiB fp32 gradient), where the generic rules put the gradients among the activations."""
    generic = allocator.replay(_fsdp2_step(""))
    rules = allocator.replay(_fsdp2_step("fsdp2"))
    assert generic.peak_reserved == 120 * MIB
    assert rules.peak_reserved == 220 * MIB


def test_fsdp2s_post_backward_frees_before_it_makes_the_reduce_scatter_buffers():
    """_fsdp_param_group.py post_backward, one rank: reshard (the unsharded parameter freed), the previous group's
    reduce-scatter input dropped (reduce_scatter_states), this group's input made on the compute stream, autograd's
    unsharded gradient freed once copied in, then the output on the reduce-scatter stream, cast to fp32 there."""
    events = _fsdp2_step("fsdp2", steps=1)
    first = events.index(("free", ("act", 0, 0, 0)))  # the first layer's backward, the second to run
    assert events[first + 1:first + 9] == [
        ("malloc", ("ugrad", 0, 0, 0), 20 * MIB),
        ("free", ("unsharded", 0, 1, 0, 0)),
        ("free", ("rs_in", 0, (1,))),
        ("malloc", ("rs_in", 0, (0,)), 20 * MIB),
        ("free", ("ugrad", 0, 0, 0)),
        ("malloc", ("rs_out", 0, (0,)), 20 * MIB, REDUCE),
        ("malloc", ("grad", 0, (0,)), 40 * MIB, REDUCE),
        ("free", ("rs_out", 0, (0,))),
    ]


def _zero3_step(bucket_elements: int):
    """One region of four 6 Mi-parameter tensors, bf16 gradients of 12 MiB, over one rank, no activations."""
    trace = RegionTrace(0, 0, 0, forward_events=(), backward_events=())
    sizes = StepSizes(**NOTHING, tensors=((6 * MIB,) * 4,), engine="zero3", param_bytes=2.0,
                      bucket_elements=bucket_elements)
    return step_events([SimpleNamespace(params=24 * MIB, trace=trace)], sizes, steps=1)


def test_zero3s_gradients_stay_taken_until_the_reduce_stream_passes_them():
    """A gradient larger than reduce_bucket_size is reduced alone at the next parameter's hook, then
    record_stream(reduce stream) and dropped. Over one rank the reduction is a local copy, done by the next
    gradient's malloc (where the caching allocator processes its events), so each gradient's block serves the one
    after next: two 12 MiB segments, not the four the engine's own wait (the reduction three back) would allow. The
    step's gradient norms then take each 6 Mi-element partition in fp64 (48 MiB), one at a time, a segment of its
    own."""
    stats = allocator.replay(_zero3_step(1))
    assert stats.peak_reserved == 2 * 12 * MIB + 48 * MIB
    assert stats.peak_allocated == 48 * MIB


def _zero3_timed_step(backward_s: float, reduce_s: float):
    """Four regions of one 6 Mi-parameter tensor each (12 MiB bf16 gradients) over two ranks, each gradient reduced
    alone; `backward_s` a micro-step's backward (a second a region at 4.0), `reduce_s` one reduce-scatter's seconds."""
    trace = RegionTrace(0, 0, 0, forward_events=(), backward_events=())
    sizes = StepSizes(**NOTHING, tensors=((6 * MIB,),) * 4, engine="zero3", param_bytes=2.0, bucket_elements=1,
                      world=2, backward_s=backward_s, reduce_s_per_byte=reduce_s / (12 * MIB))
    return step_events([SimpleNamespace(params=6 * MIB, trace=trace) for _ in range(4)], sizes, steps=1)


def test_zero3s_gradients_free_when_the_time_model_says_the_reduction_ends():
    """Over two ranks a reduction takes the reduce-scatter's time on a stream that runs them one after another;
    a gradient is released at the first hook whose backward clock has passed its reduction's end. A reduction
    shorter than a region's backward (0.5 s against 1 s): each gradient's block serves the one after next, two
    12 MiB segments; longer (1.5 s): the first reduction ends at 3.5 s, so the fourth gradient (at 4 s) takes the
    first's block, three segments; the time model not asked: the engine's own wait alone, four. The fp64 norms of
    the 3 Mi-element partitions: one 24 MiB segment."""
    fast, slow = (allocator.replay(_zero3_timed_step(4.0, s)) for s in (0.5, 1.5))
    unknown = allocator.replay(_zero3_timed_step(0.0, 0.5))
    assert fast.peak_reserved == 2 * 12 * MIB + 24 * MIB
    assert slow.peak_reserved == 3 * 12 * MIB + 24 * MIB
    assert unknown.peak_reserved == 4 * 12 * MIB + 24 * MIB


def test_zero3s_bucketed_gradients_are_catted_on_the_reduce_stream():
    """Gradients that fit reduce_bucket_size are copied into the IPG buffer and reduced together:
    reduce_scatter_coalesced cats them into one new buffer on the reduce stream (here two 12 MiB gradients a
    bucket: one 24 MiB buffer, reused by the second bucket)."""
    events = _zero3_step(12 * MIB)
    cats = [e for e in events if e[0] == "malloc" and e[1][0] == "zcat"]
    assert cats == [("malloc", ("zcat", 0, 0), 24 * MIB, REDUCE), ("malloc", ("zcat", 0, 1), 24 * MIB, REDUCE)]


def test_fsdp2_grad_op_keeps_each_group_unsharded_to_its_own_post_backward():
    """reshard_after_forward=False (fsdp2-grad-op): each layer group keeps its unsharded parameters from its forward
    to its own post_backward (no unshard in backward), and is still reduce-scattered group by group; only the root
    group (embeddings, norm, head) waits for the end of backward. By hand, the two layers of _fsdp2_step: forward
    120 MiB (two 20 MiB unsharded layers, two 40 MiB activations); the second layer's post_backward makes its 20 MiB
    input, 20 MiB bf16 output and 40 MiB fp32 gradient while the first layer is still unsharded: 140 MiB. Taking
    every group as the root (what the replay did) kept both layers' unsharded gradients to the end: 160 MiB."""
    trace = RegionTrace(0, 0, 0, forward_events=(40 * MIB,), backward_events=(free_code(0, 0, 0),))
    regions = [SimpleNamespace(params=10 * MIB, trace=trace, name=f"layer {i}") for i in range(2)]
    sizes = StepSizes(**{**NOTHING, "reduce_stream": True, "step_gradients": 2 * 40 * MIB},
                      gather_bytes_per_param=2.0, engine="fsdp2", kept_regions=(0, 1))
    events = step_events(regions, sizes, steps=1)
    assert not any(e[0] == "malloc" and e[1][0] == "unsharded" and e[1][2] == 1 for e in events)  # no backward unshard
    assert events.index(("free", ("ugrad", 0, 1, 0))) < events.index(("malloc", ("ugrad", 0, 0, 0), 20 * MIB))
    assert events.index(("free", ("unsharded", 0, 0, 1, 0))) < events.index(("malloc", ("ugrad", 0, 0, 0), 20 * MIB))
    assert allocator.replay(events).peak_allocated == 140 * MIB


def _zero3_sp_step(bucket_elements: int):
    """Four 6 Mi-parameter tensors in one region over two ranks (bf16 gradients of 12 MiB), reduced in fp32 as
    DeepSpeed does under Ulysses SP."""
    trace = RegionTrace(0, 0, 0, forward_events=(), backward_events=())
    sizes = StepSizes(**NOTHING, tensors=((6 * MIB,) * 4,), engine="zero3", param_bytes=2.0, world=2,
                      bucket_elements=bucket_elements, reduce_bytes=4.0)
    return step_events([SimpleNamespace(params=24 * MIB, trace=trace)], sizes, steps=1)


def test_zero3_under_ulysses_sp_reduces_its_buckets_in_fp32():
    """Under Ulysses SP DeepSpeed's engine reduces in seq_parallel_communication_data_type, fp32 unless the config
    names it (toolkit.inputs.spreduce): a bucket of two 6 Mi-element bf16 gradients is catted in fp32, 48 MiB where
    bf16 made 24, and a rank's reduced partitions are cast back to bf16 beside it (3 Mi elements each over two
    ranks: 12 MiB); a gradient the bucket cannot take is cast to fp32 alone (24 MiB), a lone tensor the world divides
    needs no cat, and its partition comes back as 6 MiB."""
    def made(events, name):
        return [e[2] for e in events if e[0] == "malloc" and e[1][0] == name]

    bucketed = _zero3_sp_step(12 * MIB)
    assert made(bucketed, "zcat") == [48 * MIB, 48 * MIB]
    assert made(bucketed, "zback") == [12 * MIB, 12 * MIB]
    assert made(bucketed, "zcast") == []
    alone = _zero3_sp_step(1)
    assert made(alone, "zcast") == [24 * MIB] * 4
    assert made(alone, "zcat") == []
    assert made(alone, "zback") == [6 * MIB] * 4


def test_fsdp2_under_tp_reshards_the_kept_tail_at_its_own_post_backward():
    """Under TP transformers wraps the model from its fsdp_plan: no root group, the keep_full_weight tail (final norm
    + LM head) is a group of its own, unsharded from its forward to its own post_backward (StepSizes.fsdp_root
    False). The tail's reduce-scatter input is then made right after the tail's backward, before the layer below is
    unsharded for its backward, where the root group's waits for the end of backward. By hand (one rank, bf16
    compute, fp32 shards): at the layer's backward unshard the tail group holds its 20 MiB input and its 40 MiB fp32
    sharded gradient beside the layer's 40 MiB activation, the layer's unsharded 20 MiB and its cast 20: 140 MiB; as
    the root, the tail's unsharded parameters and gradient (20 + 20) wait there instead, and its fp32 gradient comes
    at the end of backward, after the layer's activation is gone: 120 MiB."""
    trace = RegionTrace(0, 0, 0, forward_events=(40 * MIB,), backward_events=(free_code(0, 0, 0),))
    regions = [SimpleNamespace(params=10 * MIB, trace=trace, name=name) for name in ("layer 0", "head + loss")]

    def events(root: bool):
        sizes = StepSizes(**{**NOTHING, "reduce_stream": True, "step_gradients": 2 * 40 * MIB},
                          gather_bytes_per_param=2.0, engine="fsdp2", kept_regions=(1,), fsdp_root=root)
        return step_events(regions, sizes, steps=1)

    tail, root = events(False), events(True)
    layer_unshard = ("malloc", ("unsharded", 0, 1, 0, 0), 20 * MIB)
    tail_input = ("malloc", ("rs_in", 0, (1,)), 20 * MIB)
    assert tail.index(tail_input) < tail.index(layer_unshard)
    assert root.index(tail_input) > root.index(layer_unshard)
    assert (allocator.replay(tail).peak_allocated, allocator.replay(root).peak_allocated) == (140 * MIB, 120 * MIB)
