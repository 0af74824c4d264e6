"""Flags and helpers the subcommands share: the model, hardware, job, adapter and output flag groups, the
model and hardware they name, the sequence length default, and how numbers are shown."""

from __future__ import annotations

import argparse
import sys

from toolkit import bounds
from toolkit.bounds import float_arg, int_arg, text_arg
from toolkit.errors import UserError
from toolkit.inputs.choices import COMPILE_BLOCKS, GIB, LOSSES, VISION_TOWER_MODES
from toolkit.inputs.job import checkpointing_words


def add_model_flags(p: argparse.ArgumentParser, positional: bool = True) -> None:
    """The model: a positional name (without `positional`, the command's own positional names it) or its shape."""
    if positional:
        p.add_argument("model", nargs="?", type=text_arg("model"),
                       help="catalog name (see `toolkit models`), local dir/config.json, or hub id")
    g = p.add_argument_group("model by numbers (instead of a name)")
    g.add_argument("--params", type=count, help="parameter count, e.g. 7e9 or 7B (shape guessed Llama-like)")
    g.add_argument("--layers", type=int_arg("--layers", bounds.LAYERS), help="decoder layers (num_hidden_layers)")
    g.add_argument("--hidden", type=int_arg("--hidden", bounds.HIDDEN), help="hidden size")
    g.add_argument("--heads", type=int_arg("--heads", bounds.HEADS), help="attention heads")
    g.add_argument("--kv-heads", type=int_arg("--kv-heads", bounds.HEADS),
                   help="key / value heads (default: --heads, no grouped-query attention)")
    g.add_argument("--ffn", type=int_arg("--ffn", bounds.FFN), help="MLP intermediate size")
    g.add_argument("--vocab", type=int_arg("--vocab", bounds.VOCAB), help="vocabulary size")
    g.add_argument("--trust-remote-code", action="store_true", help="allow hub models with custom code")


def add_hardware_flags(p: argparse.ArgumentParser, default: str | None = "8xH100-80GB") -> None:
    g = p.add_argument_group("hardware")
    g.add_argument("--gpus", default=default, type=text_arg("--gpus"),
                   help="e.g. 8xH100-80GB, 2x8xA100-80GB, 1xRTX-4090 (default %(default)s): a name or alias of "
                        "`toolkit gpus`, exactly; a family several entries share (A100, H100) is refused; 2xcpu: this "
                        "machine's CPU processes over gloo, at a measured GEMM peak")
    g.add_argument("--nodes", type=int_arg("--nodes", bounds.NODES),
                   help="number of nodes (or write NxGxGPU in --gpus)")
    g.add_argument("--inter-node-gbps", type=float_arg("--inter-node-gbps", bounds.INTER_NODE_GBPS),
                   help="network bandwidth per node, GB/s (default 50 = 400 Gb/s)")
    g.add_argument("--cpu-ram-gib", type=float_arg("--cpu-ram-gib", bounds.CPU_RAM_GIB),
                   help="host RAM per node, GiB (default 1024)")
    g.add_argument("--power-limit-w", type=float_arg("--power-limit-w", bounds.POWER_LIMIT_W), metavar="W",
                   help="board power limit per GPU in watts, as `nvidia-smi -pl` sets it (default: the TDP): every "
                        "compute peak (tensor and fp32) takes the ratio of the bf16 tensor peak, linear in watts "
                        "between the die's datasheet points (H100 / H200: NVL 400 W to SXM 700 W; no other GPU has "
                        "them); HBM bandwidth and links unchanged")


