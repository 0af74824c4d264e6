"""GRPO with a reward model (issue 29, --reward-model): refused unless TRL could score with it, its weights as each
engine holds them, its scoring forward as a phase of its own, its time. Unit tests: no process starts."""

from __future__ import annotations

import json
import math

import pytest

from toolkit import api
from toolkit.cli import main
from toolkit.estimate.reward import REWARD_PHASE
from toolkit.inputs.grpo import Grpo

LLAMA_8B = "llama-3.1-8b"


@pytest.fixture(scope="module")
def reward_8b(tmp_path_factory):
    """Llama-3.1-8B's config as a reward model (the shape of Skywork-Reward-Llama-3.1-8B): LlamaForSequenceClassification,
    one label, stored in bf16. Only its config.json: nothing is loaded."""
    from toolkit.inputs.modelconfig import MODEL_CATALOG_DIR

    config = json.loads((MODEL_CATALOG_DIR / f"{LLAMA_8B}.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "LABEL_0"},
                  label2id={"LABEL_0": 0}, dtype="bfloat16")
    out = tmp_path_factory.mktemp("reward-8b")
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def _grpo(strategy: str, reward: str | None, micro_batch: int = 4, grad_accum: int = 2, checkpointing=False,
          **settings):
    grpo = Grpo(max_completion_length=1024, reward_model=reward, **settings)
    return api.estimate(LLAMA_8B, "8xH100-80GB", strategy=strategy, micro_batch=micro_batch, grad_accum=grad_accum,
                        method="grpo", grpo=grpo, checkpointing=checkpointing)


def _term(memory, name: str) -> int:
    return next(t.bytes for t in memory.terms if t.name == name)


def test_the_reward_models_count_is_the_sequence_classification_class(reward_8b):
    """TRL loads AutoModelForSequenceClassification(num_labels=1): the decoder and a 4,096 x 1 score head, no LM head
    (128,256 x 4,096): Llama-3.1-8B's 8,030,261,248 less 525,336,576 plus 4,096."""
    from toolkit.inputs.reward import reward_model_of

    rm = reward_model_of(reward_8b)
    assert rm.params == 8_030_261_248 - 128_256 * 4096 + 4096 == 7_504_928_768
    assert rm.load_bytes_per_param == 2


@pytest.mark.parametrize("strategy, shard", [("zero3", 8), ("zero2", 1), ("ddp", 1), ("fsdp2", 1)])
def test_each_engine_holds_the_reward_model_as_trl_prepares_it(reward_8b, strategy, shard):
    """prepare_deepspeed: ZeRO-3 partitions it over the 8 GPUs, ZeRO-2 becomes stage 0 (a whole replica), both in
    the config's bf16; DDP and FSDP2 run accelerator.prepare_model(evaluation_mode=True), which wraps nothing: a
    whole replica in its checkpoint's bf16. Every phase holds it: the training peak moves by exactly its bytes."""
    with_rm, without = _grpo(strategy, reward_8b), _grpo(strategy, None)
    weights = math.ceil(7_504_928_768 / shard) * 2
    assert with_rm.memory.reward_bytes == _term(with_rm.memory, "reward model") == weights
    assert without.memory.reward_bytes == 0
    if with_rm.memory.peak_phase != REWARD_PHASE:
        assert with_rm.memory.peak_bytes - without.memory.peak_bytes == weights


@pytest.mark.parametrize("strategy, weights", [("zero3", 1_876_232_192), ("zero2", 15_009_857_536)])
def test_the_planners_states_floor_counts_the_reward_model(reward_8b, strategy, weights):
    """The floor the planner refuses candidates on before tracing holds the reward model's resident bytes (7,504,928,768
    bf16 parameters: ZeRO-3 an eighth each, ZeRO-2's stage 0 all of them), so it stays below the required bytes."""
    from toolkit.estimate.memory import states_floor_bytes

    def floor(e):
        return states_floor_bytes(e.model, e.candidate.strategy, e.job, e.hardware, grid=e.grid)

    with_rm, without = _grpo(strategy, reward_8b), _grpo(strategy, None)
    assert floor(with_rm) - floor(without) == weights == with_rm.memory.reward_bytes
    assert floor(with_rm) <= with_rm.memory.required_bytes


def test_the_scoring_forward_is_a_phase_of_its_own_named_when_it_is_the_peak(reward_8b):
    """ZeRO-3 with a reference (beta 0.04), checkpointed layers and generation on a vLLM server: the reward model
    scores the process's 64 x 1,536-token generation batch in one forward, before the policy's forward on 8 of them:
    the peak is there, and it is the states held between steps (ZeRO-3's gathered policy parameters partitioned again
    by then), the reward model's shard and that forward's working set."""
    e = _grpo("zero3", reward_8b, micro_batch=8, grad_accum=8, checkpointing=True, beta=0.04, use_vllm=True,
              vllm_mode="server")
    m = e.memory
    forward = _term(m, REWARD_PHASE)
    assert m.peak_phase == REWARD_PHASE
    held = (m.parameters_bytes + m.gradients_bytes + m.optimizer_bytes + m.buffers_bytes - m.gathered_bytes
            + m.reference_bytes)
    assert m.gathered_bytes > 0
    assert m.peak_bytes == held + m.reward_bytes + m.workspace_bytes + forward
    assert m.transient_bytes == forward


def test_the_reward_forward_is_its_own_share_of_the_step(reward_8b):
    """One no_grad forward of the reward model's own config over the step's completions, at the policy's rate per
    FLOP: the step grows by exactly it (and, under ZeRO-3, one all-gather of its shards)."""
    from toolkit.estimate.preference import forward_flops
    from toolkit.inputs.reward import reward_model_of

    with_rm, without = _grpo("ddp", reward_8b), _grpo("ddp", None)
    t = with_rm.timing
    assert t.reward_s > 0 and without.timing.reward_s == 0
    assert t.step_time_s == pytest.approx(without.timing.step_time_s + t.reward_s, rel=1e-9)
    rm = reward_model_of(reward_8b)
    policy = forward_flops(with_rm.model, 512 + 1024)
    reward = forward_flops(rm.spec, 512 + 1024, head_matmul_params=4096)
    assert reward < policy  # no 128,256-wide head
    assert _grpo("zero3", reward_8b).timing.reward_s > _grpo("zero3", None).timing.reward_s


def test_a_causal_lm_is_refused_as_a_reward_model(capsys):
    code = main(["estimate", LLAMA_8B, "--gpus", "8xH100-80GB", "--method", "grpo", "--reward-model", LLAMA_8B])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "not a sequence-classification model" in err[0] and "LlamaForCausalLM" in err[0]


def test_a_reward_model_without_grpo_is_refused(capsys, reward_8b):
    code = main(["estimate", LLAMA_8B, "--gpus", "8xH100-80GB", "--reward-model", reward_8b])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--reward-model applies to --method grpo" in err[0]


def test_a_reward_model_with_more_than_one_label_is_refused(capsys, tmp_path, reward_8b):
    from pathlib import Path

    config = json.loads((Path(reward_8b) / "config.json").read_text())
    config.update(id2label={"0": "A", "1": "B"}, label2id={"A": 0, "B": 1})
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = main(["estimate", LLAMA_8B, "--gpus", "8xH100-80GB", "--method", "grpo", "--reward-model", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "has 2 labels" in err[0]


def test_a_plan_names_its_reward_model_for_trl_and_the_own_script_helper(tiny_llama_dir, tiny_reward_dir, tmp_path,
                                                                         capsys):
    """plan --out: plan.json's grpo keeps the reward model, training_args.json gives it as GRPOTrainer's reward_funcs
    (not a GRPOConfig field: grpo_config is what TRL's GRPOConfig accepts), PLAN.md names it, the own-script helper
    returns it, and toolkit check passes the folder."""
    from toolkit.train.own_script import reward_funcs

    out = tmp_path / "plan"
    assert main(["plan", str(tiny_llama_dir), "--gpus", "2xH100-80GB", "--method", "grpo", "--max-prompt-length",
                 "32", "--max-completion-length", "32", "--micro-batch", "4", "--strategies", "zero3",
                 "--reward-model", str(tiny_reward_dir), "--out", str(out)]) == 0
    assert json.loads((out / "plan.json").read_text())["grpo"]["reward_model"] == str(tiny_reward_dir)
    settings = json.loads((out / "training_args.json").read_text())
    assert settings["reward_funcs"] == [str(tiny_reward_dir)]
    assert "reward_funcs" not in settings["grpo_config"] and "reward_model" not in settings["grpo_config"]
    assert f"Reward model `{tiny_reward_dir}`" in (out / "PLAN.md").read_text()
    assert reward_funcs(plan=out) == [str(tiny_reward_dir)]
    capsys.readouterr()
    assert main(["check", str(out)]) == 0, capsys.readouterr()
