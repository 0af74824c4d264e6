"""Step time: compute over the GPU's dense peak at the efficiency toolkit.estimate.efficiency fits to published runs,
communication over the links each strategy uses, the pipeline bubble, and offload traffic. Ranking needs the order
right more than the absolute time; every assumption is a named constant here or there and is printed by `--explain`;
the held-out error of the whole step against published runs is the time band (toolkit.estimate.errorband.time_band).

Sources: FLOPs = 6 x active params per token + attention (Kaplan et al. 2020; Korthikanti et al. 2022 for the
attention term and recompute); collective costs are ring algorithms (all-reduce 2(N-1)/N x bytes, all-gather and
reduce-scatter (N-1)/N x bytes: NCCL's bus-bandwidth convention); pipeline bubble (P-1)/(M+P-1) for 1F1B
(Narayanan et al. 2021).
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.estimate.collectives import all_to_all_s as _all_to_all
from toolkit.estimate.collectives import group_bandwidth as _group_bandwidth
from toolkit.estimate.collectives import recompute_factor as _recompute_factor
from toolkit.estimate.collectives import ring_s as _ring
from toolkit.estimate.efficiency import (COMPUTE, ComputeModel, Recompute, compute_seconds_per_token,
                                          flop_split, matmul_efficiency)
from toolkit.estimate.experttime import (autoep_zero_comm_s, expert_assumptions, expert_compute, expert_exchange_s,
                                         expert_parallel_fsdp_comm_s)
from toolkit.estimate.hosttime import host_assumption, host_step_s, micro_step_host_ops, optimizer_host_ops
from toolkit.estimate.savers import UNMODELLED_SPEED, exposed_copy_s, speed_unmodelled
from toolkit.estimate.visiontime import vision_time
from toolkit.inputs.choices import GIB, compute_bytes, weight_bytes
from toolkit.inputs.hardware import Hardware, power_source
from toolkit.inputs.grid import ParallelGrid, grid_of
from toolkit.inputs.job import Job
from toolkit.inputs.modelspec import ModelSpec
from toolkit.inputs.strategy import Engine, Strategy
from toolkit.inputs.spreduce import zero_reduce_bytes

OVERLAP = {Engine.FSDP2: 0.47, Engine.DDP: 0.7, Engine.DEEPSPEED: 0.7}
"""Fraction of the data-parallel communication (up to the backward's length) hidden behind compute, per engine.
FSDP2's is fitted with the compute constants on the calibration rows of the published corpus (benchmarks/
throughput.py --fit; FSDP rows whose collectives are up to half their compute: 13B-70B at micro-batch 2 across
nodes). DDP's and ZeRO's are assumed (bucketed gradient overlap, the same order): no published multi-GPU DDP or
ZeRO row with a full configuration; gpu_check --timing measures them."""
OVERLAP_FITTED = frozenset({Engine.FSDP2})
CPU_ADAM_PARAMS_PER_S = 2.0e9
"""DeepSpeedCPUAdam throughput per node (AVX-512, all cores): ~1 s per 2B parameters. Assumed. FSDP2's
CPUOffloadPolicy runs torch's own optimizer on the CPU shards instead and is priced at the same rate (cpu_step_s)."""


def cpu_step_s(trainable: float, shard: int, ranks_per_node: int) -> float:
    """Seconds of the optimizer step on the CPU, for every offload that runs it there: each of the node's ranks
    steps its 1/shard of the trainable parameters, and they share the node's cores (CPU_ADAM_PARAMS_PER_S)."""
    return trainable * ranks_per_node / shard / CPU_ADAM_PARAMS_PER_S