def add_job_flags(p: argparse.ArgumentParser, seq_max: bool = False, tiled_auto: bool = False,
                  one_device: bool = False) -> None:
    """The job's flags; `seq_max` (plan, estimate): --seq also takes max, and the tensor / context / sequence
    degrees are flags; `tiled_auto` (plan): --tiled takes auto / on / off as plan's --checkpointing does, default
    auto, the bare flag on; `one_device` (profile, which runs one process on a real device): no --device-kind (the
    device's own kernels run) and no --pipeline-stages."""
    g = p.add_argument_group("job")
    from toolkit.inputs.choices import ATTENTIONS, DEVICE_KINDS, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS

    g.add_argument("--seq", type=seq_arg if seq_max else int_arg("--seq", bounds.SEQ),
                   help="sequence length (default 2048, or the model's maximum if shorter)"
                        + ("; max: the longest each strategy fits, with a memory-vs-length chart" if seq_max else ""))
    if seq_max:
        for dim, what in (("tensor", "FSDP2 x TP, the model's tp_plan, inside a node"),
                          ("context", "FSDP2 x CP, torch ring attention"),
                          ("sequence", "ZeRO x Ulysses SP, DeepSpeed ALST"),
                          ("expert", "FSDP2 x EP, transformers' DistributedConfig ep_size, or ZeRO-1/2/3 x DeepSpeed "
                                     "AutoEP autoep_size; MoE models")):
            g.add_argument(f"--{dim}-parallel", type=int_arg(f"--{dim}-parallel", bounds.DEGREE),
                           help=f"{dim}-parallel degree ({what}); 1: none"
                                + ("" if p.prog.endswith("estimate") else " (default: the planner tries each)"))
    g.add_argument("--precision", default="bf16", choices=PRECISIONS, help="(default %(default)s)")
    g.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="(default %(default)s)")
    g.add_argument("--attention", choices=ATTENTIONS,
                   help="(default: transformers' pick for the model: sdpa, or eager where its class has no sdpa)")
    if not one_device:
        g.add_argument("--device-kind", default="cuda", choices=DEVICE_KINDS,
                       help="whose kernels' saved tensors to model (default %(default)s)")
        g.add_argument("--pipeline-stages", type=int_arg("--pipeline-stages", bounds.STAGES),
                       help="pipeline / hybrid stage count")
    g.add_argument("--optimizer-impl", default="fused", choices=OPTIMIZER_IMPLS,
                   help="torch optimizer step (default %(default)s, the Trainer's)")
    g.add_argument("--activation-offloading", action="store_true",
                   help="decoder layers' saved activations in host RAM (TRL activation_offloading)")
    if not one_device:
        g.add_argument("--vision-tower", default="train", choices=VISION_TOWER_MODES,
                       help="a multimodal class fine-tuned on text: its vision encoder and projector trained (the HF "
                            "Trainer's default) or frozen (weights only) (default %(default)s)")
        g.add_argument("--images-per-sample", type=images_arg, metavar="N",
                       help="an image-and-text job on a multimodal class: N images in every sample; the language "
                            "model sees --seq text tokens + N x the image tokens its processor makes of one image "
                            "(needs --image-size); max: the most each strategy fits")
        g.add_argument("--image-size", type=text_arg("--image-size"), metavar="WxH",
                       help="each image's width x height in pixels before the model's image processor resizes it, "
                            "e.g. 448x448 (needs --images-per-sample); max: the largest square each strategy fits, "
                            "in the processor's steps up to its max pixels")
    g.add_argument("--liger", action="store_true",
                   help="Liger kernels as the Trainer's use_liger_kernel applies them (fused linear cross-entropy: "
                        "no logits; RMSNorm, SwiGLU, RoPE); llama, mistral, qwen2, qwen3")
    if not one_device:
        g.add_argument("--loss", choices=LOSSES, default="model",
                       help="the LM head + loss: model (the model's own, whole logits: what toolkit.train's Trainer "
                            "runs) or trl (TRL's chunked NLL, the fused LM head TRL's SFTTrainer always runs) "
                            "(default %(default)s)")
    tiled_help = ("ALST tiling over the sequence (DeepSpeed TiledMLP in every layer, tiled logits + loss): "
                  "the MLP's and the logits' tensors held one chunk at a time; ZeRO only")
    if tiled_auto:
        g.add_argument("--tiled", choices=("auto", "on", "off"), default="auto", nargs="?", const="on",
                       help=tiled_help + ". auto (default): tried on a ZeRO grid that fits nothing untiled, kept "
                                         "unless an untiled choice of the row fits within the step-time band (--seq "
                                         "max: a note where tiling could reach further); on (also the bare flag): "
                                         "every row; off: none")
        g.add_argument("--savers", choices=("auto", "off"), default="auto",
                       help="auto (default): on a grid where a row fits no other way, try Liger kernels, activation "
                            "offloading, then both (rows tagged +liger / +act-offload; their speed effect is not "
                            "modelled); off: only what --liger / --activation-offloading turn on")
    else:
        g.add_argument("--tiled", action="store_true", help=tiled_help)
    g.add_argument("--compile", action="store_const", const=True, default=False,
                   help="torch.compile (inductor), as TrainingArguments torch_compile: activations from the "
                        "compiler's partition, the compiled step time")
    g.add_argument("--compile-blocks", dest="compile", action="store_const", const=COMPILE_BLOCKS,
                   help="torch.compile of each decoder layer apart, embedding, head and loss eager, as torchtitan "
                        "compiles (estimate only)")
    add_adapter_flags(p)


