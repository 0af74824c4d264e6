"""What a user's own training script needs from a plan: training_args.json and PLAN.md's "your own script" part.

A plan folder is launched with `accelerate launch --config_file PLAN/accelerate_config.yaml SCRIPT`; the YAML (and
the DeepSpeed JSON it carries) fixes the engine, and these settings fix the numbers a script must use so that the
run is the planned one:

  training_arguments   transformers.TrainingArguments keyword arguments (HF Trainer scripts; `toolkit.train` uses
                       the same dict, so there is one source for them);
  sft_config           the same plus TRL's SFTConfig keys (max_length = the plan's sequence length, packing; an
                       image plan: max_length None, pad_to_multiple_of = the sequence length);
  dpo_config           a DPO plan's instead of sft_config: TrainingArguments' plus TRL's DPOConfig keys (beta,
                       loss_type, max_length, precompute_ref_log_probs; toolkit.inputs.preference);
  grpo_config          a GRPO plan's instead: TrainingArguments' plus TRL's GRPOConfig keys (num_generations,
                       max_completion_length, beta, vLLM settings, generation_batch_size; toolkit.inputs.grpo);
  accelerate_loop      a custom accelerate loop's numbers: DataLoader batch_size, Accelerator's
                       gradient_accumulation_steps, clipping, checkpointing, and whether DeepSpeed owns the optimizer
                       (then the loop passes accelerate.utils.DummyOptim: accelerate refuses a real optimizer next to
                       the JSON's "optimizer" block, accelerator.py _prepare_deepspeed);
  accelerate_launch    the command line.

Everything here is derived from plan.json alone (pure functions).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from toolkit.emit.deepspeed import GRADIENT_CLIPPING, averages_over_sp_ranks, owns_optimizer
from toolkit.emit.parallelism import sharded_at_load
from toolkit.patches.actoffload import offload_note
from toolkit.patches.compiledckpt import DYNAMO_FLAG
from toolkit.plan.schema import Plan
from toolkit.inputs.choices import BASE_DTYPE_NAMES, TRL_LOSS
from toolkit.inputs.strategy import Engine
from toolkit.plan.files import DS_CONFIG_CONCRETE, TRAINING_ARGS

"""The fully concrete DeepSpeed JSON, for DeepSpeed's launcher / deepspeed.initialize (toolkit.emit.deepspeed)."""

OPTIM = {"adamw": "adamw_torch_fused", "adamw-8bit": "adamw_bnb_8bit", "sgd": "sgd", "adafactor": "adafactor"}
"""plan.optimizer -> TrainingArguments.optim. adamw: torch's fused AdamW (the Trainer's default on torch >= 2.8): no
foreach step temporaries, which is what the memory model assumes by default (toolkit/estimate/savers.py)."""
ADAMW_IMPL = {"fused": "adamw_torch_fused", "foreach": "adamw_torch", "for-loop": "adamw_torch"}
"""plan.optimizer_impl -> TrainingArguments.optim for AdamW. The Trainer's adamw_torch builds torch's AdamW with its
defaults (foreach where the tensors allow it) and passes no optim_args to it (transformers trainer_optimizer.py
_get_adamw_torch), so a for-loop step is only reachable from a custom loop (foreach=False); notes() says so."""


def optim_name(plan: Plan) -> str:
    return ADAMW_IMPL[plan.optimizer_impl] if plan.optimizer == "adamw" else OPTIM[plan.optimizer]


def checkpointing_name() -> str:
    """TrainingArguments' name for activation checkpointing: transformers 5.2x renamed gradient_checkpointing to
    activation_checkpointing (the old name is a deprecated alias); older versions know only the old one. Kept in the
    on-disk cache per transformers version: reading it imports transformers and torch (seconds), which a repeated
    plan otherwise never needs."""
    from toolkit import cache

    key = cache.installed_version("transformers")
    name = cache.get("checkpointing-name", key, code=_checkpointing_name)
    if name not in ("activation_checkpointing", "gradient_checkpointing"):
        name = _checkpointing_name()
        cache.put("checkpointing-name", key, name, code=_checkpointing_name)
    return name


def _checkpointing_name() -> str:
    """Read from the source of transformers' training_args.py (TrainingArguments is a dataclass: each argument is a
    field at the class's indentation), not by importing it: that import brings peft and bitsandbytes with it, about
    a second of a first plan's CPU (tests/test_user_scripts.py checks the source's answer against the signature's)."""
    import re
    from importlib.util import find_spec
    from pathlib import Path

    source = Path(find_spec("transformers").origin).with_name("training_args.py").read_text()
    return "activation_checkpointing" if re.search(r"^    activation_checkpointing\s*:", source, re.M) \
        else "gradient_checkpointing"


def trainer_checkpointing(plan: Plan) -> bool:
    """Checkpointing through TrainingArguments: on when the plan checkpoints, except FSDP2, where the accelerate
    YAML's fsdp_activation_checkpointing does it (transformers refuses both at once)."""
    return plan.checkpointing and (plan.engine != Engine.FSDP2 or sharded_at_load(plan))


