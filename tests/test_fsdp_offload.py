"""FSDP2 with CPUOffloadPolicy as the strategy fsdp2-offload (issue 28, Deliver 3): what leaves the GPU, what the
host holds, what the step pays for it, and the files accelerate reads."""

from __future__ import annotations

import pytest
import yaml

from toolkit.cli import main
from toolkit.estimate.memory import estimate_memory
from toolkit.estimate.states import fsdp2_states
from toolkit.estimate.timing import cpu_step_s
from toolkit.inputs.hardware import parse_hardware
from toolkit.inputs.job import Job
from toolkit.inputs.modelspec import resolve_model
from toolkit.inputs.strategy import parse_strategy


@pytest.fixture(scope="module")
def llama7b():
    return resolve_model("llama-2-7b")


def test_offload_leaves_no_param_grad_or_optimizer_shard_on_the_gpu_and_puts_16_bytes_per_param_on_the_host(llama7b):
    P, N, layer = llama7b.params, 8, max(llama7b.layer_params)
    kw = dict(shard=N, layer_params=layer, root_params=llama7b.pre_layer_params + llama7b.post_layer_params,
              accumulating=False)
    on_gpu = fsdp2_states(P, Job(seq_len=8), parse_strategy("fsdp2"), **kw)
    off = fsdp2_states(P, Job(seq_len=8), parse_strategy("fsdp2-offload"), **kw)
    assert off.parameters == off.step_gradients == off.optimizer == off.master == 0
    # fp32 param shard 4 + fp32 grad shard 4 + AdamW 8, per rank (CPUOffloadPolicy: all on the CPU).
    assert off.cpu == pytest.approx(16 * P / N) == on_gpu.parameters + on_gpu.step_gradients + on_gpu.optimizer
    # The two units in flight each stage their fp32 shard on the GPU before the all-gather.
    assert off.gathered - on_gpu.gathered == pytest.approx(2 * layer * 4 / N)


def test_offload_host_ram_per_node_is_every_ranks_sharded_states(llama7b):
    b = estimate_memory(llama7b, parse_strategy("fsdp2-offload"), Job(seq_len=1024), parse_hardware("8xA100-80GB"))
    assert b.cpu_bytes_per_node == pytest.approx(16 * llama7b.params, rel=1e-6)
    assert b.host.resident_bytes_per_node == b.cpu_bytes_per_node
    assert b.parameters_bytes == b.optimizer_bytes == 0


def test_offload_step_pays_the_pcie_copies_and_the_same_cpu_step_as_zero_offload(llama7b, capsys):
    from toolkit.estimate.timing import step_time

    hw, job = parse_hardware("8xA100-80GB"), Job(seq_len=1024, micro_batch=1, grad_accum=2)
    plain = step_time(llama7b, parse_strategy("fsdp2"), job, hw)
    off = step_time(llama7b, parse_strategy("fsdp2-offload"), job, hw)
    P, N = llama7b.params, 8
    # Per micro-step: 2 H2D copies of the fp32 shard (forward + backward all-gathers) + 1 D2H of the fp32 grads.
    pcie = 2 * (2 * 4 * P + 4 * P) / N / (hw.gpu.pcie_gbps * 1e9)
    assert off.offload_s == pytest.approx(pcie + cpu_step_s(P, N, 8), rel=1e-9)
    assert plain.offload_s == 0 and off.step_time_s - plain.step_time_s == pytest.approx(off.offload_s, rel=1e-9)