def add_rope_flags(p: argparse.ArgumentParser) -> None:
    """RoPE scaling as part of the job (estimate, plan; toolkit.inputs.rope)."""
    from toolkit.inputs.choices import ROPE_SCALINGS

    g = p.add_argument_group("RoPE scaling (toolkit.inputs.rope)")
    g.add_argument("--rope-scaling", choices=ROPE_SCALINGS,
                   help="scale the model's rotary positions as transformers does (its rope_parameters rope_type); "
                        "--seq may then reach the original positions x --rope-factor (default: the model's config "
                        "as it ships, its own rope scaling included)")
    g.add_argument("--rope-factor", type=float_arg("--rope-factor", bounds.ROPE_FACTOR), metavar="F",
                   help="scaled positions / original positions (at least 1; needs --rope-scaling)")
    g.add_argument("--rope-original-positions", type=int_arg("--rope-original-positions", bounds.SEQ), metavar="N",
                   help="positions the model was trained with (original_max_position_embeddings; default its "
                        "max_position_embeddings)")


def images_of(args, spec, text_tokens: int) -> tuple[int, dict]:
    """(the language model's sequence, the Job's image fields) of the command line's --images-per-sample /
    --image-size over `text_tokens` text tokens (toolkit.inputs.images.image_job): a local model folder's own
    preprocessor_config.json is read when there is one; a `max` starts its search (toolkit.estimate.mostimages)."""
    from toolkit.inputs.images import image_job

    from toolkit.estimate.mostimages import search_start

    count, size = search_start(spec, getattr(args, "images_per_sample", None), getattr(args, "image_size", None),
                               image_folder(args))
    return image_job(spec, count, size, text_tokens, image_folder(args))


def image_folder(args):
    """A local model folder (its own preprocessor_config.json is the processor's settings), or None."""
    from pathlib import Path

    model = getattr(args, "model", None)
    return Path(model) if model and Path(model).is_dir() else None


def rope_of(args):
    """The command line's RopeScaling, or None (toolkit.inputs.rope.rope_scaling_from_flags)."""
    from toolkit.inputs.rope import rope_scaling_from_flags

    return rope_scaling_from_flags(getattr(args, "rope_scaling", None), getattr(args, "rope_factor", None),
                                   getattr(args, "rope_original_positions", None))


def add_checkpointing_flag(p: argparse.ArgumentParser, help: str) -> None:
    """`--checkpointing` as estimate and profile always took it (a bare flag: on), and as plan and check spell it
    (`--checkpointing on|off`): both spellings in every command, and `op` (torchtitan's per-op selective policy).
    Gives a bool, False when absent, or "op"."""
    from toolkit.inputs.choices import CHECKPOINTING_MODES, CHECKPOINTING_OP

    def on_off(text: str) -> bool | str:
        if text.lower() not in CHECKPOINTING_MODES:
            raise argparse.ArgumentTypeError(f"give on, off or {CHECKPOINTING_OP}, not {text!r}")
        return CHECKPOINTING_OP if text.lower() == CHECKPOINTING_OP else text.lower() == "on"

    p.add_argument("--checkpointing", nargs="?", const=True, default=False, type=on_off, metavar="on|off|op",
                   help=help)


def images_arg(text: str):
    """--images-per-sample N, or max (plan / estimate): the most images a sample that fit."""
    if str(text).strip().lower() == "max":
        return "max"
    return bounds.parse_int("--images-per-sample", text, bounds.IMAGES)


images_arg.bound = bounds.IMAGES  # type: ignore[attr-defined]


