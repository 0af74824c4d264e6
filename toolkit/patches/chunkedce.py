"""torchtune's chunked cross-entropy (CEWithChunkedOutputLoss) applied to a Hugging Face causal LM instance, so the
tracer traces the head + loss as torchtune runs them (toolkit.estimate.tracer) and a real CPU step runs the same
patch (tests/test_chunkedce.py).

What torchtune does (pytorch/torchtune, torchtune/modules/transformer.py `TransformerDecoder.chunked_output` and
torchtune/modules/loss/ce_chunked_output_loss.py `CEWithChunkedOutputLoss`, as of the README's optimization-flags
table, PR #2003 @1814feb; the recipe sets the model's output chunks from the loss with `num_output_chunks` 8):
- the model's forward splits the final-norm hidden states into `chunks` pieces along the sequence
  (`h.chunk(chunks, dim=1)`) and applies the output projection to each: a list of bf16 logits chunks, together the
  size of the whole logits, all alive until the loss is computed (the recipe then `del logits`);
- the loss shifts the labels (the recipe appends an ignore index), splits them the same way and, chunk by chunk,
  upcasts the logits chunk to fp32 and takes `F.cross_entropy(..., ignore_index=-100, reduction="sum")`; the sum
  over chunks is divided by the number of labelled tokens.
So only one chunk's fp32 copy exists at a time in forward, and each chunk's log-softmax (fp32, what cross-entropy
saves for backward) is kept: together the size of fp32 logits. In backward each chunk's fp32 gradient is made and
cast down to the compute dtype one chunk at a time. torchtune compiles `compute_cross_entropy` when it compiles the
model; this module is the eager loss (the compiled loss saves other tensors; benchmarks/published.py says which).
"""

from __future__ import annotations

import contextlib

from toolkit.patches.lmhead import IGNORE_INDEX, bind, head_inputs, shifted_labels

CHUNKED_CE_SOURCE = ("torchtune CEWithChunkedOutputLoss + TransformerDecoder.chunked_output (pytorch/torchtune "
                     "torchtune/modules/loss/ce_chunked_output_loss.py, torchtune/modules/transformer.py @1814feb)")
TORCHTUNE_CHUNKS = 8
"""torchtune's default num_output_chunks (CEWithChunkedOutputLoss.__init__)."""


def chunked_cross_entropy(logits_chunks, shift_labels, num_items_in_batch=None):
    """CEWithChunkedOutputLoss.forward over already shifted labels: each chunk upcast to fp32 and summed, the total
    divided by the labelled tokens (or by `num_items_in_batch`, the Trainer's count across accumulation)."""
    import torch.nn.functional as F

    chunks = len(logits_chunks)
    count = num_items_in_batch if num_items_in_batch is not None else (shift_labels != IGNORE_INDEX).sum()
    total = 0.0
    for logits, labels in zip(logits_chunks, shift_labels.chunk(chunks, dim=1)):
        total = total + F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                                        ignore_index=IGNORE_INDEX, reduction="sum")
    return total / count


def _chunked_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                     labels=None, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    hidden, num_items = head_inputs(self, input_ids, attention_mask, position_ids, inputs_embeds, kwargs)
    head = self.get_output_embeddings()
    logits = [head(chunk) for chunk in hidden.chunk(self._toolkit_ce_chunks, dim=1)]
    loss = None
    if labels is not None:
        loss = chunked_cross_entropy(logits, shifted_labels(labels), num_items)
    return CausalLMOutputWithPast(loss=loss, logits=logits)


@contextlib.contextmanager
def chunked_ce_applied(model, chunks: int = TORCHTUNE_CHUNKS):
    """Patch `model`'s forward for the duration of the block: logits returned as a list of `chunks` sequence chunks
    and, with labels, torchtune's chunked loss over them."""
    had = "forward" in model.__dict__
    bind(model, "forward", _chunked_forward)
    model._toolkit_ce_chunks = chunks
    try:
        yield model
    finally:
        if not had:
            del model.__dict__["forward"]
