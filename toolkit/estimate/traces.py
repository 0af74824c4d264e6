"""The activation trace a memory estimate reads, for one model, job and strategy: traced once (toolkit.estimate.tracer,
or toolkit.estimate.compiled under torch.compile), kept per process and on disk (toolkit.cache), interpolated between
two traced lengths inside `traces_linear_in_seq`, and scaled to any micro-batch from micro-batches 1 and 2."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from toolkit.errors import UserError
from toolkit.estimate.activations import ActivationTrace, RegionTrace
from toolkit.estimate.reserved import leaving_replays_out
from toolkit.estimate.stepevents import lerp_events
from toolkit.inputs.images import image_marks_keyword
from toolkit.inputs.job import COMPILE_BLOCKS, TRL_LOSS, Job
from toolkit.inputs.modelspec import ModelSpec
from toolkit.inputs.strategy import Engine, Strategy


def _trace_mode(strategy: Strategy, job: Job) -> tuple[str, bool]:
    """(compute dtype, autocast): DDP runs torch AMP over fp32 weights; DeepSpeed, FSDP2 and the pipeline
    engine compute with low-precision weights."""
    dtype = job.compute_dtype_name
    return dtype, strategy.engine == Engine.DDP and job.mixed


def adapter_in_fp32(strategy: Strategy, job: Job) -> bool:
    """Whether a LoRA job's adapters train in fp32 over a low-precision base without autocast: DDP or one process
    with bf16-pure, where PEFT's get_peft_model(autocast_adapter_dtype=True) upcasts them (peft tuners_utils.py
    _cast_adapter_dtype: bf16/fp16 adapters to fp32) and no engine casts the model back (DeepSpeed casts the whole
    module to bf16, FSDP2 computes in MixedPrecisionPolicy's param_dtype); under mixed precision they are fp32
    anyway (the autocast trace). Not where the adapter says `adapter_dtype` base (another framework's LoRA)."""
    return (job.adapter.is_adapter and job.adapter.adapter_dtype == "auto" and strategy.engine == Engine.DDP
            and job.precision == "bf16-pure")


_EVENTS = ("forward_events", "backward_events")

_TRACE_CACHE: dict[tuple, tuple[ModelSpec, ActivationTrace]] = {}
"""Per process, keyed by the spec's identity; the entry keeps the spec alive so its id is never reused."""


def trace_from_dict(data: dict[str, Any]) -> ActivationTrace:
    data = {**data, "compile_traffic": tuple(data.get("compile_traffic", ()))}

    def region(r: dict) -> RegionTrace:
        return RegionTrace(**{**r, "forward_events": tuple(r.get("forward_events", ())),
                              "backward_events": tuple(r.get("backward_events", ()))})

    return ActivationTrace(**{**data, "embedding": region(data["embedding"]),
                              "layers": tuple(region(r) for r in data["layers"]),
                              "head": region(data["head"]), "notes": tuple(data["notes"])})


def _flat(obj) -> dict[str, Any]:
    """A dataclass's fields as a dict, one level deep: dataclasses.asdict copies every int of a region's event
    tuples one by one (0.25 s of CPU over the 13 traces of a cold 70B plan)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def trace_to_dict(trace: ActivationTrace) -> dict[str, Any]:
    """What dataclasses.asdict(trace) gives, the same JSON (trace_from_dict reads it back), built without copying
    the event tuples."""
    return {**_flat(trace), "embedding": _flat(trace.embedding), "layers": [_flat(r) for r in trace.layers],
            "head": _flat(trace.head)}


_SEQ_ANCHORED = False
"""True inside `traces_linear_in_seq`: traces at other lengths come from two traced lengths (toolkit.estimate.longest)."""

SEQ_ANCHOR_MIN = 1024
"""Shortest anchor length: below it a trace is taken at the exact length."""


class traces_linear_in_seq:
    """Within this context, a trace at sequence length L is interpolated between exact traces at a and 2a, a the
    power of two at or below L (L >= SEQ_ANCHOR_MIN): saved bytes, temporaries and the logits are linear in the
    sequence for the GPU kernels' footprint (no s x s tensor with flash / efficient SDPA), measured exact from
    2048 tokens on (tests/test_dimensions.py). A search over lengths then traces once per octave it visits,
    never per probe."""

    def __enter__(self):
        global _SEQ_ANCHORED
        self._was, _SEQ_ANCHORED = _SEQ_ANCHORED, True
        return self

    def __exit__(self, *exc):
        global _SEQ_ANCHORED
        _SEQ_ANCHORED = self._was


def _trl_head_bends(job: Job, low: tuple[int, int], high: tuple[int, int]) -> bool:
    """TRL's chunked log-prob head (--loss trl; every DPO / GRPO policy) is not affine in the tokens between two
    traced points when its tile rows, min(tokens, TOKEN_CHUNK_SIZE), bend between them: the tile stops growing at
    4096 tokens (trl/kernels/chunked_logprob.py). `low`, `high`: (micro-batch, sequence length) of the span; the
    trace scores b x (L - 1) tokens (labels on every position)."""
    if job.loss != TRL_LOSS:
        return False
    from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE

    return low[0] * (low[1] - 1) < TOKEN_CHUNK_SIZE < high[0] * (high[1] - 1)


def _seq_anchored(spec: ModelSpec, job: Job, strategy: Strategy, b: int,
                  image_marks: str | None = None) -> ActivationTrace | None:
    L = job.seq_len
    if not _SEQ_ANCHORED or L < SEQ_ANCHOR_MIN or L & (L - 1) == 0:
        return None
    if _trl_head_bends(job, (b, 1 << (L.bit_length() - 1)), (b, 2 << (L.bit_length() - 1))):
        return None
    from dataclasses import replace

    a = 1 << (L.bit_length() - 1)
    # the language model's trace is of text tokens alone (with_images adds the tower): the anchors drop the images,
    # whose tokens may not fit beside an anchor's length, and keep the processor's marks of them (image_marks) and
    # whether the merged input embeddings carry the tower's graph (inputs_grad, read from the job with its images)
    text = replace(job, images_per_sample=0, image_size="", image_tokens=0)
    grad = _inputs_grad(spec, job)
    t1 = _exact_trace(spec, replace(text, seq_len=a), strategy, b, image_marks, grad)
    t2 = _exact_trace(spec, replace(text, seq_len=2 * a), strategy, b, image_marks, grad)
    f = (L - a) / a

    def lerp(r1: RegionTrace, r2: RegionTrace) -> RegionTrace:
        return RegionTrace(**{k: lerp_events(v, getattr(r2, k), f) if k in _EVENTS
                              else int(round(v + (getattr(r2, k) - v) * f)) for k, v in _flat(r1).items()})

    return replace(t1, seq_len=L, embedding=lerp(t1.embedding, t2.embedding),
                   layers=tuple(lerp(x, y) for x, y in zip(t1.layers, t2.layers)), head=lerp(t1.head, t2.head),
                   output_bytes=int(round(t1.output_bytes + (t2.output_bytes - t1.output_bytes) * f)))


def activation_trace(spec: ModelSpec, job: Job, strategy: Strategy, micro_batch: int | None = None) -> ActivationTrace:
    b = micro_batch or job.micro_batch
    marks = image_marks_keyword(spec.hf_config()) if job.images_per_sample else None
    return _seq_anchored(spec, job, strategy, b, marks) or _exact_trace(spec, job, strategy, b, marks)


def step_time_terms(spec: ModelSpec, job: Job, strategy: Strategy, device_s: float | None = None) -> dict:
    """What the step-time model (toolkit.estimate.timing.step_time) reads from the trace, as its keyword arguments:
    torch.compile's fused traffic, and the host's dispatch (ActivationTrace.host_ops, toolkit.estimate.hosttime):
    an MoE model's always; a dense model's on a GPU where its step without it, `device_s`, is short enough for the
    host to bind (hosttime.host_could_bind); {} where none applies, without tracing."""
    from toolkit.estimate.hosttime import host_could_bind

    # torch.compile replaces the eager operations the trace counts with fused kernels: no dense floor from them.
    dense_host = (device_s is not None and job.device_kind != "cpu" and not job.compile
                  and host_could_bind(spec.num_layers, job.grad_accum, device_s))
    if not (job.compile or spec.moe_experts or dense_host):
        return {}
    trace = activation_trace(spec, job, strategy, 1)
    return {"compile_traffic": trace.compile_traffic,
            "host_ops": trace.host_ops if spec.moe_experts or dense_host else 0}


def priced_step_time(timer, spec: ModelSpec, strategy: Strategy, job: Job, hw, **where):
    """`timer` (toolkit.estimate.timing.step_time or a trainer's own) for the job, with the terms read from the trace
    (step_time_terms) where they apply: the step without them decides whether the host's dispatch could bind."""
    timing = timer(spec, strategy, job, hw, **where)
    terms = step_time_terms(spec, job, strategy, device_s=timing.step_time_s)
    return timer(spec, strategy, job, hw, **where, **terms) if terms else timing


def _inputs_grad(spec: ModelSpec, job: Job) -> bool:
    """An adapter job whose vision tower trains: the merged input embeddings carry the tower's graph."""
    return job.adapter.is_adapter and bool(job.images_per_sample) and tower_trains(spec, job)


def _exact_trace(spec: ModelSpec, job: Job, strategy: Strategy, micro_batch: int | None = None,
                 image_marks: str | None = None, inputs_grad: bool | None = None) -> ActivationTrace:
    """`image_marks`: an image job's language model takes its processor's marks of the image tokens under this
    keyword (toolkit.inputs.images.image_marks_keyword), fed to the trace with the ids. `inputs_grad`: whether the
    input embeddings require grad (_inputs_grad of the job; given by the anchors, whose text jobs lose the images)."""
    dtype, autocast = _trace_mode(strategy, job)
    b = micro_batch or job.micro_batch
    attention = spec.effective_attention(job.attention)
    adapter = job.adapter if job.adapter.is_adapter else None
    key = (id(spec), job.seq_len, b, dtype, autocast, attention, job.device_kind, job.checkpointing, adapter)
    if job.liger:  # appended only when set, so the disk cache of traces without Liger stays valid
        key += ("liger",)
    if job.compile:
        key += ("compile",) if job.compile is True else ("compile", job.compile)
    if job.tiled:
        key += ("tiled",)
    if job.chunked_loss:
        key += ("chunked_loss", job.chunked_loss)
    if job.loss != "model":
        key += ("loss", job.loss)
    if image_marks:
        key += ("image_marks", image_marks)
    if inputs_grad is None:
        inputs_grad = _inputs_grad(spec, job)
    if inputs_grad:
        key += ("inputs_require_grad",)
    adapter_fp32 = adapter_in_fp32(strategy, job)
    cache_key = key + ("adapter_fp32",) if adapter_fp32 else key
    if cache_key not in _TRACE_CACHE:
        from toolkit import cache
        from toolkit.estimate.compiled import trace_compiled_activations
        from toolkit.estimate.tracer import trace_activations

        # the key's fields up to the checkpointing mode; the adapter, Liger and the rest are added by name below
        disk_key = [spec.source_key, *key[1:8]] + (["liger"] if job.liger else []) if spec.source_key else None
        if disk_key and job.compile:
            disk_key += ["compile", cache.installed_version("torch")] + ([] if job.compile is True else [job.compile])
        if disk_key and adapter is not None:
            disk_key += [adapter.to_dict(), cache.installed_version("peft")]
        if disk_key and job.tiled:
            disk_key += ["tiled"]
        if disk_key and job.chunked_loss:
            disk_key += ["chunked_loss", job.chunked_loss]
        if disk_key and job.loss != "model":
            disk_key += ["loss", job.loss, cache.installed_version("trl")]
        if disk_key and adapter_fp32:
            disk_key += ["adapter_fp32"]
        if disk_key and image_marks:
            disk_key += ["image_marks", image_marks]
        if disk_key and inputs_grad:
            disk_key += ["inputs_require_grad"]
        if disk_key:  # every trace tallies what TRL's offloading would move, by TRL's own choice of head (savers)
            disk_key += ["offload", cache.installed_version("trl")]
        traced_by = trace_compiled_activations if job.compile else trace_activations
        trace = cache.get("trace", disk_key, code=traced_by, decode=trace_from_dict) if disk_key else None
        if trace is None:
            from toolkit.inputs.modelcode import CONFIG_ERRORS, model_code_problem, text_only_problem
            from toolkit.inputs.rope import traceable_config

            traced_config = traceable_config(spec.hf_config())
            try:
                if job.compile:
                    trace = trace_compiled_activations(
                        traced_config, seq_len=job.seq_len, micro_batch=b, dtype=dtype, autocast=autocast,
                        attention=attention, device_kind=job.device_kind, checkpointing=job.checkpointing,
                        blocks=job.compile == COMPILE_BLOCKS, chunked_loss=job.chunked_loss)
                else:
                    trace = trace_activations(
                        traced_config, seq_len=job.seq_len, micro_batch=b, dtype=dtype, autocast=autocast,
                        attention=attention, device_kind=job.device_kind, checkpointing=job.checkpointing,
                        liger=job.liger, adapter=adapter, tiled=job.tiled, chunked_loss=job.chunked_loss,
                        loss=job.loss, adapter_fp32=adapter_fp32, inputs_require_grad=inputs_grad,
                        image_marks=image_marks)
            except NotImplementedError as exc:  # a forward the fake-tensor trace cannot follow (Gemma-3's VLM)
                raise UserError(f"cannot estimate the activation memory of {spec.name}: {exc}") from None
            except CONFIG_ERRORS as exc:  # the model's own forward fails on a field its config leaves unset
                problem = (text_only_problem(exc, traced_config, spec.name)
                           or model_code_problem(exc, traced_config, spec.name))
                if problem is None:
                    raise
                raise UserError(problem) from None
            if disk_key:
                cache.put("trace", disk_key, trace_to_dict(trace), code=traced_by)
        _TRACE_CACHE[cache_key] = (spec, trace)
    return _TRACE_CACHE[cache_key][1]


def _lerp_region(r1: RegionTrace, r2: RegionTrace, b: int, r3: RegionTrace | None = None) -> RegionTrace:
    """`r1`, `r2` at micro-batch 1 and 2 carried to `b`; the allocator events from `r2` and `r3` (micro-batch 3)
    when given: at micro-batch 1 some copies are no-ops (a view of a batch of one is already contiguous), so the
    events of 1 and 2 can differ in number while those of 2 and 3 agree (toolkit.estimate.stepevents.lerp_events)."""
    f = b - 1
    e1, e2, fe = (r1, r2, f) if r3 is None else (r2, r3, b - 2)
    return RegionTrace(saved_bytes=r1.saved_bytes + (r2.saved_bytes - r1.saved_bytes) * f,
                       forward_extra_bytes=r1.forward_extra_bytes + (r2.forward_extra_bytes - r1.forward_extra_bytes) * f,
                       backward_extra_bytes=r1.backward_extra_bytes + (r2.backward_extra_bytes - r1.backward_extra_bytes) * f,
                       autocast_copy_bytes=r1.autocast_copy_bytes, autocast_cache_bytes=r1.autocast_cache_bytes,
                       backward_grad_bytes=r1.backward_grad_bytes, grad_bytes=r1.grad_bytes,
                       forward_grad_bytes=r1.forward_grad_bytes,
                       offload_bytes=r1.offload_bytes + (r2.offload_bytes - r1.offload_bytes) * f,
                       forward_events=lerp_events(e1.forward_events, e2.forward_events, fe),
                       backward_events=lerp_events(e1.backward_events, e2.backward_events, fe),
                       host_ops=r1.host_ops)


def scaled_trace(spec: ModelSpec, job: Job, strategy: Strategy) -> ActivationTrace:
    """The trace at job.micro_batch from traces at micro-batch 1 and 2: saved bytes are affine in the batch
    (every saved tensor has a batch dimension, or none, as rotary tables do), so two points are exact."""
    return with_images(spec, job, strategy, _language_trace(spec, job, strategy))


def _language_trace(spec: ModelSpec, job: Job, strategy: Strategy) -> ActivationTrace:
    b = job.micro_batch
    if b <= 2 or _trl_head_bends(job, (1, job.seq_len), (b, job.seq_len)):
        return activation_trace(spec, job, strategy, b)
    t1 = activation_trace(spec, job, strategy, 1)
    t2 = activation_trace(spec, job, strategy, 2)
    from dataclasses import replace

    pairs = [(t1.embedding, t2.embedding), *zip(t1.layers, t2.layers), (t1.head, t2.head)]
    t3 = None
    if b > 2 and not _trl_head_bends(job, (2, job.seq_len), (b, job.seq_len)) and any(
            not lerp_events(x.forward_events, y.forward_events, 1) and (x.forward_events or y.forward_events)
            or not lerp_events(x.backward_events, y.backward_events, 1) and (x.backward_events or y.backward_events)
            for x, y in pairs) and not leaving_replays_out():  # its events feed only the replay
        t3 = activation_trace(spec, job, strategy, 3)  # events from 2 and 3: 1 and 2 differ in number
    threes = [t3.embedding, *t3.layers, t3.head] if t3 is not None else [None] * len(pairs)
    lerped = [_lerp_region(x, y, b, z) for (x, y), z in zip(pairs, threes)]
    return replace(t1, micro_batch=b, embedding=lerped[0], layers=tuple(lerped[1:-1]), head=lerped[-1],
                   output_bytes=t1.output_bytes + (t2.output_bytes - t1.output_bytes) * (b - 1),
                   loss_bytes=t1.loss_bytes)


_TOWER_CACHE: dict[tuple, Any] = {}
"""Per process, the tower traces read from or written to the on-disk cache, keyed as there."""


def job_tower(spec: ModelSpec, job: Job, strategy: Strategy):
    """The vision encoder + projector traced for one of the image job's images (toolkit.estimate.visiontower), as
    the job runs it: trained unless --vision-tower freeze or an adapter leaves it frozen (tower_trains),
    checkpointed with the model. Kept on disk (toolkit.cache) as the language model's traces are, by the
    spec's source_key: a repeated plan of an image job traces no tower (a test calling trace_tower itself does)."""
    from toolkit import cache
    from toolkit.estimate.visiontower import TowerTrace, trace_tower
    from toolkit.inputs.images import parse_image_size

    trained = tower_trains(spec, job)
    dtype, autocast = _trace_mode(strategy, job)
    width, height = parse_image_size(job.image_size)
    ckpt = bool(job.checkpointing)
    attention = spec.effective_attention(job.attention)
    key = (spec.source_key, width, height, dtype, autocast, attention, ckpt, trained)
    if spec.source_key and key not in _TOWER_CACHE:
        _TOWER_CACHE[key] = cache.get("tower", list(key), code=trace_tower, decode=lambda d: TowerTrace(
            **{**d, "pixel_shape": tuple(d["pixel_shape"])}))
    if spec.source_key and _TOWER_CACHE[key] is not None:
        return _TOWER_CACHE[key]
    tower = trace_tower(spec.hf_config(), width, height, dtype=dtype, autocast=autocast, attention=attention,
                        checkpointing=ckpt, trained=trained)
    if spec.source_key:
        cache.put("tower", list(key), {f.name: getattr(tower, f.name) for f in fields(tower)}, code=trace_tower)
        _TOWER_CACHE[key] = tower
    return tower


def tower_trains(spec: ModelSpec, job: Job) -> bool:
    """Whether the job's vision encoder and projector train: unless --vision-tower freeze; under LoRA / QLoRA only
    where --lora-modules-to-save names every one of the class's vision modules or a module above it (PEFT matches a
    name as the last part of a module's path and trains a copy of that module whole: --lora-modules-to-save visual
    on Qwen2.5-VL, whose merger sits inside model.visual)."""
    if job.vision_tower != "train":
        return False
    if not job.adapter.is_adapter:
        return True
    saved = job.adapter.save_list()

    def covered(path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[:k]) == name or ".".join(parts[:k]).endswith("." + name)
                   for name in saved for k in range(1, len(parts) + 1))

    return bool(spec.vision_modules) and all(covered(path) for path in spec.vision_modules)


def with_images(spec: ModelSpec, job: Job, strategy: Strategy, trace: ActivationTrace) -> ActivationTrace:
    """`trace` (the language model at the job's whole sequence, image tokens included) with what the vision
    encoder and projector keep for backward for the micro-batch's images (toolkit.estimate.visiontower), in the
    embedding region: the tower runs before the first decoder layer and its backward comes last. Its saved
    storages are one birth at the end of the embedding's forward events, freed with the step's leftovers. A frozen
    tower (--vision-tower freeze, LoRA / QLoRA) saves nothing; the batch's float32 pixel values are there either
    way."""
    if not job.images_per_sample:
        return trace
    from dataclasses import replace

    images = job.images_per_sample * job.micro_batch
    tower = job_tower(spec, job, strategy)
    saved = (tower.saved_bytes + tower.pixel_bytes) * images
    events = trace.embedding.forward_events
    # the tower's backward runs inside the embedding region's, after the language model's embedding backward
    # has made the gradient of the input embeddings, which stays alive until the token embedding's backward (the
    # last node: it ran first in forward)
    embedding = replace(trace.embedding, saved_bytes=trace.embedding.saved_bytes + saved,
                        backward_extra_bytes=trace.embedding.backward_extra_bytes + tower.backward_extra_bytes * images,
                        autocast_copy_bytes=trace.embedding.autocast_copy_bytes + tower.autocast_copy_bytes,
                        forward_events=(*events, saved) if events else events)
    shape = " x ".join(map(str, tower.pixel_shape))
    note = (f"vision encoder + projector traced alone ({job.image_size}: pixel_values {shape} an image, "
            f"{tower.pixel_bytes:,} bytes of float32 in the batch): {tower.saved_bytes:,} bytes saved for backward "
            f"per image{'' if tower.saved_bytes else ' (frozen: no input of theirs requires grad)'}, "
            f"{tower.backward_extra_bytes:,} more at its backward's peak, all x {images} image(s) "
            "a micro-batch, in the "
            "embedding region" + (" (its blocks checkpointed with the model's, as the HF Trainer does: each keeps its "
                                  "inputs)" if job.checkpointing else ""))
    return replace(trace, embedding=embedding, vision_bytes=saved, notes=tuple(dict.fromkeys((*trace.notes, note))))
