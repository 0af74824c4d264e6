"""Liger kernels (the HF Trainer's `use_liger_kernel=True`) as pure-torch substitutes the tracer can run.

Liger's kernels are Triton, so they cannot run on CPU or under FakeTensorMode. What matters for memory is which
tensors each of its autograd Functions saves for backward and what it allocates; that is copied here, read from
liger-kernel 0.8.2 (github linkedin/Liger-Kernel, tag v0.8.2; the files named below are unchanged at @ead96b6,
2026-08-21):

- `_apply_liger_kernel_to_instance` (src/liger_kernel/transformers/monkey_patch.py), which the Trainer calls through
  transformers/integrations/liger.py `apply_liger_kernel(model, args.liger_kernel_config)` (transformers 5.24,
  Trainer.__init__ when args.use_liger_kernel; PEFT models unwrapped first), patches a loaded model of
  type llama / mistral / qwen2 / qwen3 by `apply_liger_kernel_to_<type>(model=...)` with its defaults: rope=True,
  rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, cross_entropy=False. On an instance that means:
  `modeling_<type>.apply_rotary_pos_emb = liger_rotary_pos_emb` (a module global, so existing attention modules
  call it), the `forward` of `model.norm` and of every decoder layer's `input_layernorm` /
  `post_attention_layernorm` bound to LigerRMSNorm.forward (casting_mode "llama", offset 0, in_place=True; Qwen3's
  q_norm / k_norm are left alone), every layer's `mlp.forward` bound to LigerSwiGLUMLP.forward, and
  `model.forward = lce_forward` (transformers/model/<type>.py), which in training with labels never computes logits.
- RMSNorm, src/liger_kernel/ops/rms_norm.py `LigerRMSNormFunction`: forward allocates Y (input dtype) and RSTD
  (fp32, one per row) and saves (X, W, RSTD), X being a view of the input. Backward writes dX into dY in place and
  reduces dW from an (sm_count, H) fp32 buffer.
- SwiGLU, src/liger_kernel/ops/swiglu.py `LigerSiLUMulFunction`: forward allocates c = silu(a) * b and saves (a, b),
  the gate and up projections; backward writes da, db into a and b in place. (HF's MLP also keeps silu(gate) and
  the product; the down projection keeps c either way.)
- RoPE, src/liger_kernel/ops/rope.py `LigerRopeFunction`: rotates q and k in place in their (batch, seq, heads,
  dim) buffers (the projections' outputs, contiguous there) and saves only cos and sin. Backward rotates
  dq.transpose(1, 2).contiguous() and dk likewise (copies, as SDPA's gradients are (b, h, s, d)).
- Fused linear cross-entropy, src/liger_kernel/ops/fused_linear_cross_entropy.py
  `LigerFusedLinearCrossEntropyFunction` (via transformers/model/loss_utils.py `LigerForCausalLMLoss`: labels padded
  with -100 and shifted, hidden states flattened to (B*T, H), reduction mean, or sum over num_items_in_batch): in
  forward it allocates grad_input = zeros_like(input), grad_weight = zeros_like(weight) (the weight's dtype; no
  accum_dtype by default) and an fp32 loss per row, then for chunks of rows (chunk = next_pow2(ceil(BT /
  ceil(V / H)))) computes a (chunk, V) logits block, lets the cross-entropy kernel overwrite it with its gradient,
  adds block @ W into grad_input and block^T @ input into grad_weight (CUDA sm80+ with an fp32 grad_weight and
  low-precision block: one `torch.addmm(..., out_dtype=float32, out=grad_weight)` with the input chunk cast to the
  block's dtype; otherwise `grad_weight += torch.mm(block.t(), input_chunk).float()`, a (V, H) product and its fp32
  copy). It saves (grad_input, grad_weight, grad_bias) and never holds the logits; backward only scales them by the
  incoming gradient, in place, when it is not 1, and returns them: autograd then takes grad_weight as the
  lm_head's .grad, so that gradient exists from the forward on. The grad_weight update is version-dependent:
  an in-place `torch.addmm(out=grad_weight)` (no (V, H) temporary) before 0.6.2, `+= torch.mm(...).float()` since
  0.6.2 (PR 830), the fp32 out_dtype addmm since 0.8.1 (PR 1239; sm80 guard in 0.8.2). Liger's own published
  memory table (benchmark/data/all_benchmark_data.csv) was measured with 0.4.2, before that change.

Traced for a GPU (`liger_applied(model, gpu_footprint=True)` under FakeTensorMode) the substitutes allocate exactly
what the kernels allocate. Otherwise, on real tensors or traced with device_kind "cpu", they compute the values
with torch ops, whose temporaries (fp32 copies, the softmax of a logits block) only a CPU run of the substitutes
has; they save the same tensors either way. tests/test_liger.py checks them against the Hugging Face modules they
replace and the trace against a real CPU run.
"""

