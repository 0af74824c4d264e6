"""emit: a Plan as the files that run it, unchanged.

    emit_files(plan, out_dir) ->
        accelerate_config.yaml   always (accelerate launch --config_file)
        ds_config.json           ZeRO, pipeline and hybrid plans (see toolkit.emit.deepspeed for the "auto" policy)
        launch.sh                one-node plans: the accelerate launch line, executable
        slurm.sbatch, hostfile   multi-node plans
        plan.json                the plan itself (toolkit.train reads it)
        PLAN.md                  the plan explained: strategy, batch arithmetic, memory, speed, candidates chart

plan.json is the only input. The folder is written whole or not at all (toolkit.fileio.write_folder: staged
beside it, swapped in with one rename, under a lock that refuses a concurrent writer), and nothing is written when
any target exists (unless force).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit.emit.accelerate import accelerate_yaml, ds_config_reference
from toolkit.emit.deepspeed import ds_config
from toolkit.emit.explain import plan_md
from toolkit.emit.launch import default_hosts, hostfile, launch_sh, slurm_sbatch
from toolkit.errors import UserError
from toolkit.fileio import write_folder
from toolkit.plan import Plan

EXECUTABLE = 0o755
READABLE = 0o644  # write_atomic's temporary file is 0o600; configs are shared with the team


def render_files(plan: Plan, out_dir: str | Path, *, candidates: list[dict[str, Any]] | None = None,
                 nvme_path: str | None = None, hosts: list[str] | None = None,
                 relative_paths: bool = False) -> dict[str, tuple[str, int]]:
    """File name -> (text, mode) for a plan; pure apart from resolving out_dir for the YAML's JSON path."""
    files: dict[str, tuple[str, int]] = {}
    ref = None
    if plan.engine in ("deepspeed", "pipeline"):
        files["ds_config.json"] = (json.dumps(ds_config(plan, nvme_path=nvme_path), indent=2) + "\n", READABLE)
        if plan.engine == "deepspeed":
            ref = ds_config_reference(Path(out_dir), relative_paths)
    hosts = hosts or default_hosts(plan)
    if len(hosts) != plan.num_machines:
        raise UserError(f"{len(hosts)} host(s) given for a plan of {plan.num_machines} nodes; give one per node")
    files["accelerate_config.yaml"] = (accelerate_yaml(plan, ds_config_ref=ref, main_host=hosts[0]), READABLE)
    if plan.num_machines == 1:
        files["launch.sh"] = (launch_sh(plan), EXECUTABLE)
    else:
        files["slurm.sbatch"] = (slurm_sbatch(plan), EXECUTABLE)
        files["hostfile"] = (hostfile(plan, hosts), READABLE)
    files["plan.json"] = (plan.to_json(), READABLE)
    files["PLAN.md"] = (plan_md(plan, candidates, nvme_path=nvme_path), READABLE)
    return files


def emit_files(plan: Plan, out_dir: str | Path, *, force: bool = False,
               candidates: list[dict[str, Any]] | None = None, nvme_path: str | None = None,
               hosts: list[str] | None = None, relative_paths: bool = False) -> list[Path]:
    """Write the plan's files into out_dir; returns their paths in writing order.

    nvme_path: directory on a local NVMe drive, required when the plan offloads to NVMe (UserError otherwise).
    hosts: node host names for the hostfile and the YAML's main_process_ip (default node0, node1, ...; slurm.sbatch
    reads the real first host from the allocation).
    relative_paths: the YAML names ds_config.json by file name instead of absolute path (presets; launch.sh
    passes the full path anyway).
    """
    out_dir = Path(out_dir)
    files = render_files(plan, out_dir, candidates=candidates, nvme_path=nvme_path, hosts=hosts,
                         relative_paths=relative_paths)
    try:
        write_folder(out_dir, files, force=force)
    except OSError as exc:
        raise UserError(f"cannot write {out_dir}: {exc.strerror or exc}; choose another folder") from None
    return [out_dir / name for name in files]
