"""DeepSpeed AutoEP against transformers' output-capture registry: the string keys DeepSpeed 0.19.8 reads and
restores, made to work on transformers 5.24 (docs/ENGINE_FACTS.md, the AutoEP entry under expert parallelism).

AutoEP's router-logit retargeting (deepspeed/module_inject/auto_ep_presets/base.py
`_retarget_transformers_output_recorders_for_modules`, `_install_instance_transformers_output_recorders`,
`_restore_transformers_output_capture_registry`) treats `transformers.utils.output_capturing._CAN_RECORD_REGISTRY`
as a dict keyed by `str(module.__class__)`: `registry.get(key)`, `registry.get(key, default)` (base.py l.326) and
`registry[key] = entry`. transformers 5.24's `_CanRecordRegistry` (utils/output_capturing.py l.39-50) keys the same
strings but its `get(model)` takes no default and both it and `__setitem__` turn their argument into
`str(argument.__class__)`: DeepSpeed's call raises `TypeError: _CanRecordRegistry.get() takes 2 positional
arguments but 3 were given`, and a string key would read and write `"<class 'str'>"`. The fix lets both methods
take a string key as the plain dict key it is; a model argument keeps transformers' behaviour. Measured with it:
AutoEP (autoep_size 2, 2 gloo ranks, tiny Qwen3-MoE) trains to one process's losses within 1e-6.

toolkit.train calls `autoep_ready` for a DeepSpeed AutoEP plan (toolkit.inputs.autoep) before the HF Trainer
starts `deepspeed.initialize`."""

from __future__ import annotations

import inspect
import json
from pathlib import Path


def needs_string_keys() -> bool:
    """True where the installed transformers' registry `get` takes the model alone (5.24; DeepSpeed's
    `get(key, default)` fails there); False where it takes a default already or the registry does not exist."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return False
    registry = getattr(output_capturing, "_CanRecordRegistry", None)
    if registry is None or getattr(registry, "_toolkit_string_keys", False):
        return False
    return len(inspect.signature(registry.get).parameters) == 2


def allow_string_keys() -> bool:
    """Make `_CanRecordRegistry.get` / `__setitem__` take a string key as a plain dict key (and `get` a default),
    once per process, only where `needs_string_keys()`. Returns whether it changed the class."""
    if not needs_string_keys():
        return False
    from transformers.utils.output_capturing import _CanRecordRegistry

    model_get, model_set = _CanRecordRegistry.get, _CanRecordRegistry.__setitem__

    def get(self, key, *default):
        return dict.get(self, key, *default) if isinstance(key, str) else model_get(self, key)

    def setitem(self, key, value):
        if isinstance(key, str):
            dict.__setitem__(self, key, value)
        else:
            model_set(self, key, value)

    _CanRecordRegistry.get, _CanRecordRegistry.__setitem__ = get, setitem
    _CanRecordRegistry._toolkit_string_keys = True
    return True


def autoep_ready(ds_file: str, on_cpu: bool) -> str | dict:
    """A DeepSpeed AutoEP plan's DeepSpeed config for the HF Trainer: the registry made to take DeepSpeed's string
    keys where the installed pair needs it (`allow_string_keys`), and on a CPU DeepSpeed's AdamW as torch's
    (`torch_adam`: its fused Adam is a CUDA kernel; torch's AdamW is the same update). Returns the file, or the
    changed config as a dict (TrainingArguments.deepspeed takes either)."""
    allow_string_keys()
    if not on_cpu:
        return ds_file
    config = json.loads(Path(ds_file).read_text())
    if "optimizer" in config:
        config["optimizer"].setdefault("params", {})["torch_adam"] = True
    return config
