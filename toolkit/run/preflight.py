"""The checks made before any training process starts (`toolkit launch`, the rehearsal): the training
arguments, the data path, the output folder, the model's config against the plan, the job rules and the engine's
config file. Each refusal is one line (UserError)."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.errors import UserError
from toolkit.plan.schema import Plan
from toolkit.inputs.strategy import Engine

from toolkit.run.launcher import LOCK_NAME
from toolkit.plan.files import DS_CONFIG, PLAN_JSON


def preflight(plan: Plan, plan_dir: Path, train_argv: list[str]) -> None:
    """The checks that need no process group, made before any process starts: arguments, data path, the model's
    config against the plan (type, layers, width, sequence length) and the engine's config file."""
    from toolkit.inputs.hardware import gpu_catalog
    from toolkit.train.model import check_matches_plan, load_config, model_source

    args = _check_train_argv(plan_dir, train_argv)
    _check_output(Path(args.output), args.resume)
    if plan.gpu in gpu_catalog():  # the job rules estimate and plan apply (plans made for catalog GPUs)
        from toolkit.plan.job import plan_job

        plan_job(plan)
    source = model_source(plan, args.model, random_init=args.random_init)
    check_matches_plan(load_config(source, random_init=args.random_init), plan, source)
    if plan.engine in (Engine.DEEPSPEED, Engine.PIPELINE) and not (plan_dir / DS_CONFIG).is_file():
        raise UserError(f"{plan_dir / DS_CONFIG} is missing; emit the plan's files with `toolkit emit`")
    if plan.engine in (Engine.DEEPSPEED, Engine.PIPELINE):
        from toolkit.engines.validate import validate_ds_config_for_plan

        ds_file = plan_dir / DS_CONFIG
        try:  # DeepSpeed's and the Trainer's own validation, at the plan's world size, before any process starts
            validate_ds_config_for_plan(read_ds_config(ds_file), plan)
        except UserError:
            raise
        except Exception as exc:  # any reason the engine refuses the file, in whatever class it raises
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"DeepSpeed refuses {ds_file}: {first[:300]}; fix it or re-emit it with "
                            "`toolkit emit`") from None
    if plan.engine == Engine.DEEPSPEED:
        from toolkit.train.hf_runner import check_ds_config_agrees

        check_ds_config_agrees(plan, args, plan_dir / DS_CONFIG)
    return args


def read_ds_config(path: Path) -> dict:
    """ds_config.json as a dict, or one line saying why it cannot be (truncated, binary, not an object)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix it or re-emit it with "
                        "`toolkit emit`") from None
    except (OSError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"cannot read {path} ({type(exc).__name__}); fix it or re-emit it with `toolkit emit`") \
            from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a JSON object; re-emit it with `toolkit emit`")
    return data


def _check_output(output: Path, resume: bool) -> None:
    """The run's own refusals that need no process: a live run holding the folder, or checkpoints of an earlier
    run without --resume (toolkit.train refuses that too, but only after every rank loaded the model)."""
    from toolkit.train.checkpoints import checkpoint_dirs

    if checkpoint_dirs(output) and not resume:
        raise UserError(f"output {output} already holds checkpoints; pass --resume to continue that run, "
                        "or choose another --output")
    lock = output / LOCK_NAME
    if lock.is_file():  # a held lock refuses here, before any process starts; run() takes it for real
        from toolkit.fileio import FolderLock

        FolderLock(lock, f"output {output}").acquire().release()


def _check_train_argv(plan_dir: Path, train_argv: list[str]):
    """Catch a typo in the training arguments here rather than in N processes after the model loaded."""
    from toolkit.train.args import parse_train_args

    if "--plan" in train_argv:
        raise UserError("pass the plan as `toolkit launch PLAN_DIR`, not --plan in the training arguments")
    args = parse_train_args(["--plan", str(plan_dir / PLAN_JSON), *train_argv])
    data = Path(args.data).expanduser()
    if (args.data.startswith((".", "/", "~")) or data.suffix) and not data.exists():
        raise UserError(f"data {args.data} does not exist")
    _check_text_data(data)
    return args


def _check_text_data(data: Path) -> None:
    """Local text-format data (toolkit.train.data.LOADERS: text / json / csv) must be UTF-8; a binary file fails
    inside every worker, as a decoding traceback, after the model has loaded. Reads the first 64 KiB of each."""
    from toolkit.train.data import LOADERS

    files = sorted(data.iterdir()) if data.is_dir() else [data] if data.is_file() else []
    for path in files:
        if not path.is_file() or LOADERS.get(path.suffix.lower()) not in ("text", "json", "csv"):
            continue
        with open(path, "rb") as f:
            head = f.read(65536)
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.start < len(head) - 4:  # not merely a character cut at the 64 KiB boundary
                raise UserError(f"data file {path} is not UTF-8 text (byte {exc.start}); convert it or give a "
                                "text / json / jsonl / csv / parquet file") from None
        if LOADERS.get(path.suffix.lower()) == "json":
            _check_json_records(path)


def _check_json_records(path: Path) -> None:
    """A JSON / JSON Lines data file must parse (datasets' json loader takes a JSON document or one object per
    line); a bad line otherwise fails inside every worker after the model has loaded. Streams the file once."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            first = f.read(1)
            if path.suffix.lower() == ".json" and first in ("[", "{"):
                try:
                    json.loads(first + f.read())
                    return
                except json.JSONDecodeError:
                    f.seek(0)  # not one document: maybe JSON Lines in a .json file
            else:
                f.seek(0)
            for number, line in enumerate(f, 1):
                if line.strip():
                    json.loads(line)
    except json.JSONDecodeError as exc:
        where = f"line {number}" if "number" in locals() else f"line {exc.lineno}"
        raise UserError(f"data file {path} is not valid JSON Lines ({where}: {exc.msg}); fix that line or give "
                        "a text / csv / parquet file") from None
    except UnicodeDecodeError:
        raise UserError(f"data file {path} is not UTF-8 text; convert it or give a text / json / jsonl / csv / "
                        "parquet file") from None
