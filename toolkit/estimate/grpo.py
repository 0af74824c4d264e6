"""What a GRPO job (TRL's GRPOTrainer, toolkit.inputs.grpo) adds to one GPU's memory and step beside the policy's
supervised step on prompt + completion sequences (docs/ENGINE_FACTS.md, "GRPO"):

- generation in the training process (transformers' generate): the KV cache of the process's generation batch
  (per_device_train_batch_size x steps_per_generation sequences of prompt + completion tokens) in the compute dtype,
  from the model's own layers / KV heads / head dim; under ZeRO-3 the whole policy gathered (ds3_gather_for_generation,
  TRL's default). The phase runs before the policy's forward, beside the model states only;
- vLLM colocated: vLLM takes vllm_gpu_memory_utilization of each GPU for the whole run; training must fit in the rest,
  and vLLM's weights and one batch's KV cache must fit in its share: the window of the fraction that does both;
- vLLM server: generation runs on other GPUs (a `trl vllm-serve` process), nothing on these;
- the reference (beta != 0) as toolkit.estimate.preference.reference_of places it.

Generation time is decode: every new token reads the weights and the keys and values its attention reads (a sliding
layer at most its window, decode_read_width) from HBM once per step, so a step of the whole batch takes (weight
bytes + those KV bytes) / HBM bandwidth; no published GRPO row backs it ('no band').

The generator's weights (generator_weight_bytes) are the policy's as it is held: a LoRA / QLoRA policy generates with
its frozen base and adapters, and a QLoRA base reads its 4-bit codes: without gradients bitsandbytes' matmul_4bit
runs the fused gemm_4bit kernel on the packed weight for any batch (bitsandbytes/autograd/_functions.py), no
dequantised copy. vLLM holds the base without adapters (TRL merges them into the weights it syncs), in 4 bits when
the policy is a bitsandbytes 4-bit model (TRL starts vLLM with quantization="bitsandbytes",
trl/generation/vllm_generation.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from toolkit.estimate.collectives import group_bandwidth, ring_s
from toolkit.estimate.breakdown import Breakdown, Term, reserved_bytes
from toolkit.inputs.choices import GIB, compute_bytes, weight_bytes
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.grpo import COLOCATE, GENERATE, SERVER
from toolkit.inputs.job import Job
from toolkit.inputs.modelspec import ModelSpec
from toolkit.inputs.strategy import Engine, Strategy

GENERATION_PHASE = "generation (transformers generate)"


def generation_sequences(job: Job) -> int:
    """Sequences one process generates at once: its slice of the generation batch, per_device_train_batch_size x
    steps_per_generation (GRPOConfig: steps_per_generation defaults to gradient_accumulation_steps)."""
    return job.micro_batch * job.grad_accum


def kv_cache_bytes(spec: ModelSpec, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for `sequences` x `tokens`: 2 x KV heads x head dim summed over the layers
    (each layer's own: Gemma-4's global layers differ) x tokens x dtype bytes per sequence (a dense cache, as
    transformers' DynamicCache grows it to the longest sequence)."""
    return 2 * spec.kv_width * tokens * sequences * dtype_bytes


def cache_width(spec: ModelSpec, seen: int, fed: int) -> int:
    """KV heads x head dim x tokens summed over the decoder layers as transformers' DynamicCache stores them once
    `seen` tokens went through, the last forward feeding `fed` of them (cache_utils.py, docs/ENGINE_FACTS.md "The KV
    cache transformers' generate keeps"): a full-attention layer every token; a sliding-window layer the tensor its
    last update concatenated (what it kept, at most window - 1 tokens, and the `fed` new ones), of which it keeps a
    view, so the whole prompt after the prefill and min(seen, window) once decoding; a layer reusing another's cache
    or without attention nothing."""
    windows = spec.layer_cache_windows or (None,) * spec.num_layers
    return sum(kv * d * (seen if w is None else min(seen - fed, w - 1) + fed if w else 0)
               for (_, kv, d), w in zip(spec.attention_shapes(), windows))


