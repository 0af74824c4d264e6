"""What the three LM head + loss patches share (toolkit.patches.liger, .tiling, .chunkedce): each binds its own
forward on a Hugging Face causal LM instance, runs the decoder to its final hidden states, and shifts the labels as
transformers' ForCausalLMLoss does. The tracer and toolkit.train apply these patches; this module is their one copy
of that common part, so a change to how the head's inputs are found reaches all three at once.
"""

from __future__ import annotations

from types import MethodType

IGNORE_INDEX = -100
"""Label of a position no loss counts: torch's cross_entropy default ignore_index, which transformers' causal LM
loss, Liger's LigerForCausalLMLoss and torchtune's CEWithChunkedOutputLoss all take."""


def bind(module, name: str, function) -> None:
    """`function` as the instance's own method `name` (what Liger's _apply_liger_kernel_to_instance does): the class
    and every other instance keep theirs."""
    module.__dict__[name] = MethodType(function, module)


def shifted_labels(labels):
    """Each position's label is the next token's: shifted left by one, the last position IGNORE_INDEX
    (transformers/loss/loss_utils.py ForCausalLMLoss: pad, then drop the first column). A view of the padded copy."""
    import torch

    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def head_inputs(model, input_ids, attention_mask, position_ids, inputs_embeds, kwargs: dict):
    """What the head + loss take from a causal LM forward's arguments: the decoder's final hidden states
    (`model.<base_model_prefix>`, after its final norm) and the Trainer's num_items_in_batch (None when not given).
    Pops num_items_in_batch and logits_to_keep (each patch computes the logits it needs) from `kwargs` and passes
    the rest to the decoder."""
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("logits_to_keep", None)
    base = getattr(model, model.base_model_prefix)
    hidden = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  inputs_embeds=inputs_embeds, **kwargs).last_hidden_state
    return hidden, num_items
