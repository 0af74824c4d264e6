"""A wheel, installed non-editable into a fresh virtual environment, has its catalogs and presets and works from
outside the checkout (the catalogs once lived outside the package, so only an editable checkout worked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLEAN_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
"""No PYTHONPATH: a checkout on it would make pip find the toolkit "already installed" and the venv see it."""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(work / "dist"), str(ROOT)], check=True, capture_output=True, env=CLEAN_ENV)
    wheel = next((work / "dist").glob("toolkit-*.whl"))
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=CLEAN_ENV)
    # The heavy dependencies (torch, transformers, ...) come from this interpreter's site-packages through a .pth
    # line; the toolkit itself only from the wheel (a .pth path line does not run the editable install's hook).
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True, text=True, env=CLEAN_ENV).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, env=CLEAN_ENV)
    return venv


def _run(venv: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**CLEAN_ENV, "TOOLKIT_NO_CACHE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(venv / "bin" / "toolkit"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_the_installed_wheel_runs_from_outside_the_checkout(installed, tmp_path):
    where = _run(installed, tmp_path, "--version")
    assert where.returncode == 0 and where.stdout.startswith("toolkit ")
    located = subprocess.run([str(installed / "bin" / "python"), "-c", "import toolkit; print(toolkit.__file__)"],
                             cwd=tmp_path, capture_output=True, text=True, check=True, env=CLEAN_ENV).stdout
    assert str(installed) in located and str(ROOT) not in located  # the wheel's copy, not the checkout

    models = _run(installed, tmp_path, "models")
    assert models.returncode == 0 and "llama-3-8b" in models.stdout.split()
    gpus = _run(installed, tmp_path, "gpus")
    assert gpus.returncode == 0 and "H100-SXM-80GB" in gpus.stdout

    plan = _run(installed, tmp_path, "plan", "llama-3-8b", "--gpus", "8xH100-80GB", "--seq", "4096",
                "--global-batch", "64", "--strategies", "zero3,fsdp2", "--out", "p")
    assert plan.returncode == 0, plan.stderr
    assert json.loads((tmp_path / "p" / "plan.json").read_text())["strategy"] in ("zero3", "fsdp2")
    check = _run(installed, tmp_path, "check", "p")
    assert check.returncode == 0, check.stdout + check.stderr

    import toolkit

    preset = Path(toolkit.__file__).parent / "catalog" / "sets" / "zero3-bf16"
    installed_preset = next((installed / "lib").glob("python*/site-packages/toolkit/catalog/sets/zero3-bf16"))
    assert sorted(p.name for p in installed_preset.iterdir()) == sorted(p.name for p in preset.iterdir())
    assert (installed_preset.parent.parent.parent / "plan" / "plan.schema.json").is_file()
