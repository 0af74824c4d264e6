"""Memory savers users switch on, and what each changes in a step's memory. Pure functions on counts; no torch.

Optimizer implementation (Job.optimizer_impl), read from torch/optim/adam.py (torch 2.13, AdamW = Adam with
decoupled weight decay) and checked on CPU with real torch.optim.AdamW (tests/test_savers.py):

  fused     one kernel per tensor list, updates in place: no temporaries (the HF Trainer's default
            `adamw_torch_fused` for torch >= 2.8; DeepSpeed's FusedAdam likewise).
  foreach   _multi_tensor_adam: `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)` allocates one tensor per
            parameter of the group, all alive until `_foreach_addcdiv_`: a temporary as large as the group's
            second-moment states (state dtype = parameter dtype). Groups are split by device and dtype only, so a
            group's whole size is live at once (torchtitan: one group; the Trainer: decay and no-decay groups,
            the decay group holds nearly all).
  for-loop  _single_tensor_adam: `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` makes two
            temporaries of the parameter being updated (the sqrt, then the quotient) before the sqrt dies:
            2 x the largest parameter tensor.

8-bit optimizers (bitsandbytes AdamW8bit: blockwise-quantised states, toolkit.estimate.states) update in their own kernel:
no temporaries beyond its states.
"""

from __future__ import annotations

OPTIMIZERS_WITH_IMPL = ("adamw",)
"""Optimizers whose step temporaries depend on torch's implementation choice (bitsandbytes' 8-bit AdamW and
Adafactor have their own kernels / loops; SGD's momentum update is in place)."""


def optimizer_step_temporary_bytes(*, impl: str, optimizer: str, group_state_bytes: float,
                                   largest_param_state_bytes: float) -> float:
    """Bytes the optimizer step allocates beyond its states and the gradients, at its peak.

    `group_state_bytes`: one second-moment state of the largest parameter group this rank steps (bytes);
    `largest_param_state_bytes`: the same for the largest single parameter tensor of this rank."""
    if optimizer not in OPTIMIZERS_WITH_IMPL or impl == "fused":
        return 0.0
    if impl == "foreach":
        return float(group_state_bytes)
    if impl == "for-loop":
        return 2.0 * float(largest_param_state_bytes)
    raise ValueError(f"unknown optimizer implementation {impl!r}")


# Activation offloading (Job.activation_offloading): TRL's `activation_offloading` (trl/models/activation_offloading.py,
# after torchtune's OffloadActivations) packs every saved tensor of the wrapped model into pinned host memory on a side
# stream and brings it back before the backward that needs it; the output head's own module is left on the GPU.
# Host side (pinned RAM, PCIe bytes): what TRL's pack hook copies, its own rule over the traced saves in order
# (toolkit.patches.actoffload.OffloadRule -> RegionTrace.offload_bytes): the layers' saves and also what the loss after
# the head saves (its fp32 logits and log-softmax, or the fused losses' saves). GPU side: modelled as the decoder
# layers' saved bytes leaving the GPU; a layer's saved bytes exist while that layer computes (forward: until the
# copy-out completes; backward: once copied back).


def offloaded_bytes(trace) -> int:
    """Bytes TRL's pack hook copies to the host in one micro-batch's forward, all alive until its backward."""
    return sum(r.offload_bytes for r in (trace.embedding, *trace.layers, trace.head))


# With ALST tiling (Job.tiled) the offload is DeepSpeed's own, the one ArcticTraining pairs with TiledMLP: DeepSpeed 0.19.8
# runtime/activation_checkpointing/offload_activations.py `CheckpointHiddenStatesOffload`, a saved_tensors_hooks
# context whose pack hook moves only the tensors its patched GradientCheckpointingLayer.__call__ marks (the
# `hidden_states` argument of each checkpointed decoder layer, while gradient checkpointing is on); every other save,
# the tiled MLP's and tiled loss's recomputes included, stays on the GPU. Of the marked inputs the newest stays
# (`keep_last_count` 1, `_flush_keep_last`), and the GPU copy of the one offloaded last is held until the next is
# marked (`max_fwd_stash_count` 2: `_reap_forward_stash` keeps ids above newest - 2), so at the end of the forward
# the last two layers' inputs are on the GPU and the other L - 2 are not; the host holds L - 1 pinned copies
# (`_empty_cpu_like`). Backward brings each one back when its checkpoint unpacks it (`_restore_tensor`: a copy on
# the side stream the compute stream waits for at once; the stashed one is handed back without a copy).
CHECKPOINT_OFFLOAD_KEPT = 2
"""Decoder layers whose checkpointed input DeepSpeed's CheckpointHiddenStatesOffload leaves on the GPU at the end of
the forward: the newest (keep_last_count 1) and the one whose copy-out it holds (max_fwd_stash_count 2)."""


