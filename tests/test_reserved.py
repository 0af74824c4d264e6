"""Reserved memory from the step's own allocation events replayed through the caching-allocator model
(toolkit.estimate.reserved), not from a margin over the tensor peak."""

from __future__ import annotations

import pytest

from toolkit.estimate import allocator
from toolkit.estimate.memory import ALLOCATOR_MARGIN, estimate_memory
from toolkit.estimate.reserved import StepSizes, replayed_reserved, step_events
from toolkit.estimate.stepevents import decode_free, free_code, region_events
from toolkit.inputs.choices import GIB
from toolkit.inputs.hardware import parse_hardware
from toolkit.inputs.job import Job
from toolkit.inputs.modelspec import resolve_model
from toolkit.inputs.strategy import parse_strategy


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return resolve_model(str(tiny_llama_dir))


def test_a_free_code_names_its_birth_back():
    assert decode_free(free_code(-3, 1, 1234)) == (-3, 1, 1234)
    assert decode_free(free_code(0, 0, 0)) == (0, 0, 0)


def test_region_events_cut_the_log_by_window_and_point_deaths_to_their_births():
    # embedding makes serial 0; layer 0 makes 1, 2 and 4, frees 0; as the layer returns, before the head allocates,
    # serial 1 dies: the layer's own (at depth that is where a layer's input dies, before the next layer's mark);
    # the head makes and frees 3, then frees 2, the layer's; layer 0's backward frees 4.
    log = [(0, 100), (1, 200), (0, -100), (2, 300), (4, 10), (1, -200), (3, 50), (3, -50), (2, -300), (4, -10)]
    marks = {"f:embedding": 0, "f:layer0": 1, "e:layer0": 5, "f:end": 9, "b:begin": 9, "b:layer0": 9,
             "be:layer0": 10, "b:end": 10}
    emb, layer, head = region_events(log, marks, 1, excluded=set())
    assert emb == ((100,), ())
    assert layer == ((200, free_code(-1, 0, 0), 300, 10, free_code(0, 0, 0)), (free_code(0, 0, 2),))
    assert head == ((50, free_code(0, 0, 0), free_code(-1, 0, 1)), ())


def test_the_estimate_reports_the_replayed_reserved_not_the_five_percent_margin(tiny):
    b = estimate_memory(tiny, parse_strategy("ddp"), Job(seq_len=128), parse_hardware("1xA100-80GB"))
    term = next(t for t in b.terms if t.name.startswith("allocator"))
    assert term.name == "allocator (replayed)"
    assert b.margin_bytes == term.bytes != int(b.peak_bytes * ALLOCATOR_MARGIN)
    assert b.reserved_bytes == b.peak_bytes + b.margin_bytes
    assert b.required_bytes == b.reserved_bytes + b.context_bytes


def test_a_micro_batch_above_two_is_replayed_from_the_traces_at_two_and_three(tiny):
    """At micro-batch 1 the loss's copies of a batch of one are views (no allocation), so the events traced at 1
    and 2 differ in number and cannot be carried to 4; those at 2 and 3 agree, and the replay runs."""
    from toolkit.estimate.traces import activation_trace, scaled_trace

    job, strategy = Job(seq_len=128, micro_batch=4), parse_strategy("ddp")
    one, two = (activation_trace(tiny, job, strategy, b).head.forward_events for b in (1, 2))
    assert len(one) != len(two)
    assert len(scaled_trace(tiny, job, strategy).head.forward_events) == len(two)
    b = estimate_memory(tiny, strategy, job, parse_hardware("1xA100-80GB"))
    assert next(t for t in b.terms if t.name.startswith("allocator")).name == "allocator (replayed)"


