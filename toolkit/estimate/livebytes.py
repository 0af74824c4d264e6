"""Measure memory on real tensors (CPU): the ground truth the activation tracer is checked against.

Deliberately shares no code with `toolkit.estimate.tracer`: storages are identified by data pointer, autocast weight copies by
their autograd history, regions by module pre-hooks only, and the whole-step peak comes from torch's own
`torch.distributed._tools.mem_tracker.MemTracker`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SavedBytes:
    saved_bytes: int
    """Bytes autograd holds for backward after forward + loss: unique storages of saved tensors, parameters and
    autocast weight copies excluded."""
    autocast_copy_bytes: int
    """Saved low-precision copies of parameters (autocast)."""
    live_bytes: int
    """Bytes of every tensor storage still alive after forward + loss with the model output released (loss kept),
    parameters, buffers and the batch excluded: saved tensors, autocast copies, the loss, and what a checkpoint's
    recompute closure holds."""
    by_region: dict[str, int] = field(default_factory=dict)
    """saved_bytes split by the module that was running when each storage was first saved: "embedding", "layer<i>",
    "head"."""
    autocast_copy_by_region: dict[str, int] = field(default_factory=dict)


def _autocast(dtype) -> Any:
    import torch

    return torch.autocast(device_type="cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


@contextlib.contextmanager
def frozen_params_trackable():
    """torch's MemTracker registers a gradient hook on every parameter of a module it enters, which torch refuses
    for parameters that need no gradient (the frozen base of a LoRA model). While this is open such a
    registration returns a handle that does nothing: a frozen parameter never gets a gradient to report."""
    import torch

    names = ("register_hook", "register_post_accumulate_grad_hook")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    class _NoHandle:
        def remove(self) -> None:
            pass

    def guarded(original):
        def register(self, hook):
            return original(self, hook) if self.requires_grad else _NoHandle()
        return register

    for name in names:
        setattr(torch.Tensor, name, guarded(originals[name]))
    try:
        yield
    finally:
        for name in names:
            setattr(torch.Tensor, name, originals[name])


def _is_parameter_copy(t) -> bool:
    """True for a tensor made from a parameter by casts and views only (an autocast weight copy)."""
    fn = t.grad_fn
    seen_cast = False
    for _ in range(4):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return seen_cast
        if name.startswith("ToCopyBackward"):
            seen_cast = True
        elif not any(name.startswith(v) for v in ("TBackward", "ViewBackward", "TransposeBackward",
                                                   "PermuteBackward", "ExpandBackward", "AliasBackward")):
            return False
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return False
        fn = nexts[0]
    return False


def _decoder_layer_list(model):
    """The language model's decoder layers (an image-text class's too, not its vision encoder's blocks)."""
    from toolkit.inputs.decoder_parts import decoder_layers
    from toolkit.inputs.modelconfig import layer_count

    return decoder_layers(model, layer_count(model.config))


def _storage_key(t) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def measure_saved_bytes(model, batch: dict, *, autocast_dtype=None):
    """Run forward + loss on real tensors and measure what is held for backward. Returns (SavedBytes, loss);
    call loss.backward() afterwards if you like (the graph is intact)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    param_keys = {_storage_key(p) for p in model.parameters()}
    region = {"name": "embedding"}
    layers = _decoder_layer_list(model)
    handles = []
    for i, layer in enumerate(layers):
        def pre(_m, _a, i=i):
            if torch.is_grad_enabled():  # not during a checkpoint's recompute
                region["name"] = f"layer{i}"
        handles.append(layer.register_forward_pre_hook(pre))
    handles.append(layers[-1].register_forward_hook(lambda *_: region.__setitem__("name", "head")))

    seen: set[tuple[int, int]] = set()
    saved = {"saved": 0, "autocast": 0}
    by_region: dict[str, int] = {}
    copies_by_region: dict[str, int] = {}

    def pack(t):
        key = _storage_key(t)
        if key in param_keys or key in seen:
            return t
        seen.add(key)
        if autocast_dtype is not None and _is_parameter_copy(t):
            saved["autocast"] += key[1]
            copies_by_region[region["name"]] = copies_by_region.get(region["name"], 0) + key[1]
        else:
            saved["saved"] += key[1]
            by_region[region["name"]] = by_region.get(region["name"], 0) + key[1]
        return t

    tracker = MemTracker()
    tracker.track_external(model, *[v for v in batch.values() if isinstance(v, torch.Tensor)])
    with frozen_params_trackable(), tracker:
        before = _act_bytes(tracker)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(autocast_dtype):
            output = model(**batch)
        loss = output.loss
        del output
        live = _act_bytes(tracker) - before
    for h in handles:
        h.remove()
    return SavedBytes(saved_bytes=saved["saved"], autocast_copy_bytes=saved["autocast"], live_bytes=live,
                      by_region=by_region, autocast_copy_by_region=copies_by_region), loss


def _act_bytes(tracker) -> int:
    """Bytes MemTracker currently sees that are neither parameters, buffers, gradients nor optimizer states."""
    import gc

    from torch.distributed._tools.mem_tracker import _MemRefType

    gc.collect()
    snapshot = tracker.get_tracker_snapshot("current")
    keep = {_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD, _MemRefType.OPT, "Total"}
    return sum(b for dev in snapshot.values() for k, b in dev.items() if k not in keep)


def peak_step_bytes(model, batch: dict, *, autocast_dtype=None, lr: float = 1e-4) -> dict[str, int]:
    """Peak of live tensor bytes over one real training step (forward, loss, backward, AdamW step) on CPU, by
    MemTracker category ("param", "grad", "act", "opt", "temp", ..., and "total")."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    tracker = MemTracker()
    tracker.track_external(model, optimizer, *[v for v in batch.values() if isinstance(v, torch.Tensor)])
    with frozen_params_trackable(), tracker:
        with _autocast(autocast_dtype):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    snapshot = tracker.get_tracker_snapshot("peak")
    totals: dict[str, int] = {}
    for dev in snapshot.values():
        for k, b in dev.items():
            name = "total" if k == "Total" else str(getattr(k, "value", k)).lower()
            totals[name] = totals.get(name, 0) + b
    return totals