def generate_cache_bytes(spec: ModelSpec, sequences: int, prompt: int, completion: int, dtype_bytes: int) -> int:
    """The most bytes the KV cache of transformers' generate holds for `sequences` of `prompt` + `completion` tokens:
    after the prefill (every layer the whole prompt) or at the end (cache_width); a model whose every layer keeps
    every token holds kv_cache_bytes at the end."""
    end = cached_tokens(prompt, completion)
    return 2 * sequences * dtype_bytes * max(cache_width(spec, prompt, prompt), cache_width(spec, end, 1))


def sampling_bytes(sequences: int, vocab: int, dtype_bytes: int, processors: int = 0) -> tuple[int, int]:
    """What generate's sampling keeps beside the cache (generation/utils.py _sample): between forwards the fp32 copy of
    the last position's logits, the processed scores when a logits processor made a new tensor (`processors`: 0 with
    TRL's defaults, temperature 1, top_p 1, top_k 0, no min_p) and the softmax probabilities; at the head of the next
    forward, while those are still bound, its logits in the model dtype, their fp32 copy and the new scores and
    probabilities (multinomial's exponential draw takes the place of the old ones). Returns (between forwards, at the
    head)."""
    row = sequences * vocab
    return row * 4 * (2 + processors), row * (dtype_bytes + 4 * (3 + processors))


def attention_bytes(spec: ModelSpec, sequences: int, queries: int, keys: int, dtype_bytes: int, attention: str) -> int:
    """The most one layer's attention allocates beside the cache in a forward of `queries` new tokens over `keys` (a
    decode step's sliding layer at most its window; the prefill's gets the whole prompt from its cache): with grouped KV heads eager and sdpa attention repeat the layer's keys and
    values to every query head (repeat_kv, a copy; sdpa takes grouped ones only without a mask, and left-padded
    prompts give one); eager attention's scores (QK^T and its scaled copy in the model dtype; below fp32 the softmax's
    fp32 input and output beside the masked scores) and its additive mask; a decode step's (one query) the key or
    value tensor DynamicLayer.update replaces, alive while torch.cat makes the longer one. flash attention reads the
    cache as it is. Plus the fed tokens' residual stream, its normed copy and the layer's input, the queries and the
    rotary tables (transformers' Llama-style layers, measured in tests/test_grpo.py)."""
    windows = spec.layer_cache_windows or (None,) * spec.num_layers
    scores = 2 * dtype_bytes if dtype_bytes >= 4 else dtype_bytes + 8
    most = 0
    for (h, kv, d), w in zip(spec.attention_shapes(), windows):
        n = keys if w is None or queries > 1 else min(keys, w) if w else 0
        cat = sequences * kv * d * (n - 1) * dtype_bytes if n and queries == 1 else 0
        repeat = 2 * sequences * h * d * n * dtype_bytes if h != kv and attention != "flash_attention_2" else 0
        eager = sequences * queries * (h * scores + dtype_bytes) * n if attention == "eager" else 0
        fed = sequences * queries * (3 * spec.hidden + h * d + 2 * d) * dtype_bytes
        most = max(most, cat + fed, repeat + eager + fed)
    return most


def generate_peak_bytes(spec: ModelSpec, sequences: int, prompt: int, completion: int, dtype_bytes: int,
                        attention: str, processors: int = 0) -> tuple[int, str]:
    """The most transformers' generate holds beside the model for `sequences` of `prompt` + `completion` tokens (all
    sampled to the full length), and when. Beside the cache: the prompt's ids and mask it is handed and its position
    ids (int64), from the first decode step on the ids, mask and position ids it grows (prompt + completion - 1
    tokens each; generate keeps position ids where the prompts are left-padded, as unequal prompts are). In the
    prefill the last layer's attention over the prompt (attention_bytes, every layer's cache of the prompt beside
    it); at the last decode forward the cache holds prompt + completion - 1 tokens, the last step's sampling tensors
    are still bound, and either one layer's attention or the head and the new sampling (sampling_bytes) add the
    most. The MLP's intermediates are not counted (below the attention in the cases measured)."""
    tokens = cached_tokens(prompt, completion)
    ids = 3 * sequences * prompt * 8
    prefill = 2 * sequences * dtype_bytes * cache_width(spec, prompt, prompt) + ids \
        + attention_bytes(spec, sequences, prompt, prompt, dtype_bytes, attention)
    end = 2 * sequences * dtype_bytes * cache_width(spec, tokens, 1) + ids + 3 * sequences * tokens * 8
    between, head = sampling_bytes(sequences, spec.vocab, dtype_bytes, processors)
    attn = between + attention_bytes(spec, sequences, 1, tokens, dtype_bytes, attention)
    return max((prefill, "prefill"), (end + attn, "last decode step's attention"),
               (end + head, "last decode step's head and sampling"))


