"""Where a GRPO job's vLLM generation runs on the GPUs it is given, and where a DPO job's reference lives (issue 29,
Deliver 4). GRPO: colocated with training on every GPU (TRL's vllm_mode "colocate"), or a `trl vllm-serve` server
on some of the node's GPUs with training on the rest (vllm_mode "server"). Each placement is planned as any job is
(plan_candidates, the same global batch) and the placements are ranked by the step time of their best row; a
placement with no row that fits (colocate without a feasible vllm_gpu_memory_utilization, or training that no longer
fits on fewer GPUs) comes last with its reason.

The server takes the fewest GPUs over which the rest still split the global batch (TRL requires whole generation
groups on every training process); its generation is timed as toolkit.estimate.grpo.grpo_step_time times a server
(decode-bound at the GPU's HBM bandwidth, the training GPUs waiting for it).

DPO: the plan's first row is costed again with the reference the other way (kept beside the policy, or its
log-probs precomputed before training), same strategy and batch, so the two peaks differ by exactly what the
reference holds."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from toolkit.errors import UserError
from toolkit.estimate.grpo import window_words
from toolkit.estimate.search import evaluate, plan_candidates
from toolkit.inputs.choices import GIB
from toolkit.inputs.grpo import COLOCATE, SERVER
from toolkit.inputs.preference import KEPT, PRECOMPUTED

if TYPE_CHECKING:
    from toolkit.estimate.candidate import Candidate
    from toolkit.estimate.request import Request
    from toolkit.inputs.hardware import Hardware
    from toolkit.inputs.modelspec import ModelSpec


@dataclass(frozen=True)
class Placement:
    """One way to place generation on the job's GPUs, and the best plan of it."""

    words: str
    """"vLLM colocate on all 8 GPUs" / "vLLM server on 4 GPUs (trl vllm-serve), training on 4"."""
    best: "Candidate | None"
    reason: str | None = None
    """Why no row of this placement fits (None when `best` is one)."""
    server_gpus: int = 0
    """GPUs the vLLM server takes from the node (0: colocate)."""

    def to_dict(self) -> dict:
        """plan --json's entry for it."""
        out = {"placement": self.words, "vllm_mode": SERVER if self.server_gpus else COLOCATE,
               "server_gpus": self.server_gpus, "fits": self.best is not None, "reason": self.reason}
        if self.best is not None:
            out.update(strategy=self.best.name, step_time_s=round(self.best.timing.step_time_s, 4),
                       generation_s=round(self.best.timing.generation_s, 4))
        if self.best is not None and not self.server_gpus:
            out.update(vllm_gpu_memory_utilization=self.best.job.grpo.vllm_gpu_memory_utilization,
                       window=_window(self.best))
        return out


