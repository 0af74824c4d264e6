"""Liger kernels (--liger): the pure-torch substitutes against the Hugging Face modules they replace, the traced bytes
against a real CPU run of the patched model, and what the estimate gains for a large vocabulary."""

from __future__ import annotations

import copy
import importlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolkit.errors import UserError
from toolkit.patches.liger import (fused_linear_cross_entropy, functions, liger_applied, liger_problem,
                                    liger_rotary_pos_emb)
from toolkit.estimate.livebytes import measure_saved_bytes
from toolkit.run.tiny import tiny_config
from toolkit.estimate.tracer import trace_activations


def _model(arch: str, dtype=torch.float32, vocab_size: int = 512):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, layers=2, hidden=64, vocab_size=vocab_size),
                                             dtype=dtype)
    model.config.use_cache = False
    return model.train()


def _grads(*tensors):
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_substitute_matches_the_module_it_replaces(arch):
    model = _model(arch)
    modeling = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    torch.manual_seed(1)
    x = torch.randn(2, 16, 64)

    # RMSNorm: output, input gradient and weight gradient
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    for use_liger in (False, True):
        xi = x.clone().requires_grad_()
        out = (functions()["rms_norm"].apply(xi, norm.weight, norm.variance_epsilon) if use_liger else norm(xi))
        (out * torch.linspace(-1, 1, 64)).sum().backward()
        if use_liger:
            torch.testing.assert_close(out, ref_out)
            torch.testing.assert_close(_grads(xi, norm.weight), ref_grads)
        else:
            ref_out, ref_grads = out.detach(), _grads(xi, norm.weight)
        norm.weight.grad = None

    # SwiGLU MLP
    mlp = model.model.layers[0].mlp
    params = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    for use_liger in (False, True):
        xi = x.clone().requires_grad_()
        out = (mlp.down_proj(functions()["silu_mul"].apply(mlp.gate_proj(xi), mlp.up_proj(xi))) if use_liger
               else mlp(xi))
        out.pow(2).sum().backward()
        if use_liger:
            torch.testing.assert_close(out, ref_out)
            torch.testing.assert_close(_grads(xi, *params), ref_grads)
        else:
            ref_out, ref_grads = out.detach(), _grads(xi, *params)
        for p in params:
            p.grad = None

    # RoPE on (b, h, s, d) views of (b, s, h, d) projections, as the attention modules pass them
    ids = torch.arange(16)[None].expand(2, 16)
    cos, sin = model.model.rotary_emb(x, ids)
    q0, k0 = torch.randn(2, 16, 4, 16), torch.randn(2, 16, 2, 16)
    for use_liger in (False, True):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        rope = liger_rotary_pos_emb if use_liger else modeling.apply_rotary_pos_emb
        qe, ke = rope(q.transpose(1, 2) * 1, k.transpose(1, 2) * 1, cos, sin)  # * 1: a fresh buffer, as a Linear's
        (qe.pow(2).sum() + (ke * 3).sum()).backward()
        if use_liger:
            torch.testing.assert_close((qe, ke), ref_out)
            torch.testing.assert_close(_grads(q, k), ref_grads)
        else:
            ref_out, ref_grads = (qe.detach(), ke.detach()), _grads(q, k)

    # Fused linear cross-entropy against lm_head + the model's own loss, with ignored labels
    labels = torch.randint(0, 512, (2, 16))
    labels[0, :5] = -100
    head = model.lm_head.weight
    for use_liger in (False, True):
        xi = x.clone().requires_grad_()
        loss = (fused_linear_cross_entropy(xi, head, labels) if use_liger
                else model.loss_function(logits=model.lm_head(xi), labels=labels, vocab_size=512))
        loss.backward()
        if use_liger:
            torch.testing.assert_close(loss, ref_loss)
            torch.testing.assert_close(_grads(xi, head), ref_grads)
        else:
            ref_loss, ref_grads = loss.detach(), _grads(xi, head)
        head.grad = None


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("mistral", torch.float32),
                                        ("qwen2", torch.bfloat16)])