def seq_arg(text: str):
    """--seq N, or max (plan / estimate): the longest sequence that fits."""
    if str(text).strip().lower() == "max":
        return "max"
    return bounds.parse_int("--seq", text, bounds.SEQ)


seq_arg.bound = bounds.SEQ  # type: ignore[attr-defined]


def longest_line(found, spec) -> str:
    """One strategy's --seq max answer."""
    if not found.seq_len:
        return f"{found.name}: no sequence fits ({found.reason})"
    c = found.candidate
    tail = (f" (the model's {spec.max_positions} positions; memory allows more)" if found.capped_by_positions
            else f" ({found.capped_by})" if found.capped_by else "")
    return (f"{found.name}: longest sequence {found.seq_len:,} tokens{tail}, {c.memory.required_bytes / GIB:.1f} "
            f"GiB per GPU, {c.timing.tokens_per_s:,.0f} tokens/s (micro-batch 1"
            f"{checkpointing_words(c.job.checkpointing)})")


def add_adapter_flags(p: argparse.ArgumentParser) -> None:
    # No defaults here: a flag the user did not give is None, so that a flag the method does not read is refused
    # (toolkit.inputs.lora.adapter_from_flags); the defaults are the Adapter's own.
    from toolkit.inputs.lora import FULL

    from toolkit.inputs.choices import (BASE_DTYPES, COMPUTE_DTYPES, DPO_DEFAULT_BETA, DPO_LOSS_TYPES, QUANT_STORAGE_DTYPES,
                                        QUANT_TYPES, REFERENCES, choices_words, method_words)

    g = p.add_argument_group("LoRA / QLoRA (toolkit.inputs.lora)")
    g.add_argument("--method", default="full", help=f"{method_words()} (default %(default)s)")
    g.add_argument("--lora-r", type=int_arg("--lora-r", bounds.LORA_RANK), help=f"adapter rank (default {FULL.r})")
    g.add_argument("--lora-alpha", type=float_arg("--lora-alpha", bounds.LORA_ALPHA),
                   help=f"LoRA alpha (default {FULL.alpha})")
    g.add_argument("--lora-dropout", type=float_arg("--lora-dropout", bounds.LORA_DROPOUT),
                   help=f"dropout on each target's input (default {FULL.dropout})")
    g.add_argument("--lora-targets", help="all-linear or comma-separated module names, "
                                          f"e.g. q_proj,v_proj (default {FULL.targets})")
    g.add_argument("--lora-modules-to-save", help="modules trained in full beside the adapters, "
                                                  "e.g. lm_head,embed_tokens")
    g.add_argument("--base-dtype", help=f"{choices_words(BASE_DTYPES)}: the dtype LoRA's frozen base (and its "
                                        "modules_to_save copies) is loaded in; fp32 under --precision bf16 / fp16 "
                                        "autocast on ddp, or as fp32 shards gathered in bf16 / fp16 on fsdp2 "
                                        f"(default {FULL.base_dtype}: the compute dtype)")
    g.add_argument("--modules-to-save-dtype", dest="saved_dtype", metavar="MODULES_TO_SAVE_DTYPE",
                   help=f"{choices_words(BASE_DTYPES)}: the dtype the trainable --lora-modules-to-save copies train "
                        "in (weights, gradients, optimizer states); fp32 or the compute dtype, on ddp (fsdp2: fp32, "
                        f"its own) (default {FULL.saved_dtype}: the base's, as PEFT copies them)")
    g.add_argument("--qlora-quant-type", help=f"{choices_words(QUANT_TYPES)} (default {FULL.quant_type})")
    g.add_argument("--qlora-no-double-quant", action="store_const", const=False, dest="qlora_double_quant",
                   help="do not quantise the absmax constants")
    g.add_argument("--qlora-compute-dtype",
                   help=f"{choices_words(COMPUTE_DTYPES)} (default {FULL.compute_dtype})")
    g.add_argument("--qlora-quant-storage",
                   help=f"{choices_words(QUANT_STORAGE_DTYPES)}: a floating storage lets FSDP2 / ZeRO-3 shard the "
                        f"4-bit base (default {FULL.quant_storage})")
    d = p.add_argument_group("DPO, TRL's DPOTrainer (--method dpo; toolkit.inputs.preference)")
    d.add_argument("--reference", help=f"{choices_words(REFERENCES)}: the reference model kept beside the policy, "
                                       "its log-probs precomputed before training (DPOConfig "
                                       "precompute_ref_log_probs), or none (default kept)")
    d.add_argument("--dpo-beta", type=float_arg("--dpo-beta", bounds.DPO_BETA),
                   help=f"DPOConfig beta (default {DPO_DEFAULT_BETA})")
    d.add_argument("--dpo-loss", help=f"DPOConfig loss_type: {choices_words(DPO_LOSS_TYPES)} (default sigmoid)")
    from toolkit.inputs.choices import GRPO_DEFAULTS, GRPO_PROMPT_LENGTH, VLLM_MODES

    r = p.add_argument_group("GRPO, TRL's GRPOTrainer (--method grpo; toolkit.inputs.grpo); the trained sequence is "
                             "prompt + completion, the micro-batch counts completions")
    r.add_argument("--num-generations", type=int_arg("--num-generations", bounds.NUM_GENERATIONS),
                   help=f"GRPOConfig num_generations: completions per prompt; the generation batch must hold whole "
                        f"groups (default {GRPO_DEFAULTS['num_generations']})")
    r.add_argument("--max-prompt-length", type=int_arg("--max-prompt-length", bounds.SEQ),
                   help=f"the longest prompt in tokens (default {GRPO_PROMPT_LENGTH})")
    r.add_argument("--max-completion-length", type=int_arg("--max-completion-length", bounds.SEQ),
                   help=f"GRPOConfig max_completion_length (default {GRPO_DEFAULTS['max_completion_length']})")
    r.add_argument("--grpo-beta", type=float_arg("--grpo-beta", bounds.GRPO_BETA),
                   help=f"GRPOConfig beta, the KL coefficient; 0 loads no reference model (default "
                        f"{GRPO_DEFAULTS['beta']:g})")
    r.add_argument("--use-vllm", action="store_const", const=True,
                   help="GRPOConfig use_vllm: generate with vLLM (default: transformers generate in the training "
                        "process)")
    r.add_argument("--vllm-mode", help=f"GRPOConfig vllm_mode with --use-vllm: {choices_words(VLLM_MODES)} "
                                       "(colocate: on the training GPUs; server: trl vllm-serve on other GPUs; "
                                       "default colocate)")
    r.add_argument("--vllm-gpu-memory-utilization",
                   type=float_arg("--vllm-gpu-memory-utilization", bounds.VLLM_GPU_MEMORY_UTILIZATION),
                   help=f"GRPOConfig vllm_gpu_memory_utilization, colocate: the share of each GPU's memory vLLM "
                        f"takes; training gets the rest (default {GRPO_DEFAULTS['vllm_gpu_memory_utilization']:g})")
    r.add_argument("--vllm-tensor-parallel-size", type=int_arg("--vllm-tensor-parallel-size", bounds.DEGREE),
                   help="GRPOConfig vllm_tensor_parallel_size, colocate: vLLM's weights split over that many GPUs "
                        "(default 1)")
    r.add_argument("--vllm-enable-sleep-mode", action="store_const", const=True,
                   help="GRPOConfig vllm_enable_sleep_mode, colocate: vLLM releases its share after each generation, "
                        "so training may use it (the share must still fit beside the model states while generating)")
    r.add_argument("--reward-model", help="GRPOTrainer reward_funcs: a sequence-classification reward model (catalog "
                                          "name, local path or hub id) that scores every completion; its weights and "
                                          "scoring forward count in memory and time (default: rule-based rewards)")


