"""ALST's tiled compute over the sequence (DeepSpeed's TiledMLP and sequence_tiled_compute), applied to a Hugging Face
causal LM instance: the tracer traces exactly this patch (toolkit.estimate.tracer) and toolkit.train runs it.

What the engine's autograd functions do (deepspeed/runtime/sequence_parallel/ulysses_sp.py, DeepSpeed 0.19.8):
- TiledMLP: forward runs the MLP on `shards` chunks of the sequence under no_grad and saves only the MLP's input;
  backward recomputes each chunk's MLP with grad and back-propagates it at once, so the MLP's intermediates (gate,
  up, activation, product: the FFN-wide tensors) exist for one chunk at a time, and the MLP's forward runs twice per
  step (three times under activation checkpointing).
- SequenceTiledCompute (sequence_tiled_compute), used here for the logits + loss as ArcticTraining does: forward
  runs LM head + loss chunk by chunk under no_grad and keeps only its inputs (the hidden states and labels);
  backward recomputes each chunk's logits and loss with grad and back-propagates it at once, so the whole-sequence
  logits and their fp32 log-softmax never exist, at the price of the LM head's forward run twice.
  (TiledFusedLogitsLoss, which back-propagates inside the forward instead, makes the LM head's weight gradient for
  an incoming gradient of 1: wrong under any later scaling of the loss; see _tiled_loss_forward.)
How many chunks: DeepSpeed's TiledMLP example and ArcticTraining's "auto" take ceil(seq / hidden) for the MLP
(chunks about as long as the hidden size); ArcticTraining's loss takes ceil(fp32 logits / 1 GiB).
"""

from __future__ import annotations

import contextlib
import sys

from toolkit.patches.lmhead import IGNORE_INDEX, bind, head_inputs, shifted_labels
from toolkit.inputs.job import loss_shards, mlp_shards
from toolkit.inputs.modelconfig import text_config

TILING_SOURCE = 'DeepSpeed 0.19.8 deepspeed/runtime/sequence_parallel/ulysses_sp.py (TiledMLP, SequenceTiledCompute)'


def _ulysses():
    """DeepSpeed's sequence-parallel module. DeepSpeed's logger writes to the stdout of the moment deepspeed is first
    imported (deepspeed/utils/logging.py binds a StreamHandler to sys.stdout then), and that import logs the
    accelerator it found; imported with stdout pointed at stderr, its lines never mix into `--json` output."""
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.sequence_parallel import ulysses_sp
    return ulysses_sp


def _mlps(model):
    """The decoder layers' MLPs TiledMLP can run (toolkit.inputs.tileable; the planner refuses tiling for a model
    with any other, so a user's apply_tiling on such a model tiles the loss and leaves those MLPs as they are)."""
    from toolkit.inputs.tileable import tileable_mlps

    config = text_config(model.config)
    return tileable_mlps(model, int(getattr(config, "hidden_size", None) or getattr(config, "n_embd")))[0]


def _tiled_mlp_forward(self, x):
    import torch

    tiled_mlp = _ulysses().TiledMLP
    shards = mlp_shards(x.shape[-2], x.shape[-1])
    if _AGREE[0]:
        shards = _agreed(shards, x.device)
    if self.training and torch.is_grad_enabled():
        LAST_CHUNKS["mlp"] = shards
    # The MLP class's own forward, run per chunk by the engine's autograd function.
    return tiled_mlp.apply(lambda mlp, chunk: type(mlp).forward(mlp, _plain(chunk)), self, x, shards,
                          [p for p in self.parameters()])


def _plain(chunk):
    """A chunk the engine cut under no_grad (its forward pass) is a view that requires grad yet has no grad_fn;
    nothing differentiates it there, and module hooks that register gradient hooks on their inputs (torch's
    ModTracker, under MemTracker) fail on such a view, so it goes in detached. The backward's recompute keeps it.
    The forward's chunks are slices of [batch, seq, hidden] along seq, strided when batch > 1: an MLP that views its
    input (GPT-2's Conv1D: `x.view(-1, hidden)`) fails on them, so a strided chunk goes in as a contiguous copy
    (one chunk, freed with it; the backward's flattened chunks are contiguous already and pass as they are)."""
    import torch

    chunk = chunk.contiguous()
    return chunk if torch.is_grad_enabled() else chunk.detach()