def server_gpus(world: int, global_batch: int) -> tuple[int | None, list[int]]:
    """The fewest server GPUs (at most half the node) that leave a training world the global batch splits over, and
    the training worlds tried before it that do not split it."""
    skipped = []
    for k in range(1, world // 2 + 1):
        if global_batch % (world - k) == 0:
            return k, skipped
        skipped.append(world - k)
    return None, skipped


def placements(spec: "ModelSpec", hw: "Hardware", req: "Request", colocated: list["Candidate"]) -> list[Placement]:
    """vLLM colocate (the plan's own rows, `colocated`) against a server on part of the node, best first; nothing for
    a job that does not generate with vLLM colocate, spans several nodes or searches its batch."""
    grpo = req.grpo
    if grpo is None or grpo.generation != COLOCATE or hw.nodes != 1 or not req.global_batch:
        return []
    world = hw.gpus_per_node
    out = [_best(f"vLLM colocate on all {world} GPUs", colocated)]
    k, skipped = server_gpus(world, req.global_batch)
    if k is None:
        out.append(Placement("vLLM server (trl vllm-serve) on part of the node", None,
                             f"the global batch {req.global_batch} splits over none of "
                             f"{', '.join(map(str, skipped))} training processes", server_gpus=1))
    else:
        words = f"vLLM server on {k} GPU{'s' if k > 1 else ''} (trl vllm-serve), training on {world - k}"
        try:
            served = plan_candidates(spec, replace(hw, gpus_per_node=world - k),
                                     replace(req, grpo=replace(grpo, vllm_mode=SERVER)))
        except UserError as exc:
            out.append(Placement(words, None, str(exc), server_gpus=k))
        else:
            out.append(replace(_best(words, served), server_gpus=k))
    return sorted(out, key=lambda p: (p.best is None, p.best.timing.step_time_s if p.best else 0.0))


def _best(words: str, candidates: list["Candidate"]) -> Placement:
    best = next((c for c in candidates if c.feasible), None)
    return Placement(words, best, None if best else next((c.reason for c in candidates), "no strategy"))


def window_problem(candidates: list["Candidate"], gpus: str) -> str | None:
    """One line for a vLLM colocate job none of whose rows fits because its vllm_gpu_memory_utilization lies outside
    every costed row's window (toolkit.estimate.grpo; or no row has a window on these GPUs): the problem and the fix.
    None when a row fits, the job does not colocate, or no row was costed with a window."""
    windows = [(c, c.memory.vllm_window) for c in candidates if c.memory is not None and c.memory.vllm_window]
    if not windows or any(c.feasible for c in candidates):
        return None
    u = windows[0][0].job.grpo.vllm_gpu_memory_utilization
    if any(low <= u <= high for _, (low, high) in windows):
        return None  # refused for another reason than the share
    server = "a separate vLLM server (--vllm-mode server)"
    rows = "this row" if len(candidates) == 1 else "every row"
    open_ = [(c, w) for c, w in windows if w[0] <= w[1]]
    if open_:
        c, (low, high) = max(open_, key=lambda x: x[1][1] - x[1][0])
        return (f"vllm_gpu_memory_utilization {u:g} lies outside vLLM colocate's window on {gpus} for {rows}: the "
                f"{'widest ' if len(open_) > 1 else ''}{window_words(low, high)} ({c.name}, micro-batch "
                f"{c.job.micro_batch} x accumulation {c.job.grad_accum}); give --vllm-gpu-memory-utilization within "
                f"it, or generate on {server}")
    vllm = min(w[0] for _, w in windows)
    c, (_, high) = max(windows, key=lambda x: x[1][1])
    return (f"no feasible vllm_gpu_memory_utilization on {gpus} for {rows.replace('every', 'any')}: vLLM needs at "
            f"least {vllm:.2f} of each GPU (its weights and one batch's KV cache) and training at least {1 - high:.2f} ({c.name}); use fewer "
            f"--num-generations, a shorter --max-completion-length, more GPUs, or {server}")


def placement_lines(found: list[Placement], global_batch: int) -> list[str]:
    """The ranking as plan prints it."""
    if not found:
        return []
    lines = [f"generation placement on these GPUs (global batch {global_batch}), ranked by step time:"]
    for i, p in enumerate(found, 1):
        if p.best is None:
            lines.append(f"  {i}. {p.words}: does not fit: {p.reason}")
            continue
        t = p.best.timing
        grpo = p.best.job.grpo
        share = f"; sets vllm_gpu_memory_utilization {grpo.vllm_gpu_memory_utilization:g} ({_window(p.best)})"
        lines.append(f"  {i}. {p.words}: {p.best.name}, {t.step_time_s:.2f} s a step (generation "
                     f"{t.generation_s:.2f} s)" + (share if grpo.generation == COLOCATE else ""))
    return lines


def _window(best: "Candidate") -> str:
    """Its memory's colocate note without the setting's name: 'feasible 0.19 to 0.42 on 79.1 GiB'."""
    return next((n.split(": ", 1)[-1].replace("vllm_gpu_memory_utilization ", "") for n in best.memory.notes
                 if "vllm_gpu_memory_utilization" in n), "")


def reference_line(spec: "ModelSpec", hw: "Hardware", chosen: "Candidate | None") -> str | None:
    """A DPO plan's first row with its reference kept and precomputed: both peaks, their difference (the reference
    terms of the memory, toolkit.estimate.preference) and which fits; None for other jobs."""
    dpo = chosen.job.dpo if chosen is not None else None
    if dpo is None or dpo.reference not in (KEPT, PRECOMPUTED):
        return None
    other = evaluate(spec, hw, chosen.strategy, replace(chosen.job, dpo=replace(
        dpo, reference=PRECOMPUTED if dpo.reference == KEPT else KEPT)), chosen.grid, chosen.partition, prune=False)
    kept, pre = (chosen, other) if dpo.reference == KEPT else (other, chosen)
    held = next(t.bytes for t in kept.memory.terms if t.name == "reference model")

    def fits(c: "Candidate") -> str:
        return "fits" if c.feasible else f"does not fit ({c.reason})"

    return (f"reference on #1 ({chosen.name}, micro-batch {chosen.job.micro_batch}, accumulation "
            f"{chosen.job.grad_accum}): kept {kept.memory.peak_bytes / GIB:.2f} GiB peak, {fits(kept)}; precomputed "
            f"{pre.memory.peak_bytes / GIB:.2f} GiB, {fits(pre)}; the difference "
            f"{(kept.memory.peak_bytes - pre.memory.peak_bytes) / GIB:.2f} GiB is the reference's "
            f"{held / GIB:.2f} GiB of weights")