def test_a_tiny_models_replay_is_made_of_2_mib_segments_above_its_allocated_peak(tiny):
    from toolkit.estimate.memory import _regions, states_for
    from toolkit.estimate.traces import scaled_trace
    from toolkit.inputs.grid import grid_of

    job, strategy, hw = Job(seq_len=128), parse_strategy("ddp"), parse_hardware("1xA100-80GB")
    trace = scaled_trace(tiny, job, strategy)
    regions = _regions(tiny, trace, 0, tiny.num_layers, True, True)
    states = states_for(tiny, strategy, job, grid_of(strategy, hw), params=tiny.params)
    sizes = StepSizes(persistent=states.parameters, optimizer=states.optimizer, gathered=0, reduce_buffers=0,
                      reduce_stream=False, step_gradients=states.step_gradients, backward_gradients=0,
                      step_transient=states.step_transient)
    events = step_events(regions, sizes)
    stats = allocator.replay(events)
    # Every tensor of a hidden-64 model is under 1 MiB: all of it lives in the small pool's 2 MiB segments.
    assert max(e[2] for e in events if e[0] == "malloc") <= allocator.SMALL_SIZE
    assert stats.peak_reserved % allocator.SMALL_BUFFER == 0
    assert stats.peak_reserved >= stats.peak_allocated > 0
    assert stats.peak_reserved == stats.segments * allocator.SMALL_BUFFER  # nothing freed back to the device
    replayed = replayed_reserved(regions, sizes)
    assert (replayed.peak_reserved, replayed.peak_allocated) == (stats.peak_reserved, stats.peak_allocated)


def test_gathered_parameters_on_their_own_stream_are_not_reused_by_activations():
    from types import SimpleNamespace

    from toolkit.estimate.activations import RegionTrace

    mib = 1 << 20
    # One 40 MiB activation a region, saved to backward; 40 MiB gathered per region on the all-gather stream.
    trace = RegionTrace(0, 0, 0, forward_events=(40 * mib,), backward_events=(free_code(0, 0, 0),))
    regions = [SimpleNamespace(params=1, trace=trace) for _ in range(4)]
    base = dict(persistent=0, optimizer=0, reduce_buffers=0, reduce_stream=False, step_gradients=0,
                backward_gradients=0, step_transient=0)
    alone = allocator.replay(step_events(regions, StepSizes(gathered=0, **base)))
    gathered = allocator.replay(step_events(regions, StepSizes(gathered=80 * mib, **base)))
    assert alone.peak_reserved == 4 * 40 * mib
    # two regions' 40 MiB gathered blocks alive at a time, in segments of their own stream
    assert gathered.peak_reserved >= alone.peak_reserved + 2 * 40 * mib


def test_optimizer_states_made_per_parameter_land_in_the_activations_cached_segments():
    """torch's optimizers make each state per parameter (adam.py _init_group: zeros_like(p)) at the first step,
    after backward freed the activations: pieces that fit the activations' cached segments go there (best fit, the
    rest split off), so the next step's activations need segments of their own; one block per region fits none."""
    from types import SimpleNamespace

    from toolkit.estimate.activations import RegionTrace

    mib = 1 << 20
    trace = RegionTrace(0, 0, 0, forward_events=(40 * mib,), backward_events=(free_code(0, 0, 0),))
    regions = [SimpleNamespace(params=1, trace=trace) for _ in range(4)]
    base = dict(persistent=0, optimizer=4 * 60 * mib, gathered=0, reduce_buffers=0, reduce_stream=False,
                step_gradients=0, backward_gradients=0, step_transient=0)
    per_region = allocator.replay(step_events(regions, StepSizes(**base)))
    per_tensor = allocator.replay(step_events(regions, StepSizes(tensors=((1, 1),) * 4, **base)))
    # per region: 4 x 40 MiB activations, then 4 x 60 MiB states in segments of their own; step 2 reuses the 40s
    assert per_region.peak_reserved == (4 * 40 + 4 * 60) * mib
    # per parameter: 30 MiB states, one in each 40 MiB activation segment (10 MiB split off), four in new 30 MiB
    # segments; step 2's activations fit none of the 10 MiB rests: four new 40 MiB segments
    assert per_tensor.peak_reserved == (4 * 40 + 4 * 30 + 4 * 40) * mib


