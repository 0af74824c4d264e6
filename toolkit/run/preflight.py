"""The checks made before any training process starts and before any file is written, the run log and lock
included (`toolkit launch`, `launch --dry-run`, the rehearsal): the training arguments, the output folder, the
model's config against the plan, the job rules, the engine's config file, the model folder (a config, a tokenizer
and weights where the run loads weights: a config-only folder is a plan, not a model), the tokenizer against the
config's vocabulary, the adapter (every named module present, the rank within the adapted matrices), the data
(toolkit.run.data_check) and a user's own script. Each refusal is one line (UserError)."""

from __future__ import annotations

import json
from pathlib import Path

from typing import Any

from toolkit.errors import UserError
from toolkit.plan.schema import Plan
from toolkit.inputs.strategy import Engine

from toolkit.run.launcher import LOCK_NAME
from toolkit.plan.files import DS_CONFIG, PLAN_JSON


def preflight(plan: Plan, plan_dir: Path, train_argv: list[str], *, here: bool = True) -> None:
    """The checks that need no process group, made before any process starts: arguments, data path, the model's
    config against the plan (type, layers, width, sequence length) and the engine's config file. here False (a
    rehearsal checking the real run's arguments): the run is not on this machine, so what this machine lacks (a GPU
    for vLLM) is not held against it."""
    from toolkit.inputs.hardware import gpu_catalog
    from toolkit.train.model import check_matches_plan, load_config, model_source

    args = _check_train_argv(plan_dir, train_argv)
    _check_output(Path(args.output), args.resume)
    if plan.gpu in gpu_catalog():  # the job rules estimate and plan apply (plans made for catalog GPUs)
        from toolkit.plan.job import plan_job

        plan_job(plan)
    source = model_source(plan, args.model, random_init=args.random_init)
    check_matches_plan(load_config(source, random_init=args.random_init), plan, source)
    check_run(plan, args, here=here)  # model folder, tokenizer, adapter, data: before any process or file
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
    from toolkit.fileio import read_bytes_limited

    try:
        data = json.loads(read_bytes_limited(Path(path), "DeepSpeed config").decode("utf-8"))
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
    return args


# ----------------------------------------------------------------------------------------------------------------
# The model folder


def model_folder_problems(folder: Path, *, need_weights: bool, need_tokenizer: bool) -> list[str]:
    """What a local model folder lacks for training: "no tokenizer files", "no weights"."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    problems = []
    if need_tokenizer and not tokenizer_files(folder):
        problems.append("no tokenizer (tokenizer.json, tokenizer_config.json or the vocabulary files)")
    if need_weights and not any((folder / name).is_file() for name in
                                (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)):
        problems.append(f"no weights ({SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME} or their sharded index)")
    return problems


def tokenizer_files(folder: Path) -> list[str]:
    """The tokenizer files a folder holds: the fast tokenizer's tokenizer.json, tokenizer_config.json, or the
    vocabulary files the config's tokenizer classes name (transformers' TOKENIZER_MAPPING, vocab_files_names)."""
    names = {"tokenizer.json", "tokenizer_config.json"}
    try:
        from transformers import AutoConfig
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

        classes = TOKENIZER_MAPPING[type(AutoConfig.from_pretrained(str(folder)))]
        for cls in classes if isinstance(classes, tuple) else (classes,):
            names.update(getattr(cls, "vocab_files_names", {}).values() if cls is not None else ())
    except Exception:  # an unknown model type: the two generic files decide
        pass
    return sorted(name for name in names if (folder / name).is_file())


def check_model_for_training(source: str, *, tokenizer: str | None, random_init: bool) -> None:
    """Refuse a local model folder that cannot train: no tokenizer (unless --tokenizer gives one), no weights
    (unless --random-init). Hub ids and catalog names are not looked at here (no network in a preflight)."""
    path = Path(source).expanduser()
    if not path.is_dir():
        return
    problems = model_folder_problems(path, need_weights=not random_init, need_tokenizer=tokenizer is None)
    if problems:
        fixes = []
        if any(p.startswith("no tokenizer") for p in problems):
            fixes.append("pass --tokenizer with the model's own")
        if any(p.startswith("no weights") for p in problems):
            fixes.append("add the weights (or pass --random-init to train from random weights)")
        raise UserError(f"model folder {path} cannot train: it holds {' and '.join(problems)}; "
                        f"{'; '.join(fixes)}")


def check_model_to_plan(model: str) -> None:
    """`plan --out` writes a folder meant to launch: a local model folder without a tokenizer or weights cannot
    (issue 19: a config-only folder failed 87 s into the ranks). Its config.json alone still plans."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return
    problems = model_folder_problems(path, need_weights=True, need_tokenizer=True)
    if problems:
        raise UserError(f"model folder {path} cannot train: it holds {' and '.join(problems)}; add the model's "
                        f"files, or plan {path / 'config.json'} (the config alone) and launch with --model or "
                        "--random-init")


