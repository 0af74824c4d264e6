"""copy.deepcopy of fake tensors, for wrappers that deep-copy a module while the tracer's FakeTensorMode is on.

PEFT's ModulesToSaveWrapper (peft/utils/other.py, `update`) deep-copies each module named in modules_to_save. Under
FakeTensorMode that copy goes through torch's Tensor.__deepcopy__ (torch/_tensor.py), which reads the FakeTensor's
data_ptr (torch warns: "undefined behavior") and copies its storage as a real storage outside the fake mode. A
process that did so died now and then at exit with a corrupted heap (SIGABRT "corrupted double-linked list" or
SIGSEGV while the interpreter clears modules; issue 33, docs/ENGINE_FACTS.md). Inside `fake_deepcopy()` a fake
tensor is copied as what it stands for: a fake clone, a parameter again if it was one.
"""

from __future__ import annotations

import contextlib


def _deepcopy(self, memo):
    import torch

    if id(self) not in memo:
        clone = self.detach().clone()
        is_param = isinstance(self, torch.nn.Parameter) or getattr(self, "_is_param", False)
        memo[id(self)] = (torch.nn.Parameter(clone, requires_grad=self.requires_grad) if is_param
                          else clone.requires_grad_(self.requires_grad))
    return memo[id(self)]


@contextlib.contextmanager
def fake_deepcopy():
    """Within: copy.deepcopy(fake tensor) is a fake clone (module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensor

    FakeTensor.__deepcopy__ = _deepcopy
    try:
        yield
    finally:
        del FakeTensor.__deepcopy__