def uses_bf16_autocast(plan: Plan) -> bool:
    """TrainingArguments.bf16. bf16-pure loads bf16 weights instead (autocast on top would only add copies), except
    under DeepSpeed, whose bf16 block must match this flag (the Trainer checks)."""
    return plan.precision == "bf16" or (plan.precision == "bf16-pure" and plan.engine == Engine.DEEPSPEED)


def training_arguments(plan: Plan) -> dict[str, Any]:
    """The TrainingArguments keyword arguments that carry the plan (JSON-safe)."""
    name = checkpointing_name()
    checkpointing = trainer_checkpointing(plan)
    kwargs: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro_batch,
        "per_device_eval_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "bf16": uses_bf16_autocast(plan),
        "fp16": plan.precision == "fp16",
        "optim": optim_name(plan),
        "max_grad_norm": GRADIENT_CLIPPING,
        name: checkpointing,
        # Non-reentrant checkpointing works with ZeRO-3 and FSDP2 (reentrant re-gathers inside the recompute).
        f"{name}_kwargs": {"use_reentrant": False} if checkpointing else None,
    }
    if plan.liger:  # only when on: the Trainer imports liger-kernel (and needs a GPU) for it
        kwargs["use_liger_kernel"] = True
    if plan.compile:  # the Trainer hands it to accelerate's dynamo plugin (backend inductor), which compiles in prepare
        kwargs["torch_compile"] = True
    if plan.engine == Engine.DDP:  # True where trained parameters get no gradient: a tower trained on text alone
        kwargs["ddp_find_unused_parameters"] = bool(plan.model_parts) and plan.vision_tower == "train" and \
            not plan.images_per_sample and plan.method == "full"
    if sharded_at_load(plan):
        # transformers refuses optimizer checkpoints of a model it sharded at load (the run side, issue 17).
        kwargs["save_only_model"] = True
    if plan.engine == Engine.FSDP2 and plan.grad_accum > 1 and not sharded_at_load(plan):
        # Reduce-scatter every micro-batch: the Trainer's default no_sync keeps every layer's unsharded gradient
        # until the last micro-batch (P x 2 bytes per GPU), which the plan's memory did not budget for.
        kwargs["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    return kwargs


def _vision_wrap_words(plan: Plan) -> str:
    """The vision encoder's block classes (the model on the meta device) for an FSDP plan's wrap policy."""
    if plan.engine != Engine.FSDP2:
        return ""
    import torch
    from transformers import CONFIG_MAPPING

    from toolkit.inputs.decoder_parts import vision_block_classes
    from toolkit.inputs.modelconfig import auto_model_class

    config = CONFIG_MAPPING[plan.model_type].from_dict(dict(plan.model_config))
    with torch.device("meta"):
        model = auto_model_class(config, images=bool(plan.images_per_sample)).from_config(config)
    blocks = vision_block_classes(model, plan.model_parts["vision_modules"])
    if not blocks:
        return ""
    return (f" FSDP: the emitted config wraps `{plan.layer_class}` (the language model's blocks); to shard the vision "
            f"encoder block by block too, add its block class{'es' if len(blocks) > 1 else ''} "
            f"{', '.join(f'`{b}`' for b in blocks)} to `fsdp_transformer_layer_cls_to_wrap` (otherwise the "
            "whole encoder is gathered as one unit with the root).")


def sft_config(plan: Plan) -> dict[str, Any]:
    """TRL SFTConfig keyword arguments: TrainingArguments' plus the sequence length and packing.

    Packing only with flash attention: TRL packs padding-free (sft_config.py: "only supported with the FlashAttention
    2 or 3"), and only the varlen kernels keep the packed conversations from attending to each other. Without it,
    every sequence is padded to at most max_length, which the plan's memory (seq_len tokens per sequence) covers.
    bf16 and checkpointing are always written: SFTConfig's defaults differ from TrainingArguments' (both True).
    A plan with TRL's chunked NLL (plan.loss "trl") writes loss_type "nll": TRL 1.16's default, written so the config
    says which loss the memory assumed (every loss_type runs the fused head; only label smoothing or a
    compute_loss_func leave it, and neither is written; docs/ENGINE_FACTS.md "TRL's chunked NLL").
    An image plan pads every sequence to seq_len and truncates none (max_length None, pad_to_multiple_of seq_len),
    as toolkit.train's image collator does: TRL's VLM collator truncates only with max_length, which would cut image
    tokens the processor then refuses (docs/ENGINE_FACTS.md "Image-and-text data in toolkit.train").
    """
    length = {"max_length": None, "pad_to_multiple_of": plan.seq_len} if plan.images_per_sample else \
        {"max_length": plan.seq_len}
    return {**training_arguments(plan), **length,
            "packing": plan.attention == "flash_attention_2",
            **({"loss_type": "nll"} if plan.loss == TRL_LOSS else {}),
            **({"activation_offloading": True} if plan.activation_offloading and not plan.tiled else {})}


def dpo_config(plan: Plan) -> dict[str, Any]:
    """TRL DPOConfig keyword arguments of a DPO plan: TrainingArguments' (per_device_train_batch_size counts pairs,
    as DPOTrainer's batches do) plus the DPO settings (toolkit.inputs.preference.Dpo.dpo_config_kwargs).
    bf16 and checkpointing are always written, as for SFTConfig (TRL's defaults differ from TrainingArguments')."""
    return {**training_arguments(plan), **plan.dpo_spec.dpo_config_kwargs(plan.seq_len),
            **({"activation_offloading": True} if plan.activation_offloading else {})}


def grpo_config(plan: Plan) -> dict[str, Any]:
    """TRL GRPOConfig keyword arguments of a GRPO plan: TrainingArguments' (per_device_train_batch_size counts
    completions) plus the GRPO settings (toolkit.inputs.grpo.Grpo.grpo_config_kwargs) and generation_batch_size,
    the plan's global batch: written out because GRPOConfig derives it from the world size it runs in, so the plan's
    number is checked (whole groups of num_generations) wherever the config is built."""
    return {**training_arguments(plan), **plan.grpo_spec.grpo_config_kwargs(),
            "generation_batch_size": plan.global_batch}


def method_config(plan: Plan) -> tuple[str, dict[str, Any]]:
    """training_args.json's key and settings for the plan's TRL trainer: dpo_config, grpo_config or sft_config."""
    if plan.dpo:
        return "dpo_config", dpo_config(plan)
    if plan.grpo:
        return "grpo_config", grpo_config(plan)
    return "sft_config", sft_config(plan)


def loop_mixed_precision(plan: Plan) -> str:
    """Accelerator(mixed_precision=...) of a custom loop: the same autocast as TrainingArguments' bf16 / fp16. Under
    DeepSpeed it also fills ds_config.json's "auto" bf16 / fp16 blocks (toolkit.emit.deepspeed)."""
    return "bf16" if uses_bf16_autocast(plan) else "fp16" if plan.precision == "fp16" else "no"


def accelerate_loop(plan: Plan) -> dict[str, Any]:
    """A custom accelerate loop's numbers (see the module docstring)."""
    return {
        "dataloader_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "mixed_precision": loop_mixed_precision(plan),
        "max_grad_norm": GRADIENT_CLIPPING,
        "gradient_checkpointing": trainer_checkpointing(plan),
        "sequence_length": plan.seq_len,
        "use_dummy_optim": owns_optimizer(plan),
        "optimizer_kwargs": ({"fused": plan.optimizer_impl == "fused", "foreach": plan.optimizer_impl == "foreach"}
                             if plan.optimizer == "adamw" and not owns_optimizer(plan) else {}),
        "model_dtype": model_dtype(plan),
    }


def model_dtype(plan: Plan) -> str:
    """The dtype to load the model in (torch attribute name): fp32 master weights for mixed precision, bf16 for
    bf16-pure, and for LoRA / QLoRA the frozen base in the compute dtype (toolkit.inputs.lora)."""
    if plan.method != "full":
        from toolkit.inputs.lora import base_dtype_name

        return base_dtype_name(plan.precision, plan.adapter_spec.base_dtype)
    return "bfloat16" if plan.precision == "bf16-pure" else "float32"


METHOD_NAMES = {"lora": "LoRA", "qlora": "QLoRA"}
KBIT_PREPARATION = (
    "load the base with quantization_config=BitsAndBytesConfig(**bnb_config) and dtype=model_dtype; with activation "
    "checkpointing call model.enable_input_require_grads() before get_peft_model (so the recompute reaches the "
    "adapters), as toolkit.train does. peft.prepare_model_for_kbit_training does that too, but also casts every "
    "parameter that is not 4-bit (embeddings, norms, lm_head) to float32, which the plan's memory does not include: "
    "call it only with headroom to spare.")


def adapter_settings(plan: Plan) -> dict[str, Any] | None:
    """LoRA / QLoRA: what the plan assumes, as a script builds it (peft.LoraConfig, transformers.BitsAndBytesConfig
    keyword arguments, the dtype to load the base in, the k-bit preparation step); None for full fine-tuning.
    TRL: SFTTrainer(peft_config=LoraConfig(**lora_config)), with the model loaded as described."""
    if plan.method == "full":
        return None
    adapter = plan.adapter_spec
    out: dict[str, Any] = {"method": plan.method, "model_dtype": model_dtype(plan),
                           "lora_config": adapter.lora_config_kwargs(),
                           "gradient_checkpointing_needs_input_grads": plan.checkpointing}
    if plan.method == "qlora":
        out["bnb_config"] = adapter.bnb_config_kwargs()
        out["kbit_preparation"] = KBIT_PREPARATION
    if adapter.saved_dtype != "auto":
        # PEFT copies modules_to_save in the base's dtype; the plan trains them in this one (toolkit.train and
        # toolkit.train.own_script.peft_model cast them after get_peft_model: toolkit.inputs.lora.apply_saved_dtype).
        out["modules_to_save_dtype"] = BASE_DTYPE_NAMES[adapter.saved_dtype]
    return out


def launch_line(script: str = "your_script.py", plan_dir: str = "PLAN_DIR") -> str:
    return shlex.join(["accelerate", "launch", "--config_file", f"{plan_dir}/accelerate_config.yaml", script]) \
        + " [ARGS]"


def notes(plan: Plan) -> list[str]:
    """What a user's script must do beyond passing the numbers."""
    out = [f"Load the model in {model_dtype(plan)} (dtype=...); the engines cast for compute."]
    if plan.method != "full":
        quantised = " 4-bit (quantization_config=BitsAndBytesConfig(**adapter['bnb_config']))" \
            if plan.method == "qlora" else ""
        out.append(f"{METHOD_NAMES[plan.method]}: load the frozen base{quantised} in {model_dtype(plan)}, wrap it with "
                   "peft.get_peft_model(model, LoraConfig(**adapter['lora_config'])) (TRL: SFTTrainer(peft_config="
                   "LoraConfig(...))); the adapters stay float32 (PEFT's autocast_adapter_dtype).")
        if plan.adapter_spec.saved_dtype != "auto":
            out.append(f"modules_to_save ({plan.adapter_spec.modules_to_save}) train in "
                       f"{BASE_DTYPE_NAMES[plan.adapter_spec.saved_dtype]}: PEFT copies them in the base's dtype; "
                       "model = toolkit.train.own_script.peft_model(model) wraps the model and casts the copies, as "
                       "toolkit.train does (give its model to the Trainer, or to SFTTrainer without peft_config).")
    if plan.method == "qlora":
        out.append("k-bit preparation: " + KBIT_PREPARATION)
    if plan.engine == Engine.FSDP2 and plan.checkpointing and not sharded_at_load(plan):
        out.append("Activation checkpointing is on through the YAML (fsdp_activation_checkpointing); leave "
                   "gradient checkpointing off in your script.")
    elif plan.checkpointing:
        out.append("The plan's memory assumes activation checkpointing: TrainingArguments carry it; a custom loop "
                   "calls model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
                   "False}).")
    if plan.optimizer == "adamw" and plan.optimizer_impl == "for-loop":
        out.append("The plan's memory assumes a for-loop AdamW step (foreach=False): the Trainer and TRL cannot "
                   "select it (optim adamw_torch runs torch's foreach default, which needs more memory at the step); "
                   "a custom loop passes foreach=False, fused=False.")
    if plan.activation_offloading:
        out.append(offload_note(plan))
    if plan.compile:
        out.append("The plan's memory and speed assume torch.compile (inductor): TrainingArguments carry "
                   "torch_compile and the YAML dynamo_config (backend INDUCTOR); a custom loop gets it from the YAML "
                   "through accelerator.prepare." + (
                       " With checkpointing and the kernels package installed (a requirement of transformers 5.25), "
                       f"set torch._dynamo.config.{DYNAMO_FLAG} = True before training, as toolkit.train does, or "
                       "Dynamo runs each checkpointed layer uncompiled." if plan.checkpointing else ""))
    if plan.liger:
        out.append("The plan's memory assumes Liger kernels: TrainingArguments carry use_liger_kernel (install "
                   "liger-kernel >= 0.8.2; its kernels need a GPU).")
    if plan.loss == TRL_LOSS:
        out.append("The plan's memory assumes TRL's chunked NLL (its fused LM head: no whole logits): TRL's "
                   "SFTTrainer runs it with this plan's SFTConfig settings (loss_type nll, no label_smoothing_factor, no "
                   "compute_loss_func) and toolkit.train applies TRL's own head to its Trainer; a plain HF Trainer "
                   "script computes the model's whole-logits loss, which needs more memory than planned (re-plan "
                   "without --loss trl for it).")
    if plan.tiled:
        out.append(tiling_paragraph(plan))
    if plan.engine == Engine.DEEPSPEED and plan.zero_stage == 3:
        out.append("ZeRO-3: create TrainingArguments (or SFTConfig) before from_pretrained: while they exist, "
                   "transformers loads the model already partitioned (zero.Init through HfDeepSpeedConfig); a model "
                   "loaded first is whole in every rank's host RAM and GPU. A custom loop creates its Accelerator "
                   "first for the same reason.")
    if plan.leaf_modules:
        out.append(f"MoE under ZeRO-3: ds_config.json names {', '.join(plan.leaf_modules)} as a leaf module "
                   "(zero_optimization.leaf_module.classes), which DeepSpeed applies itself when the Trainer, TRL or "
                   "accelerate initialises the engine with that file; a script that builds its own DeepSpeed config "
                   "calls deepspeed.utils.set_z3_leaf_modules(model, "
                   f"{list(plan.leaf_modules)!r}) before deepspeed.initialize.")
    if owns_optimizer(plan):
        out.append("DeepSpeed builds its CPU-Adam extension (C++, with the compiler) on first use: the first run on "
                   "a machine waits minutes before the first step (cached in ~/.cache/torch_extensions after).")
    if owns_optimizer(plan):
        out.append("ds_config.json holds an \"optimizer\" block (DeepSpeed's CPU Adam for the offloaded states): "
                   "a custom accelerate loop must pass accelerate.utils.DummyOptim(params, lr=..., "
                   "weight_decay=...) instead of a torch optimizer (accelerate refuses one next to the block); "
                   "the HF Trainer and TRL do this themselves.")
    if plan.engine == Engine.DEEPSPEED and plan.precision != "bf16-pure":
        out.append("ds_config.json leaves precision to the runner (bf16 / fp16 \"auto\"): the HF Trainer and TRL "
                   "take it from bf16 / fp16 above, a custom accelerate loop from Accelerator(mixed_precision="
                   f"{loop_mixed_precision(plan)!r}); leaving it out runs fp32, which the plan's memory did not "
                   "assume.")
    if plan.engine == Engine.DEEPSPEED:
        out.append("HF Trainer without accelerate launch: --deepspeed PLAN_DIR/ds_config.json with these "
                   "TrainingArguments (its \"auto\" values are filled from them). DeepSpeed's own launcher or "
                   f"deepspeed.initialize(config=...): {DS_CONFIG_CONCRETE} (every value concrete).")
    if plan.engine == Engine.PIPELINE:
        out.append("Pipeline plans run DeepSpeed's pipeline engine: use toolkit.train (Trainer, TRL and accelerate "
                   "loops cannot run a PipelineModule).")
    out += model_parallel_notes(plan)
    return out


def tiling_paragraph(plan: Plan) -> str:
    """What a user's script does for a --tiled plan: no TrainingArguments key exists for it."""
    from toolkit.inputs.job import loss_shards, mlp_shards

    local = plan.seq_len // plan.grid.seq_split
    hidden = int(plan.model_config.get("hidden_size") or plan.model_config.get("n_embd") or 0)
    vocab = int(plan.model_config.get("vocab_size") or 0)
    chunks = (f"; here {mlp_shards(local, hidden)} and {loss_shards(plan.micro_batch, local, vocab)} chunks of the "
              f"{local} tokens per rank" if hidden and vocab else "")
    return ("The plan's memory and speed assume ALST tiling: every decoder layer's MLP through DeepSpeed's TiledMLP "
            "(ceil(tokens per rank / hidden) chunks) and the logits + loss through sequence_tiled_compute "
            f"(ceil(fp32 logits / 1 GiB) chunks){chunks}. Neither transformers nor TRL applies them (no "
            "TrainingArguments key): toolkit.train does; in your own script call "
            "toolkit.patches.tiling.apply_tiling(model, agree_across_ranks=True) after from_pretrained and before "
            "the Trainer, or patch the model as ArcticTraining does (deepspeed/runtime/sequence_parallel/"
            "ulysses_sp.py). Not TiledFusedLogitsLoss: it makes the LM head's weight gradient for an unscaled loss.")


def auto_class_name(plan: Plan) -> str:
    """The transformers auto class a script loads the plan's model with (toolkit.inputs.modelconfig.auto_model_class:
    AutoModelForImageTextToText for a Qwen2.5-VL and for an image plan of Qwen3.5, AutoModelForCausalLM for a text
    model)."""
    from toolkit.inputs.modelconfig import auto_model_class, config_from_dict

    config = config_from_dict({**plan.model_config, "model_type": plan.model_type}, plan.model)
    return auto_model_class(config, images=bool(plan.images_per_sample)).__name__


def model_parallel_notes(plan: Plan) -> list[str]:
    """What a script must do under tensor / context / sequence parallelism (the engines' adapters)."""
    g = plan.grid
    if g.autoep:
        return [f"Expert parallelism is DeepSpeed AutoEP (autoep_size {g.expert}, the JSON's expert_parallel "
                "section): deepspeed.initialize replaces every MoE block with its AutoEPMoELayer, each rank holding "
                f"1/{g.expert} of every MoE layer's experts; every rank trains its own batch. DeepSpeed builds the "
                "optimizer (the JSON's optimizer block: ZeRO refuses a client optimizer without MoE parameter "
                "groups), so an accelerate loop passes DummyOptim. With transformers 5.24 call "
                "toolkit.patches.autoep.allow_string_keys() before deepspeed.initialize (toolkit.train does). "
                "The Trainer's save_model writes rank 0's AutoEP layers (mlp.experts.w1 / w2 / w3, "
                "mlp.router.gate), which from_pretrained does not read (it initialises the experts and the router "
                "at random), in the final folder and in every checkpoint-N: toolkit.train saves each in the "
                "checkpoint's own layout instead. A script's Trainer does the same with "
                "toolkit.train.autoep_export.AutoEPSaves first in its bases (class MyTrainer(AutoEPSaves, Trainer)); "
                "without the Trainer call toolkit.train.autoep_export.save_autoep_model(model, "
                "engine._config.expert_parallel_config, OUT, write=rank == 0) on every rank. Resume reads the "
                "engine's own state (checkpoint-N/global_stepN), which stays in AutoEP's layout."]
    if g.expert > 1:
        return [f"Expert parallelism (ep {g.expert}) follows the model's own ep_plan, applied by transformers at load: "
                f"model = {auto_class_name(plan)}.from_pretrained(MODEL, distributed_config=transformers.distributed."
                "DistributedConfig(**distributed_config)) with training_args.json's distributed_config "
                "(toolkit.train.own_script.model_kwargs() returns it with the dtype); each rank "
                f"holds 1/{g.expert} of every MoE layer's experts, FSDP-sharded over {g.dp_shard // g.expert} "
                f"rank(s), and the dense weights FSDP2-sharded over {g.dp_shard}. Every rank trains its own batch "
                "(routed tokens travel by all-to-all). Launch with the plan's YAML (plain processes). The Trainer "
                "saves the model only (save_only_model=True): transformers refuses optimizer checkpoints of a model "
                "it sharded at load, so such a run restarts rather than resumes."]
    if g.model_parallel == 1:
        return []
    share = (f"The batch arithmetic counts {g.data_parallel} data-parallel rank(s): the {g.model_parallel} ranks "
             "of one tensor / context / sequence group share each sample.")
    if g.tensor > 1:
        out = [f"Tensor parallelism (tp {g.tensor}) follows the model's own tp_plan, applied by transformers at load: "
               f"model = {auto_class_name(plan)}.from_pretrained(MODEL, distributed_config=transformers.distributed."
               "DistributedConfig(**distributed_config)) with training_args.json's distributed_config (FSDP2 over "
               "the other ranks included); the Trainer reads the sizes from the model. Launch with the plan's YAML "
               "(plain processes). The Trainer saves the model only (save_only_model=True): transformers refuses "
               "optimizer checkpoints of a model it sharded at load, so such a run restarts rather than resumes.",
               share]
        return out
    out = ["The accelerate YAML's parallelism_config block sets the sizes for every script it launches (Accelerator "
           "builds ParallelismConfig from them when the script passes none). Without the YAML, pass "
           "TrainingArguments(**training_arguments, parallelism_config=ParallelismConfig(**parallelism_config)) "
           "with the handlers built from their dicts (toolkit.emit.parallelism.build_parallelism_config does it). "
           + share]
    if g.sequence > 1:
        out.append(f"Ulysses sequence parallelism (sp {g.sequence}): every batch needs position_ids and a length "
                   f"divisible by {g.sequence}; attention {plan.attention} (never eager). The HF Trainer wraps its "
                   "data loader itself (accelerator.deepspeed_ulysses_dl_adapter) and computes the loss from the "
                   "shard's shift_labels; a custom accelerate loop gets UlyssesSPDataLoaderAdapter from "
                   "accelerator.prepare(model, optimizer, dataloader), whose batches hold the rank's shard with "
                   "batch['shift_labels'] (already shifted) and no labels, so model(**batch).loss is None: pop "
                   "shift_labels, take the shard's summed cross-entropy and non-ignored token count, all-gather both "
                   "over deepspeed.runtime.sequence_parallel.parallel_state_sp.get_sequence_parallel_group() with "
                   "torch.distributed.nn.functional.all_gather (differentiable) and divide the sums (transformers' "
                   "deepspeed_sp_compute_loss). Past one epoch of the HF Trainer, DeepSpeed's adapter skips a window "
                   "and a partial last one: call toolkit.train.dimensions.close_each_pass() before trainer.train().")
        if (note := sp_gradient_note(plan)) is not None:
            out.append(note)
    if g.context > 1:
        out.append(f"Context parallelism (cp {g.context}, torch ring attention): attention must be sdpa; "
                   f"sequences divisible by {2 * g.context}. The HF Trainer enters accelerator.maybe_context_parallel "
                   "itself (transformers trainer.py); a custom loop makes shift_labels (labels shifted left, padded with "
                   "-100), wraps forward and backward in `with accelerator.maybe_context_parallel(buffers=[input_ids, "
                   "shift_labels, position_ids], buffer_seq_dims=[1, 1, 1], no_restore_buffers={input_ids, "
                   "shift_labels, position_ids}):`, passes no attention mask (causal only) and computes the loss "
                   "from its chunk's shift_labels.")
    return out


def sp_gradient_note(plan: Plan) -> str | None:
    """ZeRO-1/2 x Ulysses SP: the two keys of the plan's DeepSpeed JSON that keep a user's own Trainer / TRL script
    on the single-process gradient (toolkit.emit.deepspeed.average_over_sp_ranks; docs/ENGINE_FACTS.md, "ZeRO-1/2 x
    Ulysses SP"); PLAN.md, training_args.json and `toolkit plan` say it."""
    if not averages_over_sp_ranks(plan):
        return None
    g = plan.grid
    ranks = g.data_parallel * g.sequence
    return (f"ZeRO-{plan.zero_stage} x Ulysses SP {g.sequence}: the DeepSpeed JSON's \"gradient_predivide_factor\": "
            f"{ranks} and \"zero_optimization\": {{\"reduce_scatter\": false}} make DeepSpeed average the gradient "
            f"over the {ranks} processes; keep both (the factor = the process count) in any DeepSpeed config your own "
            f"Trainer / TRL script runs with, or it trains on {g.sequence} x the gradient (the Trainer's SP loss "
            "all-gathers the ranks' losses, whose backward sums the SP ranks' gradients; ZeRO-1/2 divide by dp "
            "only). A custom loop gets the same averaging only with the same loss (torch.distributed.nn.functional."
            "all_gather of the shards' losses, token-weighted). `toolkit check` flags a config without them.")


def settings(plan: Plan) -> dict[str, Any]:
    from toolkit.emit.parallelism import distributed_config, parallelism_kwargs

    out = {
        "accelerate_launch": launch_line(),
        "training_arguments": training_arguments(plan),
        **dict([method_config(plan)]),
        "accelerate_loop": accelerate_loop(plan),
    }
    if plan.grpo and plan.grpo_spec.reward_model:  # GRPOTrainer's argument, not a GRPOConfig field: TRL loads it
        out["reward_funcs"] = [plan.grpo_spec.reward_model]
    if parallelism_kwargs(plan) and plan.grid.model_parallel > 1:
        out["parallelism_config"] = parallelism_kwargs(plan)
    if distributed_config(plan):
        out["distributed_config"] = distributed_config(plan)
    adapter = adapter_settings(plan)
    if adapter is not None:
        out["adapter"] = adapter
    if plan.model_config_overrides:
        out["model_config_overrides"] = plan.model_config_overrides
    out["notes"] = notes(plan)
    return out


def settings_json(plan: Plan) -> str:
    return json.dumps(settings(plan), indent=2) + "\n"


def plan_md_section(plan: Plan) -> list[str]:
    """PLAN.md's "your own script" section."""
    args = training_arguments(plan)
    lines = ["## Your own training script", "",
             "Launch it with the plan's accelerate config (from any directory; the folder may be copied):", "",
             f"    {launch_line()}", "",
             "or `toolkit launch PLAN_DIR -- your_script.py [ARGS]`; on a smaller box first (fewer GPUs, or CPU "
             "processes over gloo), `toolkit launch PLAN_DIR --processes 2 --cpu -- your_script.py [ARGS]` keeps the "
             "strategy and the global batch (by accumulation). The one import your script needs:", "",
             "```python",
             "from toolkit.train.own_script import training_arguments  # or "
             + method_config(plan)[0] + ", accelerate_loop",
             "args = TrainingArguments(output_dir=..., learning_rate=..., **training_arguments())",
             "```", "",
             "It returns these settings for the box the script runs on (on a machine without a GPU it also creates "
             f"accelerate's gloo state first); they are machine-readable in `{TRAINING_ARGS}`:", "",
             "TrainingArguments (HF Trainer):", "", "```python"]
    lines += [f"{key}={value!r}," for key, value in args.items()]
    if plan.dpo:
        extra = {k: v for k, v in dpo_config(plan).items() if k not in args}
        lines += ["```", "", "Method: DPO (TRL's DPOTrainer; `per_device_train_batch_size` counts chosen / rejected "
                  "pairs, run as one concatenated batch). TRL DPOConfig: the same plus "
                  + ", ".join(f"`{k}={v!r}`" for k, v in extra.items())
                  + " (`from toolkit.train.own_script import dpo_config`; "
                  + ("the reference is the adapter-disabled base, no model of its own)." if plan.method != "full"
                     else "the reference's log-probs are computed over the dataset before training)."
                     if plan.dpo_spec.reference == "precomputed" else
                     "the reference model is kept beside the policy: leave DPOTrainer's ref_model None and TRL "
                     "loads it as the plan assumes)."), ""]
    elif plan.grpo:
        extra = {k: v for k, v in grpo_config(plan).items() if k not in args}
        g = plan.grpo_spec
        lines += ["```", "", "Method: GRPO (TRL's GRPOTrainer; `per_device_train_batch_size` counts completions, "
                  f"{g.num_generations} per prompt). TRL GRPOConfig: the same plus "
                  + ", ".join(f"`{k}={v!r}`" for k, v in extra.items())
                  + " (`from toolkit.train.own_script import grpo_config`; GRPOTrainer(model=..., reward_funcs=..., "
                  "args=GRPOConfig(**grpo_config())); "
                  + ("the reference model is loaded by TRL (beta != 0)." if g.reference_kept else
                     "beta 0: TRL loads no reference model.")
                  + (" Generation runs on a separate vLLM server (`trl vllm-serve`) on other GPUs, not these."
                     if g.generation == "server" else "")
                  + (f" Reward model `{g.reward_model}` (sequence classification; its weights and scoring forward "
                     "are in the plan's memory and time): pass it by name in reward_funcs, `reward_funcs=reward_funcs()"
                     " + [your functions]` (`from toolkit.train.own_script import reward_funcs`), and TRL loads it."
                     if g.reward_model else ""), ""]
    else:
        lines += ["```", "", f"TRL SFTConfig: the same plus `max_length={plan.seq_len}`, "
                  f"`packing={sft_config(plan)['packing']}` (packing needs flash attention to keep documents "
                  "apart).", ""]
    lines += ["A custom accelerate loop: " + ", ".join(f"{k} {v}" for k, v in accelerate_loop(plan).items()) + ".", ""]
    adapter = adapter_settings(plan)
    if adapter is not None:
        lines += [f"{METHOD_NAMES[plan.method]} (peft / bitsandbytes; `adapter` in `{TRAINING_ARGS}`; "
                  "`toolkit.train.own_script.model_kwargs()` and `lora_config()` build them; `peft_model(model)` wraps "
                  "the loaded model as toolkit.train does):", "", "```python"]
        if "bnb_config" in adapter:
            lines.append(f"bnb_config = {adapter['bnb_config']!r}  # dtype names: getattr(torch, name)")
        lines += [f"model = {auto_class_name(plan)}.from_pretrained(MODEL, dtype=torch.{adapter['model_dtype']}"
                  + (", quantization_config=BitsAndBytesConfig(**bnb_config))" if "bnb_config" in adapter else ")"),
                  f"lora_config = LoraConfig(**{adapter['lora_config']!r})", "```", ""]
    if plan.images_per_sample:
        from toolkit.inputs.images import image_words

        lines += [f"Image-and-text job (`images_per_sample`, `image_size`, `image_tokens` in plan.json): "
                  f"{image_words(plan)}. The memory above counts the vision encoder's and projector's saved "
                  "activations for those images.", "",
                  "toolkit.train runs it on `--data FOLDER`: a JSONL of rows `{\"messages\": [...], \"images\": "
                  "[\"a.png\", ...]}` (TRL's VLM format; paths relative to the folder), at most "
                  f"{plan.images_per_sample} images a row. It loads the checkpoint's own processor (AutoProcessor), "
                  f"resizes every image to {plan.image_size} so the processor gives {plan.image_tokens} tokens an "
                  "image (the run says so if it finds another count), and batches with TRL's own "
                  "`DataCollatorForVisionLanguageModeling`, every sequence padded to "
                  f"{plan.seq_len} tokens; image tokens and padding are -100 in the labels, and only the assistant's "
                  "tokens train where the chat template marks them ({% generation %}).", "",
                  f"Your own TRL VLM SFT script needs the same: `model = {auto_class_name(plan)}.from_pretrained("
                  "MODEL)` (the class that runs images; Qwen3.5's AutoModelForCausalLM class is its language model "
                  "alone, which takes pixel_values and ignores them), "
                  "`processing_class=AutoProcessor.from_pretrained(MODEL)`, the images resized to "
                  f"{plan.image_size} before the collator, `SFTConfig(max_length=None, "
                  f"pad_to_multiple_of={plan.seq_len})` (truncation would cut image tokens), `per_device_train_"
                  "batch_size` as above; the collator feeds the model `input_ids`, `attention_mask`, `labels`, "
                  "`pixel_values` and what the processor adds for the class (Qwen-VL's `image_grid_thw`, "
                  "Gemma-3's `token_type_ids`)." + _vision_wrap_words(plan), ""]
    if plan.vision_tower == "freeze":
        lines += ["Vision tower frozen (`vision_tower` and `model_parts` in plan.json): the encoder and projector "
                  "stop requiring grad before the Trainer builds its optimizer, as toolkit.train does:", "",
                  "```python", f"for path in {plan.model_parts['vision_modules']!r}:",
                  "    model.get_submodule(path).requires_grad_(False)", "```", ""]
    if plan.model_config_overrides:
        lines += [f"RoPE scaling ({plan.rope_scaling['rope_type']} x{plan.rope_scaling['factor']:g}; "
                  f"`model_config_overrides` in `{TRAINING_ARGS}`): the model trains at {plan.seq_len} tokens, past "
                  "the positions it ships with, only with its config changed as planned (transformers applies "
                  "config keys given to from_pretrained):", "", "```python",
                  f"model = {auto_class_name(plan)}.from_pretrained(MODEL, "
                  + ", ".join(f"{k}={v!r}" for k, v in plan.model_config_overrides.items()) + ")", "```", ""]
    from toolkit.emit.parallelism import distributed_config, parallelism_kwargs

    if plan.grid.model_parallel > 1 and parallelism_kwargs(plan):
        lines += ["Parallelism (accelerate ParallelismConfig; the YAML sets it, `parallelism_config` in "
                  f"`{TRAINING_ARGS}` for scripts run without it):", "", "```python",
                  f"ParallelismConfig(**{parallelism_kwargs(plan)!r})", "```", ""]
    if distributed_config(plan):
        lines += [f"{'Expert' if plan.grid.expert > 1 else 'Tensor'} parallelism (transformers shards the model at "
                  "load; `distributed_config` in "
                  f"`{TRAINING_ARGS}`):", "", "```python",
                  f"model = {auto_class_name(plan)}.from_pretrained(MODEL, distributed_config=DistributedConfig("
                  f"**{distributed_config(plan)!r}))", "```", ""]
    lines += [f"- {note}" for note in notes(plan)]
    return lines + [""]
