"""The model, hardware and job a plan describes: what the planner handed on, read back from plan.json (for
re-prediction, emit and launch's preflight)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.errors import UserError
from toolkit.inputs.hardware import Hardware
from toolkit.inputs.job import Job
from toolkit.inputs.modelspec import ModelSpec

if TYPE_CHECKING:
    from toolkit.plan.schema import Plan


def plan_job(plan: "Plan", *, check: bool = True) -> tuple[ModelSpec, Hardware, Job]:
    """The model, hardware and job a plan describes, checked (check=True) by the same job rules estimate and plan
    apply (toolkit.inputs.job.check_job): re-prediction, emit and launch's preflight all start here."""
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import check_job
    from toolkit.inputs.modelspec import spec_from_config_dict

    spec = spec_from_config_dict(plan.model_config, name=plan.model, params=plan.params)
    check_plan_agrees(plan, spec)
    hw = parse_hardware(f"{plan.num_machines}x{plan.gpus_per_node}x{plan.gpu}", inter_node_gbps=plan.inter_node_gbps,
                        cpu_ram_gib=plan.cpu_ram_gib, power_limit_w=plan.power_limit_w)
    job = Job(seq_len=plan.seq_len, micro_batch=plan.micro_batch, grad_accum=plan.grad_accum,
              precision=plan.precision, optimizer=plan.optimizer, checkpointing=plan.checkpointing,
              attention=plan.attention, optimizer_impl=plan.optimizer_impl,
              activation_offloading=plan.activation_offloading, liger=plan.liger, adapter=plan.adapter_spec,
              compile=plan.compile, tiled=plan.tiled)
    if check:
        check_job(spec, job, hw, plan.strategy_spec, pipeline_stages=plan.pipeline_stages)
    return spec, hw, job


class PlanContradiction(UserError):
    """plan.json's own fields disagree with the model config it carries (an edit of one and not the other)."""


def check_plan_agrees(plan: "Plan", spec: ModelSpec) -> None:
    """The model facts plan.json states (model_type, num_layers, layer_class) must be its model_config's: an edit
    of one alone would re-predict and emit for a model that does not exist."""
    wrong = [f"{name} {stated!r} but the model's config gives {actual!r}" for name, stated, actual in
             (("model_type", plan.model_type, spec.model_type), ("num_layers", plan.num_layers, spec.num_layers),
              ("layer_class", plan.layer_class, spec.layer_class)) if stated != actual]
    if wrong:
        raise PlanContradiction(f"plan.json contradicts its model: it says {'; '.join(wrong)}; undo the edit or "
                                "re-plan with `toolkit plan`")
