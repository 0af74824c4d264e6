"""The compiled step's saved tensors, traced under FakeTensorMode with inductor's partition, against a real
torch.compile'd step on CPU (inductor's C++ backend; compiled artifacts are cached in torch's inductor cache)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolkit.estimate.compiled import compiled_saved_bytes, trace_compiled_activations
from toolkit.estimate.livebytes import measure_compiled_step
from toolkit.run.tiny import tiny_config
from toolkit.estimate.tracer import trace_activations

TOLERANCE = 0.05


@pytest.fixture(autouse=True)
def _compile_in_this_process():
    """Inductor compiles in this process, one kernel after another (compile_threads 1: no pool of compile workers),
    so a compiling test runs one C++ compiler at a time on one core (one_core): the kernels are the same."""
    import torch._inductor.config as inductor

    with inductor.patch(compile_threads=1):
        yield


def _composed_peak(trace) -> int:
    """Forward + backward peak as toolkit.estimate.memory composes it (parameters left out): what is saved so far plus the
    region's temporaries; in backward, plus the gradients made so far."""
    regions = [trace.embedding, *trace.layers, trace.head]
    held, peak = [], 0
    for r in regions:
        held.append((held[-1] if held else 0) + r.saved_bytes + r.autocast_copy_bytes)
        peak = max(peak, held[-1] + r.forward_extra_bytes)
    grads = 0
    for r, h in reversed(list(zip(regions, held))):
        peak = max(peak, h + r.backward_extra_bytes + grads + r.backward_grad_bytes)
        grads += r.grad_bytes
    return peak


def _close(predicted: int, measured: int) -> bool:
    return abs(predicted - measured) <= TOLERANCE * measured