TRAINING_ONLY_ADAPTER_FLAGS = {"lora_alpha": ("--lora-alpha", "scales the adapter's output"),
                               "qlora_quant_type": ("--qlora-quant-type", "picks the 4-bit code book (nf4 and fp4 "
                                                                          "take the same bytes)")}
"""Adapter flags that change what training computes but no memory and no step time: estimate and profile refuse
them rather than ignore them (plan writes them into plan.json, which the training reads)."""


def adapter_of(args, spec=None, *, training_only_read: bool = True):
    """The command line's Adapter; with `spec`, PEFT's dropout rule for that model applied (adapter_for_model).
    training_only_read False (estimate, profile): a flag of TRAINING_ONLY_ADAPTER_FLAGS is refused."""
    from toolkit.inputs.choices import METHODS, split_method
    from toolkit.inputs.lora import adapter_for_model, adapter_from_flags

    objective, method = split_method(args.method)
    adapters = [m for m in METHODS if m != "full"]
    if objective and args.method != objective and method not in adapters:
        raise UserError(f"--method '{args.method}' is not known; after {objective}+ give one of: "
                        f"{', '.join(adapters)} (or --method {objective} alone)")
    adapter = adapter_from_flags(method, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                              targets=args.lora_targets, modules_to_save=args.lora_modules_to_save,
                              base_dtype=args.base_dtype, saved_dtype=args.saved_dtype,
                              quant_type=args.qlora_quant_type, double_quant=args.qlora_double_quant,
                              compute_dtype=args.qlora_compute_dtype, quant_storage=args.qlora_quant_storage)
    for dest, (flag, what) in TRAINING_ONLY_ADAPTER_FLAGS.items():  # after the method's own refusals
        if not training_only_read and getattr(args, dest) is not None:
            raise UserError(f"{flag} {what} and changes no memory or step time, so {args.command} does not read it; "
                            f"drop it (toolkit plan writes it into plan.json for the training)")
    return adapter if spec is None else adapter_for_model(spec, adapter, dropout_given=args.lora_dropout is not None)


