"""emit: a Plan as the files that run it, unchanged.

    emit_files(plan, out_dir) ->
        accelerate_config.yaml     always (accelerate launch --config_file; a DeepSpeed plan's YAML carries its JSON)
        ds_config.json             ZeRO, pipeline and hybrid plans (see toolkit.emit.deepspeed for the "auto" policy)
        ds_config.deepspeed.json   ZeRO plans: every value concrete (DeepSpeed's launcher, deepspeed.initialize)
        training_args.json         the settings a user's own script needs (toolkit.emit.user_settings)
        launch.sh                  one-node plans: the accelerate launch line, executable
        slurm.sbatch, deepspeed.sh, hostfile   multi-node plans (toolkit.emit.scripts)
        plan.json                  the plan itself (toolkit.train reads it)
        PLAN.md                    the plan explained: strategy, batch arithmetic, memory, speed, candidates chart

plan.json is the only input. Nothing is written when a value would make an unsafe or wrong file
(toolkit.emit.safety) or when any target exists (unless force). The folder is written whole or not at all
(toolkit.fileio.write_folder: staged beside it, swapped in with one rename, under a lock that refuses a concurrent
writer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit.emit.accelerate import accelerate_yaml
from toolkit.emit.deepspeed import ds_config
from toolkit.emit.explain import plan_md
from toolkit.emit.scripts import default_hosts, deepspeed_sh, hostfile, launch_sh, slurm_sbatch
from toolkit.emit.safety import check_hosts, check_path_text, check_plan_for_emit
from toolkit.emit.user_settings import settings_json
from toolkit.errors import UserError
from toolkit.fileio import write_folder
from toolkit.plan.schema import Plan
from toolkit.inputs.strategy import Engine
from toolkit.plan.files import (ACCELERATE_CONFIG, DEEPSPEED_SH, DS_CONFIG, DS_CONFIG_CONCRETE, HOSTFILE, LAUNCH_SH,
                                PLAN_JSON, PLAN_MD, SLURM_SBATCH, TRAINING_ARGS)

EXECUTABLE = 0o755
READABLE = 0o644  # write_atomic's temporary file is 0o600; configs are shared with the team


def render_files(plan: Plan, *, candidates: list[dict[str, Any]] | None = None, nvme_path: str | None = None,
                 hosts: list[str] | None = None) -> dict[str, tuple[str, int]]:
    """File name -> (text, mode) for a plan; pure (no file names another by path, so the folder can move)."""
    from toolkit.inputs.resolve import loadable_model

    check_plan_for_emit(plan)
    check_path_text("--nvme-path", nvme_path)
    hosts = hosts or default_hosts(plan)
    check_hosts(hosts)
    if len(hosts) != plan.num_machines:
        raise UserError(f"{len(hosts)} host(s) given for a plan of {plan.num_machines} nodes; give one per node")
    files: dict[str, tuple[str, int]] = {}
    runner_config = None
    if plan.engine in (Engine.DEEPSPEED, Engine.PIPELINE):
        runner_config = ds_config(plan, nvme_path=nvme_path)
        files[DS_CONFIG] = (json.dumps(runner_config, indent=2) + "\n", READABLE)
    if plan.engine == Engine.DEEPSPEED:
        concrete = ds_config(plan, nvme_path=nvme_path, runner_fills=False)
        files[DS_CONFIG_CONCRETE] = (json.dumps(concrete, indent=2) + "\n", READABLE)
    yaml_ds = runner_config if plan.engine == Engine.DEEPSPEED else None
    files[ACCELERATE_CONFIG] = (accelerate_yaml(plan, ds_config=yaml_ds, main_host=hosts[0]), READABLE)
    model = loadable_model(plan.model)
    if plan.num_machines == 1:
        files[LAUNCH_SH] = (launch_sh(plan, model), EXECUTABLE)
    else:
        files[SLURM_SBATCH] = (slurm_sbatch(plan, model), EXECUTABLE)
        files[DEEPSPEED_SH] = (deepspeed_sh(plan, model), EXECUTABLE)
        files[HOSTFILE] = (hostfile(plan, hosts), READABLE)
    files[TRAINING_ARGS] = (settings_json(plan), READABLE)
    files[PLAN_JSON] = (plan.to_json(), READABLE)
    files[PLAN_MD] = (plan_md(plan, candidates, nvme_path=nvme_path), READABLE)
    return files


def emit_files(plan: Plan, out_dir: str | Path, *, force: bool = False,
               candidates: list[dict[str, Any]] | None = None, nvme_path: str | None = None,
               hosts: list[str] | None = None, extra: dict[str, str] | None = None,
               plan_md_tail: str = "") -> list[Path]:
    """Write the plan's files into out_dir; returns their paths in writing order.

    nvme_path: directory on a local NVMe drive, required when the plan offloads to NVMe (UserError otherwise).
    hosts: node host names for the hostfile and the YAML's main_process_ip (default node0, node1, ...; slurm.sbatch
    reads the real first host from the allocation).
    plan_md_tail: Markdown appended to PLAN.md (--seq max: the lever table).
    """
    out_dir = Path(out_dir)
    files = render_files(plan, candidates=candidates, nvme_path=nvme_path, hosts=hosts)
    files.update({name: (text, READABLE) for name, text in (extra or {}).items()})  # --seq max: the charts
    if plan_md_tail:
        text, mode = files[PLAN_MD]
        files[PLAN_MD] = (text.rstrip("\n") + "\n\n" + plan_md_tail.rstrip("\n") + "\n", mode)
    try:
        write_folder(out_dir, files, force=force)
    except OSError as exc:
        raise UserError(f"cannot write {out_dir}: {exc.strerror or exc}; choose another folder") from None
    return [out_dir / name for name in files]