def check_tokenizer(tokenizer: Any, config: Any, source: str) -> None:
    """The tokenizer must fit the model's embedding (an id past it crashes the first forward) and be the model's
    vocabulary, not a stand-in (under half the embedding rows: a tokenizer of another model, or one built from a
    config alone)."""
    from toolkit.train.model import check_vocab

    check_vocab(config, tokenizer, source)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and len(tokenizer) * 2 < vocab:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but model {source} embeds {vocab}: it is not "
                        "this model's tokenizer; pass --tokenizer with the model's own")


# ----------------------------------------------------------------------------------------------------------------
# The whole run


def check_script(path: str) -> None:
    """A user's training script: an existing regular file."""
    from toolkit.fileio import file_kind_problem

    script = Path(path).expanduser()
    problem = file_kind_problem(script)
    if problem is not None:
        raise UserError(f"training script {path} is {problem}, not a Python file; give the script itself")
    if not script.is_file():
        raise UserError(f"training script {path} does not exist")


def check_run(plan: Any, args: Any, *, here: bool = True) -> None:
    """Model folder, tokenizer, adapter and data of a toolkit.train run of `plan`, before any process starts."""
    from toolkit.train.adapters import adapter_for_run
    from toolkit.run.data_check import check_data
    from toolkit.train.model import load_config, load_tokenizer, model_source

    from toolkit.train.dpo import check_dpo_run

    check_dpo_run(plan, args)
    if plan.grpo:
        from toolkit.train.cpu import on_cpu
        from toolkit.train.grpo import check_grpo_run

        check_grpo_run(plan, args, on_cpu=on_cpu() if here else None)  # vLLM where it cannot run, the rewards
    elif args.reward:
        raise UserError("--reward applies to GRPO plans and this plan is not one: it would be ignored; drop it")
    source = model_source(plan, args.model, random_init=args.random_init)
    check_model_for_training(source, tokenizer=args.tokenizer, random_init=args.random_init)
    config = load_config(source, random_init=args.random_init)
    adapter = adapter_for_run(plan, args)
    if adapter is not None:
        from toolkit.inputs.lora import check_adapter_on_model

        check_adapter_on_model(config, adapter)
    tokenizer_source = args.tokenizer or (source if not Path(source).is_file() else str(Path(source).parent))
    local = Path(tokenizer_source).expanduser()
    if not local.exists():
        return  # a hub id: the ranks load it (a preflight does not reach for the network)
    if local.is_dir() and not tokenizer_files(local):
        raise UserError(f"tokenizer folder {local} holds no tokenizer (tokenizer.json, tokenizer_config.json or the "
                        "vocabulary files); pass --tokenizer with the model's own")
    tokenizer = load_tokenizer(tokenizer_source)
    check_tokenizer(tokenizer, config, source)
    check_data(args.data, text_field=args.text_field, tokenizer=tokenizer, seq_len=plan.seq_len,
               global_batch=plan.global_batch, preference=bool(plan.dpo), grpo=plan.grpo_spec)


