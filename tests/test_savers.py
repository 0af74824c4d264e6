"""Memory savers against real tensors on CPU: torch AdamW's implementations, activation offloading, the error band."""

from __future__ import annotations

import weakref

import pytest
import torch

from toolkit.estimate.savers import optimizer_step_temporary_bytes


def _step_temporaries(optimizer, params) -> int:
    """Peak bytes of storages created during optimizer.step() and alive at once (states already exist)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    known = {id(p.untyped_storage()) for p in params}
    known |= {id(p.grad.untyped_storage()) for p in params}
    known |= {id(t.untyped_storage()) for s in optimizer.state.values() for t in s.values()
              if isinstance(t, torch.Tensor)}
    live = {"now": 0, "peak": 0}
    refs = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() > 1:
                    st = t.untyped_storage()
                    if id(st) in known:
                        continue
                    known.add(id(st))
                    n = st.nbytes()
                    live["now"] += n
                    live["peak"] = max(live["peak"], live["now"])
                    refs.append(weakref.ref(st, lambda _r, n=n: live.__setitem__("now", live["now"] - n)))
            return out

    with Count():
        optimizer.step()
    return live["peak"]


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_adamw_step_temporaries_match_torch(impl):
    torch.manual_seed(0)
    emb = torch.nn.Parameter(torch.randn(500, 64))  # the largest tensor
    lin = torch.nn.Parameter(torch.randn(64, 64))
    bias = torch.nn.Parameter(torch.randn(64))
    params = [emb, lin, bias]
    kwargs = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # states exist from here on: the steady-state step follows
    measured = _step_temporaries(opt, params)
    predicted = optimizer_step_temporary_bytes(
        impl=impl, optimizer="adamw", group_state_bytes=sum(p.numel() for p in params) * 4,
        largest_param_state_bytes=emb.numel() * 4)
    assert measured == predicted, (impl, measured, predicted)


def test_foreach_adds_a_group_sized_temporary_to_the_fsdp2_step():
    from dataclasses import replace

    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.estimate.memory import states_for
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.inputs.strategy import parse_strategy

    spec = resolve_model(layers=2, hidden=64, heads=4, vocab=256)
    from toolkit.inputs.grid import grid_of

    hw = parse_hardware("4xH100-80GB")
    job = Job(seq_len=32)
    fsdp2, zero2 = parse_strategy("fsdp2"), parse_strategy("zero2")
    grid, zgrid = grid_of(fsdp2, hw), grid_of(zero2, hw)
    fused = states_for(spec, fsdp2, job, grid, params=spec.params)
    foreach = states_for(spec, fsdp2, replace(job, optimizer_impl="foreach"), grid, params=spec.params)
    assert foreach.step_transient - fused.step_transient == spec.params * 4 / 4
    # DeepSpeed steps with its own fused optimizer: the choice does not apply.
    z = states_for(spec, zero2, replace(job, optimizer_impl="foreach"), zgrid, params=spec.params)
    assert z.step_transient == states_for(spec, zero2, job, zgrid, params=spec.params).step_transient


def test_planner_refuses_a_candidate_inside_the_error_band():
    """Some micro-batch fits the GPU by the estimate but not with the band's headroom: it is refused, and the plan
    picks a smaller one."""
    from toolkit.estimate.errorband import band_for
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.inputs.grid import grid_of
    from toolkit.estimate.request import Request
    from toolkit.estimate.search import evaluate, plan_candidates
    from toolkit.inputs.strategy import parse_strategy

    spec = resolve_model("gpt2")
    hw = parse_hardware("1xL4")
    ddp = parse_strategy("ddp")
    band = band_for("ddp", False, gpu=hw.gpu)
    assert band.cases >= 1 and band.fraction > 0
    inside = None
    for seq in (1024, 960, 896, 832, 768, 704, 640):
        for micro in range(1, 33):
            c = evaluate(spec, hw, ddp, Job(seq_len=seq, micro_batch=micro), grid_of(ddp, hw))
            if c.memory.fits and not c.feasible:
                inside = (seq, micro, c)
                break
            if not c.memory.fits:
                break
        if inside:
            break
    assert inside is not None, "no micro-batch lands inside the band on this GPU"
    seq, micro, c = inside
    assert "error band" in c.reason and f"from {band.cases} GPU case" in c.reason
    assert c.memory.required_bytes + band.headroom_bytes(c.memory.peak_bytes) > c.memory.capacity_bytes
    chosen = plan_candidates(spec, hw, Request(seq_len=seq, micro_batch=None, global_batch=micro,
                                               checkpointing=False, strategies=("ddp",)))[0]
    assert chosen.feasible and chosen.job.micro_batch < micro


def test_host_ram_at_load_refuses_every_rank_loading_the_whole_model(capsys):
    """gpt2-xl (1.56B): DDP builds the fp32 model on every rank (8 x 6.2 GB on one node), FSDP2's
    cpu_ram_efficient_loading once, ZeRO-3 partitions while building."""
    from toolkit.cli import main
    from toolkit.inputs.choices import GIB
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.estimate.request import Request
    from toolkit.estimate.search import plan_candidates

    spec = resolve_model("gpt2-xl")
    hw = parse_hardware("8xA100-80GB", cpu_ram_gib=40)
    cands = {c.strategy.name: c for c in plan_candidates(
        spec, hw, Request(seq_len=512, global_batch=8, strategies=("ddp", "fsdp2", "zero3")))
        if c.dimension is None}  # the plain data-parallel rows, not their tensor / context / sequence ones
    ddp = cands["ddp"]
    assert not ddp.feasible and "host RAM per node while loading the model" in ddp.reason
    assert ddp.memory.host.load_bytes_per_node == 8 * spec.params * 4
    assert cands["fsdp2"].feasible and cands["fsdp2"].memory.host.load_bytes_per_node == spec.params * 4
    assert cands["fsdp2"].memory.host.save_bytes_per_node == spec.params * 4  # FULL_STATE_DICT on rank 0
    z3 = cands["zero3"].memory.host
    # One node holds all 8 partitions (one model) plus the module being filled.
    assert z3.load_bytes_per_node == 8 * (spec.params * 4 // 8) + spec.largest_layer_params * 4
    assert z3.save_bytes_per_node == spec.params * 2
    assert main(["estimate", "gpt2-xl", "--gpus", "8xA100-80GB", "--strategy", "ddp", "--seq", "512"]) == 0
    out = capsys.readouterr().out
    assert f"host RAM per node: load {8 * spec.params * 4 / GIB:.2f} GiB" in out
    assert "error band: peak +-" in out and "GPU case" in out


def test_activation_offloading_moves_layer_activations_to_host():
    """The decoder layers' saved bytes leave the GPU (one layer's are on the GPU while it computes); pinned host RAM
    holds what TRL's pack rule moves (per rank): the layers' saves and, after lm_head, the loss's fp32
    log-softmax, 4.98 GB of the 16.3 GB here. (TRL's offloading copies to the host, which a CPU run cannot show:
    arithmetic on the trace.)"""
    from dataclasses import replace

    from toolkit.estimate.savers import offloaded_bytes

    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.estimate.memory import estimate_memory
    from toolkit.estimate.traces import scaled_trace
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.inputs.strategy import parse_strategy

    spec = resolve_model("qwen2.5-0.5b")
    hw = parse_hardware("2xA100-80GB")
    fsdp = parse_strategy("fsdp2")
    job = Job(seq_len=2048, micro_batch=4)
    plain = estimate_memory(spec, fsdp, job, hw)
    off = estimate_memory(spec, fsdp, replace(job, activation_offloading=True), hw)
    trace = scaled_trace(spec, job, fsdp)
    layers = [r.saved_bytes for r in trace.layers]
    assert off.cpu_bytes_per_node - plain.cpu_bytes_per_node == 2 * offloaded_bytes(trace)
    assert offloaded_bytes(trace) - sum(r.offload_bytes for r in trace.layers) >= 4 * 2047 * 151936 * 4
    assert off.activations_bytes == plain.activations_bytes - sum(layers)
    assert plain.peak_bytes - off.peak_bytes >= sum(layers) - 2 * max(layers)
    assert off.host.resident_bytes_per_node == off.cpu_bytes_per_node


def test_the_memory_savers_a_plan_assumes_reach_the_settings_each_runner_reads():
    """A plan predicted with a foreach step, Liger and activation offloading says so where each route reads it:
    TrainingArguments (optim, use_liger_kernel), TRL's SFTConfig (activation_offloading), a custom loop's
    optimizer kwargs; and what a route cannot do is said, not silently dropped."""
    from toolkit.emit.user_settings import accelerate_loop, notes, sft_config, training_arguments
    from toolkit.emit.presets import preset_plan

    base = preset_plan("zero2", "bf16")
    assert training_arguments(base)["optim"] == "adamw_torch_fused" and "use_liger_kernel" not in \
        training_arguments(base)
    plan = base.replace(strategy="fsdp2", optimizer_impl="foreach", liger=True, activation_offloading=True)
    args = training_arguments(plan)
    assert args["optim"] == "adamw_torch" and args["use_liger_kernel"] is True
    assert sft_config(plan)["activation_offloading"] is True
    assert accelerate_loop(plan)["optimizer_kwargs"] == {"fused": False, "foreach": True}
    said = " ".join(notes(plan))
    assert "use_liger_kernel" in said and "activation_offloading" in said
    loop = base.replace(strategy="fsdp2", optimizer_impl="for-loop")
    assert "foreach=False" in " ".join(notes(loop))


def test_pipeline_ranks_load_only_their_stage_into_host_ram():
    """toolkit.train.pipeline.convert reads each stage's tensors from the safetensors: a node of 8 pipeline ranks holds
    about one model's worth at load, where 8 DDP ranks hold eight."""
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.inputs.strategy import parse_strategy

    spec, hw = resolve_model("llama-2-7b"), parse_hardware("8xA100-80GB")
    job = Job(seq_len=512)
    ddp = estimate_memory(spec, parse_strategy("ddp"), job, hw).host
    pipe = estimate_memory(spec, parse_strategy("pipeline"), job, hw, pipeline_stages=8).host
    assert ddp.load_bytes_per_node == 8 * spec.params * 4
    assert spec.params * 4 <= pipe.load_bytes_per_node < 1.3 * spec.params * 4
    assert "its stage" in pipe.load_source


