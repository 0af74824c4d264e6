"""What the activation tracer reports: bytes that the model's own Hugging Face code keeps, region by region.

Plain data, no torch import. `toolkit.estimate.tracer.trace_activations` fills it by running a depth-reduced copy of the
model (same config, fewer layers) forward, loss and backward under FakeTensorMode; the memory model
(`toolkit.estimate.memory`) composes these numbers with model states into a per-GPU breakdown and a peak.

Regions, in execution order: `embedding` (everything before the first decoder layer: token/position embeddings,
rotary tables, masks), one entry per decoder layer, `head` (final norm, LM head, loss). A storage shared by several
regions (rotary cos/sin, a mask) is counted once, in the first region that saved it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RegionTrace:
    saved_bytes: int
    """Bytes this region holds for backward once its forward is done (deduplicated by storage; parameters and
    autocast weight copies excluded). With checkpointing, a decoder layer's saved bytes are what the checkpoint
    keeps (its inputs)."""
    forward_extra_bytes: int
    """Peak live bytes during this region's forward above what the memory model composes as live there: the saved
    bytes and autocast copies of every region up to and including this one, plus autocast's weight cache. So it
    holds the temporaries that die inside the region (for the head: logits, their fp32 copy, ...) and the
    region's output until the next region saves it."""
    backward_extra_bytes: int
    """Peak live bytes during this region's backward above the saved bytes and autocast copies of every region
    up to and including this one: the incoming gradient and the region's gradient temporaries, excluding
    parameter gradients, which the memory model counts as model states. With checkpointing this includes the
    recomputed forward."""
    autocast_copy_bytes: int = 0
    """Low-precision copies of this region's weights that autocast keeps alive from forward to backward."""
    backward_grad_bytes: int = 0
    """Parameter-gradient bytes this region's backward has created by the moment of its backward peak (in the
    traced parameter dtype); the memory model scales them to the engine's gradient bytes."""
    grad_bytes: int = 0
    """Parameter-gradient bytes this region's backward creates in all (a tied LM head creates the embedding
    matrix's gradient here, not in the embedding region)."""
    autocast_cache_bytes: int = 0
    """Low-precision copies of this region's weights that autocast's cache holds until the autocast region (the
    forward) ends but nothing saves for backward (a checkpointed layer's weights, biases): live at the forward peak,
    gone before backward starts."""
    forward_grad_bytes: int = 0
    """Parameter gradients this region's forward already creates (in the traced parameter dtype), alive until its
    backward, where they become the parameters' gradients: Liger's fused linear cross-entropy computes the LM
    head's weight gradient in forward (toolkit.patches.liger). Not part of saved_bytes."""
    offload_bytes: int = 0
    """Bytes TRL's activation offloading would copy to host RAM of what this region saves
    (toolkit.patches.actoffload.OffloadRule over its saves in order; nothing of the output head's own module): with
    side streams on a GPU trace, without them (as toolkit measures TRL on CPU) on a CPU trace."""
    forward_events: tuple[int, ...] = ()
    """The region's allocations and frees in forward, in order (toolkit.estimate.stepevents: a birth is its bytes,
    a death a packed reference to its birth), parameter gradients left out; () when not recorded."""
    backward_events: tuple[int, ...] = ()
    """The same for the region's backward (with checkpointing, its recompute too)."""
    host_ops: int = 0
    """ATen operations the region's forward and backward (with checkpointing, its recompute too) dispatch, as the
    tracer's dispatch mode counts them: what the host runs one by one in eager mode (toolkit.estimate.hosttime);
    0 where not recorded (torch.compile traces)."""


@dataclass(frozen=True)
class ActivationTrace:
    micro_batch: int
    seq_len: int
    dtype: str
    """Compute dtype: "float32" | "bfloat16" | "float16"."""
    autocast: bool
    """True: fp32 parameters under torch.autocast(dtype) (torch AMP, as DDP runs); False: parameters in dtype."""
    attention: str
    device_kind: str
    checkpointing: bool
    embedding: RegionTrace
    layers: tuple[RegionTrace, ...]
    """One per decoder layer of the full model (layers of the same kind share one traced value)."""
    head: RegionTrace
    output_bytes: int
    """Bytes the model's output object holds (the logits) until the training loop releases it."""
    loss_bytes: int = 0
    """The loss tensor the loop keeps (already inside head.saved_bytes if the head saved it)."""
    compile_traffic: tuple = ()
    """torch.compile only: (eager elementwise bytes, compiled elementwise bytes, eager kernels, compiled kernels) of
    one micro-batch's forward + backward over the full depth (toolkit.estimate.compiled._traffic); the step-time
    model's compile term reads it."""
    vision_bytes: int = 0
    """An image-and-text job: the part of embedding.saved_bytes the vision encoder + projector keep for the
    micro-batch's images (toolkit.estimate.traces.with_images); 0 otherwise."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Substitutions and approximations made (GPU kernel stand-ins, uniform MoE routing, ...)."""

    @property
    def host_ops(self) -> int:
        """ATen operations one micro-batch's forward + backward dispatches over the full depth (RegionTrace.host_ops)."""
        return self.embedding.host_ops + sum(r.host_ops for r in self.layers) + self.head.host_ops

    @property
    def activations_bytes(self) -> int:
        """Bytes autograd holds for backward once forward and loss are done (output object released)."""
        return self.embedding.saved_bytes + sum(r.saved_bytes for r in self.layers) + self.head.saved_bytes

    @property
    def autocast_copy_bytes(self) -> int:
        return (self.embedding.autocast_copy_bytes + sum(r.autocast_copy_bytes for r in self.layers)
                + self.head.autocast_copy_bytes)
