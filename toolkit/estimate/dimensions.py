"""What one rank of a tensor / context / sequence-parallel grid holds, for the memory model (toolkit.estimate.memory).

Traced, at the per-rank shapes (toolkit.estimate.tracer under FakeTensorMode, the model's own code):
  - tensor parallel t: the decoder layers with heads / t, KV heads / t and FFN / t and the hidden size whole
    (colwise layers take the whole hidden state in, rowwise layers give it back whole after the all-reduce), and the
    parameters the model's tp_plan leaves on a rank (toolkit.inputs.tensorplan). The LM head is `colwise_gather_output`:
    the logits are gathered whole before the loss, so the head + loss region is the untensored one.
  - sequence parallel p (Ulysses) and context parallel c: every rank holds seq / p (seq / c) tokens of each sample
    outside attention, so the whole model is traced at that length: embeddings, norms, MLP, logits and loss all
    divide. Inside attention Ulysses holds heads / p for the whole sequence: for q, the output and the log-sum-exp
    that is the same number of elements as all heads for seq / p tokens, so the trace at seq / p already counts
    them; only KV heads fewer than p differ (each rank then holds one whole KV head: `kv_replication_bytes`).
    Context parallelism keeps the local chunk's q, k, v, output and log-sum-exp (torch's ring flash backward
    re-exchanges k, v), also the trace at seq / c.
Derived (tracing one process cannot see them): the communication buffers of each dimension, per layer, as
temporaries in forward and backward (`comm_extra`). Each term is printed by --explain with where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from toolkit.inputs.choices import DTYPE_BYTES, compute_bytes
from toolkit.errors import UserError

if TYPE_CHECKING:
    from toolkit.estimate.activations import ActivationTrace
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import ModelSpec

CP_COMM_STRATEGY = "allgather"
"""accelerate's default cp_comm_strategy (commands/launch.py): k and v of the whole sequence are all-gathered in
each attention (the other choice, alltoall, rotates chunks)."""


@dataclass(frozen=True)
class RankView:
    """The model and job one rank computes, and what the trace at those shapes does not hold."""

    spec: "ModelSpec"
    job: "Job"
    layer_forward_extra: int = 0
    """Communication temporaries alive in one layer's forward (per micro-batch)."""
    layer_backward_extra: int = 0
    layer_saved_extra: int = 0
    """Bytes a layer saves beyond the trace at the per-rank shapes (Ulysses KV replication)."""
    terms: tuple[tuple[str, int, str], ...] = ()
    notes: tuple[str, ...] = ()
    embedding_grad_fraction: float = 1.0
    """Share of the embedding's weight gradient one rank makes (the tp_plan's embedding_rowwise splits it); the
    trace keeps the whole vocabulary, since the lookup's output is whole."""
    head_grad_fraction: float = 1.0
    """Share of the LM head's weight gradient one rank makes (colwise_gather_output splits the weight; the logits
    are gathered whole, as traced)."""
    head_gather: int = 1
    """The tensor degree over which the LM head (tp_plan `colwise_gather_output`) all-gathers its logits (1: none)."""
    fsdp_kept_outside_params: int | None = None
    """Tensor parallel (transformers' own FSDP2 wrapping from the model's fsdp_plan): one rank's parameters outside
    the layers that stay unsharded from their forward to their backward (keep_full_weight: final norm + LM head);
    the other ones (the embedding) are gathered only while their region computes. None: not that route."""
    fsdp_layers_kept: bool = False