def dpo_of(args):
    """The command line's DPO settings (toolkit.inputs.preference.Dpo), or None when --method names no objective."""
    from toolkit.inputs.choices import split_method
    from toolkit.inputs.preference import dpo_from_flags

    objective = split_method(args.method)[0]
    return dpo_from_flags(objective if objective == "dpo" else None, reference=args.reference, beta=args.dpo_beta,
                          loss_type=args.dpo_loss)


def grpo_of(args):
    """The command line's GRPO settings (toolkit.inputs.grpo.Grpo), or None unless --method grpo."""
    from toolkit.inputs.choices import split_method
    from toolkit.inputs.grpo import GRPO_FLAGS, grpo_from_flags

    grpo = grpo_from_flags(split_method(args.method)[0],
                           **{k: getattr(args, flag[2:].replace("-", "_")) for k, flag in GRPO_FLAGS.items()})
    if grpo is not None and grpo.reward_model:  # a model TRL cannot score with: one line before anything runs
        from toolkit.inputs.reward import reward_model_of

        reward_model_of(grpo.reward_model)
    return grpo


def trainable_params(spec, adapter) -> int:
    if not adapter.is_adapter:
        return spec.params
    from toolkit.inputs.lora import counts_for_spec

    return counts_for_spec(spec, adapter).trainable_params


def add_output_flags(p: argparse.ArgumentParser, out_help: str) -> None:
    p.add_argument("--out", type=text_arg("--out"), help=out_help)
    p.add_argument("--force", action="store_true", help="overwrite files in --out")
    p.add_argument("--nvme-path", type=text_arg("--nvme-path"), help="local NVMe directory for ZeRO-Infinity plans")
    p.add_argument("--hosts", type=host_names, help="comma-separated node host names (multi-node hostfile)")


def count_arg(flag: str, bound: bounds.Bound, example: str):
    """argparse `type=` for a count written as 7e9, 7B or 7,000,000,000 (K, M, B / G, T suffixes)."""

    def convert(text: str) -> int:
        t = text.strip().upper().replace(",", "").replace("_", "")
        scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], None)
        try:
            value = float(t[:-1]) * scale if scale else float(t)
        except ValueError:
            raise UserError(f"{flag} '{text}' is not a count (write {example})") from None
        bounds.check_number(flag, value, bound)
        return int(value)

    convert.__name__ = flag
    convert.bound = bound  # type: ignore[attr-defined]
    return convert


count = count_arg("--params", bounds.PARAMS, "7e9 or 7B")