def test_steps_of_growing_shapes_reserve_more_than_the_longest_step_first():
    """Batches padded to their own longest sample change the step's shapes: the allocator splits a cached block for
    a smaller request (best fit) but never grows one, so shorter steps after the longest reuse its segments, and a
    longer step after shorter ones finds none large enough and maps its own beside them (nothing empties the
    cache)."""
    from types import SimpleNamespace

    from toolkit.estimate.activations import RegionTrace

    mib = 1 << 20

    def regions_of(size: int):
        trace = RegionTrace(0, 0, 0, forward_events=(size,), backward_events=(free_code(0, 0, 0),))
        return [SimpleNamespace(params=1, trace=trace) for _ in range(4)]

    short, long = regions_of(30 * mib), regions_of(40 * mib)
    sizes = StepSizes(persistent=0, optimizer=0, gathered=0, reduce_buffers=0, reduce_stream=False,
                      step_gradients=0, backward_gradients=0, step_transient=0)
    longest_first = allocator.replay(step_events(long, sizes, step_regions=(long, short)))
    growing = allocator.replay(step_events(long, sizes, step_regions=(short, long)))
    assert longest_first.peak_reserved == 4 * 40 * mib  # the 30 MiB steps split the 40 MiB blocks
    assert growing.peak_reserved == (4 * 30 + 4 * 40) * mib
    assert growing.peak_allocated == longest_first.peak_allocated == 4 * 40 * mib


def test_a_foreach_steps_temporaries_are_one_block_per_parameter():
    """foreach AdamW's `_foreach_sqrt(exp_avg_sqs)` (adam.py _multi_tensor_adam) makes one temporary per parameter,
    all alive until the step's last op, then freed."""
    sizes = StepSizes(persistent=0, optimizer=0, gathered=0, reduce_buffers=0, reduce_stream=False, step_gradients=0,
                      backward_gradients=0, step_transient=300, tensors=((1, 2),))
    from types import SimpleNamespace

    from toolkit.estimate.activations import RegionTrace

    regions = [SimpleNamespace(params=1, trace=RegionTrace(0, 0, 0))]
    step = [e for e in step_events(regions, sizes, steps=1) if e[0] == "malloc"]
    assert [e[2] for e in step] == [100, 200]


def test_a_real_cpu_steps_allocations_replay_to_the_same_reserved_as_the_traced_events():
    """The CPU allocator's own record of a real forward + backward (torch.profiler's allocation events: address and
    size, in order), parameter gradients left out as the trace leaves them, replayed through the allocator model,
    gives the same peaks and segments as the fake trace's recorded events replayed the estimate's way."""
    from types import SimpleNamespace

    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, LlamaConfig

    from toolkit.estimate.tracer import trace_activations

    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    seq = 1024  # hidden states of 2 MiB, MLP tensors of 6 MiB, logits of 32 MiB: both pools, 20 MiB segments
    trace = trace_activations(config, seq_len=seq, micro_batch=1, dtype="float32", device_kind="cpu")
    regions = [SimpleNamespace(params=1, trace=r) for r in (trace.embedding, *trace.layers, trace.head)]
    nothing = StepSizes(persistent=0, optimizer=0, gathered=0, reduce_buffers=0, reduce_stream=False,
                        step_gradients=0, backward_gradients=0, step_transient=0)
    ours = allocator.replay(step_events(regions, nothing, steps=1))

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ids = torch.zeros(1, seq, dtype=torch.long)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(input_ids=ids, labels=ids).loss.backward()

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    records = sorted((n.start_time_ns, i, n.extra_fields.ptr, n.extra_fields.alloc_size)
                     for i, n in enumerate(walk(prof.profiler.kineto_results.experimental_event_tree()))
                     if type(n.extra_fields).__name__ == "_ExtraFields_Allocation")
    events, live = [], {}
    for serial, (_, _, ptr, size) in enumerate(records):
        if size > 0:
            live[ptr] = serial
            events.append(("malloc", serial, size))
        elif ptr in live:
            events.append(("free", live.pop(ptr)))
    grads = {live[p.grad.untyped_storage().data_ptr()] for p in model.parameters()}
    real = allocator.replay([e for e in events if e[1] not in grads])

    assert real.peak_allocated > 100 * 2**20
    assert (ours.peak_reserved, ours.peak_allocated, ours.segments) == \
        (real.peak_reserved, real.peak_allocated, real.segments)


