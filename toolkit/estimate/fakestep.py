"""The fake training step the tracer watches: a depth-reduced copy of the model built under FakeTensorMode
(optionally wrapped with PEFT LoRA, checkpointed, Liger-patched or tiled), run forward with labels and backward with
the recording instruments (toolkit.estimate.recording) and the layer hooks that mark where regions start and end."""

from __future__ import annotations

import contextlib
from itertools import accumulate

from toolkit.estimate.activations import RegionTrace
from toolkit.estimate.layerkinds import decoder_layers, kind_ids, layer_kind, num_layers, per_layer_settings
from toolkit.estimate.recording import (Region, Run, StorageLog, backward_peak, make_recorder, peak_above,
                                        tensors_in)
from toolkit.estimate.standins import cuda_autocast_float32_ops, with_float32_ops
from toolkit.estimate.stepevents import region_events
from toolkit.inputs.choices import CHECKPOINTING_OP

@contextlib.contextmanager
def weights_uninitialised():
    """Build a model under FakeTensorMode without its weight init, as transformers itself skips it on the meta device
    (PreTrainedModel.init_weights runs initialize_weights only off meta, then ties the weights): the values mean
    nothing to fake tensors, and some inits branch on them (torch's trunc_normal_ asks `mask.any()`, which a fake
    tensor cannot answer: SigLIP's vision tower). The weights are still tied.
    A module cast while it is built (DeepSeek-V4's `RMSNorm(...).to(dtype=torch.float32)`, `.float()`) swaps each fake
    parameter for its cast copy (torch's Module._apply always swaps a FakeTensor), and torch.utils.swap_tensors refuses
    a tensor any weak reference points to, which the fake mode's own memo of converted tensors does: those memo
    entries are dropped before the swap (a memo, not a fact: a later conversion makes a new fake)."""
    import torch.utils
    from transformers import PreTrainedModel

    original, original_swap = PreTrainedModel.initialize_weights, torch.utils.swap_tensors

    def swap_tensors(t1, t2):
        for tensor in (t1, t2):
            _forget_in_fake_memo(tensor)
        return original_swap(t1, t2)

    PreTrainedModel.initialize_weights = lambda self: None
    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        PreTrainedModel.initialize_weights, torch.utils.swap_tensors = original, original_swap


def _forget_in_fake_memo(tensor) -> None:
    """Drop the fake mode's memo entries (weak-valued, keyed refs) that point to this fake tensor."""
    import weakref

    mode = getattr(tensor, "fake_mode", None)
    if mode is None:
        return
    memo = mode.fake_tensor_converter.meta_converter.tensor_memo
    for ref in weakref.getweakrefs(tensor):
        key = getattr(ref, "key", None)
        if key is not None and memo.get(key) is tensor:
            del memo[key]


def build_for_trace(config, dtype, attn_impl: str):
    """The model transformers builds for `config` (under the caller's device or fake mode), `attn_impl` set on its
    language model and every other sub-model on transformers' own pick (toolkit.inputs.attention.language_attention)."""
    from toolkit.inputs.attention import language_attention
    from toolkit.inputs.modelconfig import auto_model_class

    return auto_model_class(config).from_config(config, dtype=dtype,
                                                attn_implementation=language_attention(config, attn_impl))


