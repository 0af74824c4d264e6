"""What a training run's rank summary says about its dtypes (with TOOLKIT_RANK_SUMMARY_DIR set; tests read it): the
dtype a decoder layer and its first matmul compute in, and the dtypes of the frozen and trained parameters."""

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