def checkpoint_offload(job) -> bool:
    """Whether `job`'s activation offloading is DeepSpeed's CheckpointHiddenStatesOffload (with --tiled, ALST's
    pairing) rather than TRL's activation_offloading."""
    return bool(job.activation_offloading and job.tiled)


def offload_layer_activations(trace, job, input_bytes: int = 0):
    """(trace with the decoder layers' saved bytes moved off the GPU, host bytes per micro-batch) when `job` offloads
    its activations; else (trace, 0). `input_bytes`: one decoder layer's hidden-states input (micro-batch x the
    rank's tokens x hidden x the activations' bytes), what DeepSpeed's checkpoint offload moves per layer."""
    from dataclasses import replace

    if not job.activation_offloading:
        return trace, 0
    if checkpoint_offload(job) and job.checkpointing is not True:  # it marks checkpointed layers' inputs only
        return replace(trace, notes=trace.notes + ("activation offloading: DeepSpeed's CheckpointHiddenStatesOffload "
                                                   "moves nothing without gradient checkpointing",)), 0
    if checkpoint_offload(job):
        moved = len(trace.layers) - CHECKPOINT_OFFLOAD_KEPT
        layers = tuple(replace(r, saved_bytes=r.saved_bytes - input_bytes,
                               forward_extra_bytes=r.forward_extra_bytes + input_bytes,
                               backward_extra_bytes=r.backward_extra_bytes + input_bytes, forward_events=(),
                               backward_events=()) if i < moved else r for i, r in enumerate(trace.layers))
        note = ("activation offloading: DeepSpeed's CheckpointHiddenStatesOffload keeps the decoder layers' "
                "checkpointed inputs but the last two in pinned host RAM")
        host = max(0, len(trace.layers) - 1) * input_bytes
        return replace(trace, layers=layers, notes=trace.notes + (note,)), host
    # The copies to and from the host (TRL's side stream) are not recorded events: no allocator replay for them.
    layers = tuple(replace(r, saved_bytes=0, forward_extra_bytes=r.forward_extra_bytes + r.saved_bytes,
                           backward_extra_bytes=r.backward_extra_bytes + r.saved_bytes, forward_events=(),
                           backward_events=()) for r in trace.layers)
    host = offloaded_bytes(trace)
    return replace(trace, layers=layers,
                   notes=trace.notes + ("activation offloading: decoder layers' saved tensors in pinned host RAM",)), host


def offload_copies(spec, job, strategy, hw, grid=None) -> tuple[int, float]:
    """(one rank's bytes TRL moves per micro-batch, the PCIe seconds of their copies a step): each byte out in the
    forward and back in the backward (DeepSpeed's checkpoint offload with --tiled: the layer inputs it moves and
    brings back, above), every micro-step, over the GPU's host link from the catalog. A DPO job's moved
    bytes are its policy's, chosen and rejected concatenated (policy_job); its reference's forward runs under no_grad
    and saves nothing to move. On a context / sequence-parallel `grid`, the rank's: its share of the tokens, as
    toolkit.estimate.memory traces it (rank_view, apply_to_trace)."""
    from toolkit.estimate.traces import scaled_trace
    from toolkit.inputs.job import policy_job

    if job.dpo is not None:
        job = policy_job(job)
    if grid is not None and grid.model_parallel > 1:
        from toolkit.estimate.dimensions import apply_to_trace, rank_view

        view = rank_view(spec, job, grid)
        rank_spec, rank_job = view.spec, view.job
        trace = apply_to_trace(scaled_trace(view.spec, view.job, strategy), view, job.checkpointing)
    else:
        rank_spec, rank_job = spec, job
        trace = scaled_trace(spec, job, strategy)
    if checkpoint_offload(job):  # out: every layer's input but the newest; back: those but the stashed one
        if job.checkpointing is not True:
            return 0, 0.0
        layers, one = len(trace.layers), layer_input_bytes(rank_spec, rank_job)
        rank_bytes, back = max(0, layers - 1) * one, max(0, layers - CHECKPOINT_OFFLOAD_KEPT) * one
        return rank_bytes, job.grad_accum * (rank_bytes + back) / (hw.gpu.pcie_gbps * 1e9)
    rank_bytes = offloaded_bytes(trace)
    return rank_bytes, job.grad_accum * 2 * rank_bytes / (hw.gpu.pcie_gbps * 1e9)