NVME_GBPS = 6.0
"""NVMe read/write bandwidth per node (two Gen4 drives). Assumed."""
P2P_EFFICIENCY = 0.8
LORA_HBM_EFFICIENCY = 2.5
"""Effective fraction of HBM bandwidth at which PEFT's unfused LoRA kernels' bytes (LORA_FEATURE_PASSES) cost time.
Fitted by benchmarks/lora.py on the calibration rows of both published corpora together (benchmarks/data/
lora_gpu.json and the LoRA rows of benchmarks/data/throughput_gpu.json; held-out rows never used), the compute
efficiency and DEQUANT_EFFICIENCY held as committed: least squares on log(ours / published) over a 0.25-6 grid.
Above 1 it is not a bandwidth: the rows' LoRA cost is below PEFT's counted bytes at HBM peak (1.0), so fewer bytes
reach HBM than counted, or the compute term is pessimistic for a frozen base; the rows cannot tell which (NeMo
runs its own LoRA module, the RTX 4090 rows borrow Ampere's compute efficiency). The minimum is shallow (2.0-3.0
within 1% of its sum of squared log errors) and the term switched off is worse. Was 0.7 (assumed) with 6 passes a feature and 5 us
launches. Profile and per-row errors: benchmarks/results/lora.md, 'The LoRA term fitted on both corpora'."""
LORA_FEATURE_PASSES = 8.0
"""Activation elements read or written per token and adapted feature (in + out of each wrapped Linear), forward and
backward, in peft 0.21's LoRA Linear (tuners/lora/layer.py, `result + lora_B(lora_A(dropout(x))) * scaling`, each
op its own kernel beside the base Linear's): forward reads x for lora_A (1 in), lora_B writes its product (1 out),
`* scaling` reads and writes it (2 out), the add reads both and writes the sum (3 out); backward: scaling's gradient
(2 out), lora_B's input and weight gradients each read the output gradient (2 out), lora_A's input gradient writes
(1 in) and weight gradient reads x (1 in), and autograd sums the two input gradients (3 in). 6 in + 10 out: 8 a
feature on average (in and out are not counted apart; for all-linear targets they are close)."""
LORA_RECOMPUTE_PASSES = 3.5
"""Per token and feature when a checkpointed layer recomputes the adapters' forward (1 in + 6 out, averaged)."""
LORA_DROPOUT_PASSES = 2.0
"""Per token and feature when lora_dropout > 0 (nn.Dropout, else nn.Identity): forward reads x and writes its copy,
backward reads the copy's gradient and writes the input's (4 in, averaged); its 1-byte mask is left out."""
LORA_KERNELS_PER_MODULE = 10
"""Kernels one wrapped Linear adds per micro-step without dropout: lora_A, lora_B, mul, add forward; mul, two for
lora_B, two for lora_A, and the gradient sum backward (+1 forward, +1 backward with dropout; the forward's again
when recomputed). Each costs KERNEL_OVERHEAD_S."""
DEQUANT_EFFICIENCY = 0.22
"""Fraction of memory bandwidth bitsandbytes' 4-bit dequantisation kernel reaches (it reads packed codes and
absmax blocks and writes the compute-dtype weight). Fitted by benchmarks/lora.py on the calibration rows of
benchmarks/data/lora_gpu.json (published LoRA / QLoRA runs; held-out rows never used): least squares on
log(ours / published) over the QLoRA rows. LitGPT's bitsandbytes 0.41 runs on an A100-40GB, where dequantisation
is 40-49% of the step, carry the fit; Answer.AI's 2024 runs (2-20%) barely move it. Held-out error and the
resulting QLoRA / LoRA ratios: benchmarks/results/lora.md. Was 0.35 (assumed) before the corpus."""

# torch.compile's speed-up, kept apart from the compute efficiency (toolkit.estimate.efficiency): the elementwise and
# reduction work (norms, activations, residual adds, rotary, casts, the loss's softmax) is memory-bound, and
# inductor fuses it into fewer kernels that move fewer bytes (toolkit.estimate.compiled._traffic counts both sides
# from the partitioned graphs). Matmuls and attention run the same kernels either way.
ELEMENTWISE_HBM_EFFICIENCY = 0.87
"""Fraction of HBM peak the memory-bound elementwise kernels stream at, eager and compiled alike. Fitted, on one
published compile-on/off pair only: torchtitan Llama-3.1-8B on 8 H100 (FSDP2, per-op selective checkpointing, each
block compiled, seq 8192, micro-batch 2; 5762 -> 6667 tokens/s/GPU, benchmarks/llama3_h100_202412_torchtitan.md),
which gives 0.875 (benchmarks/published.py fit_compile_efficiency; 0.880 before the MPT rows of the
compute fit moved to GPT-2-block configs), in the 80-90% that STREAM-style kernels reach on
H100 (NVIDIA H100 tuning guide). Held out: the same model on 128 H100 (-3%) and torchtune Llama-3.2-3B on one A100
(no checkpointing, 7075 -> 8998 tokens/s; -9%, its compiled loss's fusion not counted) off their published
speed-ups (benchmarks/results/published.md)."""
KERNEL_OVERHEAD_S = 3e-6
"""Fixed cost of one small GPU kernel in a stream (launch latency, ramp-up and tail). ASSUMED, NOT SOURCED: no
published per-kernel (or per-op) figure for PyTorch eager on A100/H100 was found. PyTorch's "Accelerating PyTorch
with CUDA Graphs" (pytorch.org blog, 2021-10-26; pytorch/pytorch.github.io _posts/2021-10-26-accelerating-pytorch-
with-cuda-graphs.md) says only that strong-scaled GPU operations take "just a few microseconds" and that launch
overheads then stall the GPU, with no per-kernel number; NVIDIA's "Getting Started with CUDA Graphs"
(developer.nvidia.com/blog/cuda-graphs, 2019) times a few-microsecond kernel back to back on a V100, but its text
could not be retrieved to cite its figures. 3 us is chosen inside that "few microseconds". Not fitted either: the
published pairs cannot separate it from ELEMENTWISE_HBM_EFFICIENCY (an exact two-constant fit on the two
independent pairs gives a negative efficiency and about 100 us a kernel), and it is a few per cent of the saving."""


