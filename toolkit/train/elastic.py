"""Elastic restarts (`toolkit launch --max-restarts N`): what a worker that torchrun restarted must do differently.

torchrun's elastic agent restarts the whole local worker group when a worker dies, and keeps its key-value store
(the rendezvous store every worker's process group is built on) across attempts. gloo publishes each rank's
address in that store under the same keys every attempt, so a restarted rank could read the dead worker's old
address and fail to connect (measured here on CPU: "Gloo connectFullMesh failed ... Connection refused", through
`accelerate launch --max_restarts` and plain torchrun alike). A restarted worker therefore builds the default
process group itself, over the agent's store under a prefix of its own attempt, before accelerate or DeepSpeed
would (both skip their own init when a group exists). It then resumes from the last complete checkpoint
(toolkit.train.args sets --resume).
"""

from __future__ import annotations

import os


def restart_count() -> int:
    """How many times torchrun restarted this worker group (TORCHELASTIC_RESTART_COUNT, set by
    torch/distributed/elastic/agent/server/local_elastic_agent.py); 0 outside torchrun."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def join_restarted_group() -> None:
    """On a restart, the default process group over the agent's store under this attempt's own key prefix."""
    attempt = restart_count()
    if attempt == 0 or "MASTER_ADDR" not in os.environ:
        return
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(minutes=10))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, store=dist.PrefixStore(f"toolkit_attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=world)
    if dist.get_rank() == 0:
        import sys

        print(f"toolkit.train: restart {attempt} after a worker died; resuming from the last complete checkpoint",
              file=sys.stderr, flush=True)
