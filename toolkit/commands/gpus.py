"""`toolkit gpus`: the GPU catalog (memory, peak rate, link)."""

from __future__ import annotations
from toolkit.inputs.choices import GIB


def add_parser(sub) -> None:
    sub.add_parser("gpus", help="list the GPU catalog").set_defaults(func=cmd_gpus)


def cmd_gpus(args) -> int:
    from toolkit.inputs.hardware import gpu_catalog

    for g in gpu_catalog().values():
        # A GPU without bf16 (V100, T4) trains in fp16: show that rate, not "bf16 0.0".
        rate = f"bf16 {g.bf16_tflops:>7.1f}" if g.bf16_supported else f"fp16 {g.fp16_tflops:>7.1f}"
        print(f"{g.name:<18}{g.memory_bytes / GIB:>8.1f} GiB  {rate} TFLOP/s  "
              f"link {g.intra_node_gbps:>5.0f} GB/s ({g.interconnect})")
    return 0