def steady_step_peak(model, batch: dict, *, autocast_dtype=None, lr: float = 1e-4) -> int:
    """Peak of all live tensor bytes (MemTracker's total) over a steady-state real training step on CPU: one step of
    forward, loss, backward and fused AdamW to allocate the optimizer states, then the measured one."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

    def step() -> None:
        with _autocast(autocast_dtype):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer, *[v for v in batch.values() if isinstance(v, torch.Tensor)])
    with tracker:
        step()
    return sum(dev["Total"] for dev in tracker.get_tracker_snapshot("peak").values())


@dataclass(frozen=True)
class LayerPeaks:
    forward_peak_bytes: int
    """Peak live bytes during the layer's forward (parameters, buffers, gradients and the batch left out)."""
    backward_peak_bytes: int
    """Peak live bytes during the layer's backward, on the same terms."""


@dataclass(frozen=True)
class Peaks:
    forward_peak_bytes: int
    """Peak live bytes during the whole forward + loss (parameters, buffers, gradients and the batch left out)."""
    backward_peak_bytes: int
    """Peak live bytes during the whole backward, on the same terms."""
    layers: tuple[LayerPeaks, ...]


def measure_peaks(model, batch: dict, *, autocast_dtype=None) -> Peaks:
    """Forward, loss and backward on real tensors; the peaks MemTracker's module snapshots show, for the whole
    model and per decoder layer."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

    inputs = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    batch_bytes = sum({_storage_key(t): t.untyped_storage().nbytes() for t in inputs}.values())
    tracker = MemTracker()
    tracker.track_external(model, *inputs)
    with frozen_params_trackable(), tracker:
        with _autocast(autocast_dtype):
            loss = model(**batch).loss
        loss.backward()
    skip = {_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD, "Total"}

    def live(state, module) -> int:
        snapshot = tracker.memory_tracking[module].snapshots[state][0]
        return sum(b for dev in snapshot.values() for k, b in dev.items() if k not in skip) - batch_bytes

    layers = tuple(LayerPeaks(forward_peak_bytes=live(_ModState.PEAK_FW, layer),
                              backward_peak_bytes=live(_ModState.PEAK_BW, layer))
                   for layer in _decoder_layer_list(model))
    return Peaks(forward_peak_bytes=live(_ModState.PEAK_FW, model),
                 backward_peak_bytes=live(_ModState.PEAK_BW, model), layers=layers)



@dataclass(frozen=True)
class CompiledStep:
    saved_bytes: int
    """Bytes the compiled forward saved for backward (unique storages, parameters and buffers excluded; the
    compiled autograd function passes them through ctx.save_for_backward, so the pack hook sees them)."""
    saved: tuple
    """(shape, dtype, bytes) of each saved storage."""
    peak_bytes: int
    """Peak bytes allocated over forward + loss + backward above what was live before it (parameters, buffers,
    the batch): activations, temporaries and the parameter gradients, from the CPU allocator's own records in the
    profiler (inductor's kernels allocate outside the dispatcher, where MemTracker cannot see them)."""


def measure_compiled_step(model, batch: dict) -> CompiledStep:
    """torch.compile `model` (inductor), run one step to compile it, drop the gradients, and measure a second
    forward + backward on CPU, in the Dynamo settings toolkit.train runs it with."""
    from toolkit.patches.compiledckpt import checkpointed_layers_compiled

    with checkpointed_layers_compiled(model):  # as toolkit.train runs the compiled step
        return _measure_compiled_step(model, batch)


def _measure_compiled_step(model, batch: dict) -> CompiledStep:
    import torch
    from torch.profiler import ProfilerActivity, profile

    persistent = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
    compiled = torch.compile(model)
    compiled(**batch).loss.backward()
    for p in model.parameters():
        p.grad = None
    seen: dict = {}

    def pack(t):
        key = _storage_key(t)
        if key not in persistent:
            seen[key] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), key[1])
        return t

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = compiled(**batch).loss
        loss.backward()
    # The kineto records keep every allocation and free (prof.events() drops some of them).
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in changes:
        live += nbytes
        peak = max(peak, live)
    return CompiledStep(saved_bytes=sum(v[2] for v in seen.values()), saved=tuple(seen.values()), peak_bytes=peak)


def generation_peak_bytes(run, model, *tracked) -> int:
    """Peak of live tensor bytes beside `model`'s parameters and buffers while `run()` generates with it (transformers'
    generate, or a trainer's generation step), by torch's MemTracker with `tracked` (an optimizer, the prompt
    tensors) counted as theirs. generate calls the model once a token: MemTracker refuses a root module's second
    forward in one tracking, so its per-module stats are cleared after each; the peak it keeps is not reset."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    tracker = MemTracker()
    tracker.track_external(model, *tracked)
    hook = model.register_forward_hook(lambda *_: tracker.reset_mod_stats())
    try:
        with tracker:
            run()
    finally:
        hook.remove()
    return sum(dev["Total"] - dev.get(_MemRefType.PARAM, 0) - dev.get(_MemRefType.BUFFER, 0)
               for dev in tracker.get_tracker_snapshot("peak").values())