def test_patched_model_gives_the_same_loss_and_gradients(arch, dtype):
    ref = _model(arch, dtype)
    patched = copy.deepcopy(ref)
    ids = torch.randint(0, 512, (2, 32))
    ref(input_ids=ids, labels=ids).loss.backward()
    with liger_applied(patched):
        out = patched(input_ids=ids, labels=ids)
        out.loss.backward()
    assert out.logits is None  # the fused loss never makes them
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    ref_loss = ref(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(out.loss.detach(), ref_loss.detach(), **tol)
    for (name, p), q in zip(ref.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad.float(), p.grad.float(), **tol, msg=name)


@pytest.mark.parametrize("arch,dtype,autocast,checkpointing", [
    ("llama", "bfloat16", False, False),
    ("qwen2", "bfloat16", True, False),
    ("mistral", "float32", False, True),
])
def test_traced_bytes_with_liger_equal_a_real_run(arch, dtype, autocast, checkpointing):
    config = tiny_config(arch, layers=2, hidden=64, vocab_size=512)
    kw = dict(dtype=dtype, autocast=autocast, attention="sdpa", checkpointing=checkpointing, micro_batch=2,
              seq_len=64)
    trace = trace_activations(config, device_kind="cpu", liger=True, **kw)
    compute = getattr(torch, dtype)
    model = _model(arch, torch.float32 if autocast else compute)
    if checkpointing:
        model.activation_checkpointing_enable()
    ids = torch.randint(0, 512, (2, 64))
    with liger_applied(model):
        measured, loss = measure_saved_bytes(model, {"input_ids": ids, "labels": ids},
                                             autocast_dtype=compute if autocast else None)
        grad_weight = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
        loss.backward()
    # The fused loss saves the LM head's weight gradient (made in forward): the trace reports it apart.
    assert trace.head.forward_grad_bytes == grad_weight
    # Alive after forward + loss: the saved tensors (the token ids among them, which the measurement counts as an
    # input), that gradient, autocast weight copies, the loss, what a checkpoint's closure holds (rotary tables).
    predicted_live = (trace.activations_bytes + trace.head.forward_grad_bytes + trace.autocast_copy_bytes
                      + trace.loss_bytes)
    assert predicted_live == measured.live_bytes + ids.nbytes
    if not checkpointing:  # a non-reentrant checkpoint holds its keyword inputs outside autograd's saved tensors
        assert trace.activations_bytes + trace.head.forward_grad_bytes == measured.saved_bytes
        assert [r.saved_bytes for r in trace.layers] == [measured.by_region[f"layer{i}"] for i in range(2)]
    assert trace.autocast_copy_bytes == measured.autocast_copy_bytes
    assert trace.output_bytes == 0
    assert any("Liger" in n for n in trace.notes)


def test_liger_drops_the_logits_term_of_llama_3_8b_at_8k():
    from dataclasses import replace

    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.inputs.strategy import parse_strategy

    spec = resolve_model("llama-3-8b")
    hw = parse_hardware("8xH100-80GB")
    fsdp2 = parse_strategy("fsdp2")
    job = Job(seq_len=8192, micro_batch=1, precision="bf16")
    plain = estimate_memory(spec, fsdp2, job, hw)
    liger = estimate_memory(spec, fsdp2, replace(job, liger=True), hw)
    tokens, hidden, vocab = 8192, 4096, 128256
    # Without Liger the head keeps the fp32 log-softmax of the logits (and more); with it, what the fused loss
    # saves: grad_input (tokens x hidden, bf16), plus the final norm's input (bf16) and fp32 inverse RMS.
    assert plain.logits_loss_bytes >= tokens * vocab * 4
    assert liger.logits_loss_bytes == tokens * hidden * 2 * 2 + tokens * 4
    head_grad = [t for t in liger.terms if t.name == "LM-head gradient made in forward"]
    assert head_grad and head_grad[0].bytes == vocab * hidden * 2  # bf16: FSDP2 computes with bf16 weights
    assert plain.peak_bytes - liger.peak_bytes > tokens * vocab * 4
    assert liger.activations_bytes < plain.activations_bytes - (plain.logits_loss_bytes - liger.logits_loss_bytes)


def test_unsupported_architectures_and_engines_are_refused():
    assert liger_problem("llama") is None
    assert "llama, mistral, qwen2, qwen3" in liger_problem("gpt2")
    assert "gemma2" in liger_problem("gemma2") and "drop --liger" in liger_problem("gemma2")
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job, check_job, job_problem
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.inputs.strategy import parse_strategy

    hw = parse_hardware("8xH100-80GB")
    with pytest.raises(UserError, match="llama, mistral, qwen2, qwen3"):
        check_job(resolve_model("gpt2"), Job(seq_len=512, liger=True), hw, parse_strategy("zero2"))
    assert "pipeline" in job_problem("bf16", hw.gpu, parse_strategy("pipeline"), liger=True)
    for strategy in ("zero2", "zero3", "zero3-offload"):  # DeepSpeed 0.19.8 gathers the head Liger reads
        assert job_problem("bf16", hw.gpu, parse_strategy(strategy), liger=True) is None


def test_liger_under_zero3_is_planned_with_the_heads_whole_weight_gathered_for_the_step():
    # DeepSpeed 0.19.8 gathers lm_head.weight when Liger's lce_forward reads it inside the engine's forward and
    # keeps it to the end of backward (toolkit.estimate.states.liger_head_gathered; the CPU run below): the plan
    # holds the head's whole bf16 weight, vocab x hidden x 2 B, for the replay's whole forward and backward. Over
    # one rank nothing is gathered (the partition is the parameter), and without Liger nothing is held.
    from types import SimpleNamespace

    from toolkit.estimate.activations import RegionTrace
    from toolkit.estimate.request import Request
    from toolkit.estimate.reserved import StepSizes, _held_taken_out, replays_asked, step_events
    from toolkit.estimate.search import plan_candidates
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.modelspec import resolve_model

    spec = resolve_model("qwen2.5-0.5b")  # tied: the head Liger reads is the embedding's matrix
    head = 151_936 * 896 * 2
    assert spec.head_matmul_params * 2 == head == 272_269_312
    held = {}
    for gpus, liger in (("2xA100-80GB", True), ("1xA100-80GB", True), ("2xA100-80GB", False)):
        with replays_asked() as asked:
            candidates = plan_candidates(spec, parse_hardware(gpus), Request(seq_len=2048, global_batch=8,
                                                                             strategies=("zero3",), liger=liger))
        zero3 = next(c for c in candidates if c.feasible)
        assert {c.job.liger for c in candidates} == {liger}
        held[gpus, liger] = {sizes.held_gathered for _, sizes, _ in asked}
        buffers = next(t for t in zero3.memory.terms if t.name == "engine buffers")
        assert ("LM head's weight read outside its module, gathered whole (0.25 GiB)" in buffers.source) \
            == ((gpus, liger) == ("2xA100-80GB", True))
    assert held == {("2xA100-80GB", True): {head}, ("1xA100-80GB", True): {0.0}, ("2xA100-80GB", False): {0.0}}

    # The replay: the held weight is made before the first region's forward and freed after the last backward,
    # and the region whose module holds it (the head's, then a tied embedding's) no longer gathers it itself.
    trace = RegionTrace(0, 0, 0, forward_events=(), backward_events=())
    regions = [SimpleNamespace(name=name, params=n, trace=trace)
               for name, n in (("embedding", 1000), ("layer 0", 300), ("head + loss", 10))]
    sizes = StepSizes(persistent=0, optimizer=0, gathered=2000, held_gathered=2000, reduce_buffers=0,
                      reduce_stream=False, step_gradients=0, backward_gradients=0, step_transient=0, param_bytes=2.0)
    assert _held_taken_out(regions, sizes) == [10, 300, 0]
    events = step_events(regions, sizes, steps=1)
    held_events = [i for i, e in enumerate(events) if e[1:2] == (("held", 0),)]
    gathers = [i for i, e in enumerate(events) if e[0] == "malloc" and e[1][0] == "gather"]
    assert events[held_events[0]][:3] == ("malloc", ("held", 0), 2000)
    assert held_events[0] < gathers[0] and events[held_events[-1]][0] == "free" and held_events[-1] > gathers[-1]


@pytest.mark.multiprocess
def test_liger_trains_under_zero3_on_two_ranks_as_on_one_process(tiny_llama_dir, tmp_path):
    # tests/liger_zero3.py: the model patched with Liger's substitutes (their lce_forward reads lm_head.weight
    # outside the lm_head module, as Liger's does) under the installed DeepSpeed's ZeRO-3 on 2 gloo ranks (fp32,
    # every parameter partitioned, checkpointing, 2 micro-steps a step), beside one process on the same samples.
    # Measured: losses 6.266730 / 6.235154 / 6.267727 on both ranks and in one process (largest difference 5e-7).
    # The head's weight, as the ZeRO-3 estimate holds it: gathered whole on first read in forward (the first
    # micro-step, while the coordinator records its trace; released at the root's post-forward and gathered again
    # by the root's backward fetch), from the second micro-step on at the root's own pre-forward fetch, kept
    # through forward and backward, and released by the optimizer's backward_epilogue, never held at the step.
    import json
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import liger_zero3

    script = Path(liger_zero3.__file__)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": str(script.resolve().parent.parent)}
    summary = tmp_path / "ranks"
    ranks = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                              str(script), str(tiny_llama_dir), str(tmp_path / "out"), str(summary), "2"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    liger_zero3.main(str(tiny_llama_dir), str(tmp_path / "ref"), str(summary), "reference")  # meanwhile, here
    output = ranks.communicate(timeout=600)[0]
    assert ranks.returncode == 0, output[-6000:]
    reference = json.loads((summary / "reference.json").read_text())["losses"]
    assert len(reference) == liger_zero3.STEPS
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    whole = config["vocab_size"] * config["hidden_size"]
    for rank in range(2):
        got = json.loads((summary / f"rank{rank}.json").read_text())
        assert got["losses"].keys() == reference.keys()
        for step in reference:
            assert got["losses"][step] == pytest.approx(reference[step], abs=1e-4), (rank, step)
        for step, events in enumerate(got["events"]):
            micro_steps = [i for i, e in enumerate(events) if e[0] == "backward leftovers released"]
            assert len(micro_steps) == liger_zero3.ACCUMULATE and events[-1][0] == "step end"
            start = 1
            for k, end in enumerate(micro_steps):
                held = [(e[0], e[1], e[2]) for e in events[start:end] if e[2] != "NOT_AVAILABLE"]
                loss = next(i for i, e in enumerate(events) if i >= start and e[0] == "fused loss")
                assert events[loss][2:] == ["AVAILABLE", whole]
                if step == 0 and k == 0:  # recording the trace: the getter gathers, the root's hooks release
                    assert events[start][2] == "NOT_AVAILABLE" and events[loss + 1][:3] == \
                        ["release forward", "LlamaForCausalLM", "NOT_AVAILABLE"]
                    assert all(e[2:] == ["AVAILABLE", whole] for e in events[loss + 2:end])
                else:  # the root's fetch gathers it before the embedding; held to the end of backward
                    assert events[start][:3] == ["fetch forward", "LlamaForCausalLM", "AVAILABLE"]
                    assert len(held) == end - start and all(e[3] == whole for e in events[start:end])
                assert events[end][2] == "NOT_AVAILABLE"
                start = end + 1
            assert all(e[2] == "NOT_AVAILABLE" for e in events[start:])


def test_plan_carries_liger_and_its_prediction_is_reproduced(capsys):
    from toolkit.cli import main
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.estimate.request import Request
    from toolkit.estimate.search import plan_candidates, predict_plan, to_plan

    spec = resolve_model("qwen2.5-0.5b")  # tied embeddings: the fused loss's gradient is the embedding's
    hw = parse_hardware("2xA100-80GB")
    strategies = ("zero2", "pipeline")
    plain = plan_candidates(spec, hw, Request(seq_len=2048, global_batch=8, strategies=strategies))
    fused = plan_candidates(spec, hw, Request(seq_len=2048, global_batch=8, strategies=strategies, liger=True))
    by_name = {c.strategy.name: c for c in fused}
    assert "pipeline" in by_name["pipeline"].reason  # Liger patches the HF model, not pipeline stages
    chosen = by_name["zero2"]
    before = {c.strategy.name: c for c in plain}["zero2"]
    assert chosen.job.liger and chosen.memory.logits_loss_bytes < before.memory.logits_loss_bytes
    plan = to_plan(chosen, spec, hw, "qwen2.5-0.5b")
    assert plan.liger and not plan.prediction_is_stale
    again = predict_plan(plan)
    assert again.predicted["peak_bytes"] == plan.predicted["peak_bytes"]
    assert predict_plan(plan.replace(liger=False)).predicted["peak_bytes"] > plan.predicted["peak_bytes"]

    capsys.readouterr()
    assert main(["estimate", "gpt2", "--seq", "512", "--liger"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "llama, mistral, qwen2, qwen3" in err


@pytest.mark.parametrize("arch,precision,vocab_size", [("llama", "bf16", 1000), ("qwen2", "bf16-pure", 1000),
                                                      ("mistral", "fp32", 1000), ("llama", "bf16-pure", 16000),
                                                      ("qwen2", "bf16", 16000)])
def test_whole_step_peak_with_liger_matches_a_real_cpu_step(arch, precision, vocab_size):
    # The memory model's composition (the LM-head gradient made in forward, alive until the head's backward)
    # against torch's MemTracker over a real steady-state step of the patched model: forward, fused loss,
    # backward, fused AdamW.
    from toolkit.estimate.livebytes import steady_step_peak
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.modelspec import build_spec
    from toolkit.estimate.profile import _batch, _dtype, build_model
    from toolkit.inputs.strategy import parse_strategy

    config = tiny_config(arch, vocab_size=vocab_size, max_positions=256, hidden=128, layers=3, heads=4, kv_heads=2,
                         ffn=344)  # vocab 1000 / hidden 128: the fused loss runs 8 chunks of 32 rows
    model = build_model(config, precision, "sdpa", False, "cpu")
    with liger_applied(model):
        measured = steady_step_peak(model, _batch(config, 2, 128, "cpu"), autocast_dtype=_dtype(precision))
    job = Job(seq_len=128, micro_batch=2, precision=precision, device_kind="cpu", liger=True)
    predicted = estimate_memory(build_spec(arch, config), parse_strategy("ddp"), job, parse_hardware("1xH200"))
    assert predicted.peak_bytes == pytest.approx(measured, rel=0.01), (predicted.peak_phase, measured)


@pytest.mark.parametrize("dtype,autocast,weight_temporaries,cached_copy,head_grad", [
    # bf16 weights: grad_weight (bf16) += torch.mm(block.t(), x).float(): a bf16 V x H product and its fp32 copy
    ("bfloat16", False, 6, 0, 2),
    # fp32 weights under autocast (DDP AMP): fp32 grad_weight filled by addmm(out_dtype=float32); autocast casts
    # weight.t() (a view, never cached) to bf16 for every block and caches the bf16 weight of block @ weight
    ("bfloat16", True, 2, 2, 4),
    # fp32: the fp32 V x H product (.float() is a no-op)
    ("float32", False, 4, 0, 4),
])
def test_fused_loss_forward_temporaries_follow_ligers_code(dtype, autocast, weight_temporaries, cached_copy,
                                                           head_grad):
    config = tiny_config("llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn=344, vocab_size=16000,
                         max_positions=256)
    weight = 16000 * 128  # V x H elements: the chunked logits (4 rows x V) and the rest are small beside it
    head = trace_activations(config, seq_len=128, micro_batch=2, dtype=dtype, autocast=autocast,
                             device_kind="cuda", liger=True).head
    assert weight_temporaries * weight <= head.forward_extra_bytes < (weight_temporaries + 0.2) * weight
    assert head.autocast_cache_bytes == cached_copy * weight
    assert head.forward_grad_bytes == head_grad * weight


def test_qwen3_with_its_qk_norms_left_alone_matches_hf_and_a_real_run():
    # Liger's instance patch binds the layer norms and the MLP of each decoder layer; Qwen3's q_norm / k_norm stay.
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  intermediate_size=128, vocab_size=512, num_hidden_layers=2,
                                  max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config).train()
    ref.config.use_cache = False
    patched = copy.deepcopy(ref)
    ids = torch.randint(0, 512, (2, 32))
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    with liger_applied(patched):
        measured, loss = measure_saved_bytes(patched, {"input_ids": ids, "labels": ids})
        loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach())
    for p, q in zip(ref.parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    assert "forward" not in vars(patched.model.layers[0].self_attn.q_norm)
    trace = trace_activations(config, seq_len=32, micro_batch=2, dtype="float32", device_kind="cpu", liger=True)
    assert trace.activations_bytes + trace.head.forward_grad_bytes == measured.saved_bytes