def test_activation_offloading_step_peak_within_5_percent_of_trl_offloading_on_cpu():
    """A checkpointed tiny Llama step run under TRL's own offloading context (toolkit.patches.actoffload, built as
    SFTTrainer builds it), measured on CPU as a GPU would hold it (host copies left out, copies brought back
    counted: toolkit.estimate.profile.measure_offloaded_step), against the estimate with --activation-offloading.
    Measured: 15,216,896 bytes vs 15,212,552 predicted (0.03%); TRL moved 12 tensors, 2,840,576 bytes at most at
    once, the estimate's host bytes to the byte (the next test): the 3 layer checkpoints, the final norm's saves
    and the loss's fp32 log-softmax (saved twice, by log_softmax and nll_loss; without side streams TRL copies it
    twice). On the GPU side the estimate moves the layers' saved bytes only and keeps the log-softmax."""
    from toolkit.estimate.profile import measure_offloaded_step, predict_step
    from toolkit.run.tiny import tiny_config

    config = tiny_config("llama", vocab_size=1000, max_positions=256, hidden=128, layers=3, heads=4, kv_heads=2,
                         ffn=344)
    kwargs = dict(seq_len=128, micro_batch=2, precision="fp32", checkpointing=True)
    measured = measure_offloaded_step(config, **kwargs)
    predicted = predict_step(config, device_kind="cpu", activation_offloading=True, **kwargs)
    assert predicted["peak_bytes"] == pytest.approx(measured["peak_bytes"], rel=0.05)
    checkpoints = 3 * 2 * 128 * 128 * 4
    assert measured["offloaded_tensors"] >= 3 and measured["host_bytes"] >= checkpoints
    assert predicted["host_bytes"] == measured["host_bytes"] == 2_840_576


