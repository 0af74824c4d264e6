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

The temporaries of the compiled forward and backward come from a liveness walk over the two partitioned graphs in
their order, with inductor's fusion rule applied: a pointwise op's result is a buffer only when an extern kernel
(matmul, attention, embedding backward, ...) or the graph's output reads it, else it is computed inside its
consumer's kernel; views share their base's buffer; a buffer dies after its last reader; the backward graph frees
each saved input after its last use (inductor's generated code deletes its inputs as it goes), and the gradients it
returns stay (they become .grad).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

from toolkit.estimate.activations import ActivationTrace

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
    traffic: dict = field(default_factory=dict)
    """region -> (eager elementwise bytes, compiled elementwise bytes, eager kernels, compiled kernels) over forward
    and backward (`_traffic`)."""
    forward_traffic: dict = field(default_factory=dict)
    """The forward graph's share of `traffic`: what a checkpointed layer runs again in backward."""
    extras: dict = field(default_factory=dict)
    """region -> (forward_extra_bytes, backward_extra_bytes, backward_grad_bytes, grad_bytes) from the liveness
    walk over the partitioned graphs (the meanings of toolkit.estimate.activations.RegionTrace's fields)."""

    @property
    def total_bytes(self) -> int:
        return sum(self.by_region.values())


def trace_compiled_activations(config, *, seq_len: int, micro_batch: int = 1, dtype: str = "bfloat16",
                               autocast: bool = False, attention: str = "sdpa", device_kind: str = "cuda",
                               checkpointing: bool | str = False, blocks: bool = False,
                               chunked_loss: int = 0) -> ActivationTrace:
    """The activation trace of a torch.compile'd step: saved bytes from the compiler's partition, the rest
    (temporaries, autocast cache, output) from the eager trace of the same job.

    With checkpointing (True, or "op" for the per-op selective policy), each decoder layer keeps what the eager
    checkpoint keeps (its inputs: the compiled checkpoint saves the inputs of the wrapped region and recomputes the
    rest; the per-op policy's MUST_SAVE outputs as well, which the partitioner keeps as tagged), and embedding and
    head are traced compiled. Measured against real compiled CPU steps: tests/test_compiled.py.

    `blocks`: each decoder layer is compiled on its own and embedding, head and loss run eagerly (torchtitan's
    apply_compile: torch.compile per TransformerBlock, fullgraph): the layers as traced compiled, embedding and head
    as the eager trace has them, and only the layers' traffic fused. `chunked_loss` (with `blocks` only): that eager
    head + loss is torchtune's chunked cross-entropy (toolkit.patches.chunkedce)."""
    from toolkit.estimate import layerkinds, tracer
    from toolkit.inputs.modelconfig import reduced_config

    if attention == "flash_attention_2":
        raise NotImplementedError("--compile with flash_attention_2: the flash-attn kernels are traced only eagerly; "
                                  "use sdpa (which compiles to the same flash kernel without a mask)")
    if chunked_loss and not blocks:
        raise NotImplementedError("chunked cross-entropy under a whole-model compile: the compiled head + loss are "
                                  "traced unchunked; use blocks (layers compiled, head + loss eager)")
    eager = tracer.trace_activations(config, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype,
                                     autocast=autocast, attention=attention, device_kind=device_kind,
                                     checkpointing=checkpointing, chunked_loss=chunked_loss)
    full_kinds = layerkinds.layer_kinds_of_full_model(config)
    traced_count = layerkinds.traced_layer_count(full_kinds)
    reduced = reduced_config(config, len(full_kinds), traced_count)
    notes: list[str] = []
    saved = compiled_saved_bytes(reduced, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype,
                                 autocast=autocast, attention=attention, device_kind=device_kind, notes=notes)

    def region(name: str, eager_region):
        forward_extra, backward_extra, backward_grads, grads = saved.extras.get(name, (0, 0, 0, 0))
        return replace(eager_region, saved_bytes=saved.by_region.get(name, 0),
                       autocast_copy_bytes=saved.autocast_copy_by_region.get(name, 0),
                       forward_extra_bytes=forward_extra, backward_extra_bytes=backward_extra,
                       backward_grad_bytes=backward_grads, grad_bytes=grads,
                       forward_events=(), backward_events=())  # inductor's allocations are not recorded

    if checkpointing:
        layers = eager.layers
        notes.append("checkpointed layers keep what the eager checkpoint keeps (inputs; with the per-op policy also "
                     "its kept matmul and attention outputs); embedding and head traced compiled")
    else:
        layers = tuple(region(f"layer{layerkinds.traced_index_for(i, full_kinds, traced_count)}", eager.layers[i])
                       for i in range(len(full_kinds)))
    def layer_traffic(name: str):
        # A checkpointed layer runs its forward's elementwise work again in backward (the per-op policy recomputes
        # all but matmuls and attention), fused the same way.
        t = saved.traffic.get(name, (0, 0, 0, 0))
        again = saved.forward_traffic.get(name, (0, 0, 0, 0)) if checkpointing else (0, 0, 0, 0)
        return tuple(a + b for a, b in zip(t, again))

    ends = (0, 0, 0, 0)
    per_region = [ends if blocks else saved.traffic.get("embedding", ends),
                  ends if blocks else saved.traffic.get("head", ends),
                  *(layer_traffic(f"layer{layerkinds.traced_index_for(i, full_kinds, traced_count)}")
                    for i in range(len(full_kinds)))]
    traffic = tuple(sum(t[k] for t in per_region) for k in range(4))
    notes.append(f"torch.compile: saved tensors from AOTAutograd's joint graph split by {PARTITIONER} "
                 "(inductor decompositions, FakeTensorMode); temporaries from a liveness walk over the partitioned "
                 "graphs with inductor's pointwise fusion")
    if blocks:
        notes.append("torch.compile per decoder layer (torchtitan's apply_compile): embedding, head and loss eager")
    return replace(eager, embedding=eager.embedding if blocks else region("embedding", eager.embedding),
                   layers=layers, head=eager.head if blocks else region("head", eager.head), compile_traffic=traffic, notes=tuple(dict.fromkeys(eager.notes + tuple(notes))))


def compiled_saved_bytes(config, *, seq_len: int, micro_batch: int = 1, dtype: str = "bfloat16",
                         autocast: bool = False, attention: str = "sdpa", device_kind: str = "cuda",
                         notes: list | None = None) -> CompiledSaved:
    """Partition the joint graph of `config`'s model (at its own depth) as inductor does, and sum what the
    forward graph saves for backward, region by region. Memoised per process on everything the partition reads
    (the config's content and every argument), with the notes it adds: a whole-model and a per-block compiled trace
    of one job partition the same graph."""
    key = (type(config).__name__, _content(config.to_dict()), seq_len, micro_batch, dtype, autocast, attention,
           device_kind)
    if key not in _SAVED_MEMO:
        added: list[str] = []
        _SAVED_MEMO[key] = (_partitioned_saved_bytes(config, *key[2:], notes=added), tuple(added))
    saved, added = _SAVED_MEMO[key]
    (notes if notes is not None else []).extend(added)
    return saved


_SAVED_MEMO: dict = {}


def _content(value):
    """A config's fields as a key, less its dtype (the model is built with the dtype given, then written back)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _content(v)) for k, v in value.items() if k not in ("dtype", "torch_dtype")))
    if isinstance(value, (list, tuple)):
        return tuple(_content(v) for v in value)
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def _partitioned_saved_bytes(config, seq_len: int, micro_batch: int, dtype: str, autocast: bool, attention: str,
                             device_kind: str, *, notes: list) -> CompiledSaved:
    import torch
    import torch.fx.traceback as fx_traceback
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.compile_fx import partition_fn as inductor_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode

    from toolkit.estimate import layerkinds, standins
    from toolkit.estimate.fakestep import build_for_trace, weights_uninitialised

    compute_dtype = getattr(torch, dtype)
    param_dtype = torch.float32 if autocast else compute_dtype
    n = layerkinds.num_layers(config)
    captured: dict = {}
    cuda_autocast = device_kind == "cuda" and autocast and compute_dtype != torch.float32
    with contextlib.ExitStack() as stack:
        attn_impl = stack.enter_context(standins.trace_environment(attention, "cpu", notes))
        stack.enter_context(_compiling())
        if device_kind == "cuda" and attention == "sdpa":
            stack.enter_context(_cuda_sdpa_ops(notes))
        fake_mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        with weights_uninitialised():
            model = build_for_trace(config, param_dtype, attn_impl)
        model.train()
        named = [*model.named_parameters(), *model.named_buffers()]
        n_params = len(list(model.parameters()))
        names, tensors = [k for k, _ in named], [v for _, v in named]
        layers = layerkinds.decoder_layers(model, n)
        regions = contextlib.ExitStack()

        def enter(name):
            regions.close()
            regions.enter_context(fx_traceback.annotate({"toolkit_region": name}))

        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda *_, i=i: enter(f"layer{i}"))
            layer.register_forward_hook(lambda *_: enter("head"))

        loss_apart = _loss_in_own_graph(model)
        if loss_apart:
            notes.append("torch.compile: the loss runs as its own graph (Dynamo breaks the graph where transformers "
                         "logs that the model's loss_type is unknown): the model's graph returns the logits and "
                         "gets their real gradient, the loss graph saves its own tensors")

        def step(*args):
            enter("embedding")
            try:
                out = torch.func.functional_call(model, dict(zip(names, args[:-1])), (args[-1],),
                                                 None if loss_apart else {"labels": args[-1]})
                return out.logits if loss_apart else (out.loss, out.logits)
            finally:
                regions.close()

        def loss_step(logits, labels):
            enter("head")
            try:
                return model.loss_function(logits, labels, vocab_size=model.config.vocab_size)
            finally:
                regions.close()

        def partition(gm, joint_inputs, **kwargs):
            # Dynamo marks parameters and buffers static inputs; inductor passes their indices on.
            kwargs["static_lifetime_input_indices"] = list(range(len(tensors))) if not captured else []
            with V.set_fake_mode(fake_mode):  # as compile_fx partitions (its random-seed passes read it)
                fw, bw = inductor_partition(gm, joint_inputs, **kwargs)
            captured[len(captured)] = (fw, bw)
            return fw, bw

        def keep(gm, _inputs):
            return make_boxed_func(gm.forward)

        def compiled(fn):
            return aot_function(fn, fw_compiler=keep, bw_compiler=keep, partition_fn=partition,
                                decompositions=select_decomp_table())

        input_ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        amp = (torch.autocast(device_type="cpu", dtype=compute_dtype) if autocast and compute_dtype != torch.float32
               else contextlib.nullcontext())
        with fx_traceback.preserve_node_meta(), amp, (standins.cuda_autocast_float32_ops() if cuda_autocast
                                                      else contextlib.nullcontext()):
            logits = compiled(step)(*tensors, input_ids)
            if loss_apart:
                compiled(loss_step)(logits, input_ids)
    graphs = [(fw, bw, len(tensors) if i == 0 else 0) for i, (fw, bw) in sorted(captured.items())]
    return _saved_of(graphs, n_params=n_params, autocast=autocast)


def _loss_in_own_graph(model) -> bool:
    """Whether Dynamo runs the model's loss as a graph of its own: transformers' `PreTrainedModel.loss_function`
    logs a warning (Python logging, which Dynamo does not trace: a graph break) when the model class's `loss_type`
    is not a key of its LOSS_MAPPING (GPT2LMHeadModel: None) and no loss function was set on the model."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    return "_loss_function" not in vars(model) and getattr(model, "loss_type", None) not in LOSS_MAPPING


def _saved_of(graphs: list, *, n_params: int, autocast: bool) -> CompiledSaved:
    """The backward graphs' non-gradient inputs, by storage, with the region of the forward node that made them.
    `graphs`: (forward, backward, number of static inputs) of each compiled graph in the order the step runs them
    (the model, then the loss when it is a graph of its own)."""
    import torch

    by_region: dict[str, int] = {}
    copies: dict[str, int] = {}
    rows = []
    seen: set = set()
    for index, (fw, bw, n_inputs) in enumerate(graphs):
        fw_nodes = {node.name: node for node in fw.graph.nodes}
        placeholders = [node for node in fw.graph.nodes if node.op == "placeholder"]
        static = {node.name for node in placeholders[:n_inputs]}
        params = {node.name for node in placeholders[:min(n_params, n_inputs)]}
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
            region = (((source.meta.get("custom") or {}).get("toolkit_region") if source is not None else None)
                      or "head")
            if source is not None and source.op == "placeholder":
                # the model graph's batch (token ids, for the embedding's backward); a later graph's inputs
                region = "embedding" if index == 0 else "head"
            nbytes = storage.nbytes()
            if autocast and source is not None and _is_cast_of(source, params):
                copies[region] = copies.get(region, 0) + nbytes
            else:
                by_region[region] = by_region.get(region, 0) + nbytes
            rows.append((region, tuple(value.shape), str(value.dtype).replace("torch.", ""), nbytes))
    order = ["embedding", *sorted({r for r in by_region if r.startswith("layer")}, key=lambda r: int(r[5:])), "head"]
    traffic = {r: (0, 0, 0, 0) for r in order}
    forward = {r: (0, 0, 0, 0) for r in order}
    for fw, bw, _ in graphs:
        ahead, back = _traffic(fw.graph, order, backward=False), _traffic(bw.graph, order, backward=True)
        for r in order:
            forward[r] = tuple(a + b for a, b in zip(forward[r], ahead[r]))
            traffic[r] = tuple(a + b + c for a, b, c in zip(traffic[r], ahead[r], back[r]))
    return CompiledSaved(by_region=by_region, autocast_copy_by_region=copies, saved=tuple(rows), traffic=traffic,
                         forward_traffic=forward,
                         extras=_extras(graphs, order, {r: by_region.get(r, 0) + copies.get(r, 0) for r in order}))


# ----------------------------------------------------------------------------------------------------------------
# Liveness of the compiled graphs


def _nbytes(node) -> int:
    import torch

    value = node.meta.get("val")
    return value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else 0


def _kind(node) -> str:
    """"input", "view", "fusible" (pointwise: inside its consumer's kernel), "reduction", "extern" or "other"."""
    import torch

    if node.op == "placeholder":
        return "input"
    if node.op != "call_function":
        return "other"
    target = node.target
    if getattr(target, "__name__", "") == "getitem":
        return "extern"  # one output of a multi-output kernel (attention's out / logsumexp)
    tags = getattr(target, "tags", ())
    if getattr(target, "is_view", False):
        return "view"
    if torch.Tag.pointwise in tags or "convert_element_type" in str(target):
        return "fusible"
    if not node.all_input_nodes or "inductor_random" in str(target) or "inductor_lookup_seed" in str(target):
        return "fusible"  # factories (full, iota) and inductor's in-kernel random numbers are generated in place
    if torch.Tag.reduction in tags:
        return "reduction"
    return "extern"


def _walk(graph, *, freed_inputs: set, counted_inputs: set):
    """Live bytes after each node of `graph` runs (before the buffers it read last die), by inductor's rules; returns
    [(node, live_bytes_after_alloc)], and the output node's inputs stay live to the end."""
    nodes = [n for n in graph.nodes]
    index = {n: i for i, n in enumerate(nodes)}
    output = nodes[-1]
    returned = {a for a in output.all_input_nodes}
    kinds = {n: _kind(n) for n in nodes}
    buffers = {n: _nbytes(n) for n in nodes if n.op == "call_function" and _materialized(n, kinds, returned)}
    # Where each node's value is really read: at its own kernel if it is one, else inside its consumers' kernels.
    read_at: dict = {}
    for n in reversed(nodes):
        if n in buffers or n.op in ("output", "placeholder") or not n.users:
            read_at[n] = index[n]
        else:
            read_at[n] = max(read_at[u] for u in n.users)

    root = _root
    last_use: dict = {}
    for u in nodes:
        for x in u.all_input_nodes:
            r = root(x)
            last_use[r] = max(last_use.get(r, -1), len(nodes) if u.op == "output" else read_at[u])
    live = sum(_nbytes(n) for n in nodes if n.op == "placeholder" and n.name in counted_inputs)
    dying: dict = {}
    for r, k in last_use.items():
        if (r in buffers) or (r.op == "placeholder" and r.name in freed_inputs and r.name in counted_inputs):
            dying.setdefault(k, []).append(r)
    curve = []
    for i, n in enumerate(nodes):
        live += buffers.get(n, 0)
        curve.append((n, live))
        for r in dying.get(i, ()):
            live -= buffers.get(r, 0) if r in buffers else _nbytes(r)
    return curve


def _root(node):
    """The node whose buffer `node` reads: itself, or the base of a chain of views."""
    while _kind(node) == "view" and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _regions_along(curve, order: list, *, backward: bool):
    """(region, node, live) along a graph's run. A node's region is its FX annotation, held monotone (forward: never
    back to an earlier region, backward: never to a later one), since the partitioner moves some small nodes
    (views of saved values, casts) out of their region's stretch, only kernels of their own (matmuls, reductions)
    move it on; graph inputs are skipped."""
    rank = {r: i for i, r in enumerate(order)}
    current = len(order) - 1 if backward else 0
    for node, live in curve:
        if node.op == "placeholder":
            continue
        name = (node.meta.get("custom") or {}).get("toolkit_region")
        if name in rank and _kind(node) in ("extern", "reduction"):
            current = min(current, rank[name]) if backward else max(current, rank[name])
        yield order[current], node, live


def _extras(graphs: list, order: list, held_by_region: dict) -> dict:
    """Per region: forward and backward peaks above the saved bytes of every region up to and including it, and the
    parameter gradients the backward has made by its peak and in all. `graphs` as in `_saved_of`: the forwards run
    in order, each on top of what the earlier ones left (their saved tensors and outputs), the backwards in reverse,
    each on top of the saved inputs of the backwards still to come; a later graph's input gradients are the
    incoming gradients of the graph before it (counted there), only the first graph's are parameter gradients."""
    from itertools import accumulate

    held = dict(zip(order, accumulate(held_by_region[r] for r in order)))
    extras = {r: [0, 0, 0, 0] for r in order}
    base = 0
    waiting = []  # bytes each backward's saved inputs hold while the later graphs' backwards run
    for index, (fw, bw, n_inputs) in enumerate(graphs):
        fw_inputs = [n.name for n in fw.graph.nodes if n.op == "placeholder"]
        counted = set(fw_inputs[n_inputs:]) if index == 0 else set()  # a later graph's inputs are counted already
        fw_curve = _walk(fw.graph, freed_inputs=set(), counted_inputs=counted)
        for region, _node, live in _regions_along(fw_curve, order, backward=False):
            extras[region][0] = max(extras[region][0], base + live - held[region])
        base += fw_curve[-1][1] if fw_curve else 0
        static = set(fw_inputs[:n_inputs])
        waiting.append(sum(_nbytes(n) for n in bw.graph.nodes if n.op == "placeholder"
                           and not n.name.startswith("tangents") and n.name not in static))
    grad_total = 0
    start: dict = {}
    for index in reversed(range(len(graphs))):
        fw, bw, n_inputs = graphs[index]
        bw_inputs = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
        static = {n.name for n in list(fw.graph.nodes)[:n_inputs] if n.op == "placeholder"}
        grads_out = {_root(a) for a in list(bw.graph.nodes)[-1].all_input_nodes} if index == 0 else set()
        # The incoming gradients count too: AOTAutograd materializes zeros for an output the loss does not reach
        # (the logits when the loss is in the model's graph; measured: a logits-sized buffer is allocated before the
        # compiled backward runs).
        bw_curve = _walk(bw.graph, freed_inputs=bw_inputs, counted_inputs=bw_inputs - static)
        earlier = sum(waiting[:index])
        for region, node, live in _regions_along(bw_curve, order, backward=True):
            start.setdefault(region, grad_total)
            if node in grads_out:
                grad_total += _nbytes(node)
                extras[region][3] += _nbytes(node)
            above = earlier + live - grad_total - held[region]
            if above > extras[region][1]:
                extras[region][1] = above
                extras[region][2] = grad_total - start[region]
    return {r: tuple(max(0, v) for v in e) for r, e in extras.items()}


def _traffic(graph, order: list, *, backward: bool) -> dict:
    """Memory traffic and kernel launches of the elementwise and reduction work of one forward or backward graph,
    eager against compiled, per region.

    Eager: each ATen op the model called is one kernel (the nodes a decomposition made from one op share its
    `original_aten` and autograd sequence number) that reads its inputs from memory and writes its outputs.
    Compiled: each buffer the fusion rule materializes (`_walk`) is one kernel that reads the buffers and inputs
    its fused chain reaches and writes itself. Matmuls, attention and other extern kernels run in both and are left
    out. Returns region -> (eager bytes, compiled bytes, eager kernels, compiled kernels)."""
    out = {r: [0, 0, 0, 0] for r in order}
    nodes = list(graph.nodes)
    kinds = {n: _kind(n) for n in nodes}
    elementwise = {n for n in nodes if kinds[n] in ("fusible", "reduction") and n.all_input_nodes}
    # A node's own annotation where it has one (backward nodes carry their forward op's), else its neighbours'
    # (the loss's and the tied weight's gradient sums have none): a walk in graph order would hand the head's
    # large elementwise work to the last layer, which the expansion to the full depth multiplies.
    region_of = {node: _own_region(node, order) or _neighbours_region(node, order) or region
                 for region, node, _ in _regions_along(((n, 0) for n in nodes), order, backward=backward)}
    groups: dict = {}
    for n in elementwise:
        seq_nr = n.meta.get("seq_nr")  # nodes without one were no op of the model's: each its own kernel
        key = ((seq_nr, str(n.meta.get("original_aten") or n.target)) if seq_nr is not None else (n,),
               region_of.get(n))
        groups.setdefault(key, set()).add(n)
    for members in groups.values():
        inputs = {x for n in members for x in n.all_input_nodes if x not in members}
        outputs = {n for n in members if any(u not in members for u in n.users)}
        region = region_of.get(next(iter(members)), order[-1 if backward else 0])
        out[region][0] += sum(_nbytes(x) for x in inputs) + sum(_nbytes(n) for n in outputs)
        out[region][2] += 1
    returned = set(nodes[-1].all_input_nodes)
    for n in elementwise:
        if not _materialized(n, kinds, returned):
            continue
        leaves, stack, seen = set(), list(n.all_input_nodes), set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if x in elementwise and not _materialized(x, kinds, returned) or kinds.get(x) == "view":
                stack.extend(x.all_input_nodes)
            else:
                leaves.add(_root(x))
        region = region_of.get(n, order[-1 if backward else 0])
        out[region][1] += _nbytes(n) + sum(_nbytes(x) for x in leaves)
        out[region][3] += 1
    return {r: tuple(v) for r, v in out.items()}


def _own_region(node, order: list) -> str | None:
    name = (node.meta.get("custom") or {}).get("toolkit_region")
    return name if name in order else None


def _neighbours_region(node, order: list) -> str | None:
    """The annotation of the nearest annotated node among `node`'s inputs, then its users (breadth first)."""
    for step in (lambda n: n.all_input_nodes, lambda n: list(n.users)):
        frontier, seen = [node], {node}
        for _ in range(4):
            frontier = [x for n in frontier for x in step(n) if x not in seen and x.op != "placeholder"]
            seen.update(frontier)
            found = [r for r in (_own_region(x, order) for x in frontier) if r]
            if found:
                return max(found, key=order.index)
    return None


def _materialized(n, kinds: dict, returned: set) -> bool:
    """Inductor's fusion rule (see _walk): a pointwise result is a buffer only when an extern kernel or the graph's
    output reads it; reductions, extern kernels and the like always are."""
    if kinds[n] != "fusible":
        return kinds[n] in ("extern", "reduction", "other")
    stack, seen = list(n.users), set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == "output" or kinds.get(u) == "extern":
            return True
        if kinds.get(u) == "view":
            stack.extend(u.users)
    return n in returned


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
