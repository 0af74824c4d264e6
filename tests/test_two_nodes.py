"""Two nodes for real, on one machine: every rank a real process over gloo, each "node" a launcher invocation of its
own (machine rank 0 and 1), and the emitted multi-node scripts (slurm.sbatch, deepspeed.sh with its hostfile, and
the top-level launch/ ones) run under stand-ins for sbatch / srun / scontrol / pdsh / ssh (tests/cluster_shims.py)
that start the two nodes the way SLURM and DeepSpeed's launcher do. The scripts run as emitted: their quoting,
their rendezvous (the first host of the allocation or hostfile) and their environment handling are untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.quick_launch import quick_launch
from tests import cluster_shims
from toolkit.commands.launch import launch_main
from toolkit.emit import emit_files
from toolkit.run.launcher import emit_plan_files, free_port, launch_command
from toolkit.run.rehearsal import plan_for_model, rehearsal_argv, small_setup
from toolkit.train.hf_runner import read_rank_summaries

REPO = Path(__file__).resolve().parent.parent
QUIET = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def losses(summary: dict) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in summary["log_history"] if "loss" in e]


def assert_same_losses(two_nodes: list[tuple[int, float]], one_node: list[tuple[int, float]]) -> None:
    assert [step for step, _ in two_nodes] == [step for step, _ in one_node]
    assert [loss for _, loss in two_nodes] == pytest.approx([loss for _, loss in one_node], abs=1e-6)


# --- HSDP and hybrid through `toolkit launch DIR --rehearse --nodes 2` ---------------------------------------------

def start_one_launcher_reference(plan, work: Path) -> subprocess.Popen:
    """The rehearsal's own small plan, model and data (rebuilt: they are made deterministically), started as ONE
    launcher invocation of all 4 processes: the single-node run of the same plan and the same process grid. Its
    ranks report into work/ranks (one_launcher_reference)."""
    _, small, _, small_dir, data = small_setup(plan, work, nodes=2)
    config = small_dir / "accelerate_config.yaml"
    config.write_text(config.read_text().replace("num_machines: 2\n", "num_machines: 1\n"))
    env = {**os.environ, **QUIET, "TOOLKIT_RANK_SUMMARY_DIR": str(work / "ranks"), "PYTHONWARNINGS": "ignore"}
    command = quick_launch(launch_command(small_dir, rehearsal_argv(data, work / "out", [])))
    with open(work / "launcher.log", "w") as log:  # a file: a full pipe would stall the run
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def one_launcher_reference(started: subprocess.Popen, work: Path) -> list[dict]:
    """What the ranks of start_one_launcher_reference's run reported, once it ends."""
    assert started.wait(timeout=600) == 0, (work / "launcher.log").read_text(errors="replace")[-4000:]
    return read_rank_summaries(work / "ranks")


def rehearse(plan_dir: Path, nodes: int, summaries: Path, capfd, monkeypatch) -> tuple[str, list[dict]]:
    """`toolkit launch DIR --rehearse --nodes N`, its ranks reporting into summaries (a debugging hook the
    rehearsal passes on)."""
    monkeypatch.setenv("TOOLKIT_RANK_SUMMARY_DIR", str(summaries))
    code = launch_main(plan_dir, [], rehearse=True, nodes=nodes)
    monkeypatch.delenv("TOOLKIT_RANK_SUMMARY_DIR")
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert "rehearsal passed" in out
    return out, read_rank_summaries(summaries)


TWO_NODES = "on 4 CPU processes over gloo (2 launcher invocations, machine ranks 0-1, over loopback)"


@pytest.mark.multiprocess
def test_hsdp_rehearses_as_two_nodes_with_identical_replicas_and_the_losses_of_one_node(tiny_llama_dir, tmp_path,
                                                                                        capfd, monkeypatch):
    """HSDP: 2 nodes x 2 shards, shard i of node 0 and shard i of node 1 are replicas. The rehearsal checks after
    training that they hold the same parameters and that every rank gives the same logits; here the ranks' own
    reports are read again, and the losses equal the same plan and process grid started on one node."""
    plan = plan_for_model(tiny_llama_dir, "fsdp2-hybrid", num_machines=2, gpus_per_node=4, grad_accum=2)
    # The one-node reference runs beside the rehearsal (each on a rendezvous port of its own): a world of 4 ranks
    # alone leaves cores idle while it starts, meets and saves.
    reference = start_one_launcher_reference(plan, tmp_path / "one-node")
    out, ranks = rehearse(emit_plan_files(plan, tmp_path / "p"), 2, tmp_path / "two-nodes", capfd, monkeypatch)
    assert TWO_NODES in out
    assert [(r["rank"], r["node"]) for r in ranks] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert [r["local_param_abs_sum"] for r in ranks[:2]] == [r["local_param_abs_sum"] for r in ranks[2:]]
    assert ranks[0]["local_param_abs_sum"] != ranks[1]["local_param_abs_sum"]  # two different shards
    assert all(r["probe_logits"] == ranks[0]["probe_logits"] for r in ranks)
    one = one_launcher_reference(reference, tmp_path / "one-node")
    assert [r["node"] for r in one] == [0, 0, 0, 0]
    assert len(losses(ranks[0])) == 4
    assert_same_losses(losses(ranks[0]), losses(one[0]))


