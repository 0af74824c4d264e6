"""Trace the bytes a Hugging Face causal LM keeps for backward, by running its own code under FakeTensorMode.

A depth-reduced copy of the model (same config, the fewest leading layers that show every distinct layer kind twice)
runs forward with labels (HF's own loss) and backward on fake tensors: no memory, well under a second. Three
instruments watch it:

- a TorchDispatchMode logs every storage an op creates and, through a weakref on the storage, when it dies; replaying
  that log gives live bytes at any moment (parameter gradients left out: the memory model counts them as states);
- `saved_tensors_hooks` see every tensor autograd keeps, deduplicated by storage and charged to the region running
  when it was first saved (parameters and autocast weight copies set apart);
- module hooks and gradient hooks on each decoder layer's input and output mark where regions start and end, in
  forward and in backward.

Traced layers are then expanded to the full depth: layer i takes the trace of the traced layer of the same kind,
its first occurrence for the first layer of that kind (which is charged the shared rotary tables and masks) and a
later one for the rest. Kinds are told apart by comparing the layers' structure and settings (class, parameter
shapes, per-layer attributes such as a sliding window) in a meta-device build of the full model, so architectures
never seen before are handled without special cases.

With device_kind="cuda" the CPU kernels whose saved tensors differ from the GPU's are replaced during the trace by
stand-ins with the GPU kernel's footprint (see `_cuda_kernels`); every substitution that fired is listed in notes.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from toolkit.estimate.activations import ActivationTrace, RegionTrace
from toolkit.inputs.choices import ATTENTIONS, CHECKPOINTING_OP, COMPUTE_DTYPES as DTYPES, DEVICE_KINDS
from toolkit.inputs.modelspec import reduced_config
# Registered with transformers for the duration of a flash-attention trace (flash kernels cannot run on CPU).
_FLASH_STANDIN = "toolkit_fa2_standin"  # no "flash" in the name: transformers would try to import the kernel


def trace_activations(config, *, seq_len: int, micro_batch: int = 1, dtype: str = "bfloat16",
                      autocast: bool = False, attention: str = "sdpa", device_kind: str = "cuda",
                      checkpointing: bool = False, liger: bool = False, adapter=None,
                      tiled: bool = False, chunked_loss: int = 0) -> ActivationTrace:
    """Bytes the model keeps for backward, region by region, for one micro-batch of `micro_batch` x `seq_len`.

    `config` is any decoder-only causal-LM config; it is not modified. `adapter` (a toolkit.inputs.lora.Adapter with
    method lora or qlora) wraps the model with the real PEFT LoRA layers before the step: the base in the compute
    dtype and frozen, the adapters trainable (fp32 under autocast, as PEFT's autocast_adapter_dtype leaves them), so
    the trace holds the adapter intermediates, the dropout masks and dropped copies of each target's input, and the
    frozen base's input gradients; parameter gradients exist only for the adapters. The batch has no attention mask (unpadded
    fixed-length sequences, as the Trainer feeds packed or truncated text) and the labels are the inputs.
    `liger`: the model patched as the Trainer's use_liger_kernel does, with toolkit.estimate.liger's substitutes.
    `tiled`: ALST's tiled MLP and tiled logits + loss, the engine's own autograd functions (toolkit.estimate.tiling).
    `chunked_loss`: torchtune's chunked cross-entropy over this many sequence chunks (toolkit.estimate.chunkedce).
    """
    import torch

    _check_choice("dtype", dtype, DTYPES)
    _check_choice("attention", attention, ATTENTIONS)
    _check_choice("device_kind", device_kind, DEVICE_KINDS)
    if seq_len < 1 or micro_batch < 1:
        raise ValueError(f"seq_len and micro_batch must be positive (got {seq_len}, {micro_batch})")
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    compute_dtype = getattr(torch, dtype)
    if attention == "flash_attention_2" and compute_dtype == torch.float32:
        raise ValueError("flash_attention_2 runs in bfloat16 or float16 only; use dtype bfloat16/float16 "
                         "(or autocast) or attention sdpa")
    param_dtype = torch.float32 if autocast else compute_dtype

    full_kinds = _layer_kinds_of_full_model(config)
    traced_count = _traced_layer_count(full_kinds)
    traced_config = reduced_config(config, len(full_kinds), traced_count)

    notes: list[str] = []
    cuda_autocast = device_kind == "cuda" and autocast and compute_dtype != torch.float32
    with _trace_environment(attention, device_kind, notes, cuda_autocast=cuda_autocast) as attn_impl:
        try:
            run = _run_fake_step(traced_config, attn_impl, param_dtype, compute_dtype if autocast else None,
                                 micro_batch, seq_len, checkpointing, notes, liger=liger,
                                 device_kind=device_kind, adapter=adapter, tiled=tiled, chunked_loss=chunked_loss)
        except (DynamicOutputShapeException, DataDependentOutputException) as exc:
            raise NotImplementedError(
                f"{type(config).__name__}: the model's forward has shapes that depend on the data ({exc}), e.g. "
                "MoE experts looped over the tokens routed to each; such models trace only through transformers' "
                "grouped_mm experts implementation") from None
    traced_kinds = run.layer_kinds
    if traced_kinds != full_kinds[:traced_count]:
        raise RuntimeError(f"{type(config).__name__}: the first {traced_count} layers of a {traced_count}-layer "
                           "copy differ from those of the full model; cannot trace this architecture by depth "
                           "reduction")
    if autocast and compute_dtype != torch.float32:
        notes.append(f"autocast: torch.autocast('cpu', {dtype})" + (" with CUDA's float32 op list applied on top"
                                                                    if cuda_autocast else ""))
    notes.append(f"traced {traced_count} of {len(full_kinds)} layers, expanded by layer kind")
    notes.append("batch without attention mask (unpadded sequences); labels = inputs")
    if liger:
        from toolkit.estimate.liger import LIGER_SOURCE

        notes.append(f"Liger kernels (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy) traced with substitutes "
                     f"that save what {LIGER_SOURCE} saves" + (" and allocate what its kernels allocate"
                                                               if device_kind == "cuda" else
                                                               "; device_kind cpu: the substitutes' own CPU run "
                                                               "(Liger's Triton kernels do not run on CPU)"))

    if tiled:
        from toolkit.estimate.tiling import TILING_SOURCE
        from toolkit.inputs.job import loss_shards, mlp_shards

        notes.append(f"tiled: MLP in {mlp_shards(seq_len, config.hidden_size)} chunks of the sequence, logits + loss "
                     f"in {loss_shards(micro_batch, seq_len, config.vocab_size)}, traced through {TILING_SOURCE}")
    if chunked_loss:
        from toolkit.estimate.chunkedce import CHUNKED_CE_SOURCE

        notes.append(f"chunked cross-entropy: logits and loss in {chunked_loss} sequence chunks, each upcast to fp32 "
                     f"apart, traced through {CHUNKED_CE_SOURCE}")
    layers = tuple(run.layers[_traced_index_for(i, full_kinds, traced_count)] for i in range(len(full_kinds)))
    return ActivationTrace(
        micro_batch=micro_batch, seq_len=seq_len, dtype=dtype, autocast=autocast, attention=attention,
        device_kind=device_kind, checkpointing=checkpointing, embedding=run.embedding, layers=layers,
        head=run.head, output_bytes=run.output_bytes, loss_bytes=run.loss_bytes, notes=tuple(dict.fromkeys(notes)))


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)} (got {value!r})")


# ----------------------------------------------------------------------------------------------------------------
# Layer kinds and depth reduction


def _text(config):
    """The decoder's own config: the text config of a vision-language config (AutoModelForCausalLM builds the text
    model from it, e.g. Qwen3.5), the config itself otherwise."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _num_layers(config) -> int:
    n = getattr(_text(config), "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ValueError(f"{type(config).__name__} has no num_hidden_layers; is it a decoder-only causal LM?")
    return n


def _decoder_layers(model, count: int):
    """The ModuleList of decoder layers: the shallowest ModuleList with one entry per layer."""
    import torch

    lists = [(name.count("."), name, m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no list of {count} decoder layers found")
    return min(lists, key=lambda x: x[:2])[2]


def _per_layer_settings(config, n: int) -> list[tuple]:
    """Per-layer entries of the config (lists with one value per layer, such as layer_types), layer by layer:
    the model's forward may read them by index (which mask a layer gets) without the layer storing them."""
    lists = sorted((k, v) for k, v in vars(_text(config)).items() if isinstance(v, (list, tuple)) and len(v) == n)
    return [tuple((k, repr(v[i])) for k, v in lists) for i in range(n)]


def _layer_kind(layer, settings: tuple = ()) -> tuple:
    """What makes two decoder layers trace alike: module classes, parameter shapes, per-layer settings."""
    parts = [settings]
    for name, module in layer.named_modules():
        settings = tuple(sorted((k, v) for k, v in vars(module).items()
                                if not k.startswith("_") and k != "training" and "idx" not in k
                                and isinstance(v, (bool, int, float, str, type(None)))))
        params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters(recurse=False))
        parts.append((name, type(module).__name__, settings, params))
    return tuple(parts)


_KINDS_CACHE: dict[str, tuple] = {}


def _layer_kinds_of_full_model(config) -> tuple:
    key = config.to_json_string(use_diff=False)
    if key not in _KINDS_CACHE:
        _KINDS_CACHE[key] = _build_layer_kinds(config)
    return _KINDS_CACHE[key]


def _build_layer_kinds(config) -> tuple:
    import torch
    from transformers import AutoModelForCausalLM

    n = _num_layers(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    kinds = tuple(_layer_kind(layer, settings)
                  for layer, settings in zip(_decoder_layers(model, n), _per_layer_settings(config, n)))
    # Kinds as small integers in order of first appearance: cheap to compare and to show.
    ids: dict[tuple, int] = {}
    return tuple(ids.setdefault(k, len(ids)) for k in kinds)


def _traced_layer_count(kinds: tuple) -> int:
    """The shortest prefix in which every kind appears twice (or as often as it appears at all)."""
    want = {k: min(2, kinds.count(k)) for k in set(kinds)}
    seen: dict[int, int] = {}
    for i, k in enumerate(kinds):
        seen[k] = seen.get(k, 0) + 1
        if all(seen.get(kk, 0) >= c for kk, c in want.items()):
            return i + 1
    return len(kinds)


def _traced_index_for(i: int, kinds: tuple, traced_count: int) -> int:
    if i < traced_count:
        return i
    return max(j for j in range(traced_count) if kinds[j] == kinds[i])


# ----------------------------------------------------------------------------------------------------------------
# Instruments


class _StorageLog:
    """Every storage created by an op, as (serial, +bytes) on birth and (serial, -bytes) on death."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self.marks: dict[str, int] = {}
        self.alive: dict[int, tuple[int, Any]] = {}  # id(storage) -> (serial, weakref)
        self._next_serial = 0

    def mark(self, label: str) -> None:
        self.marks.setdefault(label, len(self.events))

    def serial_of(self, storage) -> int | None:
        entry = self.alive.get(id(storage))
        return entry[0] if entry is not None else None

    def note(self, storage) -> None:
        key = id(storage)
        if key in self.alive:
            return
        serial, nbytes = self._next_serial, storage.nbytes()
        self._next_serial += 1

        def died(_ref, log=self, key=key, serial=serial, nbytes=nbytes):
            log.events.append((serial, -nbytes))
            log.alive.pop(key, None)

        self.alive[key] = (serial, weakref.ref(storage, died))
        self.events.append((serial, nbytes))

    def live_curve(self, excluded: set[int]) -> list[int]:
        """curve[k] = live bytes after the first k events."""
        return [0, *accumulate(0 if s in excluded else d for s, d in self.events)]


def _make_recorder(log: _StorageLog, param_ids: set[int], autocast_copies: dict[int, tuple[str, int]],
                   region_now):
    """Logs storages; notes casts of parameters (autocast weight copies) in autocast_copies: serial -> (region
    that made it, bytes)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    to_copy = torch.ops.aten._to_copy.default

    class Recorder(TorchDispatchMode):
        grouped_mm = False  # MoE experts ran as grouped matmuls

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "grouped_mm" in func.__name__:
                self.grouped_mm = True
            out = func(*args, **(kwargs or {}))
            inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if id(st) not in inputs:  # not a view or in-place result of something already known
                        log.note(st)
            if (func is to_copy and isinstance(args[0], torch.Tensor)
                    and id(args[0].untyped_storage()) in param_ids):
                st = out.untyped_storage()
                serial = log.serial_of(st)
                if serial is not None:
                    autocast_copies[serial] = (region_now(), st.nbytes())
            return out

    return Recorder()


@dataclass
class _Region:
    saved_bytes: int = 0
    forward_grad_bytes: int = 0
    autocast_copy_bytes: int = 0
    autocast_cache_bytes: int = 0


@dataclass
class _Run:
    embedding: RegionTrace
    layers: list[RegionTrace]
    head: RegionTrace
    output_bytes: int
    loss_bytes: int
    layer_kinds: tuple = field(default_factory=tuple)


def _tensors_in(obj):
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _run_fake_step(config, attn_impl: str, param_dtype, autocast_dtype, micro_batch: int, seq_len: int,
                   checkpointing: bool, notes: list[str], liger: bool = False, device_kind: str = "cuda",
                   adapter=None, tiled: bool = False, chunked_loss: int = 0) -> _Run:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    n = _num_layers(config)
    lora = adapter is not None and adapter.is_adapter
    with FakeTensorMode(allow_non_fake_inputs=True), contextlib.ExitStack() as patches:
        # LoRA: the frozen base is stored in the compute dtype (toolkit.train loads it so; autocast then only
        # copies the small adapters).
        base_dtype = (autocast_dtype or param_dtype) if lora else param_dtype
        model = AutoModelForCausalLM.from_config(config, dtype=base_dtype, attn_implementation=attn_impl)
        model.train()
        if liger:
            from toolkit.estimate.liger import liger_applied

            patches.enter_context(liger_applied(model, gpu_footprint=device_kind == "cuda"))
        if tiled:
            from toolkit.estimate.tiling import tiling_traced

            patches.enter_context(tiling_traced(model))
        if chunked_loss:
            from toolkit.estimate.chunkedce import chunked_ce_applied

            patches.enter_context(chunked_ce_applied(model, chunked_loss))
        layers = _decoder_layers(model, n)
        kinds = tuple(_layer_kind(layer, settings) for layer, settings in zip(layers, _per_layer_settings(config, n)))
        if checkpointing:
            # Before wrapping, as the Trainer does on the PeftModel (which forwards to the base): transformers'
            # activation_checkpointing_enable also calls enable_input_require_grads, so the frozen embedding's
            # output requires grad and the checkpointed layers' recompute reaches the adapters.
            _enable_checkpointing(model, op_policy=checkpointing == CHECKPOINTING_OP,
                                  on_save=lambda out: [charge(t) for t in _tensors_in(out)])
        if lora:
            model = _wrap_with_peft(model, adapter, autocast=autocast_dtype is not None, notes=notes)
            model.train()
        input_ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)

        log = _StorageLog()
        param_ids = {id(p.untyped_storage()) for p in model.parameters()}
        autocast_copies: dict[int, tuple[str, int]] = {}
        regions = {name: _Region() for name in ("embedding", *(f"layer{i}" for i in range(n)), "head")}
        state = {"region": "embedding", "phase": "forward"}
        charged: set = set()
        charged_serials: list[tuple[str, int, int]] = []  # (region, serial, bytes) of saved storages

        def charge(t, region_name: str | None = None) -> None:
            st = t.untyped_storage()
            key = id(st)
            if key in param_ids:
                return
            serial = log.serial_of(st)
            ident = ("serial", serial) if serial is not None else ("external", key)
            if ident in charged:
                return
            charged.add(ident)
            region = regions[region_name or state["region"]]
            if autocast_dtype is not None and serial is not None and serial in autocast_copies:
                region.autocast_copy_bytes += st.nbytes()
            else:
                region.saved_bytes += st.nbytes()
                if serial is not None:
                    charged_serials.append((region_name or state["region"], serial, st.nbytes()))

        def pack(t):
            if state["phase"] == "forward":
                charge(t)
            return t

        def enter_layer(i: int, hidden) -> None:
            if state["phase"] != "forward" or state["region"] == f"layer{i}":
                return
            state["region"] = f"layer{i}"
            log.mark(f"f:layer{i}")
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(lambda _g, i=i: log.mark(f"be:layer{i}"))

        handles = []
        for i, layer in enumerate(layers):
            def pre_hook(_m, args, kwargs, i=i):
                hidden = args[0] if args else kwargs.get("hidden_states")
                enter_layer(i, hidden)

            def post_hook(_m, _args, output, i=i):
                if state["phase"] != "forward":
                    return
                log.mark(f"e:layer{i}")
                state["region"] = "head"
                outs = _tensors_in(output)
                if outs and outs[0].requires_grad:
                    outs[0].register_hook(lambda _g, i=i: log.mark(f"b:layer{i}"))

            handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(layer.register_forward_hook(post_hook))
            if checkpointing and hasattr(layer, "_gradient_checkpointing_func"):
                layer._gradient_checkpointing_func = _charging_checkpoint(
                    layer._gradient_checkpointing_func, i, enter_layer, charge, state)

        recorder = _make_recorder(log, param_ids, autocast_copies, lambda: state["region"])
        amp = (torch.autocast(device_type="cpu", dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
        with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            log.mark("f:embedding")
            with amp:
                output = model(input_ids=input_ids, labels=input_ids)
                if autocast_dtype is not None:
                    alive = {entry[0] for entry in log.alive.values()}
                    for serial, (name, nbytes) in autocast_copies.items():
                        if serial in alive and ("serial", serial) not in charged:
                            regions[name].autocast_cache_bytes += nbytes
            loss = output.loss
            logits = [st for st in {id(t.untyped_storage()): t.untyped_storage()
                                    for t in _tensors_in(output.logits)}.values()]
            output_bytes = sum(st.nbytes() for st in logits if log.serial_of(st) is None
                               or ("serial", log.serial_of(st)) not in charged)
            del output, logits
            log.mark("f:end")
            state["phase"] = "backward"
            log.mark("b:begin")
            loss.backward()
            log.mark("b:end")
        if recorder.grouped_mm:
            notes.append("MoE experts: grouped matmuls over tokens x top_k routed rows, a footprint that does not "
                         "depend on the routing (real runs differ by a few hundred bytes a layer)")
        for h in handles:
            h.remove()
        grad_serials = {log.serial_of(p.grad.untyped_storage()) for p in model.parameters() if p.grad is not None}
        loss_bytes = loss.untyped_storage().nbytes()

    # A saved storage that ends as a parameter's .grad was a gradient made in forward (Liger's fused linear
    # cross-entropy computes the LM head's weight gradient there): the memory model counts it apart from the
    # activations, from that forward until its region's backward turns it into the parameter's gradient.
    for name, serial, nbytes in charged_serials:
        if serial in grad_serials:
            regions[name].saved_bytes -= nbytes
            regions[name].forward_grad_bytes += nbytes

    curve = log.live_curve(grad_serials - {None})
    grad_curve = [0, *accumulate(d if s in grad_serials else 0 for s, d in log.events)]
    marks = log.marks
    last = f"layer{n - 1}"

    # Extras are measured above what the memory model composes as live: every region's saved bytes and autocast
    # copies up to and including this one (toolkit.estimate.memory._simulate), and in forward the copies autocast's cache
    # holds. What else is live at that moment (a layer's
    # output not yet saved by the next one, the incoming gradient) is part of the extra, so the composed peak is
    # the traced one.
    order = ["embedding", *(f"layer{i}" for i in range(n)), "head"]
    held = dict(zip(order, accumulate(regions[r].saved_bytes + regions[r].autocast_copy_bytes for r in order)))
    cached = dict(zip(order, accumulate(regions[r].autocast_cache_bytes for r in order)))

    def region_trace(name: str, fwd: tuple[str, str], bwd: tuple[str, str]) -> RegionTrace:
        region = regions[name]
        backward_extra, grads_at_peak, grads = _backward_peak(curve, grad_curve, marks, *bwd, held[name])
        return RegionTrace(saved_bytes=region.saved_bytes,
                           forward_extra_bytes=_peak_above(curve, marks, *fwd, held[name] + cached[name]),
                           backward_extra_bytes=backward_extra,
                           autocast_copy_bytes=region.autocast_copy_bytes,
                           autocast_cache_bytes=region.autocast_cache_bytes,
                           backward_grad_bytes=grads_at_peak, grad_bytes=grads,
                           forward_grad_bytes=region.forward_grad_bytes)

    embedding = region_trace("embedding", ("f:embedding", "f:layer0"), ("be:layer0", "b:end"))
    layer_traces = [region_trace(f"layer{i}", (f"f:layer{i}", f"e:layer{i}"), (f"b:layer{i}", f"be:layer{i}"))
                    for i in range(n)]
    head = region_trace("head", (f"e:{last}", "f:end"), ("b:begin", f"b:{last}"))
    return _Run(embedding=embedding, layers=layer_traces, head=head, output_bytes=output_bytes,
                loss_bytes=loss_bytes, layer_kinds=_kind_ids(kinds))


def _kind_ids(kinds: tuple) -> tuple:
    ids: dict[tuple, int] = {}
    return tuple(ids.setdefault(k, len(ids)) for k in kinds)


def _peak_above(curve: list[int], marks: dict[str, int], start: str, end: str, held: int) -> int:
    """Peak live bytes between two marks, above `held`."""
    if start not in marks or end not in marks or marks[end] < marks[start]:
        return 0
    return max(0, max(curve[marks[start]:marks[end] + 1]) - held)


def _backward_peak(curve: list[int], grad_curve: list[int], marks: dict[str, int], start: str, end: str,
                   held: int) -> tuple[int, int, int]:
    """(peak live bytes above `held`, parameter-gradient bytes created by then, all created in the window) for a
    backward window; the peak is that of activations plus the gradients the window has created, since both are
    live together on the device."""
    if start not in marks or end not in marks or marks[end] < marks[start]:
        return 0, 0, 0
    a, b = marks[start], marks[end]
    base = grad_curve[a]
    k = max(range(a, b + 1), key=lambda i: curve[i] + grad_curve[i] - base)
    return max(0, curve[k] - held), max(0, grad_curve[k] - base), max(0, grad_curve[b] - base)


def _wrap_with_peft(model, adapter, *, autocast: bool, notes: list[str]):
    """The real PEFT LoRA wrapper (peft.get_peft_model) around the fake base model."""
    import warnings

    import torch
    from peft import get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    from toolkit.estimate.fakecopy import fake_deepcopy

    # Adapters are born in their training dtype on the fake CPU device: fp32 under autocast (PEFT's default
    # autocast_adapter_dtype=True upcasts bf16/fp16 adapters), else the base's dtype (DeepSpeed casts the whole
    # module, FSDP2's MixedPrecisionPolicy computes in it). PEFT's move of each adapter to its base layer's
    # device and dtype is skipped, as are PEFT's module.to(base weight's device) calls: they are no-ops here, and
    # nn.Module.to() cannot swap fake parameters.
    adapter_dtype = torch.float32 if autocast else next(model.parameters()).dtype
    previous_dtype, previous_move = torch.get_default_dtype(), BaseTunerLayer._move_adapter_to_device_of_base_layer
    previous_to = torch.nn.Module.to
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_default_dtype(adapter_dtype)
        BaseTunerLayer._move_adapter_to_device_of_base_layer = lambda self, *a, **k: None
        torch.nn.Module.to = lambda self, *a, **k: self
        try:  # fake_deepcopy: PEFT's modules_to_save copies (toolkit/estimate/fakecopy.py)
            with fake_deepcopy():
                wrapped = get_peft_model(model, adapter.lora_config(), autocast_adapter_dtype=False)
        finally:
            torch.set_default_dtype(previous_dtype)
            BaseTunerLayer._move_adapter_to_device_of_base_layer = previous_move
            torch.nn.Module.to = previous_to
    notes.append(f"{adapter.method}: PEFT LoRA r={adapter.r}, dropout {adapter.dropout}, targets {adapter.targets}"
                 + ("; 4-bit base traced as its compute-dtype matmuls (bitsandbytes MatMul4Bit saves no input "
                    "for a frozen weight, as a frozen nn.Linear)" if adapter.method == "qlora" else ""))
    return wrapped


def _enable_checkpointing(model, *, op_policy: bool = False, on_save=None) -> None:
    """As the HF Trainer does (transformers 5: activation_checkpointing_enable, use_reentrant=False by default);
    `op_policy`: with torchtitan's per-op selective policy as the checkpoint's context_fn (toolkit.estimate.selective),
    whose kept outputs go to `on_save`."""
    import warnings

    from toolkit.estimate.selective import op_context_fn

    kwargs = {"use_reentrant": False, "context_fn": op_context_fn(on_save)} if op_policy else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(kwargs)
        else:
            model.gradient_checkpointing_enable(kwargs)


def _charging_checkpoint(checkpoint_func, i: int, enter_layer, charge, state):
    """Wrap a layer's checkpoint call so that what the checkpoint keeps (its positional inputs, saved by autograd,
    and the keyword tensors its recompute closure holds: masks, rotary tables) is charged to that layer."""

    def call(function, *args, **kwargs):
        if state["phase"] == "forward":
            enter_layer(i, args[0] if args else None)
            for t in _tensors_in((getattr(function, "keywords", {}), kwargs)):
                charge(t, f"layer{i}")
        return checkpoint_func(_with_float32_ops(function), *args, **kwargs)

    return call


# ----------------------------------------------------------------------------------------------------------------
# Trace environment: fake-mode fixes and GPU kernel stand-ins


@contextlib.contextmanager
def _trace_environment(attention: str, device_kind: str, notes: list[str], *, cuda_autocast: bool = False):
    """Yields the attn_implementation to build the model with."""
    import torch
    import transformers.masking_utils as masking_utils
    from torch._subclasses.fake_tensor import FakeTensor

    original_find = masking_utils.find_packed_sequence_indices

    # Under FakeTensorMode transformers treats fake tensors as graph tracing and builds a full (b, 1, s, s) mask
    # (and SDPA then expands grouped key/value heads) where real unpacked inputs get none (docs/ENGINE_FACTS.md).
    def find_packed_sequence_indices(position_ids):
        if isinstance(position_ids, FakeTensor):
            return None
        return original_find(position_ids)

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    grouped_mm_patch = _grouped_mm_fake_fix()
    F = torch.nn.functional
    original_sdpa, original_dropout = F.scaled_dot_product_attention, F.dropout
    attn_impl = attention
    try:
        if attention == "flash_attention_2":
            attn_impl = _register_flash_standin(notes)
        elif device_kind == "cuda" and attention == "sdpa":
            F.scaled_dot_product_attention = _cuda_sdpa_standin(original_sdpa, notes)
        if device_kind == "cuda":
            F.dropout = _cuda_dropout_standin(original_dropout, notes)
        with _cuda_autocast_float32_ops() if cuda_autocast else contextlib.nullcontext():
            yield attn_impl
    finally:
        masking_utils.find_packed_sequence_indices = original_find
        if grouped_mm_patch is not None:
            grouped_mm_patch()
        F.scaled_dot_product_attention, F.dropout = original_sdpa, original_dropout


def _grouped_mm_fake_fix():
    """MoE experts run as grouped matrix multiplies over all routed tokens (transformers' default experts
    implementation), so their footprint does not depend on the routing. torch's fake kernel for grouped_mm accepts
    only bfloat16 where the real CPU kernel also takes float32: route other dtypes through transformers' own
    fallback op, which saves the same tensors. Returns an undo function, or None when there is nothing to patch."""
    try:
        import transformers.integrations.moe as moe
    except ImportError:
        return None
    if not hasattr(moe, "_can_use_grouped_mm"):
        return None
    from torch._subclasses.fake_tensor import FakeTensor
    import torch

    original = moe._can_use_grouped_mm

    def can_use_grouped_mm(input, weight, offs):
        if isinstance(weight, FakeTensor) and weight.dtype != torch.bfloat16:
            return False
        return original(input, weight, offs)

    moe._can_use_grouped_mm = can_use_grouped_mm

    def undo():
        moe._can_use_grouped_mm = original

    return undo


def _attention_kernel_function():
    """An autograd function with the footprint of the CUDA flash / memory-efficient attention kernels: forward
    saves q, k, v, the output and the fp32 log-sum-exp (batch x heads x seq), and (with a mask) the bias; no
    seq x seq tensor (PyTorch aten/src/ATen/native/transformers/cuda/attention_backward.cu)."""
    import torch

    from toolkit.estimate.selective import kernel_saved

    class AttentionKernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, mask, heads_first: bool):
            # Both kernels write their output as (batch, seq, heads, dim); SDPA returns it as a (b, h, s, d) view.
            if heads_first:
                b, h, s_q, _ = q.shape
                out = q.new_empty((b, s_q, h, v.shape[-1])).transpose(1, 2)
            else:
                b, s_q, h, _ = q.shape
                out = q.new_empty((b, s_q, h, v.shape[-1]))
            lse = q.new_empty((b, h, s_q), dtype=torch.float32)
            kernel_saved(out, lse)  # the selective op policy keeps the attention kernel's outputs
            ctx.save_for_backward(q, k, v, out, lse, *([mask] if isinstance(mask, torch.Tensor) else []))
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = ctx.saved_tensors[:3]
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None

    return AttentionKernel


def _autocast_inputs(*tensors):
    """As autocast casts the inputs of attention kernels (sdpa is on its lower-precision list; transformers casts
    flash-attention inputs to the autocast dtype)."""
    import torch

    if not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def _cuda_sdpa_standin(original, notes: list[str]):
    kernel = _attention_kernel_function()

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False):
        notes.append("sdpa: CUDA kernel footprint (q, k, v, out, fp32 logsumexp; no seq x seq) instead of CPU's")
        query, key, value = _autocast_inputs(query, key, value)
        return kernel.apply(query, key, value, attn_mask, True)

    return scaled_dot_product_attention


def _register_flash_standin(notes: list[str]) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    kernel = _attention_kernel_function()

    def flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        notes.append("flash_attention_2: traced with a stand-in of the flash kernel's footprint (q, k, v, out, "
                     "fp32 logsumexp; grouped k/v not repeated, no mask)")
        # As transformers' flash_attention_forward: (b, s, h, d) views of the projections go to the kernel.
        q, k, v = (t.transpose(1, 2) for t in _autocast_inputs(query, key, value))
        return kernel.apply(q, k, v, None, False), None

    AttentionInterface.register(_FLASH_STANDIN, flash_attention)
    AttentionMaskInterface.register(_FLASH_STANDIN, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return _FLASH_STANDIN


def _cuda_dropout_standin(original, notes: list[str]):
    import torch

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0 or inplace:
            return original(input, p, training, inplace)
        notes.append("dropout: CUDA fused kernel keeps a 1-byte mask (CPU keeps it in the activation dtype)")
        return torch.native_dropout(input, p, True)[0]

    return dropout


# CUDA autocast runs these in float32 (torch/csrc/autocast_mode.cpp, "fp32" and "fp32_set_opt_dtype" CUDA lists);
# CPU autocast leaves them in the input dtype, so a bf16 softmax or GELU saves half the bytes it would on a GPU.
_CUDA_AUTOCAST_FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "group_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "cross_entropy", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "norm",
)


_FLOAT32_OPS_ACTIVE = [0]
"""How many _cuda_autocast_float32_ops contexts are open: a checkpoint's recompute runs in the autograd engine,
outside the TorchFunctionMode stack of the forward, so checkpointed layers re-enter the mode themselves."""


def _float32_ops_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    F = torch.nn.functional
    funcs = set()
    for name in _CUDA_AUTOCAST_FLOAT32:
        for owner in (torch, torch.Tensor, F, torch.special, torch.linalg):
            f = getattr(owner, name, None)
            if f is not None:
                funcs.add(f)
    funcs.update({torch.Tensor.__pow__, torch.Tensor.__rpow__, torch.linalg.vector_norm})
    low = (torch.bfloat16, torch.float16)

    def up(x):
        return x.float() if isinstance(x, torch.Tensor) and x.dtype in low else x

    class Float32Ops(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in funcs and torch.is_autocast_enabled("cpu"):
                args = tuple(up(a) for a in args)
                kwargs = {k: up(v) for k, v in kwargs.items()}
            return func(*args, **kwargs)

    return Float32Ops()


@contextlib.contextmanager
def _cuda_autocast_float32_ops():
    """While CPU autocast is on, run the ops CUDA autocast keeps in float32 in float32 (inputs cast up, as CUDA
    autocast does), so the saved tensors have the GPU's dtypes."""
    _FLOAT32_OPS_ACTIVE[0] += 1
    try:
        with _float32_ops_mode():
            yield
    finally:
        _FLOAT32_OPS_ACTIVE[0] -= 1


def _with_float32_ops(function):
    """`function` run under the float32-ops mode, in forward and in a checkpoint's recompute alike."""
    if not _FLOAT32_OPS_ACTIVE[0]:
        return function

    def run(*args, **kwargs):
        with _float32_ops_mode():
            return function(*args, **kwargs)

    return run