@dataclass(frozen=True)
class Timing:
    step_time_s: float
    tokens_per_s: float
    compute_s: float
    communication_s: float
    """Exposed (not overlapped) communication."""
    bubble_s: float
    offload_s: float
    mfu: float
    """Model FLOPs utilisation the prediction implies (useful FLOPs / peak), recompute excluded; an image job's
    vision encoder's model FLOPs included (toolkit.estimate.visiontime.VisionTime.model_flops_per_sample)."""
    assumptions: tuple[str, ...] = ()
    lora_overhead_s: float = 0.0
    """LoRA / QLoRA: the adapters' extra matmuls beyond their FLOPs (memory-bound passes over the activations and
    small-kernel launches; lora_overhead_s())."""
    dequant_s: float = 0.0
    """QLoRA: dequantising every 4-bit weight to the compute dtype before each matmul that uses it (dequant_s())."""
    compile_saved_s: float = 0.0
    """torch.compile: compute time the fused elementwise kernels save (already taken off compute_s)."""
    tiled_recompute_s: float = 0.0
    """ALST tiling: the MLPs' and LM head's forward that DeepSpeed's tiled functions run again in backward
    (tiled_recompute_s())."""
    reference_s: float = 0.0
    """DPO: the reference's forward under no_grad in each step (toolkit.estimate.preference.dpo_step_time); GRPO: its
    no_grad scoring forwards (reference, vLLM importance sampling)."""
    reward_s: float = 0.0
    """GRPO with --reward-model: the reward model's scoring forward over the step's completions (and, under ZeRO-3,
    the all-gather of its shards), toolkit.estimate.reward."""
    generation_s: float = 0.0
    """GRPO: generating the step's completions, decode-bound (toolkit.estimate.grpo.grpo_step_time)."""
    precompute_s: float = 0.0
    """DPO with precomputed reference log-probs: the reference's forward over one step's data, run once over the
    dataset before training and not part of step_time_s (toolkit.estimate.duration adds the pass)."""
    unmodelled: tuple[str, ...] = ()
    """Memory savers the job turns on whose effect on the step time is left out (toolkit.estimate.savers
    .speed_unmodelled: "liger", "activation offloading")."""
    experts_s: float = 0.0
    """Expert parallelism: the rank's grouped expert GEMMs, part of compute_s (toolkit.estimate.experttime), whose
    efficiency is assumed within experttime.GROUPED_MM_EFFICIENCY_BAND."""
    vision_s: float = 0.0
    """Image-and-text jobs: the vision encoder's and projector's forward, backward and recompute, part of compute_s
    (toolkit.estimate.visiontime)."""
    fixed_s: float = 0.0
    retry_s: float = 0.0
    """The caching allocator's retries at the GPU's capacity, part of step_time_s (toolkit.estimate.retries)."""
    """The fixed per-step cost a calibration of this machine fitted (toolkit.inputs.calibration step_overhead_s)."""
    host_s: float = 0.0
    """The host's dispatch of the step's operations (toolkit.estimate.hosttime): every mixture-of-experts job, and a
    dense one on a GPU whose work is short enough for it to bind; the step is at least this long."""
    moe: bool = False
    """A mixture of experts: its host term (host_s) is unverified on GPUs (the dense one is measured)."""

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "compute_s": self.compute_s,
                "communication_s": self.communication_s, "bubble_s": self.bubble_s, "offload_s": self.offload_s,
                "lora_overhead_s": self.lora_overhead_s, "dequant_s": self.dequant_s,
                "mfu": self.mfu, **({"compile_saved_s": self.compile_saved_s} if self.compile_saved_s else {}),
                **({"tiled_recompute_s": self.tiled_recompute_s} if self.tiled_recompute_s else {}),
                **({"reference_s": self.reference_s} if self.reference_s else {}),
                **({"precompute_s": self.precompute_s} if self.precompute_s else {}),
                **({"generation_s": self.generation_s} if self.generation_s else {}),
                **({"reward_s": self.reward_s} if self.reward_s else {}),
                **({"unmodelled": list(self.unmodelled)} if self.unmodelled else {}),
                **({"experts_s": self.experts_s} if self.experts_s else {}),
                **({"vision_s": self.vision_s} if self.vision_s else {}),
                **({"fixed_s": self.fixed_s} if self.fixed_s else {}),
                **({"retry_s": self.retry_s} if self.retry_s else {}),
                **({"host_s": self.host_s} if self.host_s else {})}


def mlp_matmul_params(spec: ModelSpec) -> int:
    """Weights one token multiplies through in the decoder layers' MLPs: the layers' matmul weights less the
    attention projections (q and o: hidden x heads x head_dim each; k and v: hidden x KV heads x head_dim each), each
    layer's own."""
    return sum(max(0, p - spec.hidden * d * 2 * (h + kv))
               for p, (h, kv, d) in zip(spec.layer_matmul_params, spec.attention_shapes()))


def tiled_recompute_s(spec: ModelSpec, tokens: int, per_token_flop_s: float) -> float:
    """DeepSpeed's TiledMLP and SequenceTiledCompute run each chunk's forward under no_grad, then again with grad in
    backward (ulysses_sp.py): one more forward of the MLPs and of the LM head (2 FLOPs per weight per token) over
    the step's tokens."""
    return 2 * (mlp_matmul_params(spec) + spec.head_matmul_params) * tokens * per_token_flop_s


def lora_overhead_s(counts, adapter, *, num_layers: int, tokens: int, micro_steps: int, checkpointing: bool,
                    activation_bytes: int, hbm_gbps: float) -> float:
    """Time PEFT's LoRA kernels add beyond their FLOPs (flops_per_token counts those) for one replica's step.

    Each adapted Linear of in x out features holds r x (in + out) adapter parameters, so adapter_params / r is the
    summed in + out features the adapters stream per token: LORA_FEATURE_PASSES activation elements each (+
    LORA_RECOMPUTE_PASSES with checkpointing, + LORA_DROPOUT_PASSES with dropout) at LORA_HBM_EFFICIENCY of HBM
    bandwidth, plus LORA_KERNELS_PER_MODULE kernels per adapted module and micro-step at KERNEL_OVERHEAD_S."""
    dropout = adapter.dropout > 0
    passes = (LORA_FEATURE_PASSES + (LORA_RECOMPUTE_PASSES if checkpointing else 0.0)
              + (LORA_DROPOUT_PASSES * (1.5 if checkpointing else 1.0) if dropout else 0.0))
    features = counts.adapter_params / adapter.r
    streamed = tokens * features * activation_bytes * passes
    modules = num_layers * max(1, len(counts.per_module))
    forward = 4 + (1 if dropout else 0)
    kernels = LORA_KERNELS_PER_MODULE + (2 if dropout else 0) + (forward if checkpointing else 0)
    return streamed / (hbm_gbps * 1e9 * LORA_HBM_EFFICIENCY) + micro_steps * modules * kernels * KERNEL_OVERHEAD_S