def test_emitted_yaml_turns_on_accelerates_fsdp2_cpu_offload_policy(tiny_llama_dir, tmp_path, capsys):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from toolkit.engines.validate import accelerate_launch_plugins

    plugins = {}
    for name in ("fsdp2", "fsdp2-offload"):
        out = tmp_path / name
        assert main(["plan", str(tiny_llama_dir), "--seq", "64", "--global-batch", "8", "--gpus", "2xH100-80GB",
                     "--strategies", name, "--out", str(out)]) == 0, capsys.readouterr().err
        config = yaml.safe_load((out / "accelerate_config.yaml").read_text())
        assert config["fsdp_config"]["fsdp_offload_params"] is (name == "fsdp2-offload")
        assert ("gradients, optimizer states and step on CPU (torch's CPUOffloadPolicy"
                in (out / "PLAN.md").read_text()) is (name == "fsdp2-offload")
        _, plugins[name], env = accelerate_launch_plugins(out / "accelerate_config.yaml")
        assert env["FSDP_OFFLOAD_PARAMS"] == str(name == "fsdp2-offload").lower()
        assert main(["check", str(out)]) == 0, capsys.readouterr()
    assert isinstance(plugins["fsdp2-offload"].cpu_offload, CPUOffloadPolicy)
    assert plugins["fsdp2-offload"].cpu_offload.pin_memory is True
    assert type(plugins["fsdp2"].cpu_offload) is OffloadPolicy
    # check reads the YAML alone (not plan.json) back to the strategy, so its fit estimate offloads too.
    from toolkit.check.fit import fit_settings

    for name in ("fsdp2", "fsdp2-offload"):
        assert fit_settings(str(tmp_path / name / "accelerate_config.yaml")).strategy.name == name


QLORA_70B = ("llama-2-70b", "--gpus", "2xRTX-4090", "--method", "qlora", "--qlora-quant-storage", "bfloat16",
             "--strategies", "fsdp2,fsdp2-offload", "--seq", "2048", "--global-batch", "8")
"""Answer.AI's "70B QLoRA on two 24 GB GPUs": the 4-bit base stored as bf16 so that FSDP2 shards it."""


def test_70b_qlora_on_two_24gb_gpus_drops_exactly_the_shards_fsdp2_kept_on_the_gpu():
    from toolkit.inputs.lora import adapter_from_flags

    spec, hw = resolve_model("llama-2-70b"), parse_hardware("2xRTX-4090")
    job = Job(seq_len=2048, micro_batch=4, checkpointing=True,
              adapter=adapter_from_flags("qlora", quant_storage="bfloat16"))
    plain = estimate_memory(spec, parse_strategy("fsdp2"), job, hw)
    off = estimate_memory(spec, parse_strategy("fsdp2-offload"), job, hw)
    shards = (plain.parameters_bytes + plain.gradients_bytes + plain.optimizer_bytes) - off.parameters_bytes
    assert off.gradients_bytes == off.optimizer_bytes == 0
    # What left the GPUs is on the host: both ranks' shards (sharded 4-bit base + fp32 adapters, grads, AdamW).
    assert off.cpu_bytes_per_node == pytest.approx(2 * shards, rel=1e-9)
    # The peak is in backward, before the adapters' gradient shards exist: it drops by the param and optimizer
    # shards, less the staging copies of the units in flight.
    staging = off.buffers_bytes - plain.buffers_bytes
    assert 0 < staging < 0.05 * shards
    assert plain.peak_phase.startswith("backward") and off.peak_phase.startswith("backward")
    assert plain.peak_bytes - off.peak_bytes == pytest.approx(shards - plain.gradients_bytes - staging, abs=1)
    assert plain.required_bytes > hw.gpu.memory_bytes > off.required_bytes


def test_plan_70b_qlora_on_two_24gb_gpus_chooses_fsdp2_offload_with_memory_host_ram_and_time(tmp_path, capsys):
    import json

    assert main(["plan", *QLORA_70B, "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "fsdp2: needs 26.5 GiB of 23.6 per GPU" in out
    plan = json.loads((tmp_path / "p/plan.json").read_text())
    predicted = plan["predicted"]
    assert plan["strategy"] == "fsdp2-offload"
    assert predicted["required_bytes"] < predicted["capacity_bytes"]
    assert predicted["cpu_bytes_per_node"] > 30 * 2**30 and predicted["offload_s"] > 0
    assert yaml.safe_load((tmp_path / "p/accelerate_config.yaml").read_text())["fsdp_config"]["fsdp_offload_params"]


def test_plan_70b_qlora_refuses_fsdp2_offload_where_the_host_ram_does_not_hold_it(tmp_path, capsys):
    assert main(["plan", *QLORA_70B, "--cpu-ram-gib", "128", "--out", str(tmp_path / "p")]) != 0
    out = capsys.readouterr().out
    assert "fsdp2-offload: needs 164 GiB host RAM per node" in out and not (tmp_path / "p").exists()
