"""Real configs of every family the pipeline converter is tested on: the planner either offers pipeline (and the
rehearsal model, the real config shrunk by its own class, converts exactly) or refuses it at plan time naming the
part that stops it. No tracing, no processes: the spec's verdict, the grid's refusal, one-process layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from toolkit.errors import UserError

HERE = Path(__file__).resolve().parent
MODELS = HERE / "arch_configs"
CATALOG = HERE.parent / "toolkit" / "catalog" / "models"

# family -> a published config.json of it (the catalog's where it has one)
FAMILIES = {
    "phi3": CATALOG / "phi-3-mini.json", "gemma2": CATALOG / "gemma-2-2b.json",
    "gemma3_text": MODELS / "gemma-3-1b.json", "qwen3": MODELS / "qwen3-0.6b.json",
    "qwen2_moe": MODELS / "qwen1.5-moe-a2.7b.json", "qwen3_moe": MODELS / "qwen3-30b-a3b.json",
    "mixtral": CATALOG / "mixtral-8x7b.json", "olmo2": MODELS / "olmo-2-1124-7b.json",
    "stablelm": MODELS / "stablelm-2-1.6b.json", "gpt_neox": MODELS / "pythia-1b.json",
    "falcon": MODELS / "falcon-7b.json", "opt": CATALOG / "opt-1.3b.json", "llama": CATALOG / "llama-3-8b.json",
    "mistral": CATALOG / "mistral-7b.json", "qwen2": CATALOG / "qwen2.5-0.5b.json", "gpt2": CATALOG / "gpt2.json",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_real_config_of_each_family_plans_pipeline_and_its_rehearsal_model_converts_exactly(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.test_pipeline_convert import run_layers
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.train.pipeline.convert import CausalLMLoss, RouterStats, Source
    from toolkit.run.rehearsal import make_rehearsal_model, plan_for_model
    from toolkit.inputs.strategy import parse_strategy

    spec = resolve_model(str(FAMILIES[family]))
    assert spec.model_type == family and spec.pipeline_blocker is None
    ParallelGrid.for_strategy(parse_strategy("hybrid"), nodes=1, gpus_per_node=8, pipeline_stages=4) \
        .check_model(spec)
    # The rehearsal's model: this config shrunk (same class, settings kept), here with the MoE router loss on so
    # the pipeline's carried router sums are checked too.
    plan = plan_for_model(str(FAMILIES[family]), "zero3")
    if spec.moe_experts:
        plan = plan.replace(model_config={**plan.model_config, "output_router_logits": True})
    tiny_dir = make_rehearsal_model(plan, tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    assert model.config.model_type == family and model.config.num_hidden_layers == 4
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        source = Source(model.config, tiny_dir)
        out = run_layers(source, ids)
        loss = CausalLMLoss(model.config.vocab_size, RouterStats.for_source(source))(out, ids)
        reference = model(ids, labels=ids)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, reference.logits, atol=0, rtol=0)
    torch.testing.assert_close(loss, reference.loss)


def test_a_family_member_the_converter_cannot_split_is_refused_at_plan_time_naming_the_part(capsys):
    """Falcon-RW uses ALiBi: `toolkit plan --choose pipeline` refuses it before anything is written."""
    from toolkit.cli import main

    code = main(["plan", str(MODELS / "falcon-rw-1b.json"), "--gpus", "8xA100-80GB", "--seq", "1024",
                 "--micro-batch", "1", "--choose", "pipeline"])
    out = capsys.readouterr()
    assert code == 2
    assert "pipeline conversion cannot split falcon (falcon: ALiBi attention bias" in out.err + out.out


@pytest.mark.multiprocess
def test_the_rehearsal_of_a_moe_pipeline_plan_from_a_real_config_passes(tmp_path, capfd):
    """Qwen1.5-MoE, which rehearsals refused before ("no rehearsal model for model_type qwen2_moe"): its config
    shrunk, 2 pipeline stages on 2 CPU processes, with the router loss on (carried between the stages)."""
    from toolkit.commands.launch import launch_main
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model

    plan = plan_for_model(str(MODELS / "qwen1.5-moe-a2.7b.json"), "pipeline", gpus_per_node=8, pipeline_stages=8,
                          micro_batch=2, grad_accum=4, seq_len=512)
    plan = plan.replace(model_config={**plan.model_config, "output_router_logits": True})
    code = launch_main(emit_plan_files(plan, tmp_path / "p"), [], rehearse=True)
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert "qwen2_moe 4 layers" in out and "rehearsal passed" in out
