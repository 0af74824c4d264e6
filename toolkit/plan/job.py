"""The model, hardware and job a plan describes: what the planner handed on, read back from plan.json (for
re-prediction, emit and launch's preflight)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from toolkit.errors import UserError
from toolkit.inputs.hardware import Hardware
from toolkit.inputs.job import BLOCKS_COMPILE_PROBLEM, CHECKPOINTING_OP, COMPILE_BLOCKS, OP_CHECKPOINTING_PROBLEM, Job
from toolkit.inputs.modelspec import ModelSpec
from toolkit.plan.schema import Plan

ADAPTER = "adapter"
"""The Job's Adapter: plan.json spells it as `method` and the `adapter` dict of its settings."""
DPO = "dpo"
"""The Job's Dpo: plan.json holds the dict of its settings under the same name (absent for supervised jobs)."""
GRPO = "grpo"
"""The Job's Grpo, as DPO."""
ESTIMATE_ONLY = ("chunked_loss", "zero_reduce_bucket", "zero_overlap_comm")
"""Job fields no runner applies, so a plan never carries them (estimate models them; a Job bound for a plan keeps
their defaults)."""
JOB_FIELDS_IN_PLAN = tuple(f.name for f in fields(Job)
                           if f.name in {p.name for p in fields(Plan)} and f.name not in (ADAPTER, DPO, GRPO))
"""The Job's fields plan.json holds under the same name (read from both dataclasses, so a field added to both is
carried without another spelling)."""


def plan_job_problem(job: Job) -> str | None:
    """Why `job` cannot become a plan (a setting modelled by estimate only), or None."""
    if job.checkpointing == CHECKPOINTING_OP:
        return OP_CHECKPOINTING_PROBLEM
    if job.compile == COMPILE_BLOCKS:
        return BLOCKS_COMPILE_PROBLEM
    if job.chunked_loss:
        return ("--chunked-loss (torchtune's chunked cross-entropy) is modelled by estimate only: no runner here "
                "applies it; drop --chunked-loss")
    return None


def job_to_plan_fields(job: Job) -> dict[str, Any]:
    """plan.json's fields that spell `job`: the one mapping Job -> Plan (job_from_plan is its inverse)."""
    problem = plan_job_problem(job)
    if problem:
        raise UserError(problem)
    out: dict[str, Any] = {name: getattr(job, name) for name in JOB_FIELDS_IN_PLAN}
    if job.adapter.is_adapter:
        out.update(method=job.adapter.method, adapter=job.adapter.to_dict())
    if job.dpo is not None:
        out[DPO] = job.dpo.to_dict()
    if job.grpo is not None:
        out[GRPO] = job.grpo.to_dict()
    return out


def job_from_plan(plan: Plan) -> Job:
    """The Job a plan describes: the one mapping Plan -> Job."""
    return Job(**{name: getattr(plan, name) for name in JOB_FIELDS_IN_PLAN}, adapter=plan.adapter_spec,
               dpo=plan.dpo_spec, grpo=plan.grpo_spec)


def plan_job(plan: Plan, *, check: bool = True) -> tuple[ModelSpec, Hardware, Job]:
    """The model, hardware and job a plan describes, checked (check=True) by the same job rules estimate and plan
    apply (toolkit.inputs.job.check_job): re-prediction, emit and launch's preflight all start here."""
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import check_job
    from toolkit.inputs.modelspec import spec_from_config_dict

    spec = spec_from_config_dict(plan.model_config, name=plan.model, params=plan.params,
                                 images=bool(plan.images_per_sample))
    check_plan_agrees(plan, spec)
    hw = parse_hardware(f"{plan.num_machines}x{plan.gpus_per_node}x{plan.gpu}", inter_node_gbps=plan.inter_node_gbps,
                        cpu_ram_gib=plan.cpu_ram_gib, power_limit_w=plan.power_limit_w)
    job = job_from_plan(plan)
    if check:
        check_job(spec, job, hw, plan.strategy_spec, pipeline_stages=plan.pipeline_stages)
        plan.grid.check_model(spec)  # an edited degree the model cannot take (e.g. more experts than it has)
    return spec, hw, job


class PlanContradiction(UserError):
    """plan.json's own fields disagree with the model config it carries (an edit of one and not the other)."""


def check_plan_agrees(plan: Plan, spec: ModelSpec) -> None:
    """The model facts plan.json states (model_type, num_layers, layer_class) must be its model_config's: an edit
    of one alone would re-predict and emit for a model that does not exist."""
    wrong = [f"{name} {stated!r} but the model's config gives {actual!r}" for name, stated, actual in
             (("model_type", plan.model_type, spec.model_type), ("num_layers", plan.num_layers, spec.num_layers),
              ("layer_class", plan.layer_class, spec.layer_class)) if stated != actual]
    if wrong:
        raise PlanContradiction(f"plan.json contradicts its model: it says {'; '.join(wrong)}; undo the edit or "
                                "re-plan with `toolkit plan`")
