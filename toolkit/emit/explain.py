"""PLAN.md: the plan in words, for the person who will launch it."""

from __future__ import annotations

from typing import Any

from toolkit.emit.launch import batch_arithmetic
from toolkit.plan import Plan

GIB = 1024 ** 3
BAR_WIDTH = 40

SUMMARY_KEYS = ("peak_bytes", "cpu_bytes_per_node", "step_time_s", "tokens_per_s")


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.1f} GiB"


def plan_md(plan: Plan, candidates: list[dict[str, Any]] | None = None, *, nvme_path: str | None = None) -> str:
    lines = [f"# Plan: {plan.strategy} for {plan.model}", ""]
    lines += ["## Model and hardware", "",
              f"- model: `{plan.model}` ({plan.model_type}, {plan.params:,} parameters, {plan.num_layers} layers of "
              f"`{plan.layer_class}`)",
              f"- hardware: {plan.num_machines} node(s) x {plan.gpus_per_node} {plan.gpu} = {plan.world_size} GPUs",
              f"- job: sequence {plan.seq_len}, precision {plan.precision}, optimizer {plan.optimizer}, "
              f"activation checkpointing {'on' if plan.checkpointing else 'off'}, attention {plan.attention}", ""]
    lines += ["## Strategy", "", f"- {strategy_sentence(plan)}"]
    if plan.engine == "pipeline":
        lines.append(f"- {plan.pipeline_stages} stages x {plan.data_parallel} data-parallel; decoder layers split at "
                     f"{plan.partition}; 1F1B schedule with {plan.grad_accum} micro-batches per step")
    lines += [f"- notes: {note}" for note in plan.notes]
    lines += ["", "## Batch", "", f"    {batch_arithmetic(plan)}",
              f"    = {plan.tokens_per_step:,} tokens per optimizer step", ""]
    lines += memory_section(plan)
    lines += timing_section(plan)
    if candidates:
        lines += ["## Peak memory per strategy (per GPU)", "", "```"] + memory_chart(candidates) + ["```", ""]
    lines += launch_section(plan, nvme_path)
    return "\n".join(lines)


def strategy_sentence(plan: Plan) -> str:
    what = {
        "ddp": "torch DDP: every GPU holds the whole model, gradients are all-reduced",
        "deepspeed": f"DeepSpeed ZeRO-{plan.zero_stage} through the HF Trainer: "
                     + {1: "optimizer states", 2: "optimizer states and gradients",
                        3: "optimizer states, gradients and parameters"}.get(plan.zero_stage, "nothing")
                     + f" divided over {plan.data_parallel} GPUs",
        "fsdp2": f"torch FSDP2 ({plan.fsdp_mode} shard) through accelerate, wrapping each `{plan.layer_class}`",
        "pipeline": "DeepSpeed pipeline engine (PipelineModule) started by toolkit.train"
                    + (" with ZeRO-1 across the data-parallel replicas" if plan.data_parallel > 1 else ""),
    }[plan.engine]
    offload = []
    if plan.offload_optimizer != "none":
        offload.append(f"optimizer states and step on {plan.offload_optimizer.upper()}")
    if plan.offload_params != "none":
        offload.append(f"parameters on {plan.offload_params.upper()}")
    return what + (f"; offload: {', '.join(offload)}" if offload else "")


def memory_section(plan: Plan) -> list[str]:
    predicted = plan.predicted
    components = [(k, v) for k, v in predicted.items()
                  if k.endswith("_bytes") and k not in SUMMARY_KEYS and isinstance(v, (int, float))]
    if not components and "peak_bytes" not in predicted:
        return ["## Predicted memory", "", "(no prediction in plan.json)", ""]
    lines = ["## Predicted memory per GPU", "", "| component | size |", "|---|---:|"]
    lines += [f"| {k[: -len('_bytes')].replace('_', ' ')} | {gib(v)} |" for k, v in components]
    if "peak_bytes" in predicted:
        lines.append(f"| **peak** | **{gib(predicted['peak_bytes'])}** |")
    if "cpu_bytes_per_node" in predicted:
        lines += ["", f"CPU RAM per node: {gib(predicted['cpu_bytes_per_node'])}"]
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
    return lines + [""]


def memory_chart(candidates: list[dict[str, Any]]) -> list[str]:
    """One bar per strategy, scaled so that the GPU capacity is a `|` at the same column on every line."""
    scale = max([c["capacity_bytes"] for c in candidates] + [c["peak_bytes"] for c in candidates])
    name_width = max(len(c["name"]) for c in candidates)
    lines = []
    for c in candidates:
        filled = round(BAR_WIDTH * c["peak_bytes"] / scale)
        cap = round(BAR_WIDTH * c["capacity_bytes"] / scale)
        bar = ["#" if i < filled else " " for i in range(BAR_WIDTH + 1)]
        if cap <= BAR_WIDTH:
            bar[cap] = "|" if cap >= filled else "!"
        verdict = ("fits" if c["feasible"] else f"does not fit: {c.get('reason') or 'over capacity'}")
        speed = f", {c['tokens_per_s']:,.0f} tok/s" if c.get("tokens_per_s") else ""
        lines.append(f"{c['name']:<{name_width}} {''.join(bar)} {c['peak_bytes'] / GIB:6.1f} / "
                     f"{c['capacity_bytes'] / GIB:.0f} GiB  {verdict}{speed}")
    lines.append(f"{'':<{name_width}} ('#' = predicted peak, '|' = GPU capacity, '!' = capacity exceeded)")
    return lines


def launch_section(plan: Plan, nvme_path: str | None) -> list[str]:
    lines = ["## Launch", ""]
    if plan.num_machines == 1:
        lines.append("    ./launch.sh --data DATA --output OUT")
    else:
        lines += ["SLURM (from this directory; one `accelerate launch` per node):", "",
                  "    sbatch slurm.sbatch --data DATA --output OUT", "",
                  "Without SLURM: run the `accelerate launch` line of `slurm.sbatch` on every node, with "
                  "`--machine_rank R` and `--main_process_ip FIRST_HOST`."]
        if plan.engine == "deepspeed":
            lines.append("DeepSpeed's pdsh route instead: put your host names in `hostfile`, then on the first "
                         "host add `--deepspeed_multinode_launcher pdsh --deepspeed_hostfile hostfile`.")
    if nvme_path:
        lines.append(f"\nNVMe offload writes to `{nvme_path}` on every node: a local NVMe drive with room for the "
                     "offloaded states.")
    return lines + [""]
