"""Which PYTORCH_CUDA_ALLOC_CONF a run gets: the user's own (from the environment) wins; else the plan sets
`expandable_segments:True` where the engines take it, and torch's defaults where they do not, with the reason. The
estimate replays the step with the same setting (toolkit.estimate.reserved), so the prediction is of the run the
files start.

Where it is not set (docs/ENGINE_FACTS.md, "expandable segments in the plan"):
- vLLM inside the training process (GRPO --vllm-mode colocate): vLLM's CuMemAllocator refuses expandable segments
  for sleep mode (vllm-project/vllm#14189, pytorch/pytorch#147851), and engines with tensor parallelism have
  crashed at start with it (kaito-project/kaito#1077);
- ROCm GPUs: the allocator model replays CUDA's allocator only;
- CPU runs: no CUDA allocator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

EXPANDABLE = "expandable_segments:True"
ENV_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""torch 2.10+ reads PYTORCH_ALLOC_CONF first and PYTORCH_CUDA_ALLOC_CONF as its older alias (c10/core/AllocatorConfig)."""


@dataclass(frozen=True)
class AllocConf:
    conf: str
    """What the run's allocator gets ("" = torch's defaults)."""
    words: str
    """Where it comes from, for the output."""
    users: bool = False


def user_conf(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, value) of the user's own allocator setting in `environ`, or None."""
    for name in ENV_NAMES:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def default_problem(device_kind: str, grpo, gpu) -> str:
    """Why the plan leaves torch's default allocator for this job, or "" where it sets expandable segments."""
    if device_kind != "cuda":
        return "a CPU run has no CUDA caching allocator"
    if gpu.architecture.startswith("cdna"):
        return "ROCm: the allocator replay models CUDA's allocator only, so torch's defaults are kept"
    if grpo is not None and grpo.use_vllm and grpo.vllm_mode == "colocate":
        return ("vLLM colocate runs in the training process, and vLLM's CuMemAllocator refuses expandable segments "
                "(vllm-project/vllm#14189, pytorch/pytorch#147851)")
    return ""


def alloc_conf(device_kind: str, grpo, gpu, environ: Mapping[str, str]) -> AllocConf:
    """The setting the run gets and the prediction uses: the user's (environment) first, else the plan's default.
    `grpo`: the job's Grpo or None."""
    mine = user_conf(environ)
    if mine is not None:
        name, value = mine
        return AllocConf(value, f"{name}={value} from your environment (it wins over the plan's default)", users=True)
    problem = default_problem(device_kind, grpo, gpu)
    if problem:
        return AllocConf("", f"torch's default allocator: {problem}")
    return AllocConf(EXPANDABLE, f"PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}, set by the plan's launch scripts "
                                 "(less fragmentation; your own setting in the environment wins)")
