"""Entry point: `python -m toolkit.train --plan PLAN --data DATA --output DIR ...` (under `accelerate launch`).

Pipeline and hybrid plans go to toolkit.train.pipeline (neither Accelerate nor the HF Trainer can run them); everything
else to the HF Trainer path. Bad input is one line from rank 0 and exit code 2 on every rank, with no traceback.
"""

from __future__ import annotations

import os
import signal
import sys

from toolkit.errors import EXIT_USER_ERROR, UserError
from toolkit.inputs.strategy import Engine


def main(argv: list[str] | None = None) -> int:
    import warnings

    # torch's collective-API renames warn on every ZeRO / FSDP step; nothing a user of this entry can act on.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    from toolkit.plan.schema import load_plan
    from toolkit.train.args import parse_train_args

    if "LOCAL_RANK" in os.environ:  # started by a launcher: never outlive it (it may be SIGKILLed)
        from toolkit.processes import die_with_parent

        die_with_parent(signal.SIGKILL)
        if os.getppid() == 1:  # the launcher died before the line above
            return 1
    try:
        args = parse_train_args(argv)
        plan = load_plan(args.plan)
        from toolkit.train.elastic import join_restarted_group

        join_restarted_group()
        if plan.engine == Engine.PIPELINE:
            from toolkit.train.pipeline.runner import train_pipeline

            if args.trainer_flags:
                raise UserError(f"--{next(iter(args.trainer_flags))}: TrainingArguments flags configure the HF "
                                "Trainer, which pipeline plans do not use (DeepSpeed's pipeline engine runs them)")

            return train_pipeline(plan, args) or 0
        from toolkit.train.hf_runner import train_hf

        return train_hf(plan, args)
    except UserError as exc:
        first = _report_failure(exc, user_error=True)
        if _rank() == 0 or first:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except Exception as exc:
        _report_failure(exc, user_error=False)
        raise  # a bug: its traceback goes to the run's log


def _report_failure(exc: Exception, *, user_error: bool) -> bool:
    """Tell `toolkit launch` why this rank failed, if it failed first (O_EXCL: the first rank to fail wins; later
    ranks usually fail only because the first one left the process group). torchrun reports any failing worker
    as its own exit code 1, which would hide that this was bad input. True when this rank's report was first."""
    import json

    error_file = os.environ.get("TOOLKIT_ERROR_FILE")
    if not error_file:
        return False
    message = " ".join(str(exc).split()) or type(exc).__name__
    if not user_error:
        message = f"{type(exc).__name__}: {message}"
    try:
        fd = os.open(error_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"rank": _rank(), "user_error": user_error, "message": message[:2000]}, f)
    return True


def _rank() -> int:
    """The global rank from the launcher's environment (set before any process group exists)."""
    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    from toolkit.train.cpu import exit_process

    exit_process(main())