def test_estimate_says_the_pinned_host_ram_and_pcie_time_of_activation_offloading(capsys):
    """Per node: every rank's bytes TRL moves (one micro-batch: the checkpoints and, after lm_head, the loss's
    fp32 log-softmax, 4.6 GiB at Qwen2.5's 151,936-token vocabulary and 8,192 tokens); per step: each byte out and
    back per micro-step over the catalog's host link; overlap stated as an assumption, and named when it cannot
    hold."""
    from toolkit.cli import main
    from toolkit.estimate.savers import offloaded_bytes
    from toolkit.estimate.traces import scaled_trace
    from toolkit.inputs.choices import GIB
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.inputs.strategy import parse_strategy

    assert main(["estimate", "qwen2.5-0.5b", "--gpus", "2xA100-80GB", "--strategy", "fsdp2", "--seq", "8192",
                 "--micro-batch", "1", "--accumulation", "2", "--activation-offloading", "--checkpointing"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("activation offloading: "))
    fsdp = parse_strategy("fsdp2")
    job = Job(seq_len=8192, micro_batch=1, grad_accum=2, checkpointing=True, activation_offloading=True)
    rank = offloaded_bytes(scaled_trace(resolve_model("qwen2.5-0.5b"), job, fsdp))
    checkpoints = 24 * 8192 * 896 * 2  # one bf16 layer input per layer
    log_softmax = 8191 * 151936 * 4  # fp32, shifted labels (one copy: TRL's side streams keep a storage once)
    assert checkpoints + log_softmax <= rank < 1.01 * (checkpoints + log_softmax)
    seconds = 2 * 2 * rank / (parse_hardware("2xA100-80GB").gpu.pcie_gbps * 1e9)
    assert f"{2 * rank / GIB:.2f} GiB pinned host RAM per node" in line
    assert f"PCIe {seconds:.3f} s a step per rank (2 micro-step(s) x 2 copies at 32 GB/s)" in line
    assert "assumed hidden behind compute" in line


@pytest.mark.parametrize("precision,liger,loss", [("fp32", False, "model"), ("bf16", False, "model"),
                                                  ("fp32", True, "model"), ("fp32", False, "trl"),
                                                  ("bf16", True, "trl")])
def test_host_bytes_of_activation_offloading_equal_what_trls_pack_hook_moves_on_cpu(precision, liger, loss):
    """One checkpointed CPU step under TRL's own offloading context (toolkit.patches.actoffload, the counter
    toolkit.train reports: moved_bytes of every pack) against the estimate's pinned host bytes, which apply TRL's
    pack rule (OffloadRule) to the traced saves. Equal to the byte: the 3 layer checkpoints, the embedding's
    input ids, the final norm's saves and what the loss saves after lm_head (the model's head: fp32 logits and
    log-softmax, 2,840,576 bytes in fp32; Liger's fused cross-entropy and TRL's fused head never call lm_head, so
    their saves move too; under bf16 autocast, the weight copies the layers save)."""
    import contextlib

    from toolkit.estimate.profile import _batch, _dtype, build_model, predict_step
    from toolkit.patches.actoffload import LAST_OFFLOADED, offload_context, offloading_step
    from toolkit.patches.liger import liger_applied
    from toolkit.patches.trlloss import trl_loss_applied
    from toolkit.run.tiny import tiny_config

    config = tiny_config("llama", vocab_size=1000, max_positions=256, hidden=128, layers=3, heads=4, kv_heads=2,
                         ffn=344)
    model = build_model(config, precision, "sdpa", True, "cpu")
    batch = _batch(config, 2, 128, "cpu")
    amp = _dtype(precision)
    with contextlib.ExitStack() as patches:
        if liger:
            patches.enter_context(liger_applied(model))
        if loss == "trl":
            patches.enter_context(trl_loss_applied(model))
        ctx = offload_context(model, on_cpu=True)
        with offloading_step(ctx):
            with torch.autocast(device_type="cpu", dtype=amp, enabled=amp is not None):
                out = model(**batch).loss
            out.backward()
    predicted = predict_step(config, seq_len=128, micro_batch=2, precision=precision, checkpointing=True,
                             device_kind="cpu", activation_offloading=True, liger=liger, loss=loss)
    assert LAST_OFFLOADED["bytes"] == predicted["host_bytes"], (LAST_OFFLOADED, predicted["host_bytes"])
    assert LAST_OFFLOADED["bytes"] > 3 * 2 * 128 * 128 * 2  # more than the layer checkpoints


def test_a_plan_with_activation_offloading_is_rehearsed_with_it(tiny_llama_dir):
    """toolkit.train runs TRL's offloading context on CPU (toolkit.patches.actoffload) for SFT and DPO plans, so
    the rehearsal keeps it for both (a GRPO plan cannot offload: GRPOConfig has no such field)."""
    from toolkit.inputs.preference import Dpo
    from toolkit.run.rehearsal import plan_for_model, rehearsal_plan

    plan = plan_for_model(tiny_llama_dir, "zero3", gpus_per_node=8, micro_batch=2, grad_accum=2, seq_len=64,
                          precision="bf16", checkpointing=True).replace(activation_offloading=True)
    small, said = rehearsal_plan(plan, tiny_llama_dir)
    assert small.activation_offloading and not any("offloading" in s for s in said)
    small, said = rehearsal_plan(plan.replace(dpo=Dpo().to_dict()), tiny_llama_dir)
    assert small.activation_offloading and small.dpo and not any("offloading" in s for s in said)


def test_the_rehearsal_passes_an_offloading_plan_only_when_every_rank_moved_bytes(tmp_path, tiny_llama_dir):
    """The rehearsal reads toolkit.train's rank summaries (write_rank_summary, as each rank writes it): each rank's
    last micro-step must have moved bytes under TRL's offloading, and the passed line says how many on rank 0.
    Measured: launch --rehearse of a qwen2.5-0.5b zero3 +act-offload plan passed with 11 tensors, 673,792 bytes."""
    from toolkit.run.rehearsal import _offloaded, plan_for_model
    from toolkit.train.hf_runner import write_rank_summary

    small = plan_for_model(tiny_llama_dir, "zero3", gpus_per_node=2, micro_batch=2, seq_len=64,
                           checkpointing=True).replace(activation_offloading=True)
    write_rank_summary(str(tmp_path), 0, {"activation_offloaded": {"tensors": 11, "bytes": 673792}})
    assert _offloaded(tmp_path, small)[1]  # rank 1 never reported
    write_rank_summary(str(tmp_path), 1, {"activation_offloaded": {}})
    words, problems = _offloaded(tmp_path, small)
    assert words == "" and problems == ["the plan offloads activations, but 1 of 2 ranks report TRL's offloading "
                                        "moving any bytes"]
    write_rank_summary(str(tmp_path), 1, {"activation_offloaded": {"tensors": 11, "bytes": 673792}})
    assert _offloaded(tmp_path, small) == (" with TRL's activation offloading (11 tensors, 673,792 bytes to host a "
                                           "micro-step on rank 0)", [])


def test_the_offloaded_bytes_are_traced_alike_without_trl_installed(monkeypatch):
    """TRL is an optional extra: without it the tracer keeps the HF head (get_output_embeddings, TRL's lm_head pick
    for a causal LM) on the device itself, and predicts the bytes TRL's rule gives (2,840,576 on CPU, 1,684,480 with
    the GPU's side streams, which keep the twice-saved log-softmax and norm input once)."""
    import sys

    from toolkit.estimate.savers import offloaded_bytes
    from toolkit.estimate.tracer import trace_activations
    from toolkit.run.tiny import tiny_config

    config = tiny_config("llama", vocab_size=1000, max_positions=256, hidden=128, layers=3, heads=4, kv_heads=2,
                         ffn=344)
    kwargs = dict(seq_len=128, micro_batch=2, dtype="float32", checkpointing=True)
    with_trl = [offloaded_bytes(trace_activations(config, device_kind=k, **kwargs)) for k in ("cpu", "cuda")]
    monkeypatch.setitem(sys.modules, "trl", None)
    without = [offloaded_bytes(trace_activations(config, device_kind=k, **kwargs)) for k in ("cpu", "cuda")]
    assert with_trl == without == [2_840_576, 1_684_480]


@pytest.mark.parametrize("strategy, dimension", [("zero2", "sequence"), ("fsdp2", "context")])
def test_activation_offloading_on_a_split_sequence_moves_each_ranks_own_tokens(strategy, dimension):
    """Ulysses SP / FSDP2 CP with TRL's offloading: each rank's pack hook sees its own share of the tokens, so the
    pinned host RAM, the PCIe bytes and the GPU bytes it frees are those of the rank's trace at seq / 2 (checkpointed
    here: a layer saves its input and nothing of the split attention). Qwen3-0.6B at 32,768 tokens over 2 ranks."""
    from dataclasses import replace

    from toolkit.estimate.dimensions import rank_view
    from toolkit.estimate.memory import estimate_memory
    from toolkit.estimate.savers import offload_copies, offloaded_bytes
    from toolkit.estimate.traces import scaled_trace
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.inputs.strategy import parse_strategy

    spec, hw, s = resolve_model("qwen3-0.6b"), parse_hardware("2xA100-80GB"), parse_strategy(strategy)
    grid = ParallelGrid.for_strategy(s, nodes=1, gpus_per_node=2, **{dimension: 2})
    job = Job(seq_len=32768, micro_batch=1, checkpointing=True)
    plain = estimate_memory(spec, s, job, hw, grid=grid)
    off = estimate_memory(spec, s, replace(job, activation_offloading=True), hw, grid=grid)
    view = rank_view(spec, job, grid)
    assert view.job.seq_len == 16384
    rank_trace = scaled_trace(view.spec, view.job, s)
    rank = offloaded_bytes(rank_trace)
    assert off.cpu_bytes_per_node - plain.cpu_bytes_per_node == 2 * rank
    checkpoints = 28 * 16384 * 1024 * 2  # one bf16 layer input per layer, the rank's tokens
    assert rank >= checkpoints and rank < 0.6 * offloaded_bytes(scaled_trace(spec, job, s))
    assert off.activations_bytes == plain.activations_bytes - sum(r.saved_bytes for r in rank_trace.layers)
    assert off.peak_bytes < plain.peak_bytes
    moved, seconds = offload_copies(spec, replace(job, activation_offloading=True), s, hw, grid)
    assert moved == rank and seconds == pytest.approx(2 * rank / (hw.gpu.pcie_gbps * 1e9))


def test_activation_offloading_with_tensor_parallelism_is_one_line(capsys):
    from toolkit.cli import main

    assert main(["estimate", "qwen3-0.6b", "--gpus", "4xA100-80GB", "--strategy", "fsdp2", "--tensor-parallel", "2",
                 "--seq", "4096", "--activation-offloading"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "activation offloading with tensor parallelism is not planned" in err[0], err
