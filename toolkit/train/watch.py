"""What a training run's rank summary says about its dtypes and states (with TOOLKIT_RANK_SUMMARY_DIR set; tests read
it): the dtype a decoder layer and its first matmul compute in, the dtypes of the frozen and trained parameters, and
the parameter and optimizer bytes a rank holds."""

from __future__ import annotations

import os


def watch_layer_dtype(model, layer_class: str) -> dict:
    """With TOOLKIT_RANK_SUMMARY_DIR set: record the dtype the first decoder layer computes in during training
    (shows that bf16 autocast / DeepSpeed bf16 / the FSDP2 mixed-precision policy really applied)."""
    seen: dict = {}
    if not os.environ.get("TOOLKIT_RANK_SUMMARY_DIR"):
        return seen
    import torch

    layer = next((m for m in model.modules() if type(m).__name__ == layer_class), None)
    # and its first matmul's output: bf16 under autocast even where the weights and the residual stream are fp32
    # (LoRA's --base-dtype fp32)
    linear = next((m for m in layer.modules() if isinstance(m, torch.nn.Linear)), None) if layer is not None else None
    for module, key in ((layer, "train_layer_output_dtype"), (linear, "train_linear_output_dtype")):
        if module is not None:
            def hook(module, inputs, output, key=key):
                if module.training:
                    first = output[0] if isinstance(output, (tuple, list)) else output
                    seen[key] = str(getattr(first, "dtype", None))
            module.register_forward_hook(hook)
    return seen


def param_dtypes(model) -> dict[str, list[str]]:
    """The dtypes the run holds its frozen and its trained parameters in (LoRA's --base-dtype)."""
    return {f"{kind}_param_dtypes": sorted({str(p.dtype) for p in model.parameters()
                                            if p.requires_grad == (kind == "trained")})
            for kind in ("frozen", "trained")}


def held_state_bytes(model, optimizer) -> tuple[int, int]:
    """Bytes of the parameters this rank holds between steps (a DTensor's local shard: the plan's parameters_bytes)
    and of the optimizer states it holds (AdamW's moments and steps: the plan's optimizer_bytes a rank). FSDP2 keeps
    the root's parameters unsharded after a forward (the last evaluation's), so it is resharded first."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    param_bytes = sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in model.parameters())
    optimizer = getattr(optimizer, "optimizer", optimizer)
    optimizer_bytes = sum(getattr(t, "_local_tensor", t).numel() * t.element_size()
                          for state in getattr(optimizer, "state", {}).values() for t in state.values()
                          if torch.is_tensor(t))
    return param_bytes, optimizer_bytes
