"""The allocator setting a plan emits and predicts with (toolkit.inputs.allocconf): expandable segments where the
engines take them, torch's defaults with the reason where they do not, and the user's own setting over both."""

from __future__ import annotations

import subprocess

import pytest

from toolkit.emit.scripts import ALLOCATOR
from toolkit.estimate.memory import estimate_memory
from toolkit.inputs.allocconf import EXPANDABLE, alloc_conf
from toolkit.inputs.grpo import Grpo
from toolkit.inputs.hardware import find_gpu, parse_hardware
from toolkit.inputs.job import Job
from toolkit.inputs.modelspec import resolve_model
from toolkit.inputs.strategy import parse_strategy

H100 = find_gpu("H100-80GB")


def test_the_plan_sets_expandable_segments_on_cuda():
    a = alloc_conf("cuda", None, H100, {})
    assert a.conf == EXPANDABLE == "expandable_segments:True" and not a.users


def test_the_users_own_setting_wins_and_the_new_name_first():
    a = alloc_conf("cuda", None, H100, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    assert a.conf == "max_split_size_mb:128" and a.users and "from your environment" in a.words
    both = {"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.8", "PYTORCH_CUDA_ALLOC_CONF": "x:1"}
    assert alloc_conf("cuda", None, H100, both).conf == "garbage_collection_threshold:0.8"


@pytest.mark.parametrize("kind, grpo, gpu, reason", [
    ("cuda", Grpo(use_vllm=True), H100, "vllm-project/vllm#14189"),
    ("cuda", None, find_gpu("MI300X"), "ROCm"),
    ("cpu", None, H100, "no CUDA caching allocator"),
])
def test_where_an_engine_disagrees_the_default_allocator_stays_with_the_reason(kind, grpo, gpu, reason):
    a = alloc_conf(kind, grpo, gpu, {})
    assert a.conf == "" and reason in a.words


def test_server_mode_vllm_is_not_in_the_process_so_expandable_segments_stay():
    assert alloc_conf("cuda", Grpo(use_vllm=True, vllm_mode="server"), H100, {}).conf == EXPANDABLE


def test_the_replay_predicts_with_the_setting_and_says_so():
    """Expandable segments grow one segment per stream in 20 MiB pages instead of caching a segment per size:
    Llama-2-7B ZeRO-3 on 8 x H100 at seq 2048 reserves less above its tensor peak with them."""
    spec = resolve_model("llama-2-7b")
    default = estimate_memory(spec, parse_strategy("zero3"), Job(seq_len=2048), parse_hardware("8xH100-80GB"))
    expandable = estimate_memory(spec, parse_strategy("zero3"), Job(seq_len=2048, allocator_conf=EXPANDABLE),
                                 parse_hardware("8xH100-80GB"))
    assert expandable.peak_bytes == default.peak_bytes
    assert expandable.margin_bytes < default.margin_bytes
    assert expandable.allocator_conf == EXPANDABLE and default.allocator_conf == ""
    term = next(t for t in expandable.terms if t.name == "allocator (replayed)")
    assert term.source.endswith(f"with PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}")
    ignored = estimate_memory(spec, parse_strategy("zero3"),
                              Job(seq_len=2048, allocator_conf=f"{EXPANDABLE},pinned_use_cuda_host_register:True"),
                              parse_hardware("8xH100-80GB"))
    assert ignored.margin_bytes == expandable.margin_bytes
    assert "(pinned_use_cuda_host_register not modelled)" in next(t.source for t in ignored.terms
                                                                  if t.name == "allocator (replayed)")


def test_a_malformed_setting_is_refused_in_one_line():
    from toolkit.errors import UserError

    with pytest.raises(UserError, match="is not of the form key:value"):
        Job(seq_len=128, allocator_conf="expandable_segments:True; rm -rf /")


def _exported(tmp_path, environ: dict[str, str]) -> str:
    (tmp_path / "plan.json").write_text('{\n  "allocator_conf": "expandable_segments:True",\n'
                                        '  "inputs": {\n    "allocator_conf": "ignored"\n  }\n}\n')
    script = "\n".join(["set -euo pipefail", f'HERE="{tmp_path}"', *ALLOCATOR,
                        'echo "${PYTORCH_CUDA_ALLOC_CONF:-}|${PYTORCH_ALLOC_CONF:-}"'])
    env = {"PATH": "/usr/bin:/bin", **environ}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_launch_scripts_export_the_plans_setting_unless_the_environment_has_one(tmp_path):
    assert _exported(tmp_path, {}) == "expandable_segments:True|"
    assert _exported(tmp_path, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}) == "max_split_size_mb:64|"
    assert _exported(tmp_path, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}) == "|max_split_size_mb:64"


def test_estimate_says_which_allocator_it_predicted_with(capsys, monkeypatch):
    from toolkit.cli import main

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    args = ["estimate", "gpt2", "--gpus", "1xH100-80GB", "--seq", "512", "--micro-batch", "1", "--explain"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set by the plan's launch scripts" in out
    assert "the caching allocator's segments with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "allocator: PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 from your environment" in out
