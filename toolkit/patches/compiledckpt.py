"""Checkpointed decoder layers kept inside torch.compile's graph where the `kernels` package routes functions from a
module's forward (docs/ENGINE_FACTS.md, "transformers 5.25 and the compiled checkpointed layers").

transformers 5.25 requires the `kernels` package (>= 0.19.1; 5.24 listed it as an extra only). Where it is installed,
the classes transformers decorates with `use_kernelized_func` (Llama's and Qwen2's attention, for
apply_rotary_pos_emb) run kernels' forward wrapper, which sets a module-level context variable before the real
forward and resets it after (kernels/_internals/layer/layer.py, `new_forward`: `_ACTIVE_KERNEL_FUNCS.set`, under
compile an attribute write on a `CompileableContextVar`). Inside torch.utils.checkpoint Dynamo refuses a write to
state outside the checkpointed region ("HOP: Unsafe side effect") and breaks the graph there: each checkpointed
layer then runs eagerly, outside the compiled graph, in every torch.compile'd step with checkpointing (whole-layer
or per-op). Dynamo's `skip_fwd_side_effects_in_bwd_under_checkpoint` traces the write instead and leaves it out
of the backward's recompute, where it has nothing to do (the wrapper undoes it when the forward returns): the step
compiles whole again, as with transformers 5.24.
"""

from __future__ import annotations

import contextlib

DYNAMO_FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def routes_kernels_in_forward(model) -> bool:
    """Whether a module of `model` runs kernels' `use_kernelized_func` forward (its `__init__` wrapper gives each
    instance the `_kernel_funcs` the forward routes to)."""
    return any("_kernel_funcs" in vars(m) for m in model.modules())


def checkpointed_layers_compiled(model):
    """The context to run `model`'s torch.compile'd steps in: Dynamo's DYNAMO_FLAG on where the installed code puts
    kernels' routing into a module's forward and the installed torch has the flag; nothing otherwise."""
    import torch._dynamo.config as dynamo

    if not routes_kernels_in_forward(model) or not hasattr(dynamo, DYNAMO_FLAG):
        return contextlib.nullcontext()
    return dynamo.patch(**{DYNAMO_FLAG: True})