def dequant_s(counts, *, micro_steps: int, checkpointing: bool, compute_bytes: int, hbm_gbps: float) -> float:
    """QLoRA: bitsandbytes dequantises a whole 4-bit weight into the compute dtype for every matmul that uses it in
    training (forward, input-gradient backward, recompute), then runs a dense matmul. Each time it reads the packed
    weight with its constants and writes compute_bytes per element."""
    passes = 2 + (1 if checkpointing else 0)
    per_pass = counts.quantized_bytes + counts.quantized_params * compute_bytes
    return micro_steps * passes * per_pass / (hbm_gbps * 1e9 * DEQUANT_EFFICIENCY)


def data_parallel_gather_bytes(counts, job: Job) -> float:
    """LoRA / QLoRA: bytes one ZeRO-3 / FSDP2 all-gather pass moves over the whole model (before the ring's
    (N-1)/N): the frozen base as those engines shard it (toolkit.inputs.lora.sharded_base_bytes: QLoRA's packed
    4-bit codes without their constants, which stay on every GPU) and the adapters in the compute dtype (FSDP2's
    MixedPrecisionPolicy param_dtype; DeepSpeed's bf16 module). A base stored wider (--base-dtype fp32 under FSDP2)
    is cast to param_dtype shard by shard before the all-gather (torch _fsdp_param.py all_gather_inputs), so the
    base moves in the compute dtype too."""
    from toolkit.inputs.lora import sharded_base_bytes

    compute = compute_bytes(job.precision)
    return sharded_base_bytes(counts, job.adapter, compute) + counts.trainable_params * compute


def data_parallel_gather_note(job: Job) -> str:
    """What data_parallel_gather_bytes counts for the frozen base, in words."""
    from toolkit.inputs.lora import quantized_base_sharded

    if job.adapter.method != "qlora":
        return "frozen base in its dtype + adapters"
    if quantized_base_sharded(job.adapter):
        return f"4-bit codes packed in {job.adapter.quant_storage}, constants kept on every GPU; rest + adapters"
    return "4-bit base stored as uint8 is not sharded, so not gathered; rest + adapters"


def flops_per_token(spec: ModelSpec, seq_len: int, checkpointing: bool,
                    trainable_params: int | None = None) -> tuple[float, float]:
    """(training FLOPs per token including recompute, model FLOPs per token without it); see
    toolkit.estimate.efficiency.flop_split for the counts."""
    split = flop_split(spec, seq_len, Recompute.of(checkpointing), trainable_params)
    return split.total, split.model


