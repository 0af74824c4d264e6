"""PLAN.md: the plan in words, for the person who will launch it."""

from __future__ import annotations

from typing import Any

from toolkit.emit.deepspeed import ds_zero_stage
from toolkit.emit.parallelism import sharded_at_load
from toolkit.emit.scripts import batch_arithmetic
from toolkit.emit.user_settings import plan_md_section
from toolkit.plan.schema import Plan
from toolkit.inputs.strategy import Engine

from toolkit.inputs.choices import GIB
BAR_WIDTH = 40

SUMMARY_KEYS = ("peak_bytes", "reserved_bytes", "nvidia_smi_bytes", "required_bytes", "capacity_bytes",
                "cpu_bytes_per_node", "nvme_bytes_per_node", "nccl_bytes", "workspace_bytes")
"""predicted.* byte counts printed as totals under the component table, or parts of another entry (NCCL's buffers of
the context, cuBLAS's workspaces of the peak), not as components."""
CHART_ROWS = 24
"""At most this many bars: the best row of each strategy first (the planner lists every batch/checkpointing mix)."""


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.1f} GiB"


def plan_md(plan: Plan, candidates: list[dict[str, Any]] | None = None, *, nvme_path: str | None = None) -> str:
    lines = []
    if plan.prediction_is_stale:
        lines += ["> STALE PREDICTION: plan.json was edited after the memory and speed below were predicted; they "
                  "describe the plan before the edit. Refresh them with `toolkit emit plan.json --force` (or re-plan "
                  "with `toolkit plan`).", ""]
    lines += [f"# Plan: {plan.strategy} for {plan.model}", ""]
    lines += ["## Model and hardware", "",
              f"- model: `{plan.model}` ({plan.model_type}, {plan.params:,} parameters, {plan.num_layers} layers of "
              f"`{plan.layer_class}`)",
              f"- hardware: {plan.num_machines} node(s) x {plan.gpus_per_node} {plan.gpu} = {plan.world_size} GPUs"
              + (f", each at a {plan.power_limit_w:g} W board power limit (the step time uses the tensor peak that "
                 "limit leaves: see the notes)" if plan.power_limit_w else ""),
              f"- job: sequence {plan.seq_len}, precision {plan.precision}, optimizer {plan.optimizer}, "
              f"activation checkpointing {'on' if plan.checkpointing else 'off'}, attention {plan.attention}"]
    if plan.method != "full":
        a = plan.adapter
        lines.append(f"- method: {plan.method} through PEFT (r {a.get('r')}, alpha {a.get('alpha')}, dropout "
                     f"{a.get('dropout')}, targets {a.get('targets')}"
                     + (f", modules to save {a['modules_to_save']}" if a.get("modules_to_save") else "")
                     + (f", 4-bit {a.get('quant_type')}{' double-quantised' if a.get('double_quant') else ''}, "
                        f"storage {a.get('quant_storage')}" if plan.method == "qlora" else "")
                     + f"): {plan.trainable_params:,} trainable parameters; toolkit.train saves the adapter "
                     "(adapter_config.json + adapter_model.safetensors)")
    if plan.dpo:
        d = plan.dpo_spec
        lines.append(f"- method: DPO through TRL's DPOTrainer (loss {d.loss_type}, beta {d.beta:g}, reference "
                     f"{d.reference}): chosen and rejected run as one batch of twice the micro-batch of pairs; "
                     + ("the reference is the policy with its adapters disabled" if plan.method != "full" else
                        "the reference model is kept beside the policy" if d.reference_forward else
                        "the reference's log-probs are precomputed over the dataset before training")
                     + "; toolkit.train runs it on prompt / chosen / rejected rows (`toolkit launch PLAN_DIR -- "
                     "--data pairs.jsonl --output OUT`), as does your own TRL script (below)")
    if plan.grpo:
        from toolkit.inputs.grpo import grpo_words

        lines.append(f"- method: {grpo_words(plan.grpo_spec)[2:]} through TRL's GRPOTrainer; toolkit.train runs it "
                     + ("on prompt rows scored by the reward model, which TRL loads, and any --reward functions you "
                        "add (`toolkit launch PLAN_DIR -- --data prompts.jsonl --output OUT`)"
                        if plan.grpo_spec.reward_model else
                        "on prompt rows with the rewards you name (`toolkit launch PLAN_DIR -- --data prompts.jsonl "
                        "--output OUT --reward MODULE:FUNCTION`)")
                     + (" where vLLM runs (a GPU, vllm installed)" if plan.grpo_spec.use_vllm else "")
                     + ", as does your own TRL script (below)")
    lines.append("")
    lines += ["## Strategy", "", f"- {strategy_sentence(plan)}"]
    if plan.engine == Engine.PIPELINE:
        lines.append(f"- {plan.pipeline_stages} stages x {plan.data_parallel} data-parallel; decoder layers split at "
                     f"{plan.partition}; 1F1B schedule with {plan.grad_accum} micro-batches per step")
        lines.append("- accelerate only starts the processes; toolkit.train runs DeepSpeed's pipeline engine with "
                     "ds_config.json (no \"auto\" values: nothing would fill them)")
        if ds_zero_stage(plan) != plan.zero_stage:
            lines.append(f"- ds_config.json uses ZeRO-{ds_zero_stage(plan)} with fp32 gradient accumulation: "
                         "DeepSpeed's bf16 pipeline path needs it (bf16 accumulation is not numerically safe)")
    lines += [f"- notes: {note}" for note in plan.notes]
    lines += ["", "## Batch", "", f"    {batch_arithmetic(plan)}",
              f"    = {plan.tokens_per_step:,} tokens per optimizer step", ""]
    lines += memory_section(plan)
    lines += timing_section(plan)
    if candidates:
        lines += ["## Peak memory per strategy (per GPU)", "", "```"] + memory_chart(candidates) + ["```", ""]
    lines += launch_section(plan, nvme_path)
    if plan.engine != Engine.PIPELINE:
        lines += plan_md_section(plan)
    return "\n".join(lines)


