"""Decoder stacks of several layer classes (hybrid attention / linear-attention / Mamba stacks) are found and traced,
and a layer that loops over the tokens in Python stops the trace with one line instead of running for minutes.
In-process, on shrunk configs of real architectures (transformers' own config classes)."""

import pytest

from toolkit import api
from toolkit.errors import UserError
from toolkit.inputs.modelspec import build_spec

SMALL = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SEQ = 256


def _config(model_type: str, **overrides):
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**{**SMALL, **overrides})


def test_a_stack_of_two_layer_classes_is_counted_and_traced_layer_by_kind():
    import torch
    from transformers import AutoModelForCausalLM

    config = _config("olmo_hybrid")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    classes = {type(layer).__name__ for layer in model.model.layers}
    assert len(classes) == 2  # linear-attention and attention decoder layers in one list
    spec = build_spec("tiny-olmo-hybrid", config)
    assert spec.params == sum(p.numel() for p in model.parameters())
    estimate = api.estimate(spec, "8xH100-80GB", strategy="zero3", seq_len=SEQ)
    assert estimate.memory.activations_bytes > 0
    assert "traced 4 of 4 layers, expanded by layer kind" in estimate.memory.notes


def test_a_layer_looping_over_the_tokens_is_refused_in_one_line():
    # Mamba's mixer runs transformers' token-by-token reference scan without the mamba-ssm kernels (~47 operations
    # a token, against 1-12 for chunked scans: toolkit.estimate.recording.TOKEN_LOOP_OPS_PER_TOKEN), inside
    # transformers' hub-kernels wrapper, where raising from the dispatch aborted the interpreter (terminate called
    # after throwing python_error): the tracer's layer hook raises instead
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING["mamba"](hidden_size=64, num_hidden_layers=2, vocab_size=256, state_size=8,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    spec = build_spec("tiny-mamba", config)
    with pytest.raises(UserError, match=r"more than 12,288 operations at 512 tokens, a Python loop over the tokens"):
        api.estimate(spec, "8xH100-80GB", strategy="zero3", seq_len=512)


def test_the_api_takes_the_cli_words_for_checkpointing():
    spec = build_spec("tiny-olmo-hybrid", _config("olmo_hybrid"))  # the same spec: its off trace is the one above
    on = api.estimate(spec, "8xH100-80GB", strategy="zero3", seq_len=SEQ, checkpointing="on")
    assert on.job.checkpointing is True
    off = api.estimate(spec, "8xH100-80GB", strategy="zero3", seq_len=SEQ, checkpointing="off")
    assert off.job.checkpointing is False
    assert on.memory.activations_bytes < off.memory.activations_bytes
