"""Compute time of a training step: the FLOPs split into matmuls and attention, each over the GPU's dense peak at
an efficiency that depends on what published runs show it depends on.

    matmul efficiency     e = ceiling[architecture] x t / (t + tokens_half) x h / (h + h0),
                          h0 = hidden_half_per_balance x peak FLOP/s / HBM bytes/s
    attention efficiency  e x attention_relative[architecture]

t is the tokens one GPU pushes through one micro-step (micro-batch x sequence), h the hidden size. Each factor has
a physical reading. Each micro-step has work that does not grow with its tokens (every weight is read from HBM once
per GEMM, kernels are launched, FSDP / ZeRO gathers and frees): amortised over t tokens it is t / (t + t0). Each
token has memory-bound work that grows as h (norms, activations, residual adds, RoPE, casts) beside GEMM FLOPs that
grow as h^2; its time runs at HBM bandwidth while the GEMMs run at the tensor-core peak, so the half point h0 scales
with the GPU's machine balance (peak FLOP/s over HBM bytes/s: A100-80GB 153, A100-40GB 201, H100 SXM 295, H200 206).
Attention runs in its own kernel (FlashAttention-2, or SDPA's flash backend), whose causal forward + backward
reaches a lower fraction of peak than large GEMMs, and a lower one on Hopper than on Ampere (FlashAttention-2 uses
no Hopper-specific instructions: Shah et al. 2024, FlashAttention-3, report it at about 35% of H100 peak); that is
the relative factor, and it is what makes long sequences slower per FLOP. The calibration rows show both effects:
before these two terms the errors grew with the attention share of FLOPs on H100 and not on A100, and A100-40GB rows
ran slower than A100-80GB ones at equal peak.

The constants are fitted by benchmarks/throughput.py on the calibration split of benchmarks/data/throughput_gpu.json
(published runs; the split is a hash of each row id, stated there) and never on its held-out rows; the held-out
errors are the step-time error band (toolkit.estimate.errorband.time_band). What the corpus does not cover is an assumption
and says so in the step's notes: architectures without a published row borrow the nearest one's ceiling, eager
attention borrows the flash kernels' factor, fp32 keeps the old plain constant.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.inputs.cpudevice import CPU_ARCHITECTURE
from toolkit.inputs.hardware import Gpu
from toolkit.inputs.job import CHECKPOINTING_OP
from toolkit.inputs.modelspec import ModelSpec


@dataclass(frozen=True)
class Recompute:
    """Share of the forward that activation checkpointing runs again in backward."""

    matmul: float = 0.0
    attention: float = 0.0

    @staticmethod
    def of(checkpointing: bool) -> "Recompute":
        """Full checkpointing (the HF / DeepSpeed / FSDP wrapper around each decoder layer) reruns each layer's whole
        forward; no checkpointing reruns nothing; the per-op selective policy ("op") about half the matmuls."""
        if checkpointing == CHECKPOINTING_OP:
            return SELECTIVE_OP_RECOMPUTE
        return FULL_RECOMPUTE if checkpointing else NO_RECOMPUTE


NO_RECOMPUTE = Recompute(0.0, 0.0)
FULL_RECOMPUTE = Recompute(1.0, 1.0)
SELECTIVE_OP_RECOMPUTE = Recompute(0.5, 0.0)
"""torchtitan's per-op selective checkpointing (selective_ac_option='op'): its policy saves every other matmul
output and the SDPA outputs, so about half the layer matmuls and no attention run again (torchtitan
models/llama3/parallelize: _save_list and the 'mm' alternation). Used for the published rows that ran it."""


@dataclass(frozen=True)
class FlopSplit:
    """Training FLOPs per token."""

    matmul: float
    """Linear layers (and LM head), forward + backward + recompute."""
    attention: float
    """Score and value products (causal: half the square), forward + backward + recompute."""
    model: float
    """Model FLOPs (no recompute): what MFU divides."""

    @property
    def total(self) -> float:
        return self.matmul + self.attention


def flop_split(spec: ModelSpec, seq_len: int, recompute: Recompute, trainable_params: int | None = None) -> FlopSplit:
    """Training FLOPs per token, split by kernel kind.

    Full fine-tuning: backward = 2 x forward (input gradients + weight gradients; Kaplan et al. 2020: 6 x params per
    token). LoRA / QLoRA (`trainable_params` = the adapters' count): the frozen base runs forward and the
    input-gradient half of backward only; each adapter parameter adds 2 FLOPs forward and 4 backward per token.
    Causal attention: QK^T and AV each 2 x seq/2 x attn_dim multiply-adds per token per layer on average
    (Korthikanti et al. 2022 count the full square; causal kernels skip the masked half); its backward is twice its
    forward whether or not the weights train."""
    matmul_params = sum(spec.layer_matmul_params) + spec.head_matmul_params
    layer_matmul_params = sum(spec.layer_matmul_params)
    attention_fwd = 2 * 2 * (seq_len / 2) * spec.query_width
    if trainable_params is not None:
        matmul = 2 * matmul_params * 2 + 6 * trainable_params
        layer_fwd = 2 * layer_matmul_params + 2 * trainable_params
    else:
        matmul = 2 * matmul_params * 3
        layer_fwd = 2 * layer_matmul_params
    attention = 3 * attention_fwd
    model = matmul + attention
    return FlopSplit(matmul=matmul + recompute.matmul * layer_fwd,
                     attention=attention + recompute.attention * attention_fwd, model=model)


@dataclass(frozen=True)
class ComputeModel:
    """The fitted constants (benchmarks/throughput.py --fit prints them from the calibration rows)."""

    ceiling: dict[str, float]
    """Matmul efficiency with many tokens per micro-step and a wide model, per architecture with a published row."""
    tokens_half: float
    """Tokens per GPU per micro-step at which the fixed per-micro-step work halves the matmul efficiency."""
    hidden_half_per_balance: float
    """Hidden size at which per-token memory-bound work halves the matmul efficiency, per FLOP/byte of machine
    balance."""
    attention_relative: dict[str, float]
    """Fused causal attention (FlashAttention-2 / SDPA flash) forward + backward efficiency over the matmuls', per
    architecture."""

    def hidden_half(self, peak_flops: float, hbm_bytes_per_s: float) -> float:
        return self.hidden_half_per_balance * peak_flops / hbm_bytes_per_s


COMPUTE = ComputeModel(ceiling={"hopper": 0.682, "ampere": 0.782}, tokens_half=524.0, hidden_half_per_balance=3.39,
                       attention_relative={"hopper": 0.330, "ampere": 0.510})
"""Fitted on the calibration rows of benchmarks/data/throughput_gpu.json (see benchmarks/results/throughput.md)."""

BORROWED_CEILING = {"volta": "ampere", "turing": "ampere", "ada": "ampere", "blackwell": "hopper",
                    "cdna2": "ampere", "cdna3": "hopper"}
"""Architectures with no published row in the corpus: the ceiling of the nearest one that has rows (by dense-peak
class). An assumption, said in the step's notes."""

FP32_EFFICIENCY = 0.70
"""fp32 runs on CUDA cores whose peak is low and kernels get closer to it. Assumed: no fp32 row in the corpus."""


def _measured_architecture(architecture: str, model: ComputeModel) -> tuple[str, str | None]:
    if architecture in model.ceiling:
        return architecture, None
    borrowed = BORROWED_CEILING.get(architecture, "ampere")
    return borrowed, (f"no published {architecture or 'unknown-architecture'} run in the corpus: {borrowed}'s "
                      "matmul ceiling and attention factor assumed")


def matmul_efficiency(gpu: Gpu, precision: str, tokens_per_micro_step: int, hidden: int,
                      model: ComputeModel = COMPUTE) -> tuple[float, str | None]:
    """(Fraction of dense peak the step's matmuls reach, the assumption made if any), divided by the GPU's
    calibrated compute ratio (toolkit.inputs.calibration; 1 uncalibrated)."""
    eff, note = _uncalibrated_efficiency(gpu, precision, tokens_per_micro_step, hidden, model)
    if gpu.compute_ratio != 1.0:
        return eff / gpu.compute_ratio, "; ".join(n for n in (note, (
            f"calibrated on this machine: efficiency / {gpu.compute_ratio:.3g}, the measured over predicted compute "
            "time of `toolkit tune`")) if n)
    return eff, note


def _uncalibrated_efficiency(gpu: Gpu, precision: str, tokens_per_micro_step: int, hidden: int,
                             model: ComputeModel) -> tuple[float, str | None]:
    if gpu.architecture == CPU_ARCHITECTURE:
        return 1.0, ("CPU processes: the measured torch.mm rate is the peak, reached at every size (efficiency 1 "
                     "assumed; toolkit.inputs.cpudevice)")
    if precision == "fp32":
        return FP32_EFFICIENCY, "fp32: efficiency 0.70 of the plain fp32 peak assumed (no fp32 run in the corpus)"
    arch, note = _measured_architecture(gpu.architecture, model)
    t = max(1, tokens_per_micro_step)
    h0 = model.hidden_half(gpu.peak_tflops(precision) * 1e12, gpu.hbm_gbps * 1e9)
    return model.ceiling[arch] * t / (t + model.tokens_half) * hidden / (hidden + h0), note


def compute_seconds_per_token(split: FlopSplit, gpu: Gpu, peak_flops: float, efficiency: float,
                              attention_kernel: str, model: ComputeModel = COMPUTE) -> tuple[float, str | None]:
    """Seconds one GPU spends per token on the step's FLOPs (before any pipeline split)."""
    note = None
    if gpu.architecture == CPU_ARCHITECTURE:
        return split.total / (peak_flops * efficiency), note
    if attention_kernel == "eager":
        note = "eager attention: the fused kernels' attention efficiency assumed (no eager run in the corpus)"
    arch, _ = _measured_architecture(gpu.architecture, model)
    attention_eff = efficiency * model.attention_relative[arch]
    return split.matmul / (peak_flops * efficiency) + split.attention / (peak_flops * attention_eff), note
