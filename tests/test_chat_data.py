"""Chat data in toolkit.train: the chat template's tokens, loss on the assistant's turns only, one conversation per
sequence (never packed together)."""

from __future__ import annotations

import json

import pytest

from toolkit.errors import UserError
from toolkit.train.data import IGNORE_INDEX, build_datasets, chat_example

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "A mutable sequence."},
    {"role": "user", "content": "And a tuple?"},
    {"role": "assistant", "content": "An immutable one."},
]
# The same template without {% generation %} marks: the prefix-rendering route must find the same tokens.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ message['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from toolkit.run.tiny import corpus_text, train_tokenizer

    return train_tokenizer(corpus_text(30_000), vocab_size=400)


@pytest.mark.parametrize("route", ["generation marks", "prefix rendering"])
def test_labels_are_the_assistant_tokens_only(tokenizer, route):
    import copy

    tok = copy.deepcopy(tokenizer)
    if route == "prefix rendering":
        tok.chat_template = PLAIN_TEMPLATE
    example = chat_example(CONVERSATION, tok, seq_len=200)
    ids, labels, mask = example["input_ids"], example["labels"], example["attention_mask"]
    assert len(ids) == len(labels) == len(mask) == 200
    n_real = sum(mask)
    assert ids[:n_real] == tok(tok.apply_chat_template(CONVERSATION, tokenize=False),
                               add_special_tokens=False)["input_ids"]
    trained = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
    assert all(labels[i] == ids[i] for i in trained)
    # Exactly the two answers, each with its end-of-turn token, in two contiguous spans.
    assert tok.decode([ids[i] for i in trained]) == "A mutable sequence.<|endoftext|>An immutable one.<|endoftext|>"
    spans = sum(1 for a, b in zip(trained, trained[1:]) if b != a + 1) + 1
    assert spans == 2
    assert all(label == IGNORE_INDEX for label in labels[n_real:]) and not any(mask[n_real:])


def test_truncation_keeps_the_shape_and_a_template_is_required(tokenizer):
    example = chat_example(CONVERSATION, tokenizer, seq_len=16)
    assert len(example["input_ids"]) == 16 and sum(example["attention_mask"]) == 16
    assert all(label == IGNORE_INDEX for label in example["labels"])  # the answers start after token 16
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(UserError, match="chat template"):
        chat_example(CONVERSATION, bare, seq_len=16)


def test_chat_files_become_one_conversation_per_sequence(tokenizer, tmp_path):
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:3]}, {"messages": CONVERSATION[:2]}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, evaluation = build_datasets(str(tmp_path / "train.jsonl"), tokenizer, 128, eval_fraction=0.0, seed=0)
    assert evaluation is None
    assert len(train) == 2  # the conversation without an assistant turn has nothing to learn
    for row in train:
        assert len(row["input_ids"]) == 128 and row["labels"][0] == IGNORE_INDEX
