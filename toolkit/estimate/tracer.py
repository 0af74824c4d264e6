"""Trace the bytes a Hugging Face causal LM keeps for backward, by running its own code under FakeTensorMode.

A depth-reduced copy of the model (same config, the fewest leading layers that show every distinct layer kind twice)
runs forward with labels (HF's own loss) and backward on fake tensors: no memory, well under a second. Three
instruments watch it:

- a TorchDispatchMode logs every storage an op creates and, through a weakref on the storage, when it dies; replaying
  that log gives live bytes at any moment (parameter gradients left out: the memory model counts them as states);
- `saved_tensors_hooks` see every tensor autograd keeps, deduplicated by storage and charged to the region running
  when it was first saved (parameters and autocast weight copies set apart);
- module hooks and gradient hooks on each decoder layer's input and output mark where regions start and end, in
  forward and in backward.

Traced layers are then expanded to the full depth: layer i takes the trace of the traced layer of the same kind,
its first occurrence for the first layer of that kind (which is charged the shared rotary tables and masks) and a
later one for the rest. Kinds are told apart by comparing the layers' structure and settings (class, parameter
shapes, per-layer attributes such as a sliding window) in a meta-device build of the full model, so architectures
never seen before are handled without special cases.

With device_kind="cuda" the CPU kernels whose saved tensors differ from the GPU's are replaced during the trace by
stand-ins with the GPU kernel's footprint; every substitution that fired is listed in notes.

This module is the entry; the parts live in their own modules: the layer kinds and depth reduction (layerkinds), the
fake step with its hooks (fakestep), the storage log and saved-tensor tallies (recording), and the trace environment
with the GPU kernel stand-ins (standins).
"""

from __future__ import annotations

import re

from toolkit.estimate.activations import ActivationTrace
from toolkit.estimate.fakestep import run_fake_step
from toolkit.estimate.layerkinds import (layer_kinds_of_full_model, per_layer_keys, traced_index_for,
                                         traced_layer_count)
from toolkit.estimate.standins import trace_environment
from toolkit.inputs.choices import ATTENTIONS, COMPUTE_DTYPES as DTYPES, DEVICE_KINDS, LOSSES, TRL_LOSS
from toolkit.inputs.modelconfig import reduced_config