def add_run_size_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("time to train (toolkit.estimate.duration)")
    g.add_argument("--dataset-tokens", type=count_arg("--dataset-tokens", bounds.DATASET_TOKENS, "2e9 or 2B"), metavar="N",
                   help="tokens of training data, e.g. 2e9 or 2B: prints steps, hours and GPU-hours (the data "
                        "packed into --seq-token sequences)")
    g.add_argument("--data", type=text_arg("--data"), metavar="PATH",
                   help="training data (a file or folder as toolkit.train reads it) whose tokens the model's own "
                        "tokenizer counts, in place of --dataset-tokens; big data is sampled (2,000 records)")
    g.add_argument("--epochs", type=float_arg("--epochs", bounds.EPOCHS), metavar="E",
                   help="passes over the data (default 1; needs --dataset-tokens or --data)")
    g.add_argument("--gpu-hour-price", type=float_arg("--gpu-hour-price", bounds.GPU_HOUR_PRICE), metavar="PRICE",
                   help="price of one GPU-hour: prints the run's cost (needs --dataset-tokens or --data)")


def run_size_flag(args) -> str | None:
    """The flag that sizes the run (--dataset-tokens or --data), or None; refuses both, and --epochs /
    --gpu-hour-price without either. Called first: nothing is read before the flags are known to agree."""
    if args.dataset_tokens is not None and args.data is not None:
        raise UserError("--data and --dataset-tokens both size the run; give the count or the data, not both")
    if args.dataset_tokens is not None:
        return "--dataset-tokens"
    if args.data is not None:
        return "--data"
    given = [f for f, v in (("--epochs", args.epochs), ("--gpu-hour-price", args.gpu_hour_price)) if v is not None]
    if given:
        raise UserError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --dataset-tokens or --data "
                        f"(what the run trains on); add one, or drop {'it' if len(given) == 1 else 'them'}")
    return None


def run_size_of(args, seq_len: int):
    """The run's size from --dataset-tokens or --data (counted with the model's tokenizer for `seq_len`
    sequences), --epochs and --gpu-hour-price; None when neither sizes it."""
    from toolkit.estimate.duration import RunSize

    flag = run_size_flag(args)
    if flag is None:
        return None
    epochs = 1.0 if args.epochs is None else args.epochs
    if flag == "--dataset-tokens":
        return RunSize(dataset_tokens=args.dataset_tokens, epochs=epochs, gpu_hour_price=args.gpu_hour_price)
    from toolkit.commands.help import status
    from toolkit.run.data_tokens import model_tokenizer, run_size_from_data

    tokenizer = model_tokenizer(args.model)
    with status(f"counting the tokens of {args.data}"):
        return run_size_from_data(args.data, args.model, seq_len=seq_len, epochs=epochs,
                                  gpu_hour_price=args.gpu_hour_price, tokenizer=tokenizer)


def host_names(text: str) -> list[str]:
    """Comma-separated host names; each must be a plain host name (it reaches the hostfile and scripts)."""
    import re

    names = [h.strip() for h in text.split(",")]
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*", name):
            raise UserError(f"--hosts entry {name!r} is not a host name; give names like node1,node2 (letters, "
                            "digits, '.', '-', '_')")
    return names