def run_fake_step(config, attn_impl: str, param_dtype, autocast_dtype, micro_batch: int, seq_len: int,
                   checkpointing: bool, notes: list[str], liger: bool = False, device_kind: str = "cuda",
                   adapter=None, tiled: bool = False, chunked_loss: int = 0, loss: str = "model",
                   per_layer: tuple[str, ...] | None = None, cast_params: bool = False,
                   adapter_fp32: bool = False, inputs_require_grad: bool = False,
                   image_marks: str | None = None) -> Run:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    n = num_layers(config)
    lora = adapter is not None and adapter.is_adapter
    with FakeTensorMode(allow_non_fake_inputs=True), contextlib.ExitStack() as patches:
        # LoRA: the frozen base is stored in the compute dtype (toolkit.train loads it so; autocast then only
        # copies the small adapters), or in the adapter's --base-dtype (fp32: autocast copies each weight it uses).
        base_dtype = (autocast_dtype or param_dtype) if lora else param_dtype
        if lora and adapter.base_dtype != "auto" and autocast_dtype is not None:  # FSDP2: gathered in param_dtype
            from toolkit.inputs.choices import BASE_DTYPE_NAMES

            base_dtype = getattr(torch, BASE_DTYPE_NAMES[adapter.base_dtype])
        with weights_uninitialised():
            model = build_for_trace(config, base_dtype, attn_impl)
        if cast_params and not lora and autocast_dtype is None:
            # The engines that compute with low-precision weights cast every parameter to that dtype (DeepSpeed's
            # _cast_module_mixed_precision, FSDP2's param_dtype), including those transformers builds in fp32
            # whatever the dtype asked (XLNet's torch.FloatTensor attention weights; its einsum then mixed dtypes).
            for p in model.parameters():
                if p.is_floating_point() and p.dtype != base_dtype:
                    p.data = p.data.to(base_dtype)
        model.train()
        if liger:
            from toolkit.patches.liger import liger_applied

            patches.enter_context(liger_applied(model, gpu_footprint=device_kind == "cuda"))
        if tiled:
            from toolkit.patches.tiling import tiling_traced

            patches.enter_context(tiling_traced(model))
        if chunked_loss:
            from toolkit.patches.chunkedce import chunked_ce_applied

            patches.enter_context(chunked_ce_applied(model, chunked_loss))
        if loss == "trl":
            from toolkit.patches.trlloss import trl_loss_applied

            patches.enter_context(trl_loss_applied(model, gpu_footprint=device_kind == "cuda"))
        layers = decoder_layers(model, n)
        kinds = tuple(layer_kind(layer, settings) for layer, settings in zip(layers, per_layer_settings(config, n, per_layer)))
        if checkpointing:
            # Before wrapping, as the Trainer does on the PeftModel (which forwards to the base): transformers'
            # activation_checkpointing_enable also calls enable_input_require_grads, so the frozen embedding's
            # output requires grad and the checkpointed layers' recompute reaches the adapters.
            enable_checkpointing(model, op_policy=checkpointing == CHECKPOINTING_OP,
                                  on_save=lambda out: [charge(t) for t in tensors_in(out)])
        elif inputs_require_grad:
            model.enable_input_require_grads()
        if lora:
            model = _wrap_with_peft(model, adapter, autocast=autocast_dtype is not None, notes=notes,
                                    adapter_fp32=adapter_fp32)
            model.train()
        input_ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        # The processor's marks of the image tokens, as its batch carries them beside the ids (int64, the ids' shape);
        # no operation reads their values under FakeTensorMode, so the mask they make has its shape whatever they mark
        marks = {image_marks: torch.zeros_like(input_ids)} if image_marks else {}

        log = StorageLog()
        param_ids = {id(p.untyped_storage()) for p in model.parameters()}
        from toolkit.patches.actoffload import OffloadRule, kept_modules_depth

        kept, offload = kept_modules_depth(model), OffloadRule(param_ids, streams=device_kind == "cuda")
        autocast_copies: dict[int, tuple[str, int]] = {}
        regions = {name: Region() for name in ("embedding", *(f"layer{i}" for i in range(n)), "head")}
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
                if not kept.depth:
                    st = t.untyped_storage()
                    serial = log.serial_of(st)
                    key = ("serial", serial) if serial is not None else ("external", id(st))
                    regions[state["region"]].offload_bytes += offload.pack(t, (key, t.storage_offset(), t.dtype))
            return t

        def enter_layer(i: int, hidden) -> None:
            if state["phase"] != "forward" or state["region"] == f"layer{i}":
                return
            state["region"] = f"layer{i}"
            log.mark(f"f:layer{i}")
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(lambda _g, i=i: log.mark(f"be:layer{i}"))

        def stop_at_token_loop() -> None:
            if recorder.token_loop:  # see make_recorder
                raise NotImplementedError(recorder.token_loop)

        handles = []
        for i, layer in enumerate(layers):
            def pre_hook(_m, args, kwargs, i=i):
                stop_at_token_loop()
                hidden = args[0] if args else kwargs.get("hidden_states")
                enter_layer(i, hidden)

            def post_hook(_m, _args, output, i=i):
                stop_at_token_loop()
                if state["phase"] != "forward":
                    return
                log.mark(f"e:layer{i}")
                state["region"] = "head"
                outs = tensors_in(output)
                if outs and outs[0].requires_grad:
                    outs[0].register_hook(lambda _g, i=i: log.mark(f"b:layer{i}"))

            handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(layer.register_forward_hook(post_hook))
            if checkpointing and hasattr(layer, "_gradient_checkpointing_func"):
                layer._gradient_checkpointing_func = _charging_checkpoint(
                    layer._gradient_checkpointing_func, i, enter_layer, charge, state)

        recorder = make_recorder(log, param_ids, autocast_copies, lambda: state["region"], seq_len=seq_len)
        amp = (torch.autocast(device_type="cpu", dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
        with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            log.mark("f:embedding")
            with amp:
                output = model(input_ids=input_ids, labels=input_ids, **marks)
                if autocast_dtype is not None:
                    alive = {entry[0] for entry in log.alive.values()}
                    for serial, (name, nbytes) in autocast_copies.items():
                        if serial in alive and ("serial", serial) not in charged:
                            regions[name].autocast_cache_bytes += nbytes
            loss = output.loss
            logits = [st for st in {id(t.untyped_storage()): t.untyped_storage()
                                    for t in tensors_in(output.logits)}.values()]
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

    events = dict(zip(order, region_events(log.events, marks, n, grad_serials - {None})))

    def region_trace(name: str, fwd: tuple[str, str], bwd: tuple[str, str]) -> RegionTrace:
        region = regions[name]
        backward_extra, grads_at_peak, grads = backward_peak(curve, grad_curve, marks, *bwd, held[name])
        return RegionTrace(saved_bytes=region.saved_bytes,
                           forward_extra_bytes=peak_above(curve, marks, *fwd, held[name] + cached[name]),
                           backward_extra_bytes=backward_extra,
                           autocast_copy_bytes=region.autocast_copy_bytes,
                           autocast_cache_bytes=region.autocast_cache_bytes,
                           backward_grad_bytes=grads_at_peak, grad_bytes=grads,
                           forward_grad_bytes=region.forward_grad_bytes, offload_bytes=region.offload_bytes,
                           forward_events=events[name][0], backward_events=events[name][1],
                           host_ops=log.ops_between(*fwd) + log.ops_between(*bwd))

    embedding = region_trace("embedding", ("f:embedding", "f:layer0"), ("be:layer0", "b:end"))
    layer_traces = [region_trace(f"layer{i}", (f"f:layer{i}", f"e:layer{i}"), (f"b:layer{i}", f"be:layer{i}"))
                    for i in range(n)]
    head = region_trace("head", (f"e:{last}", "f:end"), ("b:begin", f"b:{last}"))
    return Run(embedding=embedding, layers=layer_traces, head=head, output_bytes=output_bytes,
                loss_bytes=loss_bytes, layer_kinds=kind_ids(kinds))


def _wrap_with_peft(model, adapter, *, autocast: bool, notes: list[str], adapter_fp32: bool = False):
    """The real PEFT LoRA wrapper (peft.get_peft_model) around the fake base model. `adapter_fp32`: the adapters
    in fp32 over a low-precision base without autocast (DDP or one process with bf16-pure: nothing casts the model
    after PEFT's autocast_adapter_dtype upcast, so each LoRA layer casts its input to fp32, peft/tuners/lora/layer.py
    Linear.forward _cast_input_dtype, and lora_A keeps that copy for backward)."""
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
    adapter_dtype = torch.float32 if autocast or adapter_fp32 else next(model.parameters()).dtype
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
    if autocast:
        # --modules-to-save-dtype, as toolkit.train casts the copies after wrapping (DDP keeps them so). Without
        # autocast the engine computes them in the traced dtype (FSDP2's param_dtype, or the one compute dtype).
        from toolkit.inputs.lora import apply_saved_dtype

        apply_saved_dtype(wrapped, adapter.saved_dtype)
    notes.append(f"{adapter.method}: PEFT LoRA r={adapter.r}, dropout {adapter.dropout}, targets {adapter.targets}"
                 + ("; 4-bit base traced as its compute-dtype matmuls (bitsandbytes MatMul4Bit saves no input "
                    "for a frozen weight, as a frozen nn.Linear)" if adapter.method == "qlora" else ""))
    return wrapped


def enable_checkpointing(model, *, op_policy: bool = False, on_save=None) -> None:
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
            for t in tensors_in((getattr(function, "keywords", {}), kwargs)):
                charge(t, f"layer{i}")
        return checkpoint_func(with_float32_ops(function), *args, **kwargs)

    return call