def rank_view(spec: "ModelSpec", job: "Job", grid: "ParallelGrid") -> RankView:
    """The per-rank model and job for `grid` (itself when the grid has no model-parallel degree)."""
    if grid.model_parallel == 1:
        return RankView(spec, job)
    if job.adapter.is_adapter:
        raise UserError(f"{job.adapter.method} with tensor / context / sequence parallelism is not planned; use "
                        "full fine-tuning with them, or drop the degree")
    if job.activation_offloading and grid.tensor > 1:
        # Context / sequence ranks each offload their own saves (one rank's tokens: savers.py's rule on the rank's
        # trace); under tensor parallelism what a rank saves is DTensor shards of the transformers tp_plan, which
        # the rank view does not trace.
        raise UserError("activation offloading with tensor parallelism is not planned (a rank's DTensor saves are "
                        "not traced); drop --activation-offloading or --tensor-parallel, or split the sequence "
                        "(--sequence-parallel / --context-parallel) instead")
    if job.images_per_sample:
        raise UserError("an image-and-text job with tensor / context / sequence parallelism is not planned (each "
                        "rank's share of the vision tower is not traced); drop the degree, or the images")
    grid.check_model(spec)
    grid.check_sequence(job.seq_len, spec.effective_attention(job.attention))
    from toolkit.inputs.tensorplan import per_rank_spec

    rank_spec = per_rank_spec(spec, grid.tensor)
    local_seq = job.seq_len // grid.seq_split
    rank_job = replace(job, seq_len=local_seq)
    b = job.micro_batch
    pb = compute_bytes(job.precision)
    shapes = spec.attention_shapes()  # per-layer buffers below are the widest layer's (Gemma-4's global layers)
    fwd = bwd = saved = 0
    head_gather, kept, layers_kept = 1, None, False
    terms: list[tuple[str, int, str]] = []
    notes: list[str] = []
    if grid.tensor > 1:
        # Rowwise outputs (o_proj, down_proj) are all-reduced in place; DTensor's redistribute of the colwise
        # input's gradient keeps one whole-hidden buffer alive in backward.
        buf = b * local_seq * spec.hidden * pb
        fwd, bwd = fwd + buf, bwd + buf
        terms.append(("tensor-parallel all-reduce buffer", buf,
                      "derived: one micro-batch x seq x hidden activation per layer (rowwise output / colwise "
                      "input-gradient all-reduce)"))
        notes.append(f"tensor parallel {grid.tensor}: layers traced at heads/{grid.tensor}, KV heads/"
                     f"{grid.tensor}, FFN/{grid.tensor} (the model's tp_plan); LM head gathered whole "
                     "(colwise_gather_output: its forward holds the rank's logits slice, the all-gather buffer and "
                     "the whole logits at once); FSDP2 groups from the model's fsdp_plan")
        from toolkit.inputs.tensorplan import tensor_split

        split = tensor_split(spec, grid.tensor)
        head_gather = grid.tensor if split.head_style == "colwise_gather_output" else 1
        kept, layers_kept = split.rank_kept_outside_params, split.layers_kept
    if grid.sequence > 1:
        p = grid.sequence
        qkv = b * local_seq * max((h + 2 * kv) * d for h, kv, d in shapes) * pb
        fwd, bwd = fwd + qkv, bwd + qkv
        terms.append(("Ulysses all-to-all buffers", qkv,
                      f"derived: q, k, v of seq/{p} tokens staged for the all-to-all (ulysses_sp.py), per layer"))
        extra = kv_replication_bytes(spec, job, p)
        if extra:
            saved += extra
            terms.append(("Ulysses KV-head replication", extra,
                          f"derived: {min(kv for _, kv, _ in shapes)} KV heads < sp {p}, so each rank holds one whole KV head of the "
                          "full sequence for k and v (ulysses_sp.py kv_replication_factor), per layer"))
        notes.append(f"sequence parallel {p} (Ulysses): traced at seq/{p} = {local_seq} tokens per rank; "
                     f"attention holds heads/{p} of the whole sequence, the same bytes")
    if grid.context > 1:
        c = grid.context
        kv_whole = 2 * b * job.seq_len * max(kv * d for _, kv, d in shapes) * pb
        fwd += kv_whole
        bwd += 2 * kv_whole  # gathered k, v again plus their gradients before the reduce-scatter
        terms.append(("context-parallel k, v all-gather", kv_whole,
                      f"derived: k and v of the whole sequence gathered in each attention ({CP_COMM_STRATEGY}, "
                      "torch context_parallel); twice that in backward"))
        notes.append(f"context parallel {c}: traced at seq/{c} = {local_seq} tokens per rank (torch ring "
                     "attention, load-balanced chunks)")
    return RankView(rank_spec, rank_job, layer_forward_extra=fwd, layer_backward_extra=bwd,
                    layer_saved_extra=saved, terms=tuple(terms), notes=tuple(notes),
                    embedding_grad_fraction=_share(rank_spec.pre_layer_params, spec.pre_layer_params),
                    head_grad_fraction=_share(rank_spec.post_layer_params, spec.post_layer_params),
                    head_gather=head_gather, fsdp_kept_outside_params=kept, fsdp_layers_kept=layers_kept)


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 1.0


