"""The trace environment: fake-mode fixes and GPU kernel stand-ins.

With device_kind="cuda" the CPU kernels whose saved tensors differ from the GPU's (attention, dropout, CUDA
autocast's float32 op list) are replaced during the trace by stand-ins with the GPU kernel's footprint; every
substitution that fired is listed in the notes."""

from __future__ import annotations

import contextlib

# Registered with transformers for the duration of a flash-attention trace (flash kernels cannot run on CPU).
_FLASH_STANDIN = "toolkit_fa2_standin"  # no "flash" in the name: transformers would try to import the kernel


@contextlib.contextmanager
def trace_environment(attention: str, device_kind: str, notes: list[str], *, cuda_autocast: bool = False):
    """Yields the attn_implementation to build the model with."""
    import torch
    import transformers.masking_utils as masking_utils
    from torch._subclasses.fake_tensor import FakeTensor

    original_find = masking_utils.find_packed_sequence_indices

    # Under FakeTensorMode transformers treats fake tensors as graph tracing and builds a full (b, 1, s, s) mask
    # (and SDPA then expands grouped key/value heads) where real unpacked inputs get none (docs/ENGINE_FACTS.md).
    def find_packed_sequence_indices(position_ids):
        if isinstance(position_ids, FakeTensor):
            return None
        return original_find(position_ids)

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    grouped_mm_patch = _grouped_mm_fake_fix()
    F = torch.nn.functional
    original_sdpa, original_dropout = F.scaled_dot_product_attention, F.dropout
    attn_impl = attention
    try:
        if attention == "flash_attention_2":
            attn_impl = _register_flash_standin(notes)
        elif device_kind == "cuda" and attention == "sdpa":
            F.scaled_dot_product_attention = _cuda_sdpa_standin(original_sdpa, notes)
        if device_kind == "cuda":
            F.dropout = _cuda_dropout_standin(original_dropout, notes)
        with cuda_autocast_float32_ops() if cuda_autocast else contextlib.nullcontext():
            yield attn_impl
    finally:
        masking_utils.find_packed_sequence_indices = original_find
        if grouped_mm_patch is not None:
            grouped_mm_patch()
        F.scaled_dot_product_attention, F.dropout = original_sdpa, original_dropout


def _grouped_mm_fake_fix():
    """MoE experts run as grouped matrix multiplies over all routed tokens (transformers' default experts
    implementation), so their footprint does not depend on the routing. torch's fake kernel for grouped_mm accepts
    only bfloat16 where the real CPU kernel also takes float32: route other dtypes through transformers' own
    fallback op, which saves the same tensors. Returns an undo function, or None when there is nothing to patch."""
    try:
        import transformers.integrations.moe as moe
    except ImportError:
        return None
    if not hasattr(moe, "_can_use_grouped_mm"):
        return None
    from torch._subclasses.fake_tensor import FakeTensor
    import torch

    original = moe._can_use_grouped_mm

    def can_use_grouped_mm(input, weight, offs):
        if isinstance(weight, FakeTensor) and weight.dtype != torch.bfloat16:
            return False
        return original(input, weight, offs)

    moe._can_use_grouped_mm = can_use_grouped_mm

    def undo():
        moe._can_use_grouped_mm = original

    return undo


def _attention_kernel_function():
    """An autograd function with the footprint of the CUDA flash / memory-efficient attention kernels: forward
    saves q, k, v, the output and the fp32 log-sum-exp (batch x heads x seq), and (with a mask) the bias; no
    seq x seq tensor (PyTorch aten/src/ATen/native/transformers/cuda/attention_backward.cu)."""
    import torch

    from toolkit.estimate.selective import kernel_saved

    class AttentionKernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, mask, heads_first: bool):
            # Both kernels write their output as (batch, seq, heads, dim); SDPA returns it as a (b, h, s, d) view.
            if heads_first:
                b, h, s_q, _ = q.shape
                out = q.new_empty((b, s_q, h, v.shape[-1])).transpose(1, 2)
            else:
                b, s_q, h, _ = q.shape
                out = q.new_empty((b, s_q, h, v.shape[-1]))
            lse = q.new_empty((b, h, s_q), dtype=torch.float32)
            kernel_saved(out, lse)  # the selective op policy keeps the attention kernel's outputs
            ctx.save_for_backward(q, k, v, out, lse, *([mask] if isinstance(mask, torch.Tensor) else []))
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = ctx.saved_tensors[:3]
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None

    return AttentionKernel