def layer_input_bytes(spec, job) -> int:
    """One decoder layer's hidden-states input on this rank (`spec` and `job` at the rank's shapes): what DeepSpeed's
    checkpoint offload moves per layer."""
    from toolkit.inputs.choices import compute_bytes

    return job.micro_batch * job.seq_len * spec.hidden * compute_bytes(job.precision)


def exposed_copy_s(spec, job, strategy, hw, compute_s: float, grid=None) -> float:
    """The part of activation offloading's copies the step time pays: TRL copies on a side stream while the next
    layer computes, so at best they hide behind the step's compute (an assumption, unmeasured); the rest shows.
    DeepSpeed's checkpoint offload copies out on its side stream too, but the compute stream waits for each copy back
    as the checkpoint unpacks it (`_restore_tensor`), so its copies back are all paid."""
    rank_bytes, seconds = offload_copies(spec, job, strategy, hw, grid)
    if checkpoint_offload(job):
        out = job.grad_accum * rank_bytes / (hw.gpu.pcie_gbps * 1e9)
        return (seconds - out) + max(0.0, out - compute_s)
    return max(0.0, seconds - compute_s)


def offload_traffic_line(spec, job, strategy, hw, compute_s: float, grid=None) -> str:
    """What activation offloading asks of each node's host: the pinned RAM (every rank's moved bytes,
    one micro-batch at a time, as toolkit.estimate.memory puts them there) and the PCIe time of the copies
    (offload_copies), with what of it the step time pays (exposed_copy_s)."""
    from toolkit.inputs.choices import GIB

    rank_bytes, seconds = offload_copies(spec, job, strategy, hw, grid)
    return (f"activation offloading: {rank_bytes * hw.gpus_per_node / GIB:.2f} GiB pinned host RAM per node "
            f"({rank_bytes / GIB:.2f} GiB x {hw.gpus_per_node} ranks); PCIe {seconds:.3f} s a step per rank "
            f"({job.grad_accum} micro-step(s) x 2 copies at {hw.gpu.pcie_gbps:.0f} GB/s), "
            + (f"the copies back paid in the step ({exposed_copy_s(spec, job, strategy, hw, compute_s, grid):.3f} s: "
               "DeepSpeed's CheckpointHiddenStatesOffload of the checkpointed layer inputs; it moves nothing on a "
               "CPU accelerator)" if checkpoint_offload(job)
               else "assumed hidden behind compute (TRL's side stream)" if seconds <= compute_s
               else f"longer than the step's compute ({compute_s:.3f} s): the {seconds - compute_s:.3f} s beyond it "
               "is in the step time (offload)"))


UNMODELLED_SPEED: dict[str, str] = {
    "liger": ("Liger kernels: their effect on the step time is not modelled (the step time is that of the model's "
              "own Hugging Face kernels; only the memory is Liger's)"),
    "activation offloading": ("activation offloading: the copies of the saved activations to host RAM are assumed "
                              "hidden behind compute on the offload's side stream, and the copies back too with "
                              "TRL's (DeepSpeed's checkpoint offload, with --tiled, waits for each); only what exceeds "
                              "the compute is in the step time (unmeasured)"),
    "trl loss": ("TRL's chunked NLL: its backward recomputes every logits tile (one more LM head matmul a step), "
                 "which the step time leaves out (it is priced as the model's own head and loss)"),
}
"""Memory savers whose speed effect the step-time model leaves out, and the words that say so. Liger's published
speed-ups (its README's benchmarks) are per kernel on its own GPUs, not a step-time model we can source per job."""


def speed_unmodelled(job) -> tuple[str, ...]:
    """The savers `job` turns on whose effect on the step time is not modelled (keys of UNMODELLED_SPEED)."""
    return tuple(k for k, on in (("liger", job.liger), ("activation offloading", job.activation_offloading),
                                 ("trl loss", job.loss != "model")) if on)
