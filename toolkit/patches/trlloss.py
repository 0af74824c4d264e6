"""TRL's chunked NLL, the fused LM head SFTTrainer always patches (TRL 1.16; docs/ENGINE_FACTS.md "TRL's chunked
NLL"), applied to a Hugging Face causal LM instance so the tracer traces the head + loss as TRL computes them
(toolkit.estimate.tracer) and a real CPU step runs the same code (tests/test_trlloss.py).

Nothing of TRL's is copied: `trl_loss_applied` calls TRL's own `add_fused_lm_head` (trl/trainer/utils.py) with the
outputs SFTTrainer asks for, so the tiles, the fp32 statistics, what `ChunkedLogProbFunction` saves and the
backward's recompute and fp32 accumulators are TRL's. The step's loss is SFTTrainer.compute_loss's:
`-log_probs` summed over the labelled tokens, divided by their count (or the Trainer's num_items_in_batch).

Traced for a GPU (`gpu_footprint=True`, only under FakeTensorMode) three CPU-only parts of TRL's code are swapped
for what runs on CUDA: the two torch folds (`_forward_tile`, `_backward_tile`; the Triton kernels read and overwrite
the tile in place, with no fp32 copies of it) and `_addmm_fp32` (one addmm with out_dtype fp32 into the
accumulator, no upcast operands); and the hidden handed to the kernel is a copy, as CUDA's compact path gathers
`hidden_states[mask]` (the fake batch labels every position, so the gather keeps every row; the gather itself is a
data-dependent shape a fake tensor cannot take).
"""

from __future__ import annotations

import contextlib

from toolkit.patches.lmhead import bind

TRL_LOSS_SOURCE = ("TRL 1.16 add_fused_lm_head + ChunkedLogProbFunction (trl/trainer/utils.py, "
                   "trl/kernels/chunked_logprob.py)")
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
"""The per-token outputs SFTTrainer.__init__ asks the fused head for (entropy and is_top1 feed its metrics)."""


def _sft_forward(self, *args, labels=None, num_items_in_batch=None, **kwargs):
    """SFTTrainer.compute_loss over TRL's fused forward: per-token -log_probs summed, divided by the token count.
    Without labels the model's own forward, with its logits (TRL's fused_lm_head=False path: generation, probes)."""
    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if labels is None:
        return self._toolkit_trl_forward(*args, **kwargs)
    kwargs.pop("logits_to_keep", None)
    out = self._toolkit_trl_forward(*args, labels=labels, fused_lm_head=True, **kwargs)
    num_tokens = out.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
    loss = (-out.log_probs).sum() / torch.as_tensor(num_tokens).clamp(min=1)
    return CausalLMOutputWithPast(loss=loss, logits=(out.log_probs, out.entropy, out.is_top1))


def _no_fold(*_args, **_kwargs) -> None:
    """The Triton fold's footprint: it reads (forward) or overwrites (backward) the tile in place."""


def _addmm_in_place(acc, a, b) -> None:
    """CUDA's `torch.addmm(acc, a, b, out_dtype=float32, out=acc)`: nothing allocated."""


class _CompactHidden:
    """ChunkedLogProbFunction with its hidden as CUDA's compact path hands it: a gathered copy of the rows."""

    def __init__(self, function):
        self.function = function

    def apply(self, hidden, *args):
        return self.function.apply(hidden.clone() if hidden._is_view() else hidden, *args)


def apply_trl_loss(model) -> None:
    """What SFTTrainer.__init__ does to the model (TRL's own add_fused_lm_head with SFTTrainer's outputs), with the
    forward returning SFTTrainer.compute_loss's loss, so a plain Trainer (toolkit.train) trains as SFTTrainer does.
    Before any PEFT wrapping, as SFTTrainer patches the base model."""
    from trl.trainer import utils as trl_utils

    trl_utils.add_fused_lm_head(model, outputs=SFT_OUTPUTS)
    model.__dict__["_toolkit_trl_forward"] = model.__dict__.pop("forward")
    bind(model, "forward", _sft_forward)


@contextlib.contextmanager
def trl_loss_applied(model, gpu_footprint: bool = False):
    """Patch `model` for the duration of the block as SFTTrainer does (TRL's own add_fused_lm_head), with its
    forward returning SFTTrainer's loss. `gpu_footprint`: trace what the CUDA kernels allocate (fake tensors only)."""
    from trl.kernels import chunked_logprob
    from trl.trainer import utils as trl_utils

    original = model.__dict__.get("forward")
    saved = {}
    try:
        apply_trl_loss(model)
        if gpu_footprint:
            for module, name, value in ((chunked_logprob, "_forward_tile", _no_fold),
                                        (chunked_logprob, "_backward_tile", _no_fold),
                                        (chunked_logprob, "_addmm_fp32", _addmm_in_place),
                                        (trl_utils, "_ChunkedLogProbFunction",
                                         _CompactHidden(trl_utils._ChunkedLogProbFunction))):
                saved[(module, name)] = getattr(module, name)
                setattr(module, name, value)
        yield model
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
        model.__dict__.pop("_toolkit_trl_forward", None)
        model.__dict__.pop("forward", None)
        if original is not None:
            model.__dict__["forward"] = original
