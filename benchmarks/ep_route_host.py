"""The host's work of transformers 5.24's expert-parallel routes beside the plain model's (issue 34; results in
benchmarks/results/moe_ep.md, constants in toolkit.estimate.hosttime.EP_ROUTE_HOST_OPS).

A real training step of the tiny Qwen3-MoE (benchmarks/moe_ep.py tiny_moe_config: 4 MoE layers, hidden 64, 8
experts top-2, 16 tokens, fp32) loaded with `from_pretrained(distributed_config=...)` on two gloo ranks, each
route's forward + backward timed on the main thread's CPU clock (the fastest of STEPS steps; contention only adds),
beside the same step of the plain model started the same way (two processes side by side, so both see the same
box). What a route adds a MoE layer is expressed in the plain step's own operations: (route - plain) CPU seconds /
(plain CPU seconds / plain operations) / MoE layers, so it carries to other hosts with HOST_OP_S.

Routes (the dense modules' placement and the experts' exchange as each layout runs them):

  shared all_to_all   TRL's layout, the experts over ep and everything else whole on every rank of a batch-sharing
                      group, as transformers 5.24 loads it: DistributedConfig(tp_size=2, ep_size=2) with a tp_plan
                      naming only the experts (mixin.py _resolve_parallel_plans drops TP rules on EP modules, so
                      no dense module is split), ep_implementation "auto" (AllToAllEP when gradients flow)
  shared all_reduce   the same with ep_implementation="all_reduce" (AllReduceEP, the masked route TRL's report
                      describes)
  own batch           DistributedConfig(fsdp_size=2, ep_size=2): every rank its own batch, FSDP2 over the dense
                      modules, AllToAllEP

    python benchmarks/ep_route_host.py      # prints the JSON moe_ep.py records
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
STEPS = 7
MODEL = "qwen3-30b-a3b"
EXPERTS_ONLY_TP = {"model.layers.*.mlp.experts": "ep_dispatch_experts"}
ROUTES = {
    "plain": None,
    "shared all_to_all": {"tp_size": 2, "ep_size": 2, "tp_plan": EXPERTS_ONLY_TP},
    "shared all_reduce": {"tp_size": 2, "ep_size": 2, "tp_plan": EXPERTS_ONLY_TP, "ep_implementation": "all_reduce"},
    "own batch": {"fsdp_size": 2, "ep_size": 2},
}


def worker(folder: str, route: str, checkpointing: bool) -> None:
    """One rank: load the saved tiny model by `route`, count one step's operations, time STEPS more."""
    import time

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from moe_ep import HOST_TOKENS, _op_counter

    settings = ROUTES[route]
    kwargs = {}
    if settings is not None:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**settings)
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable()
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, HOST_TOKENS))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    step()  # lazy initialisation off the count and the clock
    Count, count = _op_counter()
    with Count():
        step()
    seconds = []
    for _ in range(STEPS):
        if dist.is_initialized():
            dist.barrier()
        start = time.thread_time()
        step()
        seconds.append(time.thread_time() - start)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    (Path(folder) / f"route-{rank}.json").write_text(json.dumps({"ops": count[0], "seconds": seconds}))
    if dist.is_initialized():
        dist.destroy_process_group()


def run(folder: str, route: str, checkpointing: bool, port: int) -> dict:
    """Two ranks of `route` (torchrun); the slower rank's fastest step and its operation count."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join((str(ROOT), str(HERE)))}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                    str(port), str(Path(__file__).resolve()), "--worker", folder, route, str(int(checkpointing))],
                   env=env, capture_output=True, text=True, check=True)
    ranks = [json.loads((Path(folder) / f"route-{rank}.json").read_text()) for rank in (0, 1)]
    slow = max(ranks, key=lambda r: min(r["seconds"]))
    return {"ops": slow["ops"], "step_s": min(slow["seconds"]), "steps_s": slow["seconds"]}


LAYERS = (4, 8)
"""MoE layers of the two models each route runs: what a route adds per layer is the difference, so a cost paid
once a step (the loss, the embedding, the optimizer-free step's own set-up) is not taken for a layer's."""


def measure() -> dict:
    """Every route with and without checkpointing at LAYERS MoE layers: its step, and what it adds a MoE layer in
    the plain step's operations (the growth from the smaller model to the larger over the layers added)."""
    import torch
    from transformers import AutoModelForCausalLM

    from moe_ep import tiny_moe_config

    out = {"model": MODEL, "steps": STEPS, "layers": list(LAYERS), "load1": os.getloadavg()[0], "runs": {}}
    for checkpointing in (True, False):
        key = "checkpointing" if checkpointing else "no checkpointing"
        out["runs"][key] = {}
        for layers in LAYERS:
            config = tiny_moe_config(MODEL)
            config.num_hidden_layers = layers
            if getattr(config, "layer_types", None):
                config.layer_types = [config.layer_types[0]] * layers
            with tempfile.TemporaryDirectory() as folder:
                torch.manual_seed(0)
                AutoModelForCausalLM.from_config(config).save_pretrained(folder)
                port = 29650 + checkpointing * 10 + layers
                out["runs"][key][str(layers)] = {route: run(folder, route, checkpointing, port + 20 * i)
                                            for i, route in enumerate(ROUTES)}
        small, large = (out["runs"][key][str(n)] for n in LAYERS)
        per_op = large["plain"]["step_s"] / large["plain"]["ops"]
        added = LAYERS[1] - LAYERS[0]
        out[key] = {route: ((large[route]["step_s"] - small[route]["step_s"])
                            - (large["plain"]["step_s"] - small["plain"]["step_s"])) / per_op / added
                    for route in ROUTES if route != "plain"}
        out[key + " per step"] = {route: ((large[route]["step_s"] - large["plain"]["step_s"]) / per_op
                                          - out[key][route] * LAYERS[1]) for route in ROUTES if route != "plain"}
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], sys.argv[4] == "1")
    else:
        print("RESULT " + json.dumps(measure()))
