"""What a torch.compile'd training step keeps for backward, traced the way the compiler partitions it, on CPU.

torch.compile's inductor backend hands the step's forward to AOTAutograd, which traces forward and backward into
one joint graph (with inductor's decompositions), and splits it with inductor's partition function: its joint-graph
passes, then `min_cut_rematerialization_partition`, which chooses the cheapest set of forward values to keep for
backward and recomputes the rest (fused elementwise chains, casts) in the backward graph
(torch/_inductor/compile_fx.py `partition_fn`, torch/_functorch/partitioners.py). The backward graph's inputs other
than the incoming gradients are exactly the tensors the compiled forward saves: the compiled autograd function
hands them to `ctx.save_for_backward`.

We run that same pipeline, with the same decompositions and the same partition function, on a depth-reduced copy of
the model under FakeTensorMode (no memory, seconds), with `torch.compiler.is_compiling()` reporting True as it does
under Dynamo, so transformers takes the code paths a compiled model takes (it builds the full boolean causal mask
instead of relying on SDPA's is_causal). Each saved value is charged to the region whose forward made it (an FX
annotation set by module hooks while tracing). Parameters and buffers are graph inputs with a static lifetime, as
Dynamo marks them, so saving one costs nothing.

device_kind="cuda": CPU's SDPA lowers to `_scaled_dot_product_flash_attention_for_cpu`; on CUDA the same call lowers
to the flash kernel without a mask or the memory-efficient kernel with one (which transformers passes under
compile). The trace calls those CUDA aten ops (their meta kernels give the shapes: out, fp32 logsumexp, the bias),
so the joint graph holds what a CUDA compile would see.

What a compiled step keeps beyond the saved tensors (temporaries inside the compiled forward and backward) is taken
from the eager trace (toolkit.tracer): inductor frees intermediates inside a fused kernel, so this is an upper
bound there; the note says so.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

from toolkit.activations import ActivationTrace

PARTITIONER = "torch._inductor.compile_fx.partition_fn -> torch._functorch.partitioners.min_cut_rematerialization_partition"


@dataclass(frozen=True)
class CompiledSaved:
    """Bytes the compiled forward saves for backward, by region of the traced (depth-reduced) model."""

    by_region: dict
    """region ("embedding", "layer<i>", "head") -> bytes of unique saved storages (parameters, buffers excluded)."""
    autocast_copy_by_region: dict
    """Saved low-precision casts of parameters (under autocast, when the partitioner keeps them)."""
    saved: tuple
    """(region, shape, dtype, bytes) of every saved tensor, for --explain and tests."""

    @property
    def total_bytes(self) -> int:
        return sum(self.by_region.values())


def trace_compiled_activations(config, *, seq_len: int, micro_batch: int = 1, dtype: str = "bfloat16",
                               autocast: bool = False, attention: str = "sdpa", device_kind: str = "cuda",
                               checkpointing: bool = False) -> ActivationTrace:
    """The activation trace of a torch.compile'd step: saved bytes from the compiler's partition, the rest
    (temporaries, autocast cache, output) from the eager trace of the same job.

    With checkpointing, each decoder layer keeps what the eager checkpoint keeps (its inputs: the compiled
    checkpoint saves the inputs of the wrapped region and recomputes the rest), and embedding and head are traced
    compiled."""
    from toolkit import tracer

    if attention == "flash_attention_2":
        raise NotImplementedError("--compile with flash_attention_2: the flash-attn kernels are traced only eagerly; "
                                  "use sdpa (which compiles to the same flash kernel without a mask)")
    eager = tracer.trace_activations(config, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype,
                                     autocast=autocast, attention=attention, device_kind=device_kind,
                                     checkpointing=checkpointing)
    full_kinds = tracer._layer_kinds_of_full_model(config)
    traced_count = tracer._traced_layer_count(full_kinds)
    reduced = tracer._reduced_config(config, len(full_kinds), traced_count)
    notes: list[str] = []
    saved = compiled_saved_bytes(reduced, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype,
                                 autocast=autocast, attention=attention, device_kind=device_kind, notes=notes)

    def region(name: str, eager_region):
        return replace(eager_region, saved_bytes=saved.by_region.get(name, 0),
                       autocast_copy_bytes=saved.autocast_copy_by_region.get(name, 0))

    if checkpointing:
        layers = eager.layers
        notes.append("checkpointed layers keep their inputs (as eager); embedding and head traced compiled")
    else:
        layers = tuple(region(f"layer{tracer._traced_index_for(i, full_kinds, traced_count)}", eager.layers[i])
                       for i in range(len(full_kinds)))
    notes.append(f"torch.compile: saved tensors from AOTAutograd's joint graph split by {PARTITIONER} "
                 "(inductor decompositions, FakeTensorMode); temporaries from the eager trace (an upper bound "
                 "inside fused kernels)")
    return replace(eager, embedding=region("embedding", eager.embedding), layers=layers,
                   head=region("head", eager.head), notes=tuple(dict.fromkeys(eager.notes + tuple(notes))))


def compiled_saved_bytes(config, *, seq_len: int, micro_batch: int = 1, dtype: str = "bfloat16",
                         autocast: bool = False, attention: str = "sdpa", device_kind: str = "cuda",
                         notes: list | None = None) -> CompiledSaved:
    """Partition the joint graph of `config`'s model (at its own depth) as inductor does, and sum what the
    forward graph saves for backward, region by region."""
    import torch
    import torch.fx.traceback as fx_traceback
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.compile_fx import partition_fn as inductor_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from toolkit import tracer

    notes = notes if notes is not None else []
    compute_dtype = getattr(torch, dtype)
    param_dtype = torch.float32 if autocast else compute_dtype
    n = tracer._num_layers(config)
    captured: dict = {}
    cuda_autocast = device_kind == "cuda" and autocast and compute_dtype != torch.float32
    with contextlib.ExitStack() as stack:
        attn_impl = stack.enter_context(tracer._trace_environment(attention, "cpu", notes))
        stack.enter_context(_compiling())
        if device_kind == "cuda" and attention == "sdpa":
            stack.enter_context(_cuda_sdpa_ops(notes))
        fake_mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        model = AutoModelForCausalLM.from_config(config, dtype=param_dtype, attn_implementation=attn_impl)
        model.train()
        named = [*model.named_parameters(), *model.named_buffers()]
        n_params = len(list(model.parameters()))
        names, tensors = [k for k, _ in named], [v for _, v in named]
        layers = tracer._decoder_layers(model, n)
        regions = contextlib.ExitStack()

        def enter(name):
            regions.close()
            regions.enter_context(fx_traceback.annotate({"toolkit_region": name}))

        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda *_, i=i: enter(f"layer{i}"))
            layer.register_forward_hook(lambda *_: enter("head"))

        def step(*args):
            enter("embedding")
            try:
                out = torch.func.functional_call(model, dict(zip(names, args[:-1])), (args[-1],),
                                                 {"labels": args[-1]})
                return out.loss, out.logits
            finally:
                regions.close()

        def partition(gm, joint_inputs, **kwargs):
            # Dynamo marks parameters and buffers static inputs; inductor passes their indices on.
            kwargs["static_lifetime_input_indices"] = list(range(len(tensors)))
            with V.set_fake_mode(fake_mode):  # as compile_fx partitions (its random-seed passes read it)
                fw, bw = inductor_partition(gm, joint_inputs, **kwargs)
            captured["fw"], captured["bw"] = fw, bw
            return fw, bw

        def keep(gm, _inputs):
            return make_boxed_func(gm.forward)

        compiled = aot_function(step, fw_compiler=keep, bw_compiler=keep, partition_fn=partition,
                                decompositions=select_decomp_table())
        input_ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        amp = (torch.autocast(device_type="cpu", dtype=compute_dtype) if autocast and compute_dtype != torch.float32
               else contextlib.nullcontext())
        with fx_traceback.preserve_node_meta(), amp, (tracer._cuda_autocast_float32_ops() if cuda_autocast
                                                      else contextlib.nullcontext()):
            compiled(*tensors, input_ids)
    return _saved_of(captured["fw"], captured["bw"], n_inputs=len(tensors), n_params=n_params,
                     autocast=autocast)


def _saved_of(fw, bw, *, n_inputs: int, n_params: int, autocast: bool) -> CompiledSaved:
    """The backward graph's non-gradient inputs, by storage, with the region of the forward node that made them."""
    import torch

    fw_nodes = {node.name: node for node in fw.graph.nodes}
    placeholders = [node for node in fw.graph.nodes if node.op == "placeholder"]
    static = {node.name for node in placeholders[:n_inputs]}
    params = {node.name for node in placeholders[:n_params]}
    by_region: dict[str, int] = {}
    copies: dict[str, int] = {}
    rows = []
    seen: set = set()
    for node in bw.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents") or node.name in static:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue  # saved sizes (SymInts), RNG seeds as ints
        storage = value.untyped_storage()
        if id(storage) in seen:
            continue
        seen.add(id(storage))
        source = fw_nodes.get(node.name)
        region = ((source.meta.get("custom") or {}).get("toolkit_region") if source is not None else None) or "head"
        if source is not None and source.op == "placeholder":
            region = "embedding"  # the batch (token ids), saved for the embedding's backward
        nbytes = storage.nbytes()
        if autocast and source is not None and _is_cast_of(source, params):
            copies[region] = copies.get(region, 0) + nbytes
        else:
            by_region[region] = by_region.get(region, 0) + nbytes
        rows.append((region, tuple(value.shape), str(value.dtype).replace("torch.", ""), nbytes))
    return CompiledSaved(by_region=by_region, autocast_copy_by_region=copies, saved=tuple(rows))


