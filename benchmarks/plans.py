"""What `toolkit plan` chooses for the three reference cases, with every rejection and its reason.

    python benchmarks/plans.py     # writes benchmarks/results/plans.md (the justification is in that file)

Cases (docs/ENGINE_FACTS.md, Peers), bf16 mixed precision, AdamW, sdpa attention with the GPU kernels' footprint:
  A  GPT-2 XL, 8 x A100-80GB, seq 1024, global batch 64 (micro-batch 4 in the peer comparison)
  B  Llama-2-7B, 8 x A100-80GB, seq 4096, global batch 64
  C  Llama-3-70B, 8 nodes x 8 x H100-80GB (400 GB/s per node), seq 8192, global batch 512
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from provenance import measured_line
from toolkit.inputs.choices import GIB
from toolkit.inputs.hardware import parse_hardware
from toolkit.inputs.modelspec import resolve_model
from toolkit.estimate.errorband import time_band
from toolkit.estimate.ranking import speed_ties
from toolkit.estimate.request import Request
from toolkit.estimate.search import plan_candidates

CASES = {
    "A": ("gpt2-xl", "8xA100-80GB", None, 1024, 64),
    "B": ("llama-2-7b", "8xA100-80GB", None, 4096, 64),
    "C": ("llama-3-70b", "8x8xH100-80GB", 400.0, 8192, 512),
    "D": ("llama-3-8b", "8xV100-32GB", None, 2048, 64, "fp16"),  # off the map: no published run on Volta, the band unknown
}


def main() -> int:
    lines = ["# Chosen plans for the reference cases", "",
             f"{measured_line('plans.py')}. Ranked by predicted tokens/s, except that "
             "candidates within the step-time band of the fastest (marked 'tie') are ordered by robustness "
             "(resumable, memory headroom in peak error bands, then simplicity: toolkit.estimate.ranking); `*` marks a speed no published run of that engine at that scale backs "
             "(benchmarks/results/throughput.md). The band is the held-out published runs' on each case's GPU "
             "generation (said under each case); where the corpus has none it is unknown and every row that fits is "
             "a tie. GiB is the required memory per GPU (tensor peak + context + margin).", ""]
    for case, (model, gpus, inter, seq, batch, *precision) in CASES.items():
        spec = resolve_model(model)
        hw = parse_hardware(gpus, inter_node_gbps=inter)
        cands = plan_candidates(spec, hw, Request(seq_len=seq, global_batch=batch,
                                                  **({"precision": precision[0]} if precision else {})))
        lines += [f"## Case {case}: {model} on {hw.spec}, seq {seq}, global batch {batch}"
                  + (f", {precision[0]}" if precision else ""), "",
                  "| rank | strategy | micro x accum | ckpt | GiB/GPU | host GiB/node | step s | tokens/s | MFU | band |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        rank = 0
        tied = {id(c) for c in speed_ties(cands)} if len(speed_ties(cands)) > 1 else set()
        for c in cands:
            if not c.feasible:
                continue
            rank += 1
            m, t = c.memory, c.timing
            lines.append(f"| {rank} | {c.name} | {c.job.micro_batch} x {c.job.grad_accum} | "
                         f"{'yes' if c.job.checkpointing else 'no'} | {m.required_bytes / GIB:.1f} | "
                         f"{m.cpu_bytes_per_node / GIB:.0f} | {t.step_time_s:.2f} | {t.tokens_per_s:,.0f}"
                         f"{'' if c.speed_evidenced else '*'} | {t.mfu:.0%} | {'tie' if id(c) in tied else ''} |")
        lines += ["", f"Band: {time_band(hw.gpu).text()}.", "", "Not possible:", ""]
        lines += [f"- {c.strategy.name}: {c.reason}" for c in cands if not c.feasible] or ["- (none)"]
        lines.append("")
    out = Path(__file__).parent / "results" / "plans.md"
    out.parent.mkdir(exist_ok=True)
    text = "\n".join(lines)
    marker = "## Why these choices"
    if out.exists() and marker in out.read_text():
        text += "\n" + out.read_text()[out.read_text().index(marker):]
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
