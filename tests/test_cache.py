"""The on-disk cache of model specs and activation traces: a hit gives the same answer without importing torch;
a changed config.json is a miss."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Each test starts fresh interpreters (the cache is read across processes), one at a time; the tests share the
# runs of one copy of the package (xdist_group: one worker runs them all, so the shared runs run once).
pytestmark = [pytest.mark.multiprocess, pytest.mark.one_core, pytest.mark.xdist_group("toolkit-cache")]

SCRIPT = """
import json, sys
from toolkit.cli import main
main(["estimate", sys.argv[1], "--gpus", "8xH100-80GB", "--strategy", "zero3", "--seq", "1024", "--json"])
print(json.dumps({"torch_imported": "torch" in sys.modules}))
"""


def run(model: str, cache: str, cwd: str | None = None, **env_vars: str) -> tuple[dict, bool]:
    env = {**os.environ, "TOOLKIT_CACHE_DIR": cache, **env_vars}
    env.pop("TOOLKIT_NO_CACHE", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, model], capture_output=True, text=True, env=env, check=True,
                         cwd=cwd)  # cwd: `python -c` puts it first on sys.path
    decoder = json.JSONDecoder()
    estimate, end = decoder.raw_decode(out.stdout)
    return estimate, json.loads(out.stdout[end:])["torch_imported"]


@pytest.fixture(scope="module")
def copied(tmp_path_factory) -> dict:
    """A copy of the package (a later test edits one of its modules) with an empty cache, and two runs of the same
    estimate on it: the first computes and stores, the second is served from the cache."""
    work = tmp_path_factory.mktemp("cache")
    package = work / "copy"
    shutil.copytree(Path(__file__).resolve().parent.parent / "toolkit", package / "toolkit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    cache = str(work / "cache")
    first, torch_first = run("gpt2", cache, str(work), PYTHONPATH=str(package))
    hit, torch_hit = run("gpt2", cache, str(work), PYTHONPATH=str(package))
    return {"package": package, "cache": cache, "cwd": str(work), "first": first, "torch_first": torch_first,
            "hit": hit, "torch_hit": torch_hit}


def test_a_cache_hit_gives_the_same_estimate_without_importing_torch(copied):
    assert copied["torch_first"] and not copied["torch_hit"]
    assert copied["first"] == copied["hit"]


def test_a_changed_config_is_not_served_from_the_cache(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    (model / "config.json").write_text(json.dumps(config))
    before, _ = run(str(model), str(tmp_path / "cache"))
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    after, torch_imported = run(str(model), str(tmp_path / "cache"))
    assert torch_imported
    assert after["params"] > before["params"]
    assert after["per_gpu"]["activations_bytes"] > before["per_gpu"]["activations_bytes"]


def test_a_change_in_any_module_the_computation_imports_misses_the_cache(copied):
    """The cache follows the imports of the code that computes a value (toolkit.cache.code_closure), so a change
    in a module the tracer only imports inside a function (patches/liger.py) is a miss, with no list to update."""
    assert not copied["torch_hit"]
    liger = copied["package"] / "toolkit" / "patches" / "liger.py"
    liger.write_text(liger.read_text() + "\n# a change\n")
    again, torch_imported = run("gpt2", copied["cache"], copied["cwd"], PYTHONPATH=str(copied["package"]))
    assert torch_imported  # traced again
    assert copied["first"] == copied["hit"] == again


PLAN_SCRIPT = """
import json, sys
from toolkit.cli import main
main(["plan", sys.argv[1], "--gpus", "2x8xH100-80GB", "--seq", "2048", "--global-batch", "64", "--json"])
imported = sorted(m for m in ("torch", "transformers") if m in sys.modules)
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):  # the files too (training_args.json names the Trainer's flags)
    assert main(["plan", sys.argv[1] + "/config.json", "--gpus", "2x8xH100-80GB", "--seq", "2048", "--global-batch",
                 "64", "--out", sys.argv[2]]) == 0
print(json.dumps({"imported": imported,
                  "imported_writing": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


def test_a_repeated_plan_with_tensor_parallel_rows_imports_neither_torch_nor_transformers(tmp_path):
    """The per-rank view of a tensor-parallel candidate builds its transformers config only when a trace misses
    (ModelSpec.hf_config on a deferred config), so a repeated plan is answered from the cache alone."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000}))
    env = {**os.environ, "TOOLKIT_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TOOLKIT_NO_CACHE", None)
    outs = [subprocess.run([sys.executable, "-c", PLAN_SCRIPT, str(model), str(tmp_path / f"plan{i}")],
                           capture_output=True, text=True, env=env, check=True).stdout for i in range(2)]
    decoder = json.JSONDecoder()
    (first, end_1), (second, end_2) = (decoder.raw_decode(out) for out in outs)
    assert any(c["tensor_parallel"] > 1 for c in first["candidates"]), \
        "the plan must price tensor-parallel rows for this test to mean anything"
    assert json.loads(outs[0][end_1:])["imported"] == ["torch", "transformers"]
    assert json.loads(outs[1][end_2:]) == {"imported": [], "imported_writing": []}
    assert first == second
    assert (tmp_path / "plan0" / "training_args.json").read_text() == \
        (tmp_path / "plan1" / "training_args.json").read_text()
