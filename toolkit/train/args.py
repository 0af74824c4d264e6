"""Command-line arguments of `python -m toolkit.train` (and `accelerate launch ... -m toolkit.train`).

The plan (plan.json) fixes everything about *how* a step runs: strategy, micro-batch, accumulation, precision,
sequence length, checkpointing, attention, optimizer. These arguments say *what* to train and for how long: model,
data, output, schedule, checkpoints. They never override the plan's strategy; to change it, re-plan.

Every other transformers.TrainingArguments flag is accepted too, in its own spelling (`--report_to wandb`,
`--warmup_ratio 0.03`, `--lr_scheduler_kwargs '{...}'`), parsed by transformers' own HfArgumentParser and handed to
the Trainer (TrainArgs.trainer_flags, only the flags given). Where such a flag sets a number the plan owns
(batch, accumulation, precision, optimizer, checkpointing, the engine configs), the plan's value wins with a warning.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from toolkit.errors import UserError
from toolkit.bounds import DEFAULT_SAVE_TOTAL_LIMIT


@dataclass
class TrainArgs:
    plan: str
    """plan.json, or the directory that holds it (next to the emitted accelerate / DeepSpeed configs)."""
    data: str
    """A local .txt / .json / .jsonl / .parquet / .csv file, a folder of them, or a hub dataset name (online)."""
    output: str
    """Run directory: checkpoint-N/ folders, then the final model + tokenizer in HF format."""
    model: str | None = None
    """Hub id, local model folder, or a config.json path; default: the model the plan was made for."""
    tokenizer: str | None = None
    """Hub id or local folder; default: the model's own tokenizer."""
    random_init: bool = False
    """Build the model from its config with random weights (pretraining / tests) instead of loading weights."""
    text_field: str = "text"
    """Column that holds the documents in json / jsonl / parquet / csv / hub data."""
    max_steps: int = -1
    """Optimizer steps to run; -1: run `epochs` epochs."""
    epochs: float = 1.0
    lr: float = 1e-4
    """Peak learning rate (after warmup)."""
    warmup_steps: int = 0
    weight_decay: float = 0.0
    """AdamW weight decay (biases and norm weights are exempt, as in the HF Trainer)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    lr_scheduler: str = "cosine"
    """Any HF scheduler name: linear, cosine, constant, constant_with_warmup, ..."""
    save_steps: int = 500
    """Write a resumable checkpoint every N optimizer steps."""
    save_total_limit: int | None = DEFAULT_SAVE_TOTAL_LIMIT
    """Keep only the newest N complete checkpoints (None: keep all); an older one goes only after a newer one is
    complete, so the last complete checkpoint is never deleted (toolkit.train.checkpoints.rotate)."""
    eval_steps: int | None = None
    """Evaluate (loss and perplexity) every N steps; default: at save_steps, and always at the end."""
    logging_steps: int = 10
    resume: bool = False
    """Continue from the newest complete checkpoint in `output` (same losses as an uninterrupted run)."""
    seed: int = 42
    eval_fraction: float = 0.02
    """Share of the packed blocks held out for evaluation when the data has no validation file; 0 disables it."""
    log_dir: str | None = None
    """TensorBoard event folder; default: OUTPUT/runs."""
    max_eval_blocks: int | None = None
    """Cap on evaluation blocks (keeps evaluation short on big held-out sets)."""
    no_save_final: bool = False
    """Skip writing the final HF model (rehearsals, benchmarks)."""
    compile: bool = False
    """torch.compile the model (TrainingArguments torch_compile) whatever the plan says."""
    lora: bool = False
    """Train LoRA adapters through PEFT (the plan's adapter settings, or LoRA defaults for a full plan)."""
    qlora: bool = False
    """Train LoRA adapters over a 4-bit base (bitsandbytes)."""
    lora_r: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_targets: str | None = None
    lora_modules_to_save: str | None = None
    merge_final: bool = False
    """LoRA: also write the base with the adapter merged in, in OUTPUT/merged (HF format)."""
    reward: list[str] | None = None
    """GRPO plans: the reward functions (toolkit.train.rewards SPECs: MODULE:FUNCTION, length, match=REGEX)."""
    trainer_flags: dict[str, Any] = field(default_factory=dict)
    """TrainingArguments flags given on the command line (name -> parsed value), e.g. {"report_to": "wandb"}."""


class _Parser(argparse.ArgumentParser):
    """argparse exits with a usage block; we raise the one-line UserError every toolkit command uses instead."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"toolkit.train: {message}")


def build_train_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m toolkit.train", allow_abbrev=False,  # `--eval_strategy` must not abbreviate `--eval-steps`
        description="Train a Hugging Face causal LM the way a toolkit plan says (run it under `accelerate launch "
                    "--config_file PLAN_DIR/accelerate_config.yaml`; see `toolkit launch`).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every transformers TrainingArguments flag is accepted as well, in its own spelling (e.g. "
               "--report_to wandb,\n--adam_beta2 0.95); the plan's batch, precision, optimizer and checkpointing win "
               "over a conflicting one.\nData: plain text (packed) or chat (a 'messages' column; loss on the "
               "assistant's tokens).\n\nexample:\n  accelerate launch --config_file plan/accelerate_config.yaml "
               "-m toolkit.train --plan plan \\\n      --data corpus/ --output runs/out --max-steps 1000 "
               "--report_to tensorboard")
    p.add_argument("--plan", required=True, help="plan.json or the directory holding it")
    p.add_argument("--data", required=True, help="local text/json/jsonl/parquet/csv file or folder, or a hub dataset")
    p.add_argument("--output", required=True, help="run directory (checkpoints, final model)")
    p.add_argument("--model", default=None, help="hub id, local folder or config.json (default: the plan's model)")
    p.add_argument("--tokenizer", default=None, help="default: the model's tokenizer")
    p.add_argument("--random-init", action="store_true", help="random weights from the model's config")
    p.add_argument("--text-field", default="text")
    p.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (default: run --epochs)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--lr-scheduler", default="cosine")
    p.add_argument("--save-steps", type=int, default=500)
    p.add_argument("--save-total-limit", type=int, default=DEFAULT_SAVE_TOTAL_LIMIT,
                   help="keep the newest N complete checkpoints (default %(default)s); the last complete one is "
                        "never deleted")
    p.add_argument("--eval-steps", type=int, default=None)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --output")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--eval-fraction", type=float, default=0.02)
    p.add_argument("--log-dir", default=None, help="TensorBoard folder (default: OUTPUT/runs)")
    p.add_argument("--max-eval-blocks", type=int, default=None)
    p.add_argument("--no-save-final", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (TrainingArguments torch_compile, inductor) even if the plan does not")
    g = p.add_argument_group("LoRA / QLoRA (default: the plan's method)")
    g.add_argument("--lora", action="store_true", help="train LoRA adapters through PEFT")
    g.add_argument("--qlora", action="store_true", help="train LoRA adapters over a 4-bit base")
    g.add_argument("--lora-r", type=int, default=None)
    g.add_argument("--lora-alpha", type=float, default=None)
    g.add_argument("--lora-dropout", type=float, default=None)
    g.add_argument("--lora-targets", default=None, help="all-linear or module names, e.g. q_proj,v_proj")
    g.add_argument("--lora-modules-to-save", default=None, help="e.g. lm_head")
    g.add_argument("--merge-final", action="store_true", help="also save the merged model in OUTPUT/merged")
    g = p.add_argument_group("GRPO plans")
    g.add_argument("--reward", action="append", default=None, metavar="SPEC",
                   help="a reward function, repeat for several: MODULE:FUNCTION, FILE.py:FUNCTION, or the built-in "
                        "length / match=REGEX")
    return p


def parse_train_args(argv: Sequence[str] | None = None) -> TrainArgs:
    """Parse argv into TrainArgs; bad values raise UserError (one line, exit 2) rather than argparse's exit."""
    import sys

    ns, rest = build_train_parser().parse_known_args(list(argv) if argv is not None else sys.argv[1:])
    values = {f.name: getattr(ns, f.name) for f in fields(TrainArgs) if f.name != "trainer_flags"}
    from toolkit.train.elastic import restart_count

    if restart_count() > 0:
        values["resume"] = True  # an elastic restart continues from the last complete checkpoint, never from 0
    args = TrainArgs(**values, trainer_flags=trainer_flags(rest, trainer_config_class(ns.plan) if rest else None))
    check_train_args(args)
    return args


def trainer_config_class(plan: str):
    """The arguments class the plan's trainer takes: TRL's GRPOConfig / DPOConfig for a GRPO / DPO plan (their own
    flags too: --temperature, --loss_type, --reward_weights), else TrainingArguments. A plan that cannot be read
    gets TrainingArguments here and its one-line error where it is loaded."""
    from transformers import TrainingArguments

    from toolkit.plan.schema import load_plan

    try:
        loaded = load_plan(plan)
    except UserError:
        return TrainingArguments
    if loaded.grpo:
        from trl import GRPOConfig

        return GRPOConfig
    if loaded.dpo:
        from trl import DPOConfig

        return DPOConfig
    return TrainingArguments


def trainer_flags(argv: list[str], config_class=None) -> dict[str, Any]:
    """The TrainingArguments (or `config_class`) flags in argv, parsed by transformers' HfArgumentParser; only those
    given."""
    if not argv:
        return {}
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser(config_class or TrainingArguments, allow_abbrev=False)  # `--learning` != --learning_rate
    for action in parser._actions:  # noqa: SLF001 - argparse has no public way to drop the defaults
        action.default = argparse.SUPPRESS
        action.required = False
    try:
        ns, unknown = parser.parse_known_args(argv)
    except SystemExit:  # argparse already printed why (a bad value for a known flag)
        raise UserError(f"toolkit.train: bad TrainingArguments value in {' '.join(argv)}") from None
    if unknown:
        raise UserError(f"toolkit.train: unrecognized arguments: {' '.join(unknown)} (neither a toolkit.train flag "
                        "nor a transformers TrainingArguments flag; see --help)")
    given = vars(ns)
    given.pop("output_dir", None)  # --output is ours
    return given


def check_train_args(args: TrainArgs) -> None:
    import math

    for flag in ("--epochs", "--lr", "--weight-decay", "--max-grad-norm", "--eval-fraction"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not math.isfinite(value):
            raise UserError(f"{flag} {value} is not a finite number; give a number such as "
                            f"{build_train_parser().get_default(flag[2:].replace('-', '_'))}")
    check_paths(args)
    known = lr_scheduler_names()
    if args.lr_scheduler not in known:
        raise UserError(f"--lr-scheduler '{args.lr_scheduler}' is not known; choose one of: {', '.join(known)}")
    if args.max_steps == 0 or args.max_steps < -1:
        raise UserError(f"--max-steps must be a positive number of steps (or -1 for --epochs), got {args.max_steps}")
    if args.max_steps == -1 and args.epochs <= 0:
        raise UserError(f"--epochs must be positive, got {args.epochs}")
    if not 0.0 <= args.eval_fraction < 1.0:
        raise UserError(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    for flag, value in (("--save-steps", args.save_steps), ("--logging-steps", args.logging_steps)):
        if value <= 0:
            raise UserError(f"{flag} must be a positive number of steps, got {value}")
    if args.eval_steps is not None and args.eval_steps <= 0:
        raise UserError(f"--eval-steps must be a positive number of steps, got {args.eval_steps}")
    if args.save_total_limit is not None and args.save_total_limit <= 0:
        raise UserError(f"--save-total-limit must be positive, got {args.save_total_limit}")
    if args.lr <= 0:
        raise UserError(f"--lr must be positive, got {args.lr}")
    if args.warmup_steps < 0 or args.weight_decay < 0 or args.max_grad_norm < 0:
        raise UserError("--warmup-steps, --weight-decay and --max-grad-norm must not be negative")


def lr_scheduler_names() -> list[str]:
    """The Trainer's own list of schedulers (transformers.trainer_utils.SchedulerType), kept in the on-disk cache
    (keyed by the transformers version): importing trainer_utils pulls in PEFT, bitsandbytes and inductor, seconds
    that launch's preflight would pay before every launch only to check one name."""
    from toolkit import cache

    stored = cache.get("lr_schedulers", [], code=lr_scheduler_names, decode=list)
    if stored:
        return stored
    from transformers.trainer_utils import SchedulerType

    known = [s.value for s in SchedulerType]
    cache.put("lr_schedulers", [], known, code=lr_scheduler_names)
    return known


def check_paths(args: TrainArgs) -> None:
    """Local paths the run reads or writes, checked before any process starts (inside the workers these fail as
    N tracebacks, or as nothing when the launcher kills the rank that would have reported)."""
    from pathlib import Path

    for flag, value in (("--output", args.output), ("--log-dir", args.log_dir)):
        if value is not None and not str(value).strip():
            raise UserError(f"{flag} is empty; give a folder")
        if value is not None:
            from toolkit.fileio import check_folder_path

            check_folder_path(Path(value), flag)
    for flag, value in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        if value is None:
            continue
        if not str(value).strip():
            raise UserError(f"{flag} is empty; give a hub id or a local folder")
        # A hub id is owner/name; anything that reads as a path must exist here.
        if value.startswith((".", "/", "~")) and not Path(value).expanduser().exists():
            raise UserError(f"{flag} {value} does not exist; give an existing local folder or a hub id")
    if not str(args.data).strip():
        raise UserError("--data is empty; give a local file or folder, or a hub dataset name")