def kv_replication_bytes(spec: "ModelSpec", job: "Job", sp: int) -> int:
    """Extra bytes per layer Ulysses keeps for k and v when the KV heads are fewer than sp: one whole KV head of the
    whole sequence per rank instead of kv_heads heads of seq / sp tokens (the layer that adds most)."""
    pb = compute_bytes(job.precision)
    return max((2 * job.micro_batch * d * pb * (job.seq_len - job.seq_len // sp * kv)
                for _, kv, d in spec.attention_shapes() if kv < sp), default=0)


def apply_to_trace(trace: "ActivationTrace", view: RankView, checkpointing: bool) -> "ActivationTrace":
    """The per-rank trace with the derived terms added to each decoder layer (with checkpointing a layer's
    attention tensors exist only while it recomputes, so the replication joins its backward temporaries)."""
    head = _scale_grads(trace.head, view.head_grad_fraction)
    if view.head_gather > 1:
        head = replace(head, forward_extra_bytes=max(head.forward_extra_bytes,
                                                     logits_gather_bytes(trace, head, view.head_gather)))
    trace = replace(trace, embedding=_scale_grads(trace.embedding, view.embedding_grad_fraction), head=head)
    if not (view.layer_forward_extra or view.layer_backward_extra or view.layer_saved_extra):
        return trace
    layers = []
    for r in trace.layers:
        saved = 0 if checkpointing else view.layer_saved_extra
        back = view.layer_backward_extra + (view.layer_saved_extra if checkpointing else 0)
        # What a layer saves beyond its own tokens is saved like the rest: TRL's pack hook moves it too.
        layers.append(replace(r, saved_bytes=r.saved_bytes + saved, offload_bytes=r.offload_bytes + saved,
                              forward_extra_bytes=r.forward_extra_bytes + view.layer_forward_extra,
                              backward_extra_bytes=r.backward_extra_bytes + back))
    return replace(trace, layers=tuple(layers))


def logits_gather_bytes(trace: "ActivationTrace", head, tensor: int) -> int:
    """The head's forward at the moment `colwise_gather_output` gathers the logits, above the head's saved bytes
    (what the memory model composes as live): this rank's vocab/t slice of the logits, the all-gather's output
    buffer and the whole-vocabulary logits it is re-laid into (DTensor Shard(-1) -> Replicate: torch
    _functional_collectives.all_gather_single gathers along dim 0, then chunk + cat along the last dim), while the
    loss's fp32 log-softmax, part of the head's saved bytes, does not exist yet. Measured on CPU over gloo:
    local + 2 x whole logits at that moment (benchmarks/results/dimension_memory.md)."""
    logits = trace.output_bytes  # the whole-vocabulary logits of one micro-batch, in the compute dtype
    pb = 2 if trace.autocast else DTYPE_BYTES[trace.dtype]
    log_softmax = min(head.saved_bytes, logits * 4 // pb)  # transformers' ForCausalLMLoss upcasts to fp32
    return logits // tensor + 2 * logits - log_softmax


def _scale_grads(region, fraction: float):
    """A region whose weights tensor parallelism splits but whose activations it does not: its weight gradients
    shrink to the rank's share."""
    if fraction == 1.0:
        return region
    return replace(region, backward_grad_bytes=int(region.backward_grad_bytes * fraction),
                   grad_bytes=int(region.grad_bytes * fraction),
                   forward_grad_bytes=int(region.forward_grad_bytes * fraction))