def _is_cast_of(node, params: set) -> bool:
    """A forward node made from a parameter by dtype conversions and views only (an autocast weight copy)."""
    for _ in range(4):
        if node.op == "placeholder":
            return node.name in params
        args = [a for a in node.args if hasattr(a, "op")]
        if len(args) != 1:
            return False
        node = args[0]
    return False


@contextlib.contextmanager
def _compiling():
    """torch.compiler.is_compiling() True while tracing, as under Dynamo: transformers reads it to choose the code
    paths a compiled model runs (masks built in full, no data-dependent shortcuts)."""
    import torch

    original = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_compiling = original


@contextlib.contextmanager
def _cuda_sdpa_ops(notes: list):
    """F.scaled_dot_product_attention as it lowers on CUDA: the flash kernel without a mask, the memory-efficient
    kernel (with a bias) when transformers passes the compiled path's boolean mask (torch's sdp_utils: flash takes no
    arbitrary mask). Their autograd formulas save q, k, v, out, the fp32 logsumexp and the bias."""
    import torch

    F = torch.nn.functional
    original = F.scaled_dot_product_attention
    aten = torch.ops.aten

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if key.shape[1] != query.shape[1]:
            # Neither CUDA kernel takes grouped k/v under autograd here: torch repeats them (math of enable_gqa).
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        if attn_mask is None:
            notes.append("sdpa: CUDA flash kernel (aten._scaled_dot_product_flash_attention) in the joint graph")
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                            scale=scale)[0]
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        notes.append("sdpa: CUDA memory-efficient kernel (aten._scaled_dot_product_efficient_attention, with the "
                     "compiled path's mask as bias) in the joint graph")
        return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask.to(query.dtype), True,
                                                            dropout_p, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