def strategy_sentence(plan: Plan) -> str:
    what = {
        "ddp": "torch DDP: every GPU holds the whole model, gradients are all-reduced",
        "deepspeed": f"DeepSpeed ZeRO-{plan.zero_stage} through the HF Trainer: "
                     + {1: "optimizer states", 2: "optimizer states and gradients",
                        3: "optimizer states, gradients and parameters"}.get(plan.zero_stage, "nothing")
                     + f" divided over {plan.data_parallel} GPUs"
                     + (f", with DeepSpeed AutoEP {plan.grid.expert} (each rank holds 1/{plan.grid.expert} of every "
                        "MoE layer's experts, routed tokens exchanged by all-to-all)" if plan.grid.autoep else ""),
        "fsdp2": f"torch FSDP2 ({plan.fsdp_mode} shard) "
                 + ("applied by transformers as it loads the model (DistributedConfig" + _grid_words(plan) + ")"
                    if sharded_at_load(plan) else "through accelerate") + f", wrapping each `{plan.layer_class}`",
        "pipeline": "DeepSpeed pipeline engine (PipelineModule) started by toolkit.train"
                    + (" with ZeRO-1 across the data-parallel replicas" if plan.data_parallel > 1 else ""),
    }[plan.engine]
    offload = []
    if plan.engine == Engine.FSDP2 and plan.offload_params != "none":
        # One switch in torch (CPUOffloadPolicy): params, grads and the optimizer move together.
        offload.append("sharded parameters, gradients, optimizer states and step on CPU (torch's CPUOffloadPolicy; "
                       "each layer's shard copied to the GPU for its all-gather)")
    elif plan.offload_optimizer != "none":
        offload.append(f"optimizer states and step on {plan.offload_optimizer.upper()}")
    if plan.offload_params != "none" and plan.engine != Engine.FSDP2:
        offload.append(f"parameters on {plan.offload_params.upper()}")
    return what + (f"; offload: {', '.join(offload)}" if offload else "")