def decode_read_width(spec: ModelSpec, prompt: int, completion: int) -> int:
    """KV heads x head dim x tokens the attention reads, summed over the decoder layers and over generate's decode
    steps. The prefill samples the first completion token; decode step j (1 to completion - 1) feeds the j-th, so
    a full-attention layer attends over prompt + j tokens and a sliding-window layer over min(prompt + j, window):
    what DynamicSlidingWindowLayer.update hands the attention (cache_width with one token fed). A layer with no
    cache of its own (window 0: KV-shared or attention-free) is counted dense, every token: an upper bound, since
    a KV-shared layer reads its source's cache, full or sliding."""
    n = completion - 1
    windows = spec.layer_cache_windows or (None,) * spec.num_layers
    total = 0
    for (_, kv, d), w in zip(spec.attention_shapes(), windows):
        below = n if not w else min(max(w - prompt - 1, 0), n)  # steps whose prompt + j is under the window
        total += kv * d * (below * prompt + below * (below + 1) // 2 + (n - below) * (w or 0))
    return total


def cached_tokens(prompt: int, completion: int) -> int:
    """Tokens in the KV cache when generate returns: the prompt and every completion token but the last, which is
    sampled and never fed back (measured on transformers' DynamicCache, tests/test_grpo.py)."""
    return prompt + completion - 1


def generator_weight_bytes(spec: ModelSpec, job: Job, *, vllm: bool = False) -> float:
    """Bytes of the weights generation reads each decode step (module docstring): the whole model in the compute
    dtype for full fine-tuning; an adapter policy's frozen base as it is stored (QLoRA: 4-bit codes with their
    constants) and its adapters, or for vLLM the base alone."""
    cb = compute_bytes(job.precision)
    if not job.adapter.is_adapter:
        return spec.params * cb
    from toolkit.inputs.lora import base_storage_bytes_per_param, counts_for_spec, frozen_base_bytes

    counts = counts_for_spec(spec, job.adapter)
    base = frozen_base_bytes(counts, job.adapter, base_storage_bytes_per_param(job.precision))
    return base if vllm else base + counts.trainable_params * cb


def sharded_weight_bytes(spec: ModelSpec, job: Job) -> float:
    """The policy's weights as ZeRO-3 / FSDP2 shard and gather them: the whole model in the compute dtype, or an
    adapter policy's sharded base and adapters (toolkit.estimate.timing.data_parallel_gather_bytes: a QLoRA base's
    4-bit constants stay whole on every GPU)."""
    if job.adapter.is_adapter:
        from toolkit.estimate.timing import data_parallel_gather_bytes
        from toolkit.inputs.lora import counts_for_spec

        return data_parallel_gather_bytes(counts_for_spec(spec, job.adapter), job)
    return spec.params * compute_bytes(job.precision)


def _kept_words(spec: ModelSpec) -> str:
    """What the cache keeps of layers that do not keep every token: '24 sliding layers at most 1,024 tokens, 20
    KV-shared layers nothing'."""
    counts = Counter(w for w in spec.layer_cache_windows if w is not None)
    return ", ".join(f"{n} sliding layers at most {w:,} tokens" if w else f"{n} layers reusing another's cache nothing"
                     for w, n in sorted(counts.items(), reverse=True))


def _gathered_for_generation(b: Breakdown, spec: ModelSpec, strategy: Strategy, job: Job) -> float:
    """ZeRO-3 with ds3_gather_for_generation (TRL's default): GatheredParameters over the whole model, every
    parameter unsharded as ZeRO-3 holds it while generate runs (trl/models/utils.py _unwrap_model_for_generation).
    FSDP2 gathers one layer at a time in its own hooks (trl/distributed.py summon_full_params: a no-op for FSDP2) and
    keeps the root unsharded after its forward: the step's gathered parameters (b.gathered_bytes), which are not
    among those held between steps; other engines hold the whole model."""
    if strategy.engine == Engine.DEEPSPEED and strategy.zero_stage == 3:
        return sharded_weight_bytes(spec, job)
    return b.gathered_bytes if strategy.engine == Engine.FSDP2 else 0


def generate_element_bytes(strategy: Strategy, job: Job) -> int:
    """Bytes per element of what transformers' generate holds (cache, attention, sampling) for a policy generating in
    the training process: the compute dtype, except a fully trained DDP policy in mixed precision, which holds fp32
    weights and generates under torch.autocast (accelerate's prepare_model wraps its forward, and TRL's
    unwrap_model_for_generation keeps the wrapper): Llama-style rotary tables follow the fp32 hidden states, so the
    keys come out fp32 beside bf16 values, the softmax runs in fp32, and autocast caches bf16 copies of the weights
    for each forward. Counted at 4 B: TRL's generation step under autocast measured within -2% / +8.3% of that
    (benchmarks/results/grpo_memory.md, bf16 rows; 6-32% under at 2 B). DeepSpeed and FSDP2 generate on bf16 weights (the engine's bf16
    copy, FSDP2's param_dtype), an adapter policy on its base as loaded."""
    if strategy.engine == Engine.DDP and not job.adapter.is_adapter and weight_bytes(job.precision) > \
            compute_bytes(job.precision):
        return weight_bytes(job.precision)
    return compute_bytes(job.precision)


def with_generation(b: Breakdown, spec: ModelSpec, strategy: Strategy, job: Job) -> Breakdown:
    """The training breakdown `b` of the policy (and reference) with GRPO's generation added as TRL runs it."""
    grpo = job.grpo
    seqs, cb = generation_sequences(job), compute_bytes(job.precision)
    tokens = cached_tokens(grpo.max_prompt_length, grpo.max_completion_length)
    kv = kv_cache_bytes(spec, seqs, tokens, cb)
    kv_words = (f"2 x ({spec.attention_words()}) x "
                f"{tokens} tokens x {seqs} sequences x {cb} B = {kv / GIB:.2f} GiB")
    cap = b.capacity_bytes
    notes = list(b.notes)
    if grpo.generation == SERVER:
        notes.insert(0, "GRPO generation runs on other GPUs (vLLM server mode, trl vllm-serve): not on these GPUs; "
                        f"each server GPU holds the weights and a KV cache ({kv_words} per training process)")
        return replace(b, notes=tuple(notes))
    if grpo.generation == GENERATE:
        if (eb := generate_element_bytes(strategy, job)) != cb:
            cb, kv = eb, kv_cache_bytes(spec, seqs, tokens, eb)
            kv_words = (f"2 x ({spec.attention_words()}) x {tokens} tokens x {seqs} sequences x {cb} B = "
                        f"{kv / GIB:.2f} GiB (fp32 weights under autocast)")
        if spec.layer_cache_windows:
            kv = generate_cache_bytes(spec, seqs, grpo.max_prompt_length, grpo.max_completion_length, cb)
            kv_words += (f"; transformers' DynamicCache keeps {_kept_words(spec)}: "
                         f"{kv / GIB:.2f} GiB at its largest")
        gathered = _gathered_for_generation(b, spec, strategy, job)
        attention = spec.effective_attention(job.attention)
        generating, moment = generate_peak_bytes(spec, seqs, grpo.max_prompt_length, grpo.max_completion_length, cb,
                                                 attention)
        # The step's gradients are freed (zero_grad, set_to_none) before the next step generates.
        held = b.between_steps_bytes + b.reward_bytes
        peak = held + b.workspace_bytes + gathered + generating  # cuBLAS's workspaces stay allocated
        terms = list(b.terms) + [Term("generation KV cache", kv, f"{GENERATION_PHASE}, before the policy's forward: "
                                                                 f"{kv_words}"),
                                 Term("generation peak", generating,
                                      f"{GENERATION_PHASE} at its {moment} ({attention} attention): the cache, "
                                      "generate's token ids, its sampling's fp32 logits and probabilities and one "
                                      "layer's attention or the head (toolkit.estimate.grpo.generate_peak_bytes)")]
        if gathered and strategy.engine == Engine.DEEPSPEED:  # FSDP2's are the step's, among its buffers
            terms.append(Term("generation gathered weights", gathered,
                              f"ZeRO-3 ds3_gather_for_generation: {spec.params:,} params unsharded, "
                              f"{gathered / GIB:.2f} GiB"))
        phases = ((GENERATION_PHASE, int(peak)), *b.phase_peaks)  # generation comes first in the step
        if peak <= b.peak_bytes:
            return replace(b, terms=tuple(terms), notes=tuple(notes), generation_bytes=int(peak), phase_peaks=phases)
        margin = reserved_bytes(peak) - peak
        required = peak + b.context_bytes + margin
        return replace(b, peak_bytes=peak, peak_phase=GENERATION_PHASE, transient_bytes=gathered + generating,
                       margin_bytes=margin, required_bytes=required, terms=tuple(terms), notes=tuple(notes),
                       generation_bytes=int(peak), phase_peaks=phases)
    # vLLM colocate: its share is reserved for the whole run, training has the rest; with sleep mode (level 2 after
    # each generation) the share is taken only while generating, beside the model states training keeps.
    u = grpo.vllm_gpu_memory_utilization
    reserve = int(u * cap)
    tp = grpo.vllm_tensor_parallel_size
    vllm_weights = generator_weight_bytes(spec, job, vllm=True)
    vllm_needs = vllm_weights / tp + kv  # its group's sequences, their KV heads split over the group
    sleeping = grpo.vllm_enable_sleep_mode
    held = b.between_steps_bytes + b.reward_bytes + b.context_bytes  # the step's gradients are freed by then
    beside = held if sleeping else b.required_bytes
    low, high = vllm_needs / cap, 1 - beside / cap
    window = window_words(low, high)
    terms = list(b.terms) + [Term("vLLM colocate reserve", reserve,
                                  f"vllm_gpu_memory_utilization {u:g} x {cap / GIB:.1f} GiB: its weights "
                                  f"({vllm_weights / tp / GIB:.2f} GiB{f', 1/{tp} each' if tp > 1 else ''}) and "
                                  f"KV cache ({kv_words} for one batch) inside")]
    refusal = ""
    if vllm_needs > reserve:
        refusal = (f"vLLM colocate at vllm_gpu_memory_utilization {u:g} gets {reserve / GIB:.1f} GiB, less than its "
                   f"weights + one batch's KV cache ({vllm_needs / GIB:.1f} GiB); {window}")
    elif beside > cap - reserve:
        what = "the model states held while vLLM generates" if sleeping else "training"
        refusal = (f"{what}: {beside / GIB:.1f} GiB, more than the {1 - u:.0%} of "
                   f"{cap / GIB:.1f} GiB vLLM colocate leaves (vllm_gpu_memory_utilization {u:g}); {window}")
    notes.insert(0, f"GRPO vLLM colocate{' with sleep mode' if sleeping else ''}: {window} on {cap / GIB:.1f} GiB")
    b = replace(b, vllm_window=(low, high))
    if sleeping:
        generating = held + reserve
        phases = (("generation (vLLM colocate, awake)", generating - b.context_bytes), *b.phase_peaks)
        if generating <= b.required_bytes:
            return replace(b, terms=tuple(terms), notes=tuple(notes), refusal=refusal, phase_peaks=phases)
        return replace(b, peak_bytes=generating - b.context_bytes, peak_phase="generation (vLLM colocate, awake)",
                       margin_bytes=0, required_bytes=generating, terms=tuple(terms), notes=tuple(notes),
                       refusal=refusal, phase_peaks=phases)
    return replace(b, required_bytes=b.required_bytes + reserve, terms=tuple(terms), notes=tuple(notes),
                   refusal=refusal)


def window_words(low: float, high: float) -> str:
    """vLLM colocate's window of vllm_gpu_memory_utilization as the notes and refusals say it."""
    return (f"feasible vllm_gpu_memory_utilization {low:.2f} to {high:.2f}" if low <= high else
            f"no feasible vllm_gpu_memory_utilization: vLLM needs {low:.2f} of the GPU, training {1 - high:.2f}")


def grpo_step_time(spec: ModelSpec, strategy: Strategy, job: Job, hw, *, grid: ParallelGrid, **kwargs):
    """The step of a GRPO job: the policy's supervised step on prompt + completion sequences, the generation of the
    step's completions (decode-bound), and the no_grad scoring forwards over them: the reference's when beta != 0,
    and the policy's old log-probs when vLLM generates (vllm_importance_sampling_correction, TRL's default)."""
    from toolkit.estimate.preference import no_grad_forward_s
    from toolkit.inputs.job import policy_job
    from toolkit.estimate.timing import step_time

    grpo = job.grpo
    t = step_time(spec, strategy, policy_job(job), hw, grid=grid, **kwargs)
    trainable = None
    if job.adapter.is_adapter:
        from toolkit.inputs.lora import counts_for_spec

        trainable = counts_for_spec(spec, job.adapter).trainable_params
    forward_s, _, train_flops = no_grad_forward_s(spec, job, t.compute_s, trainable)
    scoring = int(grpo.reference_kept) + int(grpo.use_vllm)
    prefill_s = forward_s * grpo.max_prompt_length / grpo.seq_len
    seqs, cb = generation_sequences(job), compute_bytes(job.precision)
    weights = generator_weight_bytes(spec, job, vllm=grpo.use_vllm)
    tp = grpo.vllm_tensor_parallel_size if grpo.generation == COLOCATE else 1
    # Each decode step reads every weight once (a vLLM tensor-parallel rank its 1/tp, for tp x the sequences, whose
    # KV heads it holds 1/tp of) and the keys and values its attention reads (decode_read_width: sliding layers at
    # most their window; vLLM's kernels taken to read the same window).
    steps = grpo.max_completion_length - 1
    decode_bytes = steps * weights / tp + 2 * seqs * cb * decode_read_width(spec, grpo.max_prompt_length,
                                                                             grpo.max_completion_length)
    per_token_bytes = decode_bytes / steps if steps else 0.0
    decode_s = decode_bytes / (hw.gpu.hbm_gbps * 1e9)
    windowed = ", sliding layers at most their window" if any(spec.layer_cache_windows) else ""
    said = [f"GRPO generation: {steps} decode steps of {seqs} sequences after the prefill, each reading "
            f"{per_token_bytes / GIB:.2f} GiB on average (weights + the KV cache its attention reads{windowed}) at "
            f"{hw.gpu.hbm_gbps:g} GB/s HBM = "
            f"{decode_s:.2f} s, plus the prompts' prefill {prefill_s:.2f} s; decode is memory-bound, so this is a "
            "lower bound (transformers generate adds per-token launch and Python overheads); no band: no published "
            "GRPO step is scored"]
    gather_s = 0.0
    if grpo.generation == GENERATE and strategy.engine == Engine.FSDP2 and grid.shard_group > 1:
        # FSDP2 all-gathers each layer in every forward of generate, the prefill's and each decode step's (no
        # summon for FSDP2).
        gather_s = grpo.max_completion_length * ring_s(sharded_weight_bytes(spec, job), grid.shard_group,
                                                       group_bandwidth(hw, grid.shard_group), 1)
        said.append(f"GRPO generation under FSDP2: every decode step all-gathers the sharded weights, "
                    f"{gather_s:.2f} s")
    if grpo.generation == SERVER:
        said.append("GRPO generation on the vLLM server's GPUs, taken at this GPU's HBM bandwidth; the training GPUs "
                    "wait for it (TRL generates synchronously)")
    generation_s = max(decode_s, gather_s) + prefill_s
    reference_s = scoring * forward_s
    said.append(f"GRPO scoring: {scoring} no_grad forward(s) over the step's sequences ({reference_s:.3f} s): "
                + ", ".join(w for w, on in (("reference (beta != 0)", grpo.reference_kept),
                                            ("policy old log-probs (vLLM importance sampling)", grpo.use_vllm)) if on)
                if scoring else "GRPO scoring: none (beta 0, no vLLM importance sampling)")
    reward_s = 0.0
    if grpo.reward_model:
        from toolkit.estimate.reward import reward_step_s

        reward_s, words = reward_step_s(strategy, job, hw, grid, t.compute_s / train_flops)
        said.append(words)
    step = t.step_time_s + generation_s + reference_s + reward_s
    tokens = t.tokens_per_s * t.step_time_s
    return replace(t, step_time_s=step, tokens_per_s=tokens / step, mfu=t.mfu * t.step_time_s / step,
                   reference_s=reference_s, generation_s=generation_s, reward_s=reward_s,
                   assumptions=t.assumptions + tuple(said))