from __future__ import annotations

import contextlib
import importlib

from toolkit.errors import UserError
from toolkit.patches.lmhead import IGNORE_INDEX, bind, head_inputs, shifted_labels
from toolkit.inputs.job import liger_problem

LIGER_SOURCE = "liger-kernel 0.8.2 (linkedin/Liger-Kernel @ead96b6)"

H100_SM_COUNT = 132
"""Streaming multiprocessors of an H100 SXM: rows of the fp32 partial dW buffer in Liger's RMSNorm backward."""


_GPU_FOOTPRINT = [False]
"""Set by liger_applied(gpu_footprint=True) for a trace of the GPU kernels."""


def _gpu_footprint(*tensors) -> bool:
    """True when only the kernels' allocations matter: fake tensors traced for a GPU."""
    from torch._subclasses.fake_tensor import FakeTensor

    return _GPU_FOOTPRINT[0] and any(isinstance(t, FakeTensor) for t in tensors)


def _addmm_fp32_in_place(acc, a, b) -> None:
    """Liger's `torch.addmm(acc, a, b, out_dtype=float32, out=acc)` on fake tensors: nothing allocated. Fake tensors
    of torch 2.11 run `addmm.dtype_out` through the plain addmm decomposition, which takes the out_dtype for beta and
    raises TypeError (seen on the GPU day, benchmarks/data/gpu_day_2026-12-04/first.log); the kernel writes into
    `acc` and allocates nothing either way, so there the op is left out of the trace (its FLOPs with it, as
    toolkit.patches.trlloss leaves out the same kernel)."""
    import torch

    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except TypeError:
        if not _is_fake(acc):
            raise


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


# ----------------------------------------------------------------------------------------------------------------
# Autograd functions (built lazily: torch is imported only when a trace or a test needs them)

_FUNCTIONS: dict[str, type] = {}


def functions() -> dict[str, type]:
    if not _FUNCTIONS:
        _FUNCTIONS.update(_build_functions())
    return _FUNCTIONS