def step_time(spec: ModelSpec, strategy: Strategy, job: Job, hw: Hardware, *, pipeline_stages: int = 1,
              partition: list[int] | None = None, grid: ParallelGrid | None = None,
              recompute: Recompute | None = None, compute_model: ComputeModel = COMPUTE,
              compile_traffic: tuple = (), overlap: float | None = None, host_ops: int = 0) -> Timing:
    """Predicted time of one optimizer step (pipeline: partition None means the grid's balanced one). `grid`: the
    grid with its tensor / context / sequence degrees (default: the strategy's plain grid on hw). `recompute`
    overrides what job.checkpointing implies (the published-run benchmark uses it for selective checkpointing);
    `compute_model` other efficiency constants and `overlap` another communication overlap than the engine's
    (benchmarks/throughput.py --fit tries them). `host_ops`: the ATen operations one micro-step dispatches
    (ActivationTrace.host_ops): the step is then at least the host's dispatch of them (toolkit.estimate.hosttime)."""
    grid = grid or grid_of(strategy, hw, pipeline_stages)
    full_spec, full_job = spec, job
    if grid.model_parallel > 1:
        from toolkit.estimate.dimensions import rank_view

        view = rank_view(spec, job, grid)
        spec, job = view.spec, view.job  # one rank's parameters and tokens per sample
    world = grid.world
    P_stages = grid.pipeline_stages
    dp = grid.data_parallel
    tokens_per_gpu_step = full_job.seq_len * job.micro_batch * job.grad_accum  # per data-parallel replica
    trainable = None
    counts = None
    if job.adapter.is_adapter:
        from toolkit.inputs.lora import counts_for_spec

        counts = counts_for_spec(spec, job.adapter)
        trainable = counts.trainable_params
    # FLOPs of the whole model over the whole sample (attention grows with the full sequence), shared by the
    # ranks that split one sample: tensor x context x sequence. The efficiency is the rank's: its own GEMM widths
    # and tokens per micro-step.
    split = flop_split(full_spec, full_job.seq_len, recompute or Recompute.of(job.checkpointing), trainable)
    model_flops = split.model
    peak = hw.gpu.peak_tflops(job.precision) * 1e12
    if peak <= 0:
        peak = hw.gpu.fp32_tflops * 1e12  # no bf16 on this GPU: it would emulate; say so via the assumptions
    eff, eff_note = matmul_efficiency(hw.gpu, job.precision, job.tokens_per_micro_batch, spec.hidden, compute_model)
    per_token_s, attn_note = compute_seconds_per_token(split, hw.gpu, peak, eff,
                                                       spec.effective_attention(job.attention), compute_model)
    assumptions = [f"matmul efficiency {eff:.2f} of {peak / 1e12:.0f} TFLOP/s dense peak at "
                   f"{job.tokens_per_micro_batch:,} tokens per micro-step, hidden {spec.hidden} (toolkit.estimate.efficiency)"]
    assumptions += [n for n in (eff_note, attn_note, power_source(hw.gpu)) if n]

    # Compute: the replica's tokens through the whole model, split over the pipeline stages (balanced) and the
    # ranks that share each sample.
    compute = tokens_per_gpu_step * per_token_s / P_stages / grid.model_parallel
    expert_part = None
    if grid.expert > 1 and trainable is None:
        expert_part = expert_compute(full_spec, full_job, grid, hw, per_token_s=per_token_s,
                                     recompute=recompute or Recompute.of(job.checkpointing),
                                     compute_model=compute_model)
        compute = expert_part.seconds
    vision = vision_time(full_spec, strategy, full_job, hw, peak_flops=peak, compute_model=compute_model)
    if vision is not None:
        compute += vision.seconds
        assumptions.append(vision.note)
    compile_saved = 0.0
    if compile_traffic:
        micro_steps = job.micro_batch * job.grad_accum / P_stages / grid.model_parallel
        compile_saved = min(compute / 2, compile_saving_s(compile_traffic, hw) * micro_steps)
        compute -= compile_saved
        assumptions.append(compile_assumption(compile_traffic, hw, compile_saved))
    tiled_s = 0.0
    if job.tiled:
        # Seconds per matmul FLOP at the rank's efficiency (as the compute term), over the ranks sharing a sample.
        tiled_s = tiled_recompute_s(full_spec, tokens_per_gpu_step, 1 / (peak * eff)) / P_stages / grid.model_parallel
        assumptions.append(f"tiled MLP + loss: the MLPs' and the LM head's forward run again in backward "
                           f"({mlp_matmul_params(full_spec) + full_spec.head_matmul_params:,} weights a token "
                           "multiplies; DeepSpeed ulysses_sp.py TiledMLP, SequenceTiledCompute)")
    backward = compute * 2 / 3
    pb = compute_bytes(job.precision)
    P = spec.params
    # Gradients (all-reduce, reduce-scatter, offload traffic, CPU Adam) exist for trainable parameters only;
    # ZeRO-3 / FSDP2 all-gathers move every sharded parameter in the compute dtype (gather_bytes).
    P_grad = trainable if trainable is not None else P
    gather_bytes = P * pb if counts is None else data_parallel_gather_bytes(counts, job)
    comm = 0.0
    bubble = 0.0
    offload = 0.0
    A = job.grad_accum
    if trainable is not None:
        assumptions.append(f"{job.adapter.method}: frozen base runs forward + input-gradient backward; "
                           f"{trainable:,} trainable parameters get weight gradients and the optimizer step")
    if strategy.engine == Engine.DDP:
        grad_bytes = P_grad * weight_bytes(job.precision)
        comm = _ring(grad_bytes, dp, _group_bandwidth(hw, dp), 2)
        assumptions.append("DDP: one all-reduce of the gradients per step (no_sync while accumulating)")
    elif strategy.engine == Engine.DEEPSPEED:
        dp = grid.shard_group  # ZeRO's partition group: dp, times sp under Ulysses
        bw = _group_bandwidth(hw, dp)
        rb = zero_reduce_bytes(job.precision, grid.sequence)  # gradients reduce in fp32 under Ulysses SP
        if grid.autoep:
            comm = autoep_zero_comm_s(full_spec, grid, hw, pb, strategy.zero_stage, A)
            assumptions.append(f"DeepSpeed AutoEP {grid.expert}: ZeRO-{strategy.zero_stage} "
                               + ("gathers and reduce-scatters" if strategy.zero_stage == 3 else "reduces")
                               + f" the dense parameters over {dp} ranks and the rank's experts over "
                               f"{dp // grid.expert}")
        elif strategy.zero_stage in (1, 2):
            # stage_1_and_2.py average_tensor: each gradient bucket is all-reduced over the group and every rank keeps
            # its own slice (use_multi_rank_bucket_allreduce, true by default; reduce_scatter false, as the plan's
            # JSON sets under Ulysses SP, all-reduces too); then the updated partitions are all-gathered.
            reduces = A if strategy.zero_stage == 2 else 1
            comm = reduces * _ring(P_grad * rb, dp, bw, 2) + _ring(P_grad * pb, dp, bw, 1)
            assumptions.append(f"ZeRO-{strategy.zero_stage} all-reduces each gradient bucket (DeepSpeed's multi-rank "
                               "bucket all-reduce) " + ("every micro-step" if strategy.zero_stage == 2
                                                         else "once a step"))
        else:
            comm = A * (2 * _ring(gather_bytes, dp, bw, 1) + _ring(P_grad * rb, dp, bw, 1))
            assumptions.append("ZeRO-3: all-gather forward + all-gather backward + reduce-scatter, every micro-step")
        if strategy.offload_optimizer != "none":
            host_link = hw.gpu.pcie_gbps * 1e9
            # fp32 grads down, bf16 params up, per rank; ranks share the node's CPU for the Adam step.
            offload += (P_grad / dp) * (4 + pb) / host_link
            offload += cpu_step_s(P_grad, dp, hw.gpus_per_node)
            if strategy.offload_params != "none":
                offload += A * 2 * (gather_bytes / dp) / host_link
            if strategy.offload_optimizer == "nvme":
                offload += 2 * (P_grad / dp) * 16 * hw.gpus_per_node / (NVME_GBPS * 1e9)
            assumptions.append(f"offload: host link {hw.gpu.pcie_gbps:.0f} GB/s, CPU Adam "
                               f"{CPU_ADAM_PARAMS_PER_S / 1e9:.0f}B params/s per node")
    elif strategy.engine == Engine.FSDP2:
        dp = grid.shard_group  # FSDP2 shards over dp_shard x cp
        if strategy.fsdp_mode == "hybrid":
            shard, replicas = grid.shard_group, grid.dp_replicate
            comm = A * (2 * _ring(gather_bytes, shard, hw.gpu.intra_node_gbps, 1)
                         + _ring(P_grad * pb, shard, hw.gpu.intra_node_gbps, 1))
            comm += _ring(P_grad * pb / shard, replicas, hw.inter_node_gbps, 2)
        else:
            gathers = 1 if strategy.fsdp_mode == "grad_op" else 2
            bw = _group_bandwidth(hw, dp)
            if grid.expert > 1 and counts is None:
                comm = A * expert_parallel_fsdp_comm_s(full_spec, grid, hw, pb, gathers)
                assumptions.append(f"expert parallel {grid.expert}: FSDP2 gathers and reduce-scatters the dense "
                                   f"parameters over {dp} ranks and each rank's experts over efsdp "
                                   f"{grid.expert_shard_group}" if dp > 1 else
                                   f"expert parallel {grid.expert}: no FSDP (fsdp_size 1), nothing gathered")
            else:
                comm = A * (gathers * _ring(gather_bytes, dp, bw, 1) + _ring(P_grad * pb, dp, bw, 1))
        if strategy.offloads:
            # CPUOffloadPolicy (toolkit.estimate.states.fsdp2_offload): every micro-step copies each unit's shard
            # up for each all-gather (its stored dtype: trainable weights in weight_bytes) and every gradient
            # shard down (in the parameters' dtype); the optimizer step runs on the CPU.
            host_link = hw.gpu.pcie_gbps * 1e9
            grad_b = weight_bytes(job.precision)
            stored = gather_bytes + P_grad * (grad_b - pb)
            gathers = 1 if strategy.fsdp_mode == "grad_op" else 2
            offload += A * (gathers * stored + P_grad * grad_b) / dp / host_link
            offload += cpu_step_s(P_grad, dp, hw.gpus_per_node)
            assumptions.append(f"FSDP2 CPU offload: {gathers} H2D copies of each shard + 1 D2H of its gradients per "
                               f"micro-step over a {hw.gpu.pcie_gbps:.0f} GB/s host link, not overlapped; CPU "
                               f"optimizer step at {CPU_ADAM_PARAMS_PER_S / 1e9:.0f}B params/s per node")
    else:
        # Pipeline: activations cross stage boundaries; stages across nodes, data parallel inside a node.
        M = A
        bubble = compute * (P_stages - 1) / M if M else 0.0
        boundary_bytes = job.micro_batch * job.seq_len * spec.hidden * pb
        link = hw.inter_node_gbps if hw.nodes > 1 else hw.gpu.intra_node_gbps
        comm_p2p = 2 * M * boundary_bytes / (link * 1e9 * P2P_EFFICIENCY) if P_stages > 1 else 0.0
        stage_P = max(grid.stage_params(spec, partition))
        comm_dp = _ring(stage_P * pb, dp, hw.gpu.intra_node_gbps, 2) if dp > 1 else 0.0
        comm = comm_p2p * 0.5 + comm_dp  # sends overlap with the other direction's compute about half the time
        assumptions.append(f"1F1B bubble (P-1)/M of compute with P={P_stages}, M={M}")
    if counts is not None and (strategy.engine == Engine.FSDP2 or strategy.zero_stage == 3):
        assumptions.append(f"{job.adapter.method}: each all-gather pass moves {gather_bytes / GIB:.2f} GiB "
                           f"({data_parallel_gather_note(job)}); gradients reduced for the adapters only "
                           f"({P_grad * pb / GIB:.3f} GiB)")
    lora_s = quant_s = 0.0
    if counts is not None:
        lora_s = lora_overhead_s(counts, job.adapter, num_layers=spec.num_layers, tokens=tokens_per_gpu_step,
                                 micro_steps=A, checkpointing=job.checkpointing, activation_bytes=pb,
                                 hbm_gbps=hw.gpu.hbm_gbps) / P_stages
        assumptions.append(f"LoRA: PEFT's unfused adapter kernels stream {LORA_FEATURE_PASSES:g} activation elements "
                           f"per token and adapted feature (more with recompute / dropout) at "
                           f"an effective {LORA_HBM_EFFICIENCY:g} x {hw.gpu.hbm_gbps:.0f} GB/s (fitted), "
                           f"{LORA_KERNELS_PER_MODULE}+ kernels per module")
        if job.adapter.method == "qlora":
            quant_s = dequant_s(counts, micro_steps=A, checkpointing=job.checkpointing, compute_bytes=2,
                                hbm_gbps=hw.gpu.hbm_gbps) / P_stages
            assumptions.append(f"QLoRA: every 4-bit weight dequantised per forward / backward"
                               f"{' / recompute' if job.checkpointing else ''} at {DEQUANT_EFFICIENCY:.0%} of "
                               "memory bandwidth")
    hidden = OVERLAP.get(strategy.engine, 0.0) if overlap is None else overlap
    exposed = max(0.0, comm - hidden * min(comm, backward)) if strategy.engine != Engine.PIPELINE else comm
    if comm > 0 and strategy.engine != Engine.PIPELINE:
        assumptions.append(f"{hidden:.2f} of the communication hidden behind backward ("
                           f"{'fitted to published runs' if strategy.engine in OVERLAP_FITTED else 'assumed'})")
    if grid.model_parallel > 1:
        extra, said = model_parallel_comm_s(full_spec, full_job, grid, hw, compute)
        exposed += extra
        assumptions += said
    if grid.expert > 1:
        extra = expert_exchange_s(full_spec, full_job, grid, hw)
        exposed += extra
        if expert_part is not None:
            assumptions += expert_assumptions(full_spec, full_job, grid, hw, expert_part, extra)
    if job.activation_offloading:  # the rank's own tokens' copies (offload_copies), against its compute
        offload += exposed_copy_s(full_spec, full_job, strategy, hw, compute, grid)
    fixed = hw.gpu.step_overhead_s
    if fixed:
        assumptions.append(f"calibrated on this machine: {fixed * 1e3:.3g} ms a step fixed beside the model's terms "
                           "(`toolkit tune`'s runs of two compute sizes)")
    step = compute + bubble + exposed + offload + lora_s + quant_s + tiled_s + fixed
    host_s = 0.0
    if host_ops:
        host_ops = micro_step_host_ops(full_spec, grid, host_ops, job.checkpointing)
        step_ops = optimizer_host_ops(full_spec, job, grid, strategy)
        host_s = host_step_s(host_ops, A, step_ops)
        assumptions.append(host_assumption(host_ops, host_s, step, step_ops,
                                           expert_exchange=grid.expert > 1 and not grid.autoep,
                                           moe=bool(spec.moe_experts)))
        step = max(step, host_s)
    unmodelled = speed_unmodelled(job)
    assumptions += [UNMODELLED_SPEED[k] for k in unmodelled]
    tokens = grid.tokens_per_step(job.micro_batch, job.grad_accum, full_job.seq_len)
    vision_flops = vision.model_flops_per_sample * tokens / full_job.seq_len if vision is not None else 0.0
    mfu = (tokens * model_flops + vision_flops) / (step * peak * world) if step > 0 else 0.0
    return Timing(step_time_s=step, tokens_per_s=tokens / step, compute_s=compute, communication_s=exposed,
                  bubble_s=bubble, offload_s=offload, mfu=mfu, assumptions=tuple(assumptions),
                  compile_saved_s=compile_saved, lora_overhead_s=lora_s, dequant_s=quant_s,
                  tiled_recompute_s=tiled_s, unmodelled=unmodelled,
                  experts_s=expert_part.experts_s if expert_part is not None else 0.0,
                  vision_s=vision.seconds if vision is not None else 0.0, fixed_s=fixed, host_s=host_s,
                  moe=bool(spec.moe_experts))


