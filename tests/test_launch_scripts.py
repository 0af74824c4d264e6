"""The launch scripts (per plan and launch/): bash -n clean, run under fake launchers that record their argv, and
safe with hostile plan values: `toolkit emit` refuses them (exit 2) or the scripts pass them as data, never run them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from toolkit.cli import main as cli
from toolkit.emit import emit_files
from toolkit.emit.scripts import generic_scripts
from toolkit.emit.presets import reference_plan

REPO = Path(__file__).resolve().parent.parent
FAKES = {
    # Every fake appends its name and argv (NUL-separated, one record per line) to $FAKE_LOG.
    "accelerate": "",
    "deepspeed": "",
    # srun drops its own options and runs the command once, as node 0 (one task per node, here one node).
    "srun": 'while [[ "${1:-}" == --* ]]; do shift; done\nSLURM_NODEID=0 "$@"\n',
    "scontrol": 'printf "gpu-a\\ngpu-b\\n"\n',
}


@pytest.fixture
def fake_bin(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, body in FAKES.items():
        path = folder / name
        path.write_text('#!/usr/bin/env bash\n{ printf "%s\\0" ' + name + ' "$@"; echo; } >> "$FAKE_LOG"\n' + body)
        path.chmod(0o755)
    return folder


def run_script(script: Path, args: list[str], fake_bin: Path, log: Path, cwd: Path,
               env: dict[str, str] | None = None, code: int = 0) -> list[list[str]]:
    """Run a script with the fakes first on PATH; returns the recorded calls (each: [name, *argv]). code: the exit
    code expected; a refusal (non-zero) says why in one line."""
    full_env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_LOG": str(log),
                "SLURM_JOB_NODELIST": "gpu-[a-b]", **(env or {})}
    proc = subprocess.run(["bash", str(script), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == code, proc.stderr
    if code:
        assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    if not log.exists():
        return []
    return [record.split("\0") for record in log.read_text().split("\0\n") if record]


def bash_n(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, f"{script.name}: {proc.stderr}"


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_launch_folder_is_rendered_from_the_templates_and_parses():
    for name, text in generic_scripts().items():
        path = REPO / "launch" / name
        assert path.read_text() == text, f"launch/{name} is stale: python -m toolkit.emit.scripts launch"
        assert os.access(path, os.X_OK)
        assert "# When:" in text
        bash_n(path)


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_generic_scripts_start_the_plan_under_fake_launchers(tmp_path, fake_bin):
    plan_dir = tmp_path / "plan with space"
    emit_files(reference_plan("zero2", nodes=2, gpus_per_node=4), plan_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    log = tmp_path / "log"

    calls = run_script(REPO / "launch" / "one_node.sh", [str(plan_dir), "my_train.py", "--lr", "1"],
                       fake_bin, log, elsewhere)
    assert calls == [["accelerate", "launch", "--config_file", f"{plan_dir}/accelerate_config.yaml",
                      "my_train.py", "--lr", "1"]]
    log.unlink()

    calls = run_script(REPO / "launch" / "slurm.sbatch", [str(plan_dir), "--data", "d", "--output", "o"],
                       fake_bin, log, elsewhere)
    assert [c[0] for c in calls] == ["scontrol", "srun", "accelerate"]
    accelerate = calls[-1]
    assert accelerate[1:4] == ["launch", "--machine_rank", "0"]
    assert accelerate[accelerate.index("--main_process_ip") + 1] == "gpu-a"
    assert accelerate[accelerate.index("-m") + 1:] == ["toolkit.train", "--plan", f"{plan_dir}/plan.json",
                                                       "--data", "d", "--output", "o"]
    log.unlink()

    calls = run_script(REPO / "launch" / "deepspeed.sh", [str(plan_dir), "--data", "d"], fake_bin, log, elsewhere)
    assert calls == [["deepspeed", "--hostfile", f"{plan_dir}/hostfile", "--master_port", "29500", "--no_local_rank",
                      "--module", "toolkit.train", "--plan", f"{plan_dir}/plan.json", "--data", "d"]]


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_catalog_plan_launch_sh_passes_the_hub_id(tmp_path, fake_bin):
    plan = reference_plan("zero2", nodes=1, gpus_per_node=4, model="mistral-7b")
    emit_files(plan, tmp_path / "p")
    bash_n(tmp_path / "p" / "launch.sh")
    calls = run_script(tmp_path / "p" / "launch.sh", ["--data", "d", "--output", "o"], fake_bin, tmp_path / "log",
                       tmp_path)
    argv = calls[0]
    assert argv[argv.index("--model") + 1] == "mistralai/Mistral-7B-v0.1"
    assert argv[argv.index("--plan") + 1] == f"{tmp_path}/p/plan.json"


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_multi_node_plan_scripts_run_under_fakes(tmp_path, fake_bin):
    plan_dir = tmp_path / "p"
    emit_files(reference_plan("hybrid", nodes=2, gpus_per_node=4, stages=2), plan_dir, hosts=["gpu-a", "gpu-b"])
    for name in ("slurm.sbatch", "deepspeed.sh"):
        bash_n(plan_dir / name)
    sbatch = (plan_dir / "slurm.sbatch").read_text().splitlines()
    first_command = next(i for i, line in enumerate(sbatch) if line and not line.startswith("#"))
    assert all(not line.startswith("#SBATCH") for line in sbatch[first_command:])  # sbatch stops reading there
    calls = run_script(plan_dir / "slurm.sbatch", [], fake_bin, tmp_path / "log", tmp_path,
                       env={"SLURM_SUBMIT_DIR": str(plan_dir)})
    assert calls[-1][:4] == ["accelerate", "launch", "--machine_rank", "0"]


# --- hostile plan values ------------------------------------------------------------------------------------------

MARKER = "PWNED"
HOSTILE = [
    f"$(touch {MARKER})", f"`touch {MARKER}`", f"x'; touch {MARKER}; '", f'x"; touch {MARKER}; "',
    f"a b; touch {MARKER}", f"x\ntouch {MARKER}", f"x\r\n#SBATCH --wrap='touch {MARKER}'",
]


def _string_fields(plan_json: dict) -> list[tuple[str, ...]]:
    fields = [(key,) for key, value in plan_json.items() if isinstance(value, str)]
    fields += [("notes", "0"), ("model_config", "model_type")]
    return fields


def _plant(data: dict, where: tuple[str, ...], value: str) -> dict:
    data = json.loads(json.dumps(data))
    target = data
    for key in where[:-1]:
        target = target[key]
    if isinstance(target, list):
        target[int(where[-1])] = value
    else:
        target[where[-1]] = value
    return data


@pytest.mark.multiprocess
@pytest.mark.one_core
@pytest.mark.parametrize("strategy,nodes", [("zero2", 1), ("zero3", 2)])
def test_hostile_plan_values_are_refused_or_stay_data(tmp_path, fake_bin, capsys, strategy, nodes):
    base = json.loads(reference_plan(strategy, nodes=nodes, gpus_per_node=2, notes=["n"]).to_json())
    accepted = refused = 0
    accepted_fields = set()
    for where in _string_fields(base):
        for i, value in enumerate(HOSTILE):
            case = tmp_path / f"{'.'.join(where)}-{i}"
            case.mkdir()
            (case / "plan.json").write_text(json.dumps(_plant(base, where, value)))
            code = cli(["emit", str(case / "plan.json"), "--out", str(case / "out")])
            err = capsys.readouterr().err
            assert code in (0, 2), (where, value, code, err)
            if code == 2:
                refused += 1
                assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
                assert not (case / "out").exists() or not any((case / "out").iterdir())
                continue
            accepted += 1
            accepted_fields.add(where)
            scripts = [p for p in (case / "out").iterdir() if p.suffix in (".sh", ".sbatch")]
            assert scripts
            for script in scripts:
                bash_n(script)
                log = case / f"{script.name}.log"
                if script.name == "deepspeed.sh" and where == ("model",):
                    # DeepSpeed's pdsh route hands each word to a remote shell: the script refuses shell characters
                    # before it starts anything (tests/test_two_nodes.py runs the real launcher).
                    assert not run_script(script, ["--data", "d"], fake_bin, log, case, code=2)
                    continue
                calls = run_script(script, ["--data", "d"], fake_bin, log, case,
                                   env={"SLURM_SUBMIT_DIR": str(case / "out")})
                assert calls and calls[-1][0] in ("accelerate", "deepspeed")
                if where == ("model",):  # the model reaches the launcher as one argument, unchanged
                    assert calls[-1][calls[-1].index("--model") + 1] == value
            assert not list(tmp_path.rglob(MARKER)), (where, value)
    assert not list(tmp_path.rglob(MARKER)) and not (Path.cwd() / MARKER).exists()
    # Both routes were exercised; the model (a free-form name or path) always reaches the scripts as data.
    assert ("model",) in accepted_fields and accepted >= 5 and refused > 10


def test_hostile_host_names_are_refused(tmp_path, capsys):
    (tmp_path / "plan.json").write_text(reference_plan("zero3", nodes=2, gpus_per_node=2).to_json())
    code = cli(["emit", str(tmp_path / "plan.json"), "--out", str(tmp_path / "o"), "--hosts", f"a;touch {MARKER},b"])
    assert code == 2 and "host name" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_toolkit_launch_runs_a_users_script_with_the_plan(tmp_path, capsys):
    import shlex

    from toolkit.errors import UserError
    from toolkit.commands.launch import launch_main

    plan_dir = tmp_path / "p"
    emit_files(reference_plan("zero3", nodes=1, gpus_per_node=2), plan_dir)
    script = tmp_path / "my_train.py"
    script.write_text("print('hi')\n")
    assert launch_main(plan_dir, [str(script), "--lr", "1"], dry_run=True) == 0
    words = shlex.split(capsys.readouterr().out.strip().splitlines()[-1][2:])
    assert words[:4] == ["accelerate", "launch", "--config_file", str(plan_dir / "accelerate_config.yaml")]
    assert words[-3:] == [str(script), "--lr", "1"] and "toolkit.train" not in words
    with pytest.raises(UserError, match="does not exist"):
        launch_main(plan_dir, [str(tmp_path / "missing.py")], dry_run=True)