def _rotate_half(x):
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _build_functions() -> dict[str, type]:
    import torch

    class RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps):
            rows = x.reshape(-1, x.shape[-1])  # a view: Liger saves the input's own storage
            if _gpu_footprint(x, weight):
                y = torch.empty_like(rows)
                rstd = rows.new_empty(rows.shape[0], dtype=torch.float32)
            else:  # casting mode "llama": only the inverse RMS in fp32, as LlamaRMSNorm
                x32 = rows.float()
                rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
                y = weight * (x32 * rstd[:, None]).to(x.dtype)
            ctx.save_for_backward(rows, weight, rstd)
            return y.view(x.shape)

        @staticmethod
        def backward(ctx, dy):
            rows, weight, rstd = ctx.saved_tensors
            d = dy.reshape(-1, rows.shape[-1])
            if _gpu_footprint(d):
                partial = d.new_empty((H100_SM_COUNT, rows.shape[-1]), dtype=torch.float32)
                return d.view(dy.shape), partial.sum(0).to(weight.dtype), None  # dX written into dY
            xhat = rows.float() * rstd[:, None]
            dweight = (d * xhat.to(rows.dtype)).float().sum(0).to(weight.dtype)
            dxhat = (d * weight).float()
            dx = rstd[:, None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
            d = d.contiguous()
            d.copy_(dx.to(d.dtype))
            return d.view(dy.shape), dweight, None

    class SiLUMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            a, b = a.contiguous(), b.contiguous()
            if _gpu_footprint(a, b):
                c = torch.empty_like(a)
            else:
                c = torch.nn.functional.silu(a.float()).to(b.dtype) * b
            ctx.save_for_backward(a, b)
            return c

        @staticmethod
        def backward(ctx, dc):
            a, b = ctx.saved_tensors
            if not _gpu_footprint(dc):  # the kernel writes da and db over a and b
                a32, dc32 = a.float(), dc.float()
                sig = torch.sigmoid(a32)
                silu = a32 * sig
                db = (dc32 * silu).to(b.dtype)
                da = (dc32 * b.float() * (sig * (1 + a32 * (1 - sig)))).to(a.dtype)
                a.copy_(da)
                b.copy_(db)
            return a, b

    class Rope(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, cos, sin):
            qt, kt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
            cos, sin = cos.contiguous(), sin.contiguous()
            if not _gpu_footprint(q, k):  # rotated in place, in the (b, s, h, d) buffers
                c, s = cos.unsqueeze(2), sin.unsqueeze(2)
                qt.copy_(qt * c + _rotate_half(qt) * s)
                kt.copy_(kt * c + _rotate_half(kt) * s)
            ctx.save_for_backward(cos, sin)
            return qt.transpose(1, 2), kt.transpose(1, 2)

        @staticmethod
        def backward(ctx, dq, dk):
            cos, sin = ctx.saved_tensors
            dqt, dkt = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
            if not _gpu_footprint(dq, dk):  # the transpose of the rotation: x*cos - rotate_half(x*sin)
                c, s = cos.unsqueeze(2), sin.unsqueeze(2)
                dqt.copy_(dqt * c - _rotate_half(dqt * s))
                dkt.copy_(dkt * c - _rotate_half(dkt * s))
            return dqt.transpose(1, 2), dkt.transpose(1, 2), None, None

    class FusedLinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, target, bias):
            rows, hidden = x.shape
            vocab = weight.shape[0]
            inc_factor = -(-vocab // hidden)
            chunk = 1 << max(0, (-(-rows // inc_factor) - 1).bit_length())  # next power of 2
            footprint = _gpu_footprint(x, weight)
            grad_input = torch.zeros_like(x)
            grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
            grad_bias = torch.zeros_like(bias) if bias is not None else None
            loss_rows = torch.zeros(rows, dtype=torch.float32, device=x.device)
            valid = target != IGNORE_INDEX
            count = valid.sum()  # Liger reads it with .item(); a tensor here, so fake tensors pass
            for start in range(0, rows, chunk):
                x_chunk = x[start:start + chunk]
                block = x_chunk @ weight.t()
                if bias is not None:
                    block = block + bias
                _cross_entropy_rows_(block, target[start:start + chunk], count, loss_rows[start:start + chunk],
                                     footprint)
                grad_input[start:start + chunk] = block @ weight
                if grad_weight is not None:
                    low = block.dtype in (torch.float16, torch.bfloat16)
                    if grad_weight.dtype == torch.float32 and low and footprint:  # CUDA sm80+: addmm into fp32
                        _addmm_fp32_in_place(grad_weight, block.t(), x_chunk.to(block.dtype))
                    elif grad_weight.dtype == torch.float32 and low:  # same sums on CPU (no dtype_out kernel)
                        grad_weight.addmm_(block.t().float(), x_chunk.float())
                    else:
                        grad_weight += torch.mm(block.t(), x_chunk).float()
                if grad_bias is not None:
                    grad_bias += block.sum(dim=0)
                del block
            loss = loss_rows.sum()
            if grad_weight is not None:
                grad_weight = grad_weight.to(weight.dtype)
            ctx.save_for_backward(grad_input, grad_weight, grad_bias)
            return loss

        @staticmethod
        def backward(ctx, grad_loss):
            grad_input, grad_weight, grad_bias = ctx.saved_tensors
            # Liger skips the scaling when the incoming gradient is exactly 1 (a data-dependent test fake tensors
            # cannot answer; the in-place scaling allocates nothing either way).
            if _is_fake(grad_loss) or not torch.equal(grad_loss, torch.ones_like(grad_loss)):
                for t in (grad_input, grad_weight, grad_bias):
                    if t is not None:
                        t.mul_(grad_loss.to(t.dtype))
            return grad_input, grad_weight, None, grad_bias

    def _cross_entropy_rows_(block, target, count, loss_rows, footprint):
        """Liger's cross-entropy kernel on one block: per-row loss (mean over the non-ignored rows of the whole
        batch) into loss_rows, the logits' gradient written over the block. The kernel works in registers."""
        if footprint:
            return
        logits = block.float()
        valid = target != IGNORE_INDEX
        safe = target.clamp(min=0)
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, safe[:, None])[:, 0]
        loss_rows.copy_(torch.where(valid, lse - picked, torch.zeros_like(lse)) / count)
        grad = torch.softmax(logits, dim=-1)
        grad[torch.arange(grad.shape[0]), safe] -= 1
        grad *= (valid.to(grad.dtype) / count)[:, None]
        block.copy_(grad.to(block.dtype))

    return {"rms_norm": RMSNorm, "silu_mul": SiLUMul, "rope": Rope, "flce": FusedLinearCrossEntropy}


# ----------------------------------------------------------------------------------------------------------------
# Module forwards bound to the model instance, as _apply_liger_kernel_to_instance binds Liger's


def _rms_norm_forward(self, hidden_states):
    return functions()["rms_norm"].apply(hidden_states, self.weight, self.variance_epsilon)


def _swiglu_forward(self, x):
    return self.down_proj(functions()["silu_mul"].apply(self.gate_proj(x), self.up_proj(x)))


def liger_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    return functions()["rope"].apply(q, k, cos, sin)


def fused_linear_cross_entropy(hidden_states, weight, labels, bias=None, num_items_in_batch=None):
    """LigerForCausalLMLoss: labels padded with -100 and shifted left, rows flattened, mean over the non-ignored
    rows (sum / num_items_in_batch when the Trainer passes it)."""
    shifted = shifted_labels(labels).contiguous()
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])
    loss = functions()["flce"].apply(rows, weight, shifted.view(-1), bias)
    if num_items_in_batch is not None:
        valid = (shifted != IGNORE_INDEX).sum()
        loss = loss * valid / num_items_in_batch
    return loss


def _lce_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                 logits_to_keep=0, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    hidden_states, num_items_in_batch = head_inputs(self, input_ids, attention_mask, position_ids, inputs_embeds,
                                                    kwargs)
    if self.training and labels is not None:  # Liger's skip_logits default
        loss = fused_linear_cross_entropy(hidden_states, self.lm_head.weight, labels, self.lm_head.bias,
                                          num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss, logits=None)
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = self.lm_head(hidden_states[:, keep, :])
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits)