def _grid_words(plan: Plan) -> str:
    """The sizes of a plan transformers shards at load: tp, ep (each rank's share of every MoE layer's experts)."""
    g = plan.grid
    words = [f"tensor parallel {g.tensor} (the model's tp_plan)"] if g.tensor > 1 else []
    if g.expert > 1:
        words.append(f"expert parallel {g.expert}: each rank holds 1/{g.expert} of every MoE layer's experts (the "
                     f"model's ep_plan), tokens routed between ranks by all-to-all")
    return ": " + "; ".join(words) if words else ""


def memory_section(plan: Plan) -> list[str]:
    predicted = plan.predicted
    def number(key: str) -> float | None:
        value = predicted.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    components = [(k, v) for k, v in predicted.items()
                  if k.endswith("_bytes") and k not in SUMMARY_KEYS and number(k) is not None]
    if not components and number("peak_bytes") is None:
        return ["## Predicted memory", "", "(no prediction in plan.json: re-plan with `toolkit plan` for one)", ""]
    lines = ["## Predicted memory per GPU", "", "| component | size |", "|---|---:|"]
    lines += [f"| {k[: -len('_bytes')].replace('_', ' ')} | {gib(v)} |" for k, v in components]
    phase = f" ({predicted['peak_phase']})" if isinstance(predicted.get("peak_phase"), str) else ""
    for key, label in (("peak_bytes", f"peak{phase}: allocated"), ("reserved_bytes", "reserved (peak + margin)"),
                       ("required_bytes", "required: nvidia-smi (reserved + CUDA context + NCCL buffers)")):
        if number(key) is not None:
            lines.append(f"| **{label}** | **{gib(number(key))}** |")
    conf = predicted.get("allocator_conf")
    if isinstance(conf, str):
        lines += ["", f"Allocator: {'PYTORCH_CUDA_ALLOC_CONF=' + conf if conf else 'torch defaults'}, as predicted; "
                      "the launch scripts export plan.json's allocator_conf unless your environment sets one."]
    if number("capacity_bytes") is not None:
        lines += ["", f"GPU capacity: {gib(number('capacity_bytes'))}"]
    for key, label in (("cpu_bytes_per_node", "CPU RAM per node"), ("nvme_bytes_per_node", "NVMe per node")):
        if number(key):
            lines += ["", f"{label}: {gib(number(key))}"]
    return lines + [""]


def timing_section(plan: Plan) -> list[str]:
    step = plan.predicted.get("step_time_s")
    rate = plan.predicted.get("tokens_per_s")
    if step is None and rate is None:
        return []
    lines = ["## Predicted speed", ""]
    if step is not None:
        lines.append(f"- step time: {step:.2f} s")
    if rate is not None:
        lines.append(f"- throughput: {rate:,.0f} tokens/s ({rate / plan.world_size:,.0f} per GPU)")
    run = plan.predicted.get("time_to_train")
    if isinstance(run, dict):
        span = run.get("hours_band")
        cost = run.get("cost")
        source = run.get("dataset_tokens_detail") or run.get("dataset_tokens_source", "given")
        lines.append(f"- time to train: {run['dataset_tokens']:,} tokens ({source}) x {run['epochs']:g} epoch(s) = "
                     f"{run['steps']:,} steps: {run['hours']:,.2f} h"
                     + (f" ({span[0]:,.2f}-{span[1]:,.2f} h in the step-time band)" if span else
                        " (no band: this engine's speed is unverified at this scale)")
                     + f", {run['gpu_hours']:,.1f} GPU-hours"
                     + (f", cost {cost:,.2f} at {run['gpu_hour_price']:,.2f} per GPU-hour" if cost is not None
                        else "") + "; packed sequences, no evaluation, saving or start-up")
    return lines + [""]