def compile_saving_parts(traffic: tuple, hw: Hardware) -> tuple[float, float]:
    """(seconds the removed elementwise bytes of one sample take at the GPU's HBM peak, seconds of the removed
    kernels at KERNEL_OVERHEAD_S each)."""
    eager_bytes, compiled_bytes, eager_kernels, compiled_kernels = traffic
    return ((eager_bytes - compiled_bytes) / (hw.gpu.hbm_gbps * 1e9),
            (eager_kernels - compiled_kernels) * KERNEL_OVERHEAD_S)


def compile_saving_s(traffic: tuple, hw: Hardware) -> float:
    """Seconds torch.compile saves on one sample's forward + backward (and a checkpointed layer's recompute): the
    elementwise bytes it no longer moves, at ELEMENTWISE_HBM_EFFICIENCY of the GPU's HBM bandwidth, and the kernels
    it no longer launches."""
    traffic_s, kernels_s = compile_saving_parts(traffic, hw)
    return max(0.0, traffic_s / ELEMENTWISE_HBM_EFFICIENCY + kernels_s)


def compile_assumption(traffic: tuple, hw: Hardware, saved_s: float) -> str:
    eager_bytes, compiled_bytes, eager_kernels, compiled_kernels = traffic
    return (f"torch.compile: elementwise traffic {eager_bytes / GIB:.2f} -> {compiled_bytes / GIB:.2f} GiB and "
            f"{eager_kernels} -> {compiled_kernels} kernels a sample (fused by inductor), at "
            f"{ELEMENTWISE_HBM_EFFICIENCY:.0%} of {hw.gpu.hbm_gbps:.0f} GB/s and {KERNEL_OVERHEAD_S * 1e6:.0f} us a "
            f"kernel: {saved_s:.3f} s a step off compute")