# ----------------------------------------------------------------------------------------------------------------
# Multi-node input: the node count, the hostfile, the SLURM allocation (checked before any process or file; no
# connection is attempted, a host name is only resolved)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_node_count(plan: Plan, nodes: int) -> None:
    """`--nodes N` must split the plan's world into equal nodes."""
    if plan.world_size % nodes:
        works = ", ".join(str(d) for d in _divisors(plan.world_size))
        raise UserError(f"--nodes {nodes} does not divide the plan's {plan.world_size} GPUs into equal nodes; "
                        f"give a node count that does: {works}")


def check_hostfile(plan: Plan, path: Path) -> None:
    """The hostfile as DeepSpeed's launcher reads it, per host (toolkit.engines.hostfile: every host > 0 slots, the
    same on every host, adding up to the plan's GPUs; a line it refuses named by number), and every host must
    resolve (getaddrinfo only: no connection). The placeholders `toolkit emit` writes without --hosts (node0,
    node1, ...) are not resolved."""
    import socket

    from toolkit.emit.scripts import default_hosts
    from toolkit.engines.hostfile import hostfile_problems, read_hostfile

    hosts = read_hostfile(path)
    problems = hostfile_problems(hosts, str(path), world=plan.world_size, nodes=plan.num_machines,
                                 gpus_per_node=plan.gpus_per_node)
    if problems:
        raise UserError(problems[0])
    if [h.name for h in hosts] == default_hosts(plan):
        return
    for host in hosts:
        try:
            socket.getaddrinfo(host.name, None)
        except (OSError, UnicodeError):
            raise UserError(f"host {host.name} in hostfile {path} cannot be resolved; fix its name (or re-emit with "
                            "`toolkit emit --hosts`)") from None


def _slurm_int(value: str | None) -> int | None:
    """A SLURM count: "4", or "a100:4" / "4(x2)" in the GPU variables."""
    import re

    if not value:
        return None
    match = re.match(r"(?:[^:,(]*:)?(\d+)", value.strip())
    return int(match.group(1)) if match else None


def check_slurm_allocation(plan: Plan, environ: dict[str, str]) -> None:
    """Inside a SLURM allocation, refuse one smaller than the plan (nodes, GPUs per node, tasks); outside one
    (no SLURM variables) there is nothing to compare."""
    nodes = _slurm_int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES"))
    gpus = _slurm_int(environ.get("SLURM_GPUS_ON_NODE") or environ.get("SLURM_GPUS_PER_NODE"))
    tasks = _slurm_int(environ.get("SLURM_NTASKS"))
    have = []
    if nodes is not None and nodes < plan.num_machines:
        have.append(f"{nodes} node(s)")
    if gpus is not None and gpus < plan.gpus_per_node:
        have.append(f"{gpus} GPU(s) per node")
    if tasks is not None and nodes is not None and tasks < min(nodes, plan.num_machines):
        have.append(f"{tasks} task(s)")
    if have:
        raise UserError(f"the SLURM allocation has {' and '.join(have)} but the plan needs {plan.num_machines} "
                        f"node(s) x {plan.gpus_per_node} GPUs; allocate --nodes={plan.num_machines} "
                        f"--gpus-per-node={plan.gpus_per_node} (sbatch slurm.sbatch does)")


def check_multi_node(plan: Plan, plan_dir: Path, environ: dict[str, str] | None = None) -> None:
    """`toolkit launch` of a real run (not a rehearsal): the SLURM allocation it runs in, and for a multi-node
    plan the hostfile beside it."""
    import os

    from toolkit.plan.files import HOSTFILE

    check_slurm_allocation(plan, dict(os.environ if environ is None else environ))
    hostfile = plan_dir / HOSTFILE
    if plan.num_machines > 1 and (hostfile.exists() or hostfile.is_symlink()):
        check_hostfile(plan, hostfile)