def test_offloaded_activations_keep_the_named_margin_as_their_host_copies_are_not_recorded(tiny):
    b = estimate_memory(tiny, parse_strategy("ddp"), Job(seq_len=128, activation_offloading=True),
                        parse_hardware("1xA100-80GB"))
    term = next(t for t in b.terms if t.name.startswith("allocator"))
    assert term.name == "allocator margin" and "activations offloaded" in term.source
    tensors = b.peak_bytes - b.workspace_bytes  # cuBLAS's workspaces are whole segments: no margin on them
    assert b.margin_bytes == int(tensors * (1 + ALLOCATOR_MARGIN)) - tensors
    assert b.to_dict()["reserved_bytes"] == b.peak_bytes + b.margin_bytes


def test_fsdp2s_root_stays_gathered_from_its_forward_to_the_end_of_backward():
    from types import SimpleNamespace

    from toolkit.estimate.activations import RegionTrace

    mib = 1 << 20
    trace = RegionTrace(0, 0, 0, forward_events=(4 * mib,), backward_events=(free_code(0, 0, 0),))
    regions = [SimpleNamespace(params=p, trace=trace) for p in (30 * mib, 10 * mib, 10 * mib, 10 * mib)]
    base = dict(persistent=0, optimizer=0, gathered=0, reduce_buffers=0, reduce_stream=False, step_gradients=0,
                backward_gradients=0, step_transient=0, gather_bytes_per_param=1.0)
    rotating = allocator.replay(step_events(regions, StepSizes(**base)))
    kept = allocator.replay(step_events(regions, StepSizes(kept_regions=(0,), **base)))
    # Rotating: two gathered regions at a time, the peak while the root (30 MiB) and the first layer (10 MiB) are
    # gathered beside their two activations; kept: the root's 30 MiB beside two layers' and all four activations.
    assert rotating.peak_allocated == 30 * mib + 10 * mib + 2 * 4 * mib
    assert kept.peak_allocated == 30 * mib + 2 * 10 * mib + 4 * 4 * mib


def test_reset_peak_keeps_the_segments_and_restarts_the_allocated_peak():
    """torch.cuda.reset_peak_memory_stats: a freed 100 MiB block's segment stays reserved (nothing empties the
    cache) and the next 10 MiB block is carved from it; the allocated peak restarts from what is live."""
    mib = 1 << 20
    stats = allocator.replay([("malloc", "a", 100 * mib), ("free", "a"), ("reset_peak",), ("malloc", "b", 10 * mib)])
    assert stats.peak_allocated == 10 * mib
    assert stats.peak_reserved == 100 * mib
    assert stats.segments == 1