# ----------------------------------------------------------------------------------------------------------------
# Tensor / context / sequence parallelism: communication inside one sample, per optimizer step. Kept apart from the
# data-parallel terms above; each is blocking (exposed) unless it says otherwise.

TP_COLLECTIVES_PER_LAYER = 4
"""All-reduces per decoder layer and micro-step under the tp_plan's colwise -> rowwise pairs: forward after o_proj
and after down_proj, backward for the inputs' gradients of the q/k/v and gate/up projections (Megatron-LM's f / g
operators, Shoeybi et al. 2019)."""
ULYSSES_ALL_TO_ALLS_PER_LAYER = 4
"""All-to-alls per layer and micro-step: q, k, v in and the output back in forward, the same two in backward
(Jacobs et al. 2023, DeepSpeed-Ulysses)."""


def tensor_parallel_comm_s(spec: ModelSpec, job: Job, grid: ParallelGrid, hw: Hardware) -> float:
    """Blocking all-reduces of the activations one tensor-parallel group exchanges per step, over the node's link."""
    if grid.tensor <= 1:
        return 0.0
    pb = compute_bytes(job.precision)
    local_tokens = job.seq_len // grid.seq_split * job.micro_batch
    per = _ring(local_tokens * spec.hidden * pb, grid.tensor, hw.gpu.intra_node_gbps, 2)
    per_micro = TP_COLLECTIVES_PER_LAYER * spec.num_layers * per * _recompute_factor(job)
    return job.grad_accum * per_micro


