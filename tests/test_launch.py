"""toolkit launch: the command it prints and runs, the multi-node route, and the CPU rehearsal."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest

from toolkit.commands.launch import launch_main
from toolkit.run.launcher import emit_plan_files
from toolkit.run.rehearsal import plan_for_model


def test_dry_run_prints_the_accelerate_command(tiny_llama_dir, corpus_dir, tmp_path, capsys):
    plan_dir = emit_plan_files(plan_for_model(tiny_llama_dir, "zero3", micro_batch=2, seq_len=32), tmp_path / "p")
    code = launch_main(plan_dir, ["--data", str(corpus_dir), "--output", str(tmp_path / "out")], dry_run=True)
    assert code == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("$ accelerate launch --config_file ")
    words = shlex.split(line[2:])
    assert words[words.index("--config_file") + 1] == str(plan_dir / "accelerate_config.yaml")
    assert words[words.index("--deepspeed_config_file") + 1] == str(plan_dir / "ds_config.json")
    assert words[words.index("-m") + 1] == "toolkit.train"
    assert words[words.index("--plan") + 1] == str(plan_dir / "plan.json")
    assert not (tmp_path / "out").exists()


def test_multi_node_prints_each_node_and_slurm_without_running(tiny_llama_dir, corpus_dir, tmp_path, capsys):
    plan = plan_for_model(tiny_llama_dir, "zero2", num_machines=2, gpus_per_node=4, micro_batch=2, seq_len=32)
    plan_dir = emit_plan_files(plan, tmp_path / "p")
    code = launch_main(plan_dir, ["--data", str(corpus_dir), "--output", str(tmp_path / "out")])
    assert code == 0
    out = capsys.readouterr().out
    assert "--machine_rank 0" in out and "--machine_rank 1" in out
    assert "sbatch slurm.sbatch" in out and "nothing was started" in out
    assert not (tmp_path / "out").exists()


def test_one_node_rendezvouses_on_a_free_port_and_a_node_of_several_on_the_plans(tiny_llama_dir, tmp_path):
    """Two launches on one machine never take the same port (accelerate's default 29500 is one for all): a one-node
    command asks accelerate for a free one (0); a node of a multi-node run keeps the YAML's fixed 29500, or the
    port it is given."""
    import yaml

    from toolkit.run.launcher import launch_command

    one = emit_plan_files(plan_for_model(tiny_llama_dir, "zero2", micro_batch=2, seq_len=32), tmp_path / "one")
    command = launch_command(one, ["--output", "out"])
    assert command[command.index("--main_process_port") + 1] == "0"
    two = emit_plan_files(plan_for_model(tiny_llama_dir, "zero2", num_machines=2, gpus_per_node=4, micro_batch=2,
                                         seq_len=32), tmp_path / "two")
    assert yaml.safe_load((two / "accelerate_config.yaml").read_text())["main_process_port"] == 29500
    assert "--main_process_port" not in launch_command(two, [], machine_rank=1, main_host="node0")
    node = launch_command(two, [], machine_rank=1, main_host="127.0.0.1", main_port=29611)
    assert node[node.index("--main_process_port") + 1] == "29611"


def test_missing_accelerate_config_is_one_clear_error(tiny_llama_dir, tmp_path):
    from toolkit.errors import UserError

    (tmp_path / "plan.json").write_text(plan_for_model(tiny_llama_dir, "ddp", seq_len=32).to_json())
    with pytest.raises(UserError, match="accelerate_config.yaml is missing"):
        launch_main(tmp_path, ["--data", str(tmp_path), "--output", str(tmp_path / "o")])


@pytest.mark.multiprocess
def test_rehearsal_runs_an_fp16_zero3_plan_as_bf16_and_passes(tiny_llama_dir, tmp_path, capfd):
    """A 'big' plan (8 GPUs, micro 8, accum 16, seq 256, fp16, flash attention) rehearsed on 2 CPU processes."""
    plan = plan_for_model(tiny_llama_dir, "zero3", gpus_per_node=8, micro_batch=8, grad_accum=16, seq_len=256,
                          precision="fp16", attention="flash_attention_2", checkpointing=True)
    plan_dir = emit_plan_files(plan, tmp_path / "p")
    code = launch_main(plan_dir, [], rehearse=True)
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert "note: fp16 cannot run on these CPUs" in out
    assert "rehearsal passed" in out


def test_launch_refuses_a_clipping_value_the_deepspeed_config_contradicts(tiny_llama_dir, corpus_dir, tmp_path):
    """The Trainer would find this only inside train(), after loading the model, with a traceback per rank."""
    from toolkit.errors import UserError

    import json

    plan_dir = emit_plan_files(plan_for_model(tiny_llama_dir, "zero2", micro_batch=2, seq_len=32), tmp_path / "p")
    ds = json.loads((plan_dir / "ds_config.json").read_text())
    ds["gradient_clipping"] = 1.0  # edited by hand: emitted, it is "auto" (the Trainer fills --max-grad-norm)
    (plan_dir / "ds_config.json").write_text(json.dumps(ds))
    with pytest.raises(UserError, match="gradient_clipping 1.0 but --max-grad-norm is 0.5"):
        launch_main(plan_dir, ["--data", str(corpus_dir), "--output", str(tmp_path / "o"), "--max-grad-norm", "0.5"],
                    rehearse=True)


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_rehearsal_reports_a_failing_run_with_its_exit_code(tiny_llama_dir, tmp_path, capfd):
    """A plan whose DeepSpeed JSON was edited by hand into nonsense fails in the rehearsal, not on the GPUs. The
    real file is checked at the plan's world size whatever the rehearsal runs on (rehearsal._validate_real_configs),
    so one CPU process shows it (--processes 1) as two do."""
    import json

    plan_dir = emit_plan_files(plan_for_model(tiny_llama_dir, "zero2", micro_batch=2, seq_len=32), tmp_path / "p")
    ds = json.loads((plan_dir / "ds_config.json").read_text())
    ds["zero_optimization"]["stage"] = 7
    (plan_dir / "ds_config.json").write_text(json.dumps(ds))
    code = launch_main(plan_dir, [], rehearse=True, processes=1)
    out = capfd.readouterr().out
    assert code != 0
    assert "rehearsal problem: DeepSpeed refuses" in out and "rehearsal FAILED" in out
    # the log the failure points to is kept (only it: the tiny model, data and checkpoints go)
    kept = [Path(p) for line in out.splitlines() if line.startswith("the rehearsal's log")
            for p in line.split("kept: ", 1)[1].split(", ")]
    assert kept and all(p.is_file() and p.stat().st_size for p in kept), out
    work = kept[0].parent.parent
    assert [p.name for p in work.iterdir()] == ["out"] and set((work / "out").iterdir()) == set(kept)
    shutil.rmtree(work)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["zero3", "fsdp2"])
def test_a_two_node_rehearsal_trains_one_model_over_loopback(tiny_llama_dir, tmp_path, capfd, strategy):
    """`--rehearse --nodes 2`: two launcher invocations (machine ranks 0 and 1, one process each) rendezvous over
    127.0.0.1 and train together; every rank's model gives the same logits afterwards (the rehearsal checks it
    from toolkit.train's rank summaries), and the saved model reloads."""
    plan = plan_for_model(tiny_llama_dir, strategy, num_machines=2, gpus_per_node=4, micro_batch=2, seq_len=64)
    code = launch_main(emit_plan_files(plan, tmp_path / "p"), [], rehearse=True, nodes=2)
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert "(2 launcher invocations, machine ranks 0-1, over loopback)" in out and "rehearsal passed" in out
    assert "--machine_rank 0 --main_process_ip 127.0.0.1" in out and "--machine_rank 1 --main_process_ip 127.0.0.1" in out


def test_nodes_without_rehearse_is_refused_in_one_line(tiny_llama_dir, tmp_path):
    from toolkit.errors import UserError

    plan_dir = emit_plan_files(plan_for_model(tiny_llama_dir, "zero3", micro_batch=2, seq_len=32), tmp_path / "p")
    with pytest.raises(UserError, match="--nodes 2 runs a rehearsal as 2 nodes on this machine; add --rehearse"):
        launch_main(plan_dir, [], nodes=2)


def test_a_failed_rehearsal_keeps_its_launcher_logs_and_nothing_else(tmp_path, capsys):
    """The failure line names work/out/toolkit-launch.log: it must still be there after the rehearsal returns;
    a passed or refused rehearsal (no log) leaves nothing."""
    from toolkit.run.rehearsal import _remove_keeping_logs

    def work(name: str, logs: bool) -> Path:
        w = tmp_path / name
        (w / "model").mkdir(parents=True)
        (w / "model" / "model.safetensors").write_bytes(b"0" * 64)
        (w / "out" / "checkpoint-2").mkdir(parents=True)
        (w / "out" / "checkpoint-2" / "optimizer.pt").write_bytes(b"0" * 64)
        (w / "out" / "trainer_state.json").write_text("{}")
        if logs:
            (w / "out" / "toolkit-launch.log").write_text("rank 0 failed\n")
            (w / "out" / "node-1.log").write_text("node 1\n")
        return w

    failed = work("failed", logs=True)
    _remove_keeping_logs(failed, keep=True)
    assert sorted(p.relative_to(failed).as_posix() for p in failed.rglob("*")) == [
        "out", "out/node-1.log", "out/toolkit-launch.log"]
    assert str(failed / "out" / "toolkit-launch.log") in capsys.readouterr().out
    for name, logs, keep in (("passed", True, False), ("refused", False, True)):
        w = work(name, logs)
        _remove_keeping_logs(w, keep=keep)
        assert not w.exists()