def memory_chart(candidates: list[dict[str, Any]]) -> list[str]:
    """One bar per strategy, scaled so that the GPU capacity is a `|` at the same column on every line."""
    rows = chart_rows(candidates)
    measured = [c for c in rows if c.get("peak_bytes") and c.get("capacity_bytes")]
    name_width = max(len(str(c["name"])) for c in rows)
    lines = [f"{c['name']:<{name_width}} (no memory estimate) {c.get('reason') or ''}".rstrip()
             for c in rows if c not in measured]
    if not measured:
        return lines
    scale = max([c["capacity_bytes"] for c in measured] + [c["peak_bytes"] for c in measured])
    for c in measured:
        filled = round(BAR_WIDTH * c["peak_bytes"] / scale)
        cap = round(BAR_WIDTH * c["capacity_bytes"] / scale)
        bar = ["#" if i < filled else " " for i in range(BAR_WIDTH + 1)]
        if cap <= BAR_WIDTH:
            bar[cap] = "|" if cap >= filled else "!"
        verdict = "fits" if c.get("feasible") else f"does not fit: {c.get('reason') or 'over capacity'}"
        speed = f", {c['tokens_per_s']:,.0f} tok/s" if c.get("tokens_per_s") else ""
        lines.append(f"{c['name']:<{name_width}} {''.join(bar)} {c['peak_bytes'] / GIB:6.1f} / "
                     f"{c['capacity_bytes'] / GIB:.0f} GiB  {verdict}{speed}")
    lines.append(f"{'':<{name_width}} ('#' = predicted peak, '|' = GPU capacity, '!' = capacity exceeded)")
    return lines


def chart_rows(candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The candidates to draw: all of them when few, else the best of each strategy (fastest feasible, else the
    smallest peak), fastest first."""
    if len(candidates) <= CHART_ROWS:
        return list(candidates)

    def rank(c: dict[str, Any]) -> tuple:
        return (not c.get("feasible"), -(c.get("tokens_per_s") or 0.0), c.get("peak_bytes") or float("inf"))

    best: dict[str, dict[str, Any]] = {}
    for c in candidates:
        key = str(c.get("strategy", c["name"]))
        if key not in best or rank(c) < rank(best[key]):
            best[key] = c
    return sorted(best.values(), key=rank)[:CHART_ROWS]


def launch_section(plan: Plan, nvme_path: str | None) -> list[str]:
    from toolkit.inputs.resolve import loadable_model

    lines = ["## Launch", "", f"The model loads as `{loadable_model(plan.model)}`.", ""]
    if plan.num_machines == 1:
        lines += ["    ./launch.sh --data DATA --output OUT          # toolkit.train",
                  "    ./launch.sh my_train.py [ARGS]                # your own script"]
    else:
        lines += ["SLURM (from this directory; one `accelerate launch` per node):", "",
                  "    sbatch slurm.sbatch --data DATA --output OUT", "",
                  "Without SLURM: run `accelerate launch --config_file accelerate_config.yaml --machine_rank R "
                  "--main_process_ip FIRST_HOST ...` on every node, or DeepSpeed's launcher over ssh with the host "
                  "names in `hostfile`: `./deepspeed.sh --data DATA --output OUT` on the first host."]
    from toolkit.bounds import DEFAULT_SAVE_TOTAL_LIMIT

    lines.append(f"\nCheckpoints: toolkit.train writes `OUT/checkpoint-N` every `--save-steps` steps and keeps "
                 f"the newest {DEFAULT_SAVE_TOTAL_LIMIT} complete ones (`--save-total-limit`); an older one is "
                 "deleted only after a newer one is complete, so the last complete checkpoint is never lost. "
                 "`--resume` continues from it with the losses of an uninterrupted run.")
    if nvme_path:
        lines.append(f"\nNVMe offload writes to `{nvme_path}` on every node: a local NVMe drive with room for the "
                     "offloaded states.")
    return lines + [""]