def _refuse_model_contradictions(args) -> None:
    """A model name fixes the shape; numbers beside it would be silently ignored, so they are refused."""
    given = [f"--{k.replace('_', '-')}" for k in ("params", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
             if getattr(args, k, None) is not None]
    if args.model and given:
        raise UserError(f"{given[0]} cannot be combined with the model name '{args.model}'; give the name or the "
                        "numbers, not both")
    if args.params is not None and len(given) > 1:
        raise UserError(f"--params cannot be combined with {given[1]}; give the count or the shape, not both")


def _refuse_unread_remote_code(args) -> None:
    """--trust-remote-code reaches transformers' AutoConfig for a hub id only: a local folder, a catalog entry and
    bare numbers are read without running any code, so the flag beside them would be ignored."""
    if not args.trust_remote_code:
        return
    if args.model:
        from toolkit.inputs.resolve import catalog_name_of_hub_id, locate_model

        kind = locate_model(catalog_name_of_hub_id(args.model) or args.model).kind
        if kind == "hub":
            return
        what = f"'{args.model}' is {'a local config' if kind == 'local' else 'a catalog entry'}"
    else:
        what = "a model given by numbers"
    raise UserError(f"--trust-remote-code lets transformers run a hub model's own code, and {what}, read without "
                    "code; drop --trust-remote-code")


def model_spec(args):
    from toolkit.commands.help import status
    from toolkit.inputs.modelspec import resolve_model

    _refuse_model_contradictions(args)
    _refuse_unread_remote_code(args)
    rope = rope_of(args)  # the flags agree before any model is read
    with status(f"reading {args.model or 'the model'} (tracing its layers the first time)"):
        spec = resolve_model(args.model, params=args.params, layers=args.layers, hidden=args.hidden,
                             heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab,
                             trust_remote_code=args.trust_remote_code,
                             images=bool(getattr(args, "images_per_sample", None) or getattr(args, "image_size", None)))
        if rope is None:
            return spec
        from toolkit.inputs.rope import scaled_spec

        return scaled_spec(spec, rope)


def hardware_of(args):
    """The hardware the flags give; for estimate and plan (add_calibration_flags) with the calibration of this
    machine applied (or the --calibration file's, or none with --no-calibration), which it keeps in
    args.calibration_applied for the output."""
    from toolkit.inputs.hardware import parse_hardware

    hw = parse_hardware(args.gpus, nodes=args.nodes, inter_node_gbps=args.inter_node_gbps,
                        cpu_ram_gib=args.cpu_ram_gib, power_limit_w=args.power_limit_w)
    if not hasattr(args, "no_calibration"):
        return hw
    from dataclasses import replace
    from pathlib import Path

    from toolkit.inputs import calibration as cal

    if args.no_calibration and args.calibration:
        raise UserError("--calibration FILE applies a calibration and --no-calibration ignores every one; give one "
                        "of them")
    if args.calibration:
        got = cal.imported(Path(args.calibration), hw.gpu, hw.world_size)
    else:
        got = cal.stored(hw.gpu, hw.world_size)
        if args.no_calibration:  # with nothing stored, a no-op: the figures are the uncalibrated ones either way
            if got is None:
                print_note(f"--no-calibration: no calibration is stored for {hw.spec} on this machine; the figures "
                           "are uncalibrated either way")
            got = None
    args.calibration_applied = cal.Applied(got, args.calibration)
    return replace(hw, gpu=cal.apply(hw.gpu, got))


def add_calibration_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("calibration (toolkit tune)")
    g.add_argument("--calibration", type=text_arg("--calibration"), metavar="FILE",
                   help="apply this calibration file (`toolkit tune --export-calibration`) instead of the one stored "
                        "for this machine; refused when measured for another device or count")
    g.add_argument("--no-calibration", action="store_true",
                   help="ignore the calibration `toolkit tune` stored for this machine: the uncalibrated figures")


def calibration_words(args) -> str | None:
    """The line that says a calibration moved the step time, or None."""
    applied = getattr(args, "calibration_applied", None)
    return None if applied is None else applied.words()


def calibration_json(args) -> dict:
    """--json's `calibration`: the record applied, where it came from and the line the table prints; None."""
    words = calibration_words(args)
    if words is None:
        return {"calibration": None}
    applied = args.calibration_applied
    return {"calibration": {**applied.calibration.to_dict(), "source": applied.source, "words": words}}


def print_note(text: str) -> None:
    """Warnings and notes go to stderr, so stdout holds only the result (a table, JSON)."""
    print(f"note: {text}", file=sys.stderr)


def human(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def seq_len_of(spec, args) -> tuple[int, str | None]:
    """--seq as given (checked against the model), or the default adapted to the model's positions."""
    from toolkit.inputs.job import check_seq_len, default_seq_len

    grpo = grpo_of(args)
    if grpo is not None:
        if args.seq is not None:
            raise UserError("--seq with --method grpo: GRPO trains prompt + completion sequences; give "
                            "--max-prompt-length and --max-completion-length instead of --seq")
        check_seq_len(spec, grpo.seq_len)
        return grpo.seq_len, None
    seq_len, note = default_seq_len(spec, args.seq)
    check_seq_len(spec, seq_len)
    return seq_len, note


def allocator_of(args, hw, grpo, *, device_kind: str | None = None):
    """The allocator setting the run gets and the estimate replays (toolkit.inputs.allocconf): the environment's
    PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, else the plan's default for the job."""
    import os

    from toolkit.inputs.allocconf import alloc_conf

    return alloc_conf(device_kind or args.device_kind, grpo, hw.gpu, os.environ)