def trace_activations(config, *, seq_len: int, micro_batch: int = 1, dtype: str = "bfloat16",
                      autocast: bool = False, attention: str = "sdpa", device_kind: str = "cuda",
                      checkpointing: bool = False, liger: bool = False, adapter=None,
                      tiled: bool = False, chunked_loss: int = 0, loss: str = "model",
                      adapter_fp32: bool = False, inputs_require_grad: bool = False,
                      image_marks: str | None = None) -> ActivationTrace:
    """Bytes the model keeps for backward, region by region, for one micro-batch of `micro_batch` x `seq_len`.

    `config` is any decoder-only causal-LM config; it is not modified. `adapter` (a toolkit.inputs.lora.Adapter with
    method lora or qlora) wraps the model with the real PEFT LoRA layers before the step: the base in the compute
    dtype and frozen, the adapters trainable (fp32 under autocast, as PEFT's autocast_adapter_dtype leaves them), so
    the trace holds the adapter intermediates, the dropout masks and dropped copies of each target's input, and the
    frozen base's input gradients; parameter gradients exist only for the adapters. The batch has no attention mask (unpadded
    fixed-length sequences, as the Trainer feeds packed or truncated text) and the labels are the inputs.
    `liger`: the model patched as the Trainer's use_liger_kernel does, with toolkit.patches.liger's substitutes.
    `tiled`: ALST's tiled MLP and tiled logits + loss, the engine's own autograd functions (toolkit.patches.tiling).
    `chunked_loss`: torchtune's chunked cross-entropy over this many sequence chunks (toolkit.patches.chunkedce).
    `loss` "trl": TRL's chunked NLL, TRL's own fused LM head as SFTTrainer patches it (toolkit.patches.trlloss).
    `adapter_fp32`: the adapters in fp32 over a `dtype` base without autocast (PEFT's autocast_adapter_dtype where
    no engine casts the model afterwards: DDP or one process with bf16-pure), so each LoRA layer's fp32 copy of its
    input is traced.
    `inputs_require_grad`: the input embeddings require grad although the base is frozen (an adapter job whose
    vision tower trains: the image features merged into them carry the tower's graph), traced with the model's own
    enable_input_require_grads, which checkpointing turns on anyway.
    `image_marks`: the keyword under which the forward takes the processor's marks of an image job's image tokens
    (toolkit.inputs.images.image_marks_keyword), fed with the ids: Gemma-3 builds its bidirectional image mask from
    them, an explicit (b, 1, s, s) mask where the ids alone run causal without one.
    """
    import torch

    _check_choice("dtype", dtype, DTYPES)
    _check_choice("attention", attention, ATTENTIONS)
    _check_choice("device_kind", device_kind, DEVICE_KINDS)
    _check_choice("loss", loss, LOSSES)
    if seq_len < 1 or micro_batch < 1:
        raise ValueError(f"seq_len and micro_batch must be positive (got {seq_len}, {micro_batch})")
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    compute_dtype = getattr(torch, dtype)
    if attention == "flash_attention_2" and compute_dtype == torch.float32:
        raise ValueError("flash_attention_2 runs in bfloat16 or float16 only; use dtype bfloat16/float16 "
                         "(or autocast) or attention sdpa")
    param_dtype = torch.float32 if autocast else compute_dtype

    full_kinds = layer_kinds_of_full_model(config)
    notes: list[str] = []
    cuda_autocast = device_kind == "cuda" and autocast and compute_dtype != torch.float32

    def traced_run(count: int, cast_params: bool = False):
        with trace_environment(attention, device_kind, notes, cuda_autocast=cuda_autocast) as attn_impl:
            try:
                return run_fake_step(reduced_config(config, len(full_kinds), count), attn_impl, param_dtype,
                                     compute_dtype if autocast else None, micro_batch, seq_len, checkpointing, notes,
                                     liger=liger, device_kind=device_kind, adapter=adapter, tiled=tiled,
                                     chunked_loss=chunked_loss, loss=loss,
                                     per_layer=per_layer_keys(config, len(full_kinds)), cast_params=cast_params,
                                     adapter_fp32=adapter_fp32, inputs_require_grad=inputs_require_grad,
                                     image_marks=image_marks)
            except (DynamicOutputShapeException, DataDependentOutputException) as exc:
                raise NotImplementedError(
                    f"{type(config).__name__}: the model's forward has shapes that depend on the data ({exc}), e.g. "
                    "MoE experts looped over the tokens routed to each; such models trace only through "
                    "transformers' grouped_mm experts implementation") from None
            except RuntimeError as exc:
                # Weights transformers builds in fp32 whatever the dtype (XLNet) meet low-precision activations:
                # traced again with every parameter in the compute dtype, as the engines cast them.
                if not re.search(r"expected scalar type \S+ but found|to have the same dtype", str(exc)):
                    raise
                if cast_params:  # the model's own code mixes dtypes (xLSTM's float32 recurrent state)
                    raise NotImplementedError(
                        f"{type(config).__name__}: its forward mixes dtypes with every weight in {dtype} ({exc}), as "
                        "DeepSpeed, FSDP2 and the pipeline engine hold them; plan it with --precision fp32, or with "
                        "strategy ddp, whose torch autocast casts each op's inputs alike") from None
        return traced_run(count, cast_params=True)

    traced_count = traced_layer_count(full_kinds)
    run = traced_run(traced_count)
    if run.layer_kinds != full_kinds[:traced_count]:
        # Depth reduction changed the layers: a setting counts from the model's depth (Gemma-3n's last
        # num_kv_shared_layers reuse earlier layers' keys and values). The whole depth is traced instead.
        traced_count = len(full_kinds)
        run = traced_run(traced_count)
        if run.layer_kinds != full_kinds:
            raise RuntimeError(f"{type(config).__name__}: the layers of the traced build differ from those of its "
                               "meta build; cannot trace this architecture")
    if autocast and compute_dtype != torch.float32:
        notes.append(f"autocast: torch.autocast('cpu', {dtype})" + (" with CUDA's float32 op list applied on top"
                                                                    if cuda_autocast else ""))
    notes.append(f"traced {traced_count} of {len(full_kinds)} layers, expanded by layer kind")
    notes.append("batch without attention mask (unpadded sequences); labels = inputs")
    if liger:
        from toolkit.patches.liger import LIGER_SOURCE

        notes.append(f"Liger kernels (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy) traced with substitutes "
                     f"that save what {LIGER_SOURCE} saves" + (" and allocate what its kernels allocate"
                                                               if device_kind == "cuda" else
                                                               "; device_kind cpu: the substitutes' own CPU run "
                                                               "(Liger's Triton kernels do not run on CPU)"))

    if tiled:
        from toolkit.patches.tiling import TILING_SOURCE
        from toolkit.inputs.job import loss_shards, mlp_shards
        from toolkit.inputs.modelconfig import text_config

        text = text_config(config)  # a multimodal class's sizes are its text config's
        notes.append(f"tiled: MLP in {mlp_shards(seq_len, text.hidden_size)} chunks of the sequence, logits + loss "
                     f"in {loss_shards(micro_batch, seq_len, text.vocab_size)}, traced through {TILING_SOURCE}")
    if chunked_loss:
        from toolkit.patches.chunkedce import CHUNKED_CE_SOURCE

        notes.append(f"chunked cross-entropy: logits and loss in {chunked_loss} sequence chunks, each upcast to fp32 "
                     f"apart, traced through {CHUNKED_CE_SOURCE}")
    if loss == TRL_LOSS:
        from toolkit.patches.trlloss import TRL_LOSS_SOURCE

        notes.append(f"TRL's chunked NLL: logits never whole, in tiles of 4096 tokens x 32768 vocabulary, "
                     f"recomputed in backward, traced through {TRL_LOSS_SOURCE}"
                     + ("" if device_kind == "cuda" else "; device_kind cpu: its torch folds' fp32 tile copies"))
    layers = tuple(run.layers[traced_index_for(i, full_kinds, traced_count)] for i in range(len(full_kinds)))
    return ActivationTrace(
        micro_batch=micro_batch, seq_len=seq_len, dtype=dtype, autocast=autocast, attention=attention,
        device_kind=device_kind, checkpointing=checkpointing, embedding=run.embedding, layers=layers,
        head=run.head, output_bytes=run.output_bytes, loss_bytes=run.loss_bytes, notes=tuple(dict.fromkeys(notes)))


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)} (got {value!r})")