def _autocast_inputs(*tensors):
    """As autocast casts the inputs of attention kernels (sdpa is on its lower-precision list; transformers casts
    flash-attention inputs to the autocast dtype)."""
    import torch

    if not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def _cuda_sdpa_standin(original, notes: list[str]):
    import torch

    kernel = _attention_kernel_function()

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False):
        query, key, value = _autocast_inputs(query, key, value)
        if isinstance(attn_mask, torch.Tensor):
            notes.append("sdpa with an explicit mask: CUDA memory-efficient kernel footprint (q, k, v, out, fp32 "
                         "logsumexp and the mask as an additive bias in the query's dtype, one per call)")
            return kernel.apply(query, key, value, _efficient_attention_bias(attn_mask, query.dtype), True)
        notes.append("sdpa: CUDA kernel footprint (q, k, v, out, fp32 logsumexp; no seq x seq) instead of CPU's")
        return kernel.apply(query, key, value, None, True)

    return scaled_dot_product_attention


def _efficient_attention_bias(mask, dtype):
    """The bias CUDA's SDPA hands the memory-efficient kernel for `mask` (the flash kernel takes none, so a masked
    call runs there), which that kernel saves for backward: a boolean mask becomes an additive one in the query's
    dtype, a new tensor each call, and a bias whose strides are not multiples of 8 is padded on its last dimension
    and sliced back (PyTorch aten/src/ATen/native/transformers/attention.cpp scaled_dot_product_attention,
    convert_boolean_attn_mask, preprocess_mask / pad_bias)."""
    import torch

    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype)
    elif mask.is_floating_point() and torch.is_autocast_enabled("cpu"):
        mask = mask.to(dtype)  # autocast casts every floating input of sdpa
    if mask.stride(-1) != 1 or any(stride % 8 for stride in mask.stride()[:-1]):
        last = mask.shape[-1]
        mask = torch.nn.functional.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask


def _register_flash_standin(notes: list[str]) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    kernel = _attention_kernel_function()

    def flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        notes.append("flash_attention_2: traced with a stand-in of the flash kernel's footprint (q, k, v, out, "
                     "fp32 logsumexp; grouped k/v not repeated, no mask)")
        # As transformers' flash_attention_forward: (b, s, h, d) views of the projections go to the kernel.
        q, k, v = (t.transpose(1, 2) for t in _autocast_inputs(query, key, value))
        return kernel.apply(q, k, v, None, False), None

    AttentionInterface.register(_FLASH_STANDIN, flash_attention)
    AttentionMaskInterface.register(_FLASH_STANDIN, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return _FLASH_STANDIN


def _cuda_dropout_standin(original, notes: list[str]):
    import torch

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0 or inplace:
            return original(input, p, training, inplace)
        notes.append("dropout: CUDA fused kernel keeps a 1-byte mask (CPU keeps it in the activation dtype)")
        return torch.native_dropout(input, p, True)[0]

    return dropout


# CUDA autocast runs these in float32 (torch/csrc/autocast_mode.cpp, "fp32" and "fp32_set_opt_dtype" CUDA lists);
# CPU autocast leaves them in the input dtype, so a bf16 softmax or GELU saves half the bytes it would on a GPU.
_CUDA_AUTOCAST_FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "group_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "cross_entropy", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "norm",
)


_FLOAT32_OPS_ACTIVE = [0]
"""How many cuda_autocast_float32_ops contexts are open: a checkpoint's recompute runs in the autograd engine,
outside the TorchFunctionMode stack of the forward, so checkpointed layers re-enter the mode themselves."""


def _float32_ops_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    F = torch.nn.functional
    funcs = set()
    for name in _CUDA_AUTOCAST_FLOAT32:
        for owner in (torch, torch.Tensor, F, torch.special, torch.linalg):
            f = getattr(owner, name, None)
            if f is not None:
                funcs.add(f)
    funcs.update({torch.Tensor.__pow__, torch.Tensor.__rpow__, torch.linalg.vector_norm})
    low = (torch.bfloat16, torch.float16)

    def up(x):
        return x.float() if isinstance(x, torch.Tensor) and x.dtype in low else x

    class Float32Ops(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in funcs and torch.is_autocast_enabled("cpu"):
                args = tuple(up(a) for a in args)
                kwargs = {k: up(v) for k, v in kwargs.items()}
            return func(*args, **kwargs)

    return Float32Ops()


@contextlib.contextmanager
def cuda_autocast_float32_ops():
    """While CPU autocast is on, run the ops CUDA autocast keeps in float32 in float32 (inputs cast up, as CUDA
    autocast does), so the saved tensors have the GPU's dtypes."""
    _FLOAT32_OPS_ACTIVE[0] += 1
    try:
        with _float32_ops_mode():
            yield
    finally:
        _FLOAT32_OPS_ACTIVE[0] -= 1


def with_float32_ops(function):
    """`function` run under the float32-ops mode, in forward and in a checkpoint's recompute alike."""
    if not _FLOAT32_OPS_ACTIVE[0]:
        return function

    def run(*args, **kwargs):
        with _float32_ops_mode():
            return function(*args, **kwargs)

    return run