def ulysses_comm_s(spec: ModelSpec, job: Job, grid: ParallelGrid, hw: Hardware) -> float:
    """Blocking all-to-alls of q, k, v and the attention output, per step (sequence groups span nodes when sp
    exceeds a node)."""
    if grid.sequence <= 1:
        return 0.0
    p = grid.sequence
    pb = compute_bytes(job.precision)
    local = job.seq_len // p * job.micro_batch * pb
    bw = _group_bandwidth(hw, p)
    layers = sum((ULYSSES_ALL_TO_ALLS_PER_LAYER / 2) * (_all_to_all(local * d * (h + 2 * kv), p, bw)
                                                         + _all_to_all(local * d * h, p, bw))
                 for h, kv, d in spec.attention_shapes())
    return job.grad_accum * layers * _recompute_factor(job)


def ring_attention_comm_s(spec: ModelSpec, job: Job, grid: ParallelGrid, hw: Hardware,
                          attention_compute_s: float) -> float:
    """Exposed time of context parallelism's k / v exchange: gathered in forward, gathered again and the gradients
    reduce-scattered in backward, overlapped with the attention compute it feeds (torch's ring runs the next
    chunk's exchange behind the current chunk's attention)."""
    if grid.context <= 1:
        return 0.0
    c = grid.context
    pb = compute_bytes(job.precision)
    kv = 2 * job.seq_len * job.micro_batch * pb
    bw = _group_bandwidth(hw, c)
    # all-gather forward; all-gather + reduce-scatter backward
    layers = sum(3 * _ring(kv * kv_heads * d, c, bw, 1) for _, kv_heads, d in spec.attention_shapes())
    total = job.grad_accum * layers * _recompute_factor(job)
    return max(0.0, total - attention_compute_s)


def model_parallel_comm_s(spec: ModelSpec, job: Job, grid: ParallelGrid, hw: Hardware,
                          compute_s: float) -> tuple[float, list[str]]:
    """Exposed seconds of tensor / sequence / context communication per step, and what was assumed. `spec` and
    `job` are the whole model and sample; `compute_s` the rank's compute time."""
    total, model = flops_per_token(spec, job.seq_len, job.checkpointing)
    attn = 3 * 2 * 2 * (job.seq_len / 2) * spec.query_width
    attention_s = compute_s * attn / total if total else 0.0
    tp, sp = tensor_parallel_comm_s(spec, job, grid, hw), ulysses_comm_s(spec, job, grid, hw)
    cp = ring_attention_comm_s(spec, job, grid, hw, attention_s)
    said = []
    if tp:
        said.append(f"tensor parallel {grid.tensor}: {TP_COLLECTIVES_PER_LAYER} blocking all-reduces per layer "
                    f"on the node link ({tp:.3f} s/step)")
    if sp:
        said.append(f"Ulysses sp {grid.sequence}: {ULYSSES_ALL_TO_ALLS_PER_LAYER} blocking all-to-alls per layer "
                    f"({sp:.3f} s/step)")
    if grid.context > 1:
        said.append(f"context parallel {grid.context}: k/v exchange hidden behind attention, {cp:.3f} s/step "
                    "exposed")
    return tp + sp + cp, said


def zero3_release_timing(spec, strategy, job, hw, grid) -> dict:
    """StepSizes' backward_s and reduce_s_per_byte for a ZeRO-3 step from the time model: one micro-step's backward
    compute (step_time's compute, two thirds of it backward, as its overlap term takes it)
    and the reduce-scatter's seconds per byte over the partition group's link; {} where the time model cannot say."""
    if spec is None or hw is None or grid is None:
        return {}
    compute = step_time(spec, strategy, job, hw, grid=grid).compute_s
    group = grid.shard_group
    return {"backward_s": compute * 2 / 3 / max(1, job.grad_accum),
            "reduce_s_per_byte": _ring(1.0, group, _group_bandwidth(hw, group), 1)}
