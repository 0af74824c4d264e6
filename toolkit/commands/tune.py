"""`toolkit tune PLAN_DIR`: the plan's top candidates measured on this machine and re-ranked (toolkit.run.tune)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from toolkit import bounds
from toolkit.bounds import float_arg, int_arg, text_arg
from toolkit.errors import UserError

ORDER_RULE = ("Order: the candidates whose predicted step time lies within the step-time band of the fastest "
              "predicted one are measured first (the prediction cannot tell them apart), the rest after them with "
              "the budget left over.")
"""The rule toolkit.run.tune.measure_order applies, as the help and PLAN.md's Tuned section state it."""


def add_parser(sub) -> None:
    from toolkit.commands.common import add_calibration_flags, add_run_size_flags
    from toolkit.commands.plan import add_search_flags

    p = sub.add_parser("tune", help="run the plan's top candidates for a few steps here and re-rank by measurement",
                       description="Run the plan's top candidates for a few steps here and re-rank them by measured "
                                   f"step time. {ORDER_RULE} {PLAN_FIRST}")
    p.add_argument("plan_dir", metavar="PLAN_DIR|MODEL",
                   help="a plan folder (toolkit plan --out) holding plan.json, or a model to plan first with the "
                        "flags toolkit plan takes (catalog name, local dir/config.json, or hub id)")
    p.add_argument("--candidates", type=int_arg("--candidates", bounds.TUNE_CANDIDATES), default=3,
                   help="how many of the planner's rows to run, those within the fastest prediction's step-time band "
                        "first (default %(default)s)")
    p.add_argument("--budget-min", type=float_arg("--budget-min", bounds.TUNE_BUDGET_MIN), default=30.0,
                   help="minutes for the whole probe: a candidate whose probe is predicted to end later (start-up "
                        "and step time measured on the earlier ones) is skipped (default %(default)s)")
    p.add_argument("--steps", type=int_arg("--steps", bounds.PROFILE_STEPS), default=3,
                   help="measured steps per candidate, after 2 warm-up steps (default %(default)s)")
    p.add_argument("--processes", type=int_arg("--processes", bounds.PROCESSES),
                   help="processes of this machine to run each candidate on (default: the plan's GPUs per node)")
    p.add_argument("--cpu", action="store_true", help="run on CPU processes over gloo")
    p.add_argument("--memory-limit-gib", type=float_arg("--memory-limit-gib", bounds.CPU_RAM_GIB),
                   help="stop a candidate whose peak per process passes this (default: on a GPU its predicted "
                        "peak plus its error band; on CPU none)")
    p.add_argument("--emit", type=text_arg("--emit"), metavar="DIR",
                   help="write the measured winner's plan folder to DIR, as `toolkit plan --out` writes a chosen row "
                        "(DIR must be missing or empty)")
    p.add_argument("--export-calibration", type=text_arg("--export-calibration"), metavar="FILE",
                   help="also write this machine's calibration after the probe to FILE (JSON), for `estimate` / "
                        "`plan --calibration FILE` elsewhere; the probe always stores it in the user's cache")
    tune_own = len(p._actions)  # noqa: SLF001 -- the planning flags follow: tune MODEL's, refused beside a folder
    add_search_flags(p, model_positional=False)
    add_run_size_flags(p)
    add_calibration_flags(p)
    # A dest's default is its first flag's (--compile and --compile-blocks share one), as the parsed namespace's.
    p.set_defaults(func=cmd_tune, search_flags=[(a.option_strings[0], a.dest, p.get_default(a.dest))
                                                for a in p._actions[tune_own:]])  # noqa: SLF001


PLAN_FIRST = ("Given a MODEL instead of a plan folder, tune plans first as `toolkit plan MODEL --out` would, into a "
              "new folder under the system's temporary directory that it keeps and names (tune.json and PLAN.md's "
              "Tuned section go there, as into a plan folder); --emit DIR still writes the measured winner's. The "
              "planning counts against --budget-min.")