def test_deepspeeds_init_gradient_buffer_stays_cached_for_the_activations():
    """DeepSpeed 0.19.8's initialize_optimizer_states hangs a zero fp32 buffer of the largest sub-group on the flat
    partitions at engine start and drops it (stage3.py): its segment stays cached. The first step's activations
    use it, and at the step the first Adam state (one block per flat partition and state, the buffer's size) takes
    it back, so the fp32 gradient's segment, freed after the step, is what the next step's activations reuse."""
    from types import SimpleNamespace

    from toolkit.estimate.activations import RegionTrace

    mib = 1 << 20
    trace = RegionTrace(0, 0, 0, forward_events=(40 * mib,), backward_events=(free_code(0, 0, 0),))
    regions = [SimpleNamespace(params=1, trace=trace) for _ in range(4)]
    elements = 40_000_000  # one flat partition: 152.6 MiB fp32, a 154 MiB segment (2 MiB rounding)
    base = dict(persistent=0, optimizer=8 * elements, gathered=0, reduce_buffers=0, reduce_stream=False,
                step_gradients=0, backward_gradients=0, step_transient=4 * elements, flat_partitions=(elements,))
    lazy = allocator.replay(step_events(regions, StepSizes(**base)))
    cached = allocator.replay(step_events(regions, StepSizes(init_buffers=(4 * elements,), **base)))
    # no buffer: 4 x 40 MiB activation segments, then two states and the fp32 gradient in 154 MiB segments
    assert lazy.peak_reserved == (4 * 40 + 3 * 154) * mib
    # the buffer's segment holds three activations, one more 40 MiB; then states and gradient as above, the second
    # step's activations in the gradient's freed segment and the 40 MiB one
    assert cached.peak_reserved == (3 * 154 + 40) * mib
    assert cached.peak_allocated == lazy.peak_allocated


def test_a_quantized_bases_load_leaves_its_warmup_segment_reserved_under_the_step():
    """ZeRO-3 QLoRA: transformers' caching_allocator_warmup block (here 400 MiB) and the base loaded whole, freed
    region by region as the partitions are made, leave one 400 MiB segment that the step's smaller blocks reuse:
    the step's allocated peak is unchanged, its reserved peak is the warmup segment, not the step's own segments."""
    from types import SimpleNamespace

    from toolkit.estimate.activations import RegionTrace

    mib = 1 << 20
    regions = [SimpleNamespace(params=1, trace=RegionTrace(0, 0, 0)) for _ in range(4)]
    base = dict(persistent=40 * mib, optimizer=8 * mib, gathered=0, reduce_buffers=0, reduce_stream=False,
                step_gradients=40 * mib, backward_gradients=0, step_transient=0)
    plain = allocator.replay(step_events(regions, StepSizes(**base)))
    loaded = allocator.replay(step_events(regions, StepSizes(loaded=360 * mib, load_warmup=400 * mib, **base)))
    assert loaded.peak_allocated == plain.peak_allocated < 100 * mib
    assert loaded.peak_reserved == 400 * mib
    assert plain.peak_reserved == 100 * mib  # its own nine segments; under the warmup, none of them


def test_zero3_qlora_reserves_the_whole_quantized_base_it_loaded():
    """Llama-2-70B QLoRA (bf16 quant storage) on 2 x A100-40GB: the quantized base is loaded whole on every GPU
    before ZeRO-3 partitions it, so reserved memory holds the warmup's bytes (its 4-bit codes, its other weights in
    bf16: 32 GiB), above a tensor peak that holds half of them; plain LoRA is made partitioned by zero.Init and
    its reserved memory stays near its tensor peak."""
    from toolkit.inputs.lora import Adapter, counts_for_spec

    spec, hw, strategy = resolve_model("llama-2-70b"), parse_hardware("2xA100-40GB"), parse_strategy("zero3")
    qlora = Adapter(method="qlora", r=8, quant_storage="bfloat16")
    b = estimate_memory(spec, strategy, Job(seq_len=256, adapter=qlora), hw)
    counts = counts_for_spec(spec, qlora)
    warmup = counts.quantized_packed_bytes + counts.unquantized_frozen_params * 2
    assert 31 * GIB < warmup < 33 * GIB
    assert b.peak_bytes < warmup <= b.reserved_bytes < warmup + 2 * GIB
    lora = estimate_memory(spec, strategy, Job(seq_len=256, adapter=Adapter(method="lora", r=8)),
                           parse_hardware("8xH100-80GB"))
    assert lora.reserved_bytes < lora.peak_bytes * 1.1
