"""CI's runs on two pytest-xdist workers (`--dist loadgroup`, .ci/run) send the tests of one xdist_group to one
worker, so that the runs a module fixture makes for several tests are made once. The scheduler reads the group from
the `@group` ending of each collected id; with pytest 9.2 and pytest-xdist 3.8 that ending was silently lost (every
group scattered, the tune probe made on both workers), and tests/conftest.py now writes it. This test collects a real
selection the way CI does and reads the ids the workers sent: a lost ending fails it, as nothing else would.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_loadgroup_ids_carry_the_group_of_a_module_fixture_and_of_a_written_mark():
    # --setup-plan: collected and scheduled on two workers, no fixture or test run
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "--setup-plan",
                           "-n", "2", "--dist", "loadgroup", "-m", "multiprocess",
                           "tests/test_tune.py", "tests/test_gpu_check.py"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ids = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("tests/")]
    tune = [i for i in ids if i.startswith("tests/test_tune.py::")]
    # the three tests of test_gpu_check that share its one rehearsal (a fixture of the module, the mark written)
    gpu_check = [i for i in ids if i.startswith("tests/test_gpu_check.py::") and "_rehearses_" in i]
    # test_tune's probe is a module fixture (the group conftest derives); test_gpu_check names its group itself
    assert len(tune) >= 2 and all(i.endswith("@test_tune") for i in tune), ids
    assert len(gpu_check) >= 2 and all(i.endswith("@gpu-check") for i in gpu_check), ids
