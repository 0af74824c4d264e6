"""The vision encoder's and projector's compute in an image-and-text step (issue 31): the FLOPs the tower's own
fake-tensor trace counts (toolkit.estimate.visiontower: forward, the backward that reaches it, the checkpointed
blocks' recompute), priced as the language model's compute is (toolkit.estimate.efficiency): matmuls at the matmul
efficiency for the tower's patches per micro-step and its hidden size, attention at that times the architecture's
attention factor. Those constants are fitted on language-model rows; no published VLM step is scored, so the tower's
efficiency (short patch sequences, windowed attention) is an assumption the step's notes say.

Each data-parallel replica runs the tower on its own images, whole: pipeline stage 0 holds it (the slowest stage
paces 1F1B, so its time is not divided by the stages), and ranks that split one sample's sequence (tensor, context,
sequence parallel) are assumed to each run it on the sample's images.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.estimate.efficiency import ComputeModel, FlopSplit, compute_seconds_per_token, matmul_efficiency
from toolkit.inputs.hardware import Hardware
from toolkit.inputs.job import Job
from toolkit.inputs.modelspec import ModelSpec
from toolkit.inputs.strategy import Strategy


@dataclass(frozen=True)
class VisionTime:
    seconds: float
    """The tower's and projector's compute in one step of one replica (all its micro-steps)."""
    flops_per_sample: float
    """Executed FLOPs a sample: forward, backward and recompute over its images."""
    model_flops_per_sample: float
    """Model FLOPs a sample for MFU: forward, plus the backward a step without checkpointing runs (none for a
    frozen tower: the backward checkpointing makes run through it serves nothing, as recompute is left out)."""
    note: str


def vision_time(spec: ModelSpec, strategy: Strategy, job: Job, hw: Hardware, *, peak_flops: float,
                compute_model: ComputeModel) -> VisionTime | None:
    """The tower's compute for `job`'s images (None for a text job). `spec` and `job` are the whole model and
    sample."""
    if not job.images_per_sample:
        return None
    from toolkit.estimate.traces import job_tower, tower_trains

    tower = job_tower(spec, job, strategy)
    # model FLOPs: the step without checkpointing, read off the same trace (no second trace without it: a frozen
    # tower's backward then reaches nothing; a trained one's is its backward without the blocks' recompute)
    model_backward = tower.backward_flops - tower.recompute_flops if tower_trains(spec, job) else 0
    images = job.images_per_sample
    per_image = tower.forward_flops + tower.backward_flops
    vision = spec.hf_config().vision_config
    hidden = getattr(vision, "hidden_size", None) or getattr(vision, "embed_dim", None) or spec.hidden
    patches = tower.patches * images * job.micro_batch
    eff, _ = matmul_efficiency(hw.gpu, job.precision, patches, hidden, compute_model)
    split = FlopSplit(matmul=per_image - tower.attention_flops, attention=tower.attention_flops, model=0.0)
    per_image_s, _ = compute_seconds_per_token(split, hw.gpu, peak_flops, eff,
                                               spec.effective_attention(job.attention), compute_model)
    seconds = per_image_s * images * job.micro_batch * job.grad_accum
    note = (f"vision encoder + projector: {per_image * images / 1e9:,.2f} GFLOPs a sample ({images} image(s) x "
            f"forward {tower.forward_flops / 1e9:,.2f} + backward {tower.backward_flops / 1e9:,.2f}"
            f"{' with the blocks recomputed' if job.checkpointing and tower.backward_flops else ''}"
            f"{'' if tower.backward_flops else ', no backward reaches the frozen tower'}; counted from its traced "
            f"ops), {seconds:.3f} s a step at the language model's efficiency constants for {patches:,} patches a "
            f"micro-step and hidden {hidden} (matmul efficiency {eff:.2f}); assumed: the tower's attention on short "
            "patch sequences and its small GEMMs may run at another efficiency (no published VLM step scored)")
    return VisionTime(seconds=seconds, flops_per_sample=per_image * images,
                      model_flops_per_sample=(tower.forward_flops + model_backward) * images, note=note)


def vision_band_words(vision_s: float) -> str:
    """What the step-time band does not cover for an image job: the tower's share, priced at constants fitted on
    language-model rows."""
    return (f"the vision encoder's {vision_s:.3f} s of it is outside the band's evidence: its efficiency is the "
            "language model's fit (short patch sequences may run at another; no published VLM step scored)")