def _agreed(shards: int, device) -> int:
    """Every rank runs the same number of chunks (ZeRO-3 gathers per module call): the largest, as DeepSpeed's
    example all-reduces it."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return shards
    value = torch.tensor(shards, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def _chunk_loss_sum(model=None, hidden_states=None, shift_labels=None):
    """LM head and the model's own loss over one chunk, summed over its labelled tokens (num_items_in_batch 1 makes
    transformers' loss reduce by sum): chunks hold different numbers of labelled tokens, and a chunk with none gives
    0, not the mean's nan (ArcticTraining's fused_logits_loss_fn weighs each chunk the same way)."""
    with _INNER_HOOKS[0]():
        logits = model.get_output_embeddings()(_plain(hidden_states))
        # A chunk of a micro-batch above 1 is a strided view, which the loss's view(-1) cannot flatten.
        return model.loss_function(logits=logits, labels=None, vocab_size=text_config(model.config).vocab_size,
                                   shift_labels=shift_labels.contiguous(), num_items_in_batch=1)


def _tiled_loss_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                        labels=None, **kwargs):
    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    shift_labels = kwargs.pop("shift_labels", None)
    if shift_labels is None and labels is not None:
        shift_labels = shifted_labels(labels).contiguous()
    hidden, num_items = head_inputs(self, input_ids, attention_mask, position_ids, inputs_embeds, kwargs)
    if shift_labels is None or not self.training or not torch.is_grad_enabled():
        # Evaluation and plain calls: whole logits, the model's own loss (no backward to tile).
        logits = self.get_output_embeddings()(hidden)
        loss = None if shift_labels is None else self.loss_function(
            logits=logits, labels=None, vocab_size=text_config(self.config).vocab_size, shift_labels=shift_labels,
            num_items_in_batch=num_items)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
    b, s = shift_labels.shape
    shards = loss_shards(b, s, text_config(self.config).vocab_size)
    if _AGREE[0]:
        shards = _agreed(shards, hidden.device)
    LAST_CHUNKS["loss"] = shards
    # The generic SequenceTiledCompute, not TiledFusedLogitsLoss: the latter makes the LM head's weight gradient
    # inside its forward for an incoming gradient of 1 and later rescales only the hidden states' gradient, so the
    # weight gradient is wrong whenever the loss is scaled afterwards (a mean over labelled tokens, gradient
    # accumulation, the SP ranks' weighted mean); SequenceTiledCompute recomputes each chunk in backward with the
    # true incoming gradient.
    total = _LOSS_FUNCTION[0]().apply(
        _chunk_loss_sum, s, shards, ["hidden_states", "shift_labels"], ["model"], "hidden_states",
        list(self.get_output_embeddings().parameters()), 0, "sum", hidden, shift_labels, self)
    count = num_items if num_items is not None else (shift_labels != IGNORE_INDEX).sum().clamp(min=1)
    return CausalLMOutputWithPast(loss=total / count, logits=None)


def _engine_loss():
    return _ulysses().SequenceTiledCompute


def _traced_loss():
    """The engine's function for a trace: it keeps the chunked inputs as attributes of its context, which the
    tracer's saved-tensor hooks do not see; saving the hidden states as well charges what it keeps (the same
    storage, no new bytes)."""
    engine = _engine_loss()

    class TracedSequenceTiledCompute(engine):
        @staticmethod
        def forward(ctx, *args):
            out = engine.forward(ctx, *args)
            ctx.save_for_backward(ctx.kwargs_to_shard["hidden_states"])
            return out

    return TracedSequenceTiledCompute


LAST_CHUNKS: dict[str, int] = {}
"""Chunk counts of the last training-mode tiled MLP / loss call in this process (toolkit.train's rank summary
reports them)."""
_AGREE = [False]
_INNER_HOOKS = [contextlib.nullcontext]
_LOSS_FUNCTION = [_engine_loss]


def apply_tiling(model, *, agree_across_ranks: bool = False) -> None:
    """Patch `model` for good: every decoder layer's MLP through TiledMLP, the forward with labels through the tiled
    logits + loss (which returns no logits in training). `agree_across_ranks`: all-reduce the chunk counts (a
    distributed run)."""
    for mlp in _mlps(model):
        bind(mlp, "forward", _tiled_mlp_forward)
    bind(model, "forward", _tiled_loss_forward)
    _AGREE[0] = agree_across_ranks


@contextlib.contextmanager
def tiling_traced(model):
    """The patch for a trace: what a chunk saves while the tiled loss recomputes it in backward dies with the chunk,
    so it is hidden from the tracer's saved-tensor hooks (it still shows in the live bytes)."""
    import torch

    apply_tiling(model)
    was = _INNER_HOOKS[0], _LOSS_FUNCTION[0]
    _INNER_HOOKS[0] = lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    _LOSS_FUNCTION[0] = _traced_loss
    try:
        yield model
    finally:
        _INNER_HOOKS[0], _LOSS_FUNCTION[0] = was
