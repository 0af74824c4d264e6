"""`toolkit emit`: a plan's files written again from its plan.json (after an edit, or into another folder)."""

from __future__ import annotations


from toolkit.bounds import text_arg
from toolkit.errors import UserError
from toolkit.commands.common import add_output_flags, print_note


def add_parser(sub) -> None:
    p = sub.add_parser("emit", help="write a plan's config files from its plan.json")
    p.add_argument("plan", type=text_arg("plan"), help="plan.json or the directory holding it")
    add_output_flags(p, "directory (default: the plan's own; rewriting needs --force)")
    p.set_defaults(func=cmd_emit)


def cmd_emit(args) -> int:
    """Write a plan's files from its plan.json (after editing it, or into another directory)."""
    from pathlib import Path

    from toolkit.emit import emit_files
    from toolkit.plan.schema import load_plan

    plan = load_plan(args.plan)
    out = Path(args.out) if args.out else (Path(args.plan) if Path(args.plan).is_dir() else Path(args.plan).parent)
    hosts = args.hosts
    from toolkit.estimate.search import predict_plan
    from toolkit.plan.job import PlanContradiction, plan_job

    try:  # the model, GPU and job the plan describes (a plan for a GPU outside the catalog is emitted as is)
        spec, hw, job = plan_job(plan, check=False)
    except PlanContradiction:
        raise
    except UserError as exc:
        spec = None
        if plan.prediction_is_stale:
            print_note(f"plan.json was edited after its prediction and it could not be re-predicted ({exc}); PLAN.md "
                  "says the prediction is stale")
    if spec is not None:
        plan_job(plan)  # estimate's job rules, and the plan's grid against its model (an edited degree)
        if plan.prediction_is_stale:
            plan = predict_plan(plan)
            print_note("plan.json was edited after its prediction: memory and step time re-predicted for the new values")
    written = emit_files(plan, out, force=args.force, nvme_path=args.nvme_path, hosts=hosts)
    print(f"wrote {len(written)} files to {out}: " + ", ".join(p.name for p in written))
    return 0
