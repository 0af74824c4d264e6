"""`toolkit check`: the findings of toolkit.check for files and plan folders, printed one line each (or --json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from toolkit import bounds
from toolkit.bounds import int_arg, text_arg
from toolkit.errors import UserError
from toolkit.inputs.choices import CHECKPOINTING_MODES, CHECKPOINTING_OP, PRECISIONS, choices_words
from toolkit.inputs.job import OP_CHECKPOINTING_PROBLEM

if TYPE_CHECKING:
    from toolkit.check.findings import Problem


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="check accelerate YAML / DeepSpeed JSON / plan dirs")
    p.add_argument("files", nargs="+", type=text_arg("path"),
                   help="accelerate YAML, DeepSpeed JSON or plan folders; - reads one file from stdin")
    p.add_argument("--model", type=text_arg("--model"), help="also check the fit of this model")
    p.add_argument("--gpus", type=text_arg("--gpus"),
                   help="GPU spec, e.g. 8xH100-80GB (process counts; with --model, the fit)")
    p.add_argument("--seq", type=int_arg("--seq", bounds.SEQ),
                   help="sequence length for the fit check (plan dirs carry their own)")
    p.add_argument("--micro-batch", type=int_arg("--micro-batch", bounds.BATCH),
                   help="fit check: samples per GPU, where the files leave it to the runner")
    p.add_argument("--precision", help=f"fit check: {choices_words(PRECISIONS)}, where the files leave it open")
    p.add_argument("--checkpointing", choices=CHECKPOINTING_MODES, nargs="?", const="on",
                   help="fit check: activation checkpointing on (also the bare flag, as in estimate) or off; op "
                        "(per-op selective) is estimate's only")
    p.add_argument("--runner", choices=("trainer", "accelerate", "deepspeed"),
                   help="who reads a DeepSpeed JSON: its failures become errors (default: every runner that can)")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too (notes never fail)")
    p.add_argument("--json", action="store_true", help="findings as one JSON object on stdout")
    p.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    fit = None
    if args.model:
        from toolkit.check.fit import Pins, fit_findings

        if args.checkpointing == CHECKPOINTING_OP:
            raise UserError(OP_CHECKPOINTING_PROBLEM)
        ckpt = {None: None, "on": True, "off": False}[args.checkpointing]
        pins = Pins(micro_batch=args.micro_batch, precision=args.precision, checkpointing=ckpt)
        fit = lambda path: fit_findings(path, model=args.model, gpus=args.gpus, seq_len=args.seq,  # noqa: E731
                                        pins=pins)
    elif args.seq or args.micro_batch or args.precision or args.checkpointing:
        raise UserError("--seq / --micro-batch / --precision / --checkpointing pin the fit check; give --model and "
                        "--gpus too")
    from toolkit.commands.help import status

    with status("checking with accelerate's and DeepSpeed's own validation"):
        return main_check(args.files, gpus=args.gpus, runner=args.runner, fit=fit, strict=args.strict,
                          as_json=args.json)


def main_check(argv_paths: list[str], *, gpus: str | None = None, runner: str | None = None,
               fit: Callable[[str], list[Problem]] | None = None, strict: bool = False, as_json: bool = False,
               print_fn: Callable[[str], None] = print) -> int:
    """The CLI: errors and warnings on stderr, notes and the summary on stdout, one line each, like every other
    command (or, with --json, one JSON object on stdout); 0 / 1 as exit_code says.

    Unreadable input raises UserError (the CLI prints it on stderr and exits 2). fit: the fit check bound to
    --model/--gpus by the CLI (toolkit.check.fit.fit_findings), called once per path.
    """
    from dataclasses import asdict

    from toolkit.check.findings import exit_code
    from toolkit.check.folder import check_paths
    from toolkit.check.read import parse_gpus
    from toolkit.engines.readers import quiet_engines

    import tempfile
    from dataclasses import replace

    from toolkit.check.read import is_stream, stream_to_file

    from toolkit.check.folder import runner_problem

    if problem := runner_problem(argv_paths, runner):
        raise UserError(problem)
    grid = parse_gpus(gpus) if gpus else None
    problems: list[Problem] = []
    with quiet_engines(), tempfile.TemporaryDirectory(prefix="toolkit-check-") as tmp:
        # DeepSpeed logs its accelerator choice on stdout when first imported (quiet_engines)
        for number, name in enumerate(argv_paths):
            path = name
            if is_stream(name):  # stdin or <(...): read once into a file, findings named by what the user gave
                folder = Path(tmp) / str(number)
                folder.mkdir()
                path = str(stream_to_file(name, folder))
            try:
                found = check_paths([path], gpus=grid, runner=runner)
                if fit is not None:  # an error the folder rules already said (on plan.json) is said once
                    said = [p.message for p in found if p.severity == "error"]
                    found += [p for p in fit(path) if p.severity != "error" or not any(m in p.message for m in said)]
            except UserError as exc:
                raise UserError(str(exc).replace(path, name)) from None
            problems += [replace(p, file=p.file.replace(path, name)) for p in found] if path != name else found
    code = exit_code(problems, strict=strict)
    if as_json:
        print_fn(json.dumps({"exit_code": code, "strict": strict, "paths": argv_paths,
                             "findings": [asdict(p) for p in problems]}, indent=2))
        return code
    for problem in problems:
        if problem.severity in ("error", "warning") and print_fn is print:
            print(str(problem), file=sys.stderr)
        else:
            print_fn(str(problem))
    counts = {s: sum(p.severity == s for p in problems) for s in ("error", "warning", "note")}
    print_fn(f"{len(argv_paths)} path(s) checked: " + (", ".join(f"{n} {s}(s)" for s, n in counts.items() if n)
                                                         or "no findings"))
    return code
