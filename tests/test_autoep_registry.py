"""DeepSpeed AutoEP's use of transformers' output-capture registry (toolkit.patches.autoep): DeepSpeed's own
registry helpers run against transformers' own registry class. No process starts here."""

from __future__ import annotations

import pytest


@pytest.fixture
def registry():
    """A fresh transformers registry of the installed class, with the string-key fix applied to the class."""
    from transformers.utils.output_capturing import _CanRecordRegistry

    from toolkit.patches.autoep import allow_string_keys

    allow_string_keys()
    return _CanRecordRegistry()


def test_the_fix_is_applied_once():
    """After the fix the class no longer needs it, and a second call changes nothing."""
    from toolkit.patches.autoep import allow_string_keys, needs_string_keys

    allow_string_keys()
    assert not needs_string_keys() and not allow_string_keys()


def test_deepspeed_reads_and_restores_its_string_keys_and_models_keep_theirs(registry):
    """DeepSpeed's AutoEP reads an entry with a default, installs its own and restores the original
    (base.py `_restore_transformers_output_capture_registry`): under the fix the original comes back under the
    class's key and nothing lands under "<class 'str'>"; a model still reads its class's entry."""
    import torch
    from deepspeed.module_inject.auto_ep_presets.base import (_MISSING_REGISTRY_ENTRY,
                                                              _restore_transformers_output_capture_registry)

    model = torch.nn.Linear(2, 2)
    key = str(model.__class__)
    registry[model] = {"router_logits": "original"}
    assert registry.get("<class 'absent'>", _MISSING_REGISTRY_ENTRY) is _MISSING_REGISTRY_ENTRY
    original = {key: registry.get(key, _MISSING_REGISTRY_ENTRY), "<class 'new'>": _MISSING_REGISTRY_ENTRY}
    registry.update({key: {"router_logits": "autoep"}, "<class 'new'>": {"router_logits": "autoep"}})
    assert registry.get(model) == {"router_logits": "autoep"}
    _restore_transformers_output_capture_registry(registry, original)
    assert dict(registry) == {key: {"router_logits": "original"}}
    assert registry.get(torch.nn.ReLU()) == {}  # a model of a class never registered: transformers' empty dict
