"""Entry point: `python -m toolkit.train --plan PLAN --data DATA --output DIR ...` (under `accelerate launch`).

Pipeline and hybrid plans go to toolkit.pipeline (neither Accelerate nor the HF Trainer can run them); everything
else to the HF Trainer path. Bad input is one line from rank 0 and exit code 2 on every rank, with no traceback.
"""

from __future__ import annotations

import os
import sys

from toolkit.errors import EXIT_USER_ERROR, UserError


def main(argv: list[str] | None = None) -> int:
    import warnings

    # torch's collective-API renames warn on every ZeRO / FSDP step; nothing a user of this entry can act on.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    from toolkit.plan import load_plan
    from toolkit.train.args import parse_train_args

    try:
        args = parse_train_args(argv)
        plan = load_plan(args.plan)
        if plan.engine == "pipeline":
            from toolkit.pipeline.runner import train_pipeline

            if args.trainer_flags:
                raise UserError(f"--{next(iter(args.trainer_flags))}: TrainingArguments flags configure the HF "
                                "Trainer, which pipeline plans do not use (DeepSpeed's pipeline engine runs them)")

            return train_pipeline(plan, args) or 0
        from toolkit.train.hf_runner import train_hf

        return train_hf(plan, args)
    except UserError as exc:
        if _rank() == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            # `toolkit launch` reads it back: the multi-process launcher (torchrun) reports any failing worker
            # as its own exit code 1, which would hide that this was bad input.
            error_file = os.environ.get("TOOLKIT_ERROR_FILE")
            if error_file:
                with open(error_file, "w") as f:
                    f.write(f"{exc}\n")
        return EXIT_USER_ERROR


def _rank() -> int:
    """The global rank from the launcher's environment (set before any process group exists)."""
    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    from toolkit.train.cpu import exit_process

    exit_process(main())