@pytest.mark.multiprocess
@pytest.mark.one_core
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])  # gpt2 with its dropout (inductor's RNG)
def test_traced_compiled_activations_and_peak_match_a_real_compiled_step(arch):
    config = tiny_config(arch, layers=2, hidden=64, vocab_size=512)
    kw = dict(seq_len=64, micro_batch=2, dtype="float32", attention="sdpa", device_kind="cpu")
    traced = trace_compiled_activations(config, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").train()
    model.config.use_cache = False
    ids = torch.randint(0, 512, (2, 64))
    real = measure_compiled_step(model, {"input_ids": ids, "labels": ids})
    assert _close(traced.activations_bytes, real.saved_bytes), (traced.activations_bytes, real.saved)
    # GPT-2 runs its loss as a graph of its own (a Dynamo graph break in transformers' loss lookup): its model graph
    # gets the logits' real gradient, where Llama's one graph gets a zero-filled one for its logits output.
    assert _close(_composed_peak(traced), real.peak_bytes), (_composed_peak(traced), real.peak_bytes)
    assert any("loss runs as its own graph" in n for n in traced.notes) == (arch == "gpt2")
    eager = trace_activations(config, **kw)
    # The partition keeps other tensors than eager autograd does, and the eager figure would miss the goal.
    assert not _close(eager.activations_bytes, real.saved_bytes)


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_checkpointing_inside_the_compiled_model_keeps_what_the_trace_says():
    # The Trainer's non-reentrant checkpoint inside the compiled graph: each layer keeps its inputs (and the
    # recompute's RNG state), the head what the compiled partition saves.
    config = tiny_config("llama", layers=2, hidden=64, vocab_size=512)
    traced = trace_compiled_activations(config, seq_len=64, micro_batch=2, dtype="float32", attention="sdpa",
                                        device_kind="cpu", checkpointing=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 512, (2, 64))
    real = measure_compiled_step(model, {"input_ids": ids, "labels": ids})
    assert _close(traced.activations_bytes, real.saved_bytes), (traced.activations_bytes, real.saved)


def test_cuda_compile_keeps_the_kernels_logsumexp_and_no_seq_by_seq_score():
    config = tiny_config("llama", layers=2, hidden=64, vocab_size=512)
    notes: list = []
    saved = compiled_saved_bytes(config, seq_len=160, micro_batch=1, dtype="bfloat16", device_kind="cuda",
                                 notes=notes)
    assert any("CUDA flash kernel" in n or "CUDA memory-efficient kernel" in n for n in notes)
    layer = [r for r in saved.saved if r[0] == "layer1"]
    assert ("layer1", (1, 4, 160), "float32", 4 * 160 * 4) in layer  # logsumexp (b, h, s) in fp32
    assert sum(1 for r in layer if r[1][-2:] == (160, 160)) <= 1  # at most the mask as a bias, never scores
    cpu = compiled_saved_bytes(config, seq_len=160, micro_batch=1, dtype="bfloat16", device_kind="cpu")
    assert cpu.total_bytes != saved.total_bytes


def test_compile_is_refused_where_it_cannot_run_or_is_not_modelled():
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import job_problem
    from toolkit.inputs.lora import Adapter
    from toolkit.inputs.strategy import parse_strategy

    gpu = parse_hardware("8xH100-80GB").gpu
    assert "pipeline runner" in job_problem("bf16", gpu, parse_strategy("pipeline"), compile=True)
    assert job_problem("bf16", gpu, parse_strategy("zero3"), compile=True) is None
    assert job_problem("bf16", gpu, parse_strategy("fsdp2"), compile=True) is None
    assert "not modelled" in job_problem("bf16", gpu, parse_strategy("ddp"), compile=True,
                                         adapter=Adapter(method="lora"))
    assert "flash_attention_2" in job_problem("bf16", gpu, parse_strategy("ddp"), compile=True,
                                              attention="flash_attention_2")


def test_a_compiled_plan_emits_torch_compile_and_the_dynamo_yaml(tiny_llama_dir):
    from toolkit.emit.accelerate import accelerate_config
    from toolkit.emit.user_settings import training_arguments
    from toolkit.run.rehearsal import plan_for_model

    plan = plan_for_model(tiny_llama_dir, "fsdp2", gpus_per_node=2, micro_batch=1, grad_accum=1, seq_len=32,
                          precision="fp32")
    assert "compile" not in plan.to_dict() and "torch_compile" not in training_arguments(plan)
    compiled = plan.replace(compile=True)
    assert compiled.to_dict()["compile"] is True
    assert training_arguments(compiled)["torch_compile"] is True
    assert accelerate_config(compiled)["dynamo_config"] == {"dynamo_backend": "INDUCTOR"}
    # A user's own run needs the Dynamo flag toolkit.train sets for checkpointed layers (toolkit.patches.compiledckpt).
    from toolkit.emit.user_settings import notes
    from toolkit.patches.compiledckpt import DYNAMO_FLAG

    assert any(DYNAMO_FLAG in n for n in notes(compiled.replace(checkpointing=True)))
    assert not any(DYNAMO_FLAG in n for n in notes(compiled.replace(checkpointing=False)))
    assert compiled.prediction_key() != plan.prediction_key()


def test_estimate_compile_prints_less_activation_memory_and_a_faster_step(capsys):
    import json

    from toolkit.cli import main

    argv = ["estimate", "gpt2", "--gpus", "1xH100-80GB", "--seq", "256", "--json"]
    assert main(argv) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main([*argv, "--compile"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert compiled["job"]["compile"] is True
    assert compiled["per_gpu"]["activations_bytes"] < eager["per_gpu"]["activations_bytes"]
    assert compiled["timing"]["compile_saved_s"] > 0
    assert compiled["timing"]["tokens_per_s"] > eager["timing"]["tokens_per_s"]
    assert any("min_cut_rematerialization_partition" in n for n in compiled["notes"])
    assert main(["estimate", "gpt2", "--gpus", "2xH100-80GB", "--strategy", "pipeline", "--compile"]) == 2


def test_a_compiled_plan_is_rehearsed_compiled(tiny_llama_dir):
    from toolkit.run.rehearsal import plan_for_model, rehearsal_plan

    plan = plan_for_model(tiny_llama_dir, "zero2", gpus_per_node=8, micro_batch=4, grad_accum=2, seq_len=64,
                          precision="bf16").replace(compile=True)
    small, said = rehearsal_plan(plan, tiny_llama_dir)
    assert small.compile and any("torch.compile" in s for s in said)


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_per_op_selective_checkpointing_inside_the_compiled_model_keeps_what_the_trace_says():
    # torchtitan's per-op policy under compile: the partitioner keeps the policy's MUST_SAVE outputs, and each layer
    # keeps what the eager policy keeps (+4.7% here: the compiled step keeps a float mask where eager keeps less).
    from toolkit.estimate.selective import op_context_fn

    config = tiny_config("llama", layers=2, hidden=64, vocab_size=512)
    traced = trace_compiled_activations(config, seq_len=64, micro_batch=2, dtype="float32", attention="sdpa",
                                        device_kind="cpu", checkpointing="op")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable({"use_reentrant": False, "context_fn": op_context_fn()})
    ids = torch.randint(0, 512, (2, 64))
    real = measure_compiled_step(model, {"input_ids": ids, "labels": ids})
    assert _close(traced.activations_bytes, real.saved_bytes), (traced.activations_bytes, real.saved)
    assert _close(_composed_peak(traced), real.peak_bytes), (_composed_peak(traced), real.peak_bytes)


def test_each_region_is_charged_its_own_elementwise_traffic_and_blocks_compile_only_the_layers():
    # Two identical layers move the same elementwise bytes whatever order the partitioner leaves the backward in
    # (the loss's and the tied weight's gradient sums belong to the head, not to the last layer).
    config = tiny_config("llama", layers=2, hidden=64, vocab_size=4096)
    config.tie_word_embeddings = True
    config.use_cache = False  # as the Trainer runs it and the compiled trace partitions it: one partition serves all three
    saved = compiled_saved_bytes(config, seq_len=128, micro_batch=2, dtype="bfloat16", device_kind="cuda")
    layer0, layer1 = saved.traffic["layer0"], saved.traffic["layer1"]
    assert abs(layer0[0] - layer1[0]) <= 0.05 * layer0[0], (layer0, layer1, saved.traffic["head"])
    # --compile-blocks (torchtitan): layers compiled, embedding / head / loss as eager, only the layers' traffic.
    kw = dict(seq_len=128, micro_batch=2, dtype="bfloat16")
    whole = trace_compiled_activations(config, **kw)
    blocks = trace_compiled_activations(config, blocks=True, **kw)
    eager = trace_activations(config, **kw)
    assert blocks.head == eager.head and blocks.embedding == eager.embedding
    assert blocks.layers == whole.layers and blocks.head != whole.head
    assert 0 < blocks.compile_traffic[0] < whole.compile_traffic[0]


@pytest.mark.parametrize("op_policy", [False, True])
def test_checkpointed_layers_stay_inside_the_compiled_graph(op_policy):
    # transformers 5.25 installs `kernels`, whose forward wrapper on Llama's attention writes a module-level variable:
    # inside a checkpoint Dynamo broke the graph there and ran each layer eagerly (toolkit.patches.compiledckpt).
    from toolkit.estimate.fakestep import enable_checkpointing
    from toolkit.patches.compiledckpt import checkpointed_layers_compiled

    config = tiny_config("llama", layers=2, hidden=64, vocab_size=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").train()
    model.config.use_cache = False
    enable_checkpointing(model, op_policy=op_policy)
    ids = torch.randint(0, 512, (2, 64))
    torch._dynamo.reset()
    with checkpointed_layers_compiled(model):
        explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