@contextlib.contextmanager
def liger_applied(model, *, gpu_footprint: bool = False):
    """Patch `model` as liger-kernel's _apply_liger_kernel_to_instance does (with the substitutes), for the duration
    of the block: instance forwards stay bound afterwards, the module-global RoPE function is restored.
    `gpu_footprint`: fake tensors allocate what Liger's kernels allocate on a GPU (the tracer's device_kind cuda)."""
    model_type = model.config.model_type
    problem = liger_problem(model_type)
    if problem:
        raise UserError(problem)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    base = getattr(model, model.base_model_prefix, model)
    bind(base.norm, "forward", _rms_norm_forward)
    for layer in base.layers:
        bind(layer.mlp, "forward", _swiglu_forward)
        bind(layer.input_layernorm, "forward", _rms_norm_forward)
        bind(layer.post_attention_layernorm, "forward", _rms_norm_forward)
    bind(model, "forward", _lce_forward)
    original, footprint = modeling.apply_rotary_pos_emb, _GPU_FOOTPRINT[0]
    modeling.apply_rotary_pos_emb = liger_rotary_pos_emb
    _GPU_FOOTPRINT[0] = gpu_footprint
    try:
        yield model
    finally:
        modeling.apply_rotary_pos_emb = original
        _GPU_FOOTPRINT[0] = footprint