def cmd_tune(args) -> int:
    from toolkit.plan.files import PLAN_JSON
    from toolkit.plan.schema import load_plan
    from toolkit.run.tune import probe, table, write_results

    plan_dir = Path(args.plan_dir)
    if plan_dir.name == PLAN_JSON:
        plan_dir = plan_dir.parent
    planning = not (plan_dir / PLAN_JSON).is_file()
    if planning and plan_dir.is_dir() and not (plan_dir / "config.json").is_file():
        raise UserError(f"{plan_dir} is no plan folder (no {PLAN_JSON} in it) and no model folder (no config.json); "
                        "give a folder `toolkit plan --out` wrote, or a model")
    if not planning and (given := _search_flags_given(args)):
        raise UserError(f"{' '.join(given)}: {plan_dir} is a plan folder, which carries its own model, GPUs and job; "
                        "drop them, or give a model instead of the folder to plan first")
    args.model = str(plan_dir) if planning else None
    searches = args.seq == "max" or "max" in (args.images_per_sample, str(args.image_size).strip().lower())
    if planning and (searches or _nodes(args) > 1):
        raise UserError("tune MODEL plans one job on one node: give --seq N (and images as N and WxH) and one node's "
                        "GPUs (max searches and --nodes are toolkit plan's)")
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            raise UserError("this machine has no CUDA device; add --cpu to tune on CPU processes over gloo")
    emit_dir = Path(args.emit) if args.emit else None
    if emit_dir is not None:
        _refuse_emit_dir(emit_dir)
    export = Path(args.export_calibration) if args.export_calibration else None
    if export is not None and (export.is_dir() or not export.parent.is_dir()):
        raise UserError(f"--export-calibration {export}: give a file path in an existing folder")
    planning_s = None
    if planning:  # the planning counts against --budget-min: the probe's clock starts before it
        import time

        began = time.monotonic()
        plan_dir = _plan_first(args)
        if plan_dir is None:
            return 1
        planning_s = time.monotonic() - began
    plan = load_plan(plan_dir / PLAN_JSON)
    if plan.num_machines > 1:
        raise UserError(f"tune runs on this machine; the plan spans {plan.num_machines} nodes: re-plan for one "
                        "node, or tune on its GPUs per node with --processes")
    processes = args.processes or plan.gpus_per_node
    result = probe(plan, plan_dir, count=args.candidates, budget_min=args.budget_min, steps=args.steps,
                   processes=processes, cpu=args.cpu, limit_gib=args.memory_limit_gib, emit_dir=emit_dir,
                   planning_s=planning_s)
    print()
    for line in table(result):
        print(line)
    written = write_results(result, plan_dir, ORDER_RULE)
    best = result["ranking"][0] if result["ranking"] else None
    print(f"fastest measured: {best}" if best else "no candidate was measured")
    print("wrote " + ", ".join(str(p) for p in written))
    code = _export(result, export)
    if emit_dir is None:
        return code
    if result["emitted"]:
        print(f"wrote the plan folder of {best} to {emit_dir}")
        return code
    why = "no candidate was measured" if best is None else "see the line above"
    print(f"--emit: {why}, so {emit_dir} was not written", file=sys.stderr)
    return 1


def _export(result: dict, export: Path | None) -> int:
    """--export-calibration FILE: the calibration the probe stored, written to FILE; 1 when there is none."""
    if export is None:
        return 0
    if not result["calibration"]:
        print(f"--export-calibration: no candidate was measured, so {export} was not written", file=sys.stderr)
        return 1
    from toolkit.inputs import calibration as cal

    cal.export(cal.from_dict(result["calibration"], "the probe's calibration"), export)
    print(f"wrote this machine's calibration to {export}")
    return 0


def _refuse_emit_dir(out: Path) -> None:
    """--emit DIR: a missing or empty folder, refused before any process starts (nothing is overwritten)."""
    from toolkit.fileio import check_folder_path

    check_folder_path(out, "--emit")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--emit {out} is not empty; give a missing or empty folder (tune never writes over a plan "
                        "folder)")


def _search_flags_given(args) -> list[str]:
    """The planning flags (toolkit plan's) given away from their defaults, by name."""
    return [flag for flag, dest, default in args.search_flags if getattr(args, dest) != default]


def _nodes(args) -> int:
    from toolkit.commands.common import hardware_of, model_spec

    model_spec(args)  # a config that is wrong is named first, as plan names it
    return hardware_of(args).nodes


def _plan_first(args) -> Path | None:
    """tune MODEL: `toolkit plan MODEL --out` into a new folder under the temporary directory (PLAN_FIRST); its
    folder, or None when no strategy fits (plan said why)."""
    import tempfile
    import uuid

    from toolkit.commands.plan import cmd_plan

    # A name, not a folder yet: plan writes it only once it has refused nothing (bad input leaves nothing behind).
    folder = Path(tempfile.gettempdir()) / f"toolkit-tune-{uuid.uuid4().hex[:8]}"
    plan_args = argparse.Namespace(**vars(args), out=str(folder), force=False, strategy_choice=None, top=10,
                                   explain=False, json=False, nvme_path=None, hosts=None)
    if cmd_plan(plan_args) != 0:
        return None
    print(f"planned into {folder}: tuning its candidates (tune.json and PLAN.md's Tuned section go there)")
    return folder