@pytest.mark.multiprocess
def test_a_hybrid_plan_rehearses_on_one_node_and_as_two_nodes_with_the_same_losses(tiny_llama_dir, tmp_path,
                                                                                   capfd, monkeypatch):
    """A 'big' hybrid plan (8 GPUs, 2 stages, micro 4, accum 8, seq 128, bf16) rehearsed as 2 stages x 2
    data-parallel on 4 CPU processes, first on one node, then as two: DeepSpeed's grid puts the stage outermost,
    so stage 0 runs on node 0 and stage 1 on node 1 (the pipeline's sends cross the nodes), each stage's
    replicas inside a node. The rehearsal checks the replicas; the losses are the one-node run's."""
    plan = plan_for_model(tiny_llama_dir, "hybrid", gpus_per_node=8, pipeline_stages=2, micro_batch=4,
                          grad_accum=8, seq_len=128, precision="bf16")
    plan_dir = emit_plan_files(plan, tmp_path / "p")
    # The one-node rehearsal (`python -m toolkit launch DIR --rehearse`) runs beside the two-node one, each on a
    # rendezvous port of its own: one after the other, each world of 4 ranks alone left a core idle while it started,
    # met and saved, and a test of its own is among the last that CI's second run hands out (xdist's loadgroup sends
    # the groups of several tests first, then single tests in file order: xdist/scheduler/loadscope.py), when the
    # other worker may have nothing left to run.
    one_node = tmp_path / "one-node"
    env = {**os.environ, **QUIET, "TOOLKIT_RANK_SUMMARY_DIR": str(one_node), "PYTHONWARNINGS": "ignore"}
    with open(tmp_path / "one-node.log", "w") as log:  # a file: a full pipe would stall the run
        beside = subprocess.Popen([sys.executable, "-m", "toolkit", "launch", str(plan_dir), "--rehearse"], env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        out, ranks = rehearse(plan_dir, 2, tmp_path / "two-nodes", capfd, monkeypatch)
    finally:
        beside.wait(timeout=600)
    one_out = (tmp_path / "one-node.log").read_text(errors="replace")
    assert beside.returncode == 0 and "rehearsal passed" in one_out, one_out[-3000:]
    assert "on 4 CPU processes" in one_out and "launcher invocations" not in one_out
    one = read_rank_summaries(one_node)
    assert TWO_NODES in out
    assert [(r["rank"], r["node"], r["stage"], r["data_rank"]) for r in ranks] == [
        (0, 0, 0, 0), (1, 0, 0, 1), (2, 1, 1, 0), (3, 1, 1, 1)]
    assert ranks[0]["local_param_abs_sum"] == ranks[1]["local_param_abs_sum"] != ranks[2]["local_param_abs_sum"]
    assert ranks[2]["local_param_abs_sum"] == ranks[3]["local_param_abs_sum"]
    assert len(losses(ranks[0])) == 4 and all(losses(r) == losses(ranks[0]) for r in ranks)
    assert_same_losses(losses(ranks[0]), losses(one[0]))


# --- the emitted scripts under SLURM and DeepSpeed's launcher -------------------------------------------------------

@pytest.fixture(scope="module")
def two_node_plan(tiny_llama_dir, tmp_path_factory) -> Path:
    """ZeRO-3 on 2 nodes x 1 process; the hostfile names two loopback addresses of this machine."""
    plan_dir = tmp_path_factory.mktemp("two-node-plan") / "plan"
    emit_files(plan_for_model(tiny_llama_dir, "zero3", num_machines=2, gpus_per_node=1, micro_batch=2, seq_len=64),
               plan_dir, hosts=["127.0.0.1", "127.0.0.2"])
    return plan_dir


def route(name: str, plan_dir: Path, train: list[str], cwd: Path) -> list[str]:
    """How a user starts each route (the plan folder's scripts name their plan folder themselves)."""
    if name == "plan folder slurm.sbatch":  # sbatch from the plan folder: SLURM_SUBMIT_DIR is the plan folder
        return ["sbatch", "--wait", str(plan_dir / "slurm.sbatch"), *train]
    if name == "launch/slurm.sbatch":  # its usage line: the geometry on sbatch's command line
        return ["sbatch", "--wait", "--nodes=2", "--gpus-per-node=1", str(REPO / "launch" / "slurm.sbatch"),
                str(plan_dir), *train]
    if name == "plan folder deepspeed.sh":
        return ["bash", str(plan_dir / "deepspeed.sh"), *train]
    return ["bash", str(REPO / "launch" / "deepspeed.sh"), str(plan_dir), *train]


ROUTES = ["plan folder slurm.sbatch", "launch/slurm.sbatch", "plan folder deepspeed.sh", "launch/deepspeed.sh"]


@pytest.mark.multiprocess
def test_the_multi_node_scripts_train_one_model_as_two_nodes(two_node_plan, corpus_dir, tmp_path):
    """Each route: 2 nodes x 1 rank, 2 ZeRO-3 steps; both ranks report, each from its own node, the same logits
    afterwards; and every route trains the same numbers (same plan, seed and data: one model, whoever started it).
    The DeepSpeed route gets its environment the way DeepSpeed documents for pdsh: a .deepspeed_env file in the
    folder it starts from (the remote shell starts with a login environment only)."""
    shims = cluster_shims.install(tmp_path / "bin")
    ports = set()
    while len(ports) < len(ROUTES):
        ports.add(free_port())
    started = {}
    for name, port in zip(ROUTES, sorted(ports)):  # side by side, each on a rendezvous port of its own: one route's
        # 2 ranks alone leave a core idle while they start, meet and save
        slug = name.replace("/", "-").replace(" ", "-")
        cwd = two_node_plan if name == "plan folder slurm.sbatch" else tmp_path / slug
        cwd.mkdir(exist_ok=True)
        ranks = tmp_path / "ranks" / slug
        env = {**os.environ, **QUIET, "PATH": f"{shims}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               "MASTER_PORT": str(port), "TOOLKIT_RANK_SUMMARY_DIR": str(ranks)}
        if "deepspeed" in name:  # TORCH_EXTENSIONS_DIR: the DeepSpeed ops .ci/setup built (tests/conftest.py), else
            # the ranks rebuild the shared-memory collectives in ~/.cache for this venv's paths (47 s in the last CI)
            remote = {**QUIET, "TOOLKIT_RANK_SUMMARY_DIR": str(ranks),
                      "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]}
            (cwd / ".deepspeed_env").write_text("".join(f"{k}={v}\n" for k, v in remote.items()))
        train = ["--data", str(corpus_dir), "--output", str(tmp_path / "out" / slug), "--random-init",
                 "--max-steps", "2", "--logging-steps", "1", "--save-steps", "100", "--no-save-final"]
        logs = tmp_path / f"{slug}.out", tmp_path / f"{slug}.err"  # files: a full pipe would stall a route
        with open(logs[0], "w") as out, open(logs[1], "w") as err:
            started[name] = (subprocess.Popen(route(name, two_node_plan, train, cwd), cwd=cwd, env=env, stdout=out,
                                              stderr=err), cwd, ranks, logs)
    for proc, *_ in started.values():
        proc.wait(timeout=600)
    results = {}
    for name, (proc, cwd, ranks, logs) in started.items():
        stdout, stderr = (log.read_text(errors="replace") for log in logs)
        job_log = "".join(p.read_text(errors="replace") for p in cwd.glob("slurm-*.out"))
        assert proc.returncode == 0, f"{name}:\n{stdout[-3000:]}\n{stderr[-3000:]}\n{job_log[-3000:]}"
        summaries = read_rank_summaries(ranks)
        assert [(s["rank"], s["world"], s["node"]) for s in summaries] == [(0, 2, 0), (1, 2, 1)], name
        assert summaries[0]["probe_logits"] == summaries[1]["probe_logits"], name
        # The scripts export it for a user's script; on DeepSpeed's route it reaches the nodes through DS_ENV_FILE.
        assert [s["toolkit_plan_dir"] for s in summaries] == [str(two_node_plan)] * 2, name
        results[name] = losses(summaries[0])
        if "deepspeed" in name:  # pdsh ran one node per hostfile line; DeepSpeed read the rendezvous from ssh
            assert "127.0.0.1: " in stdout and "127.0.0.2: " in stdout
        else:
            assert stdout.startswith("Submitted batch job ") and "toolkit.train: zero3" in job_log
    first = results[ROUTES[0]]
    assert len(first) == 2 and all(loss == first for loss in results.values()), results


def test_an_hsdp_plan_rehearses_as_two_nodes_without_being_asked(tiny_llama_dir, tmp_path, capsys):
    """HSDP needs two nodes (the grid refuses it on one): `--rehearse` alone runs it as 2 launcher invocations."""
    plan = plan_for_model(tiny_llama_dir, "fsdp2-hybrid", num_machines=2, gpus_per_node=4)
    assert launch_main(emit_plan_files(plan, tmp_path / "p"), [], rehearse=True, dry_run=True) == 0
    out = capsys.readouterr().out
    assert "rehearsing it as 2 nodes on this machine" in out and TWO_NODES in out
    assert "--machine_rank 0" in out and "--machine_rank 1" in out
