"""Time to train (toolkit.estimate.duration): steps, hours, GPU-hours and cost for a dataset, from the candidate's
own predicted step; the step-time band only where published runs back the engine; bad input refused in one line."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from toolkit.cli import main
from toolkit.errors import UserError
from toolkit.estimate.duration import RunSize, duration
from toolkit.estimate.errorband import time_band
from toolkit.inputs.hardware import find_gpu


def estimate_json(capsys, *argv: str) -> dict:
    assert main(["estimate", "gpt2", "--seq", "1024", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_steps_hours_and_cost_follow_from_the_predicted_step(capsys):
    out = estimate_json(capsys, "--gpus", "8xH100-80GB", "--strategy", "ddp", "--micro-batch", "4",
                        "--accumulation", "2", "--dataset-tokens", "1.5B", "--epochs", "2", "--gpu-hour-price", "3")
    run, step = out["time_to_train"], out["timing"]["step_time_s"]
    tokens_per_step = 4 * 2 * 8 * 1024
    steps = math.ceil(1_500_000_000 * 2 / tokens_per_step)
    assert (run["tokens_per_step"], run["steps"], run["gpus"]) == (tokens_per_step, steps, 8)
    assert run["seconds"] == pytest.approx(steps * step, rel=1e-12)
    assert run["gpu_hours"] == pytest.approx(steps * step / 3600 * 8, rel=1e-12)
    assert run["cost"] == pytest.approx(run["gpu_hours"] * 3, rel=1e-12)


def test_the_band_is_the_step_time_band_only_where_published_runs_back_the_engine(capsys):
    backed = estimate_json(capsys, "--gpus", "1xH100-80GB", "--strategy", "ddp", "--dataset-tokens", "1e9")
    h100 = find_gpu("H100-80GB")
    assert time_band(h100).covers("ddp", 1)
    run = backed["time_to_train"]
    # The nearest evidence: the GPU day's one-GPU Hopper DDP steps widen the published band (test_bands).
    assert run["band"] == time_band(h100, strategy="ddp", gpus=1).fraction > time_band(h100).fraction
    assert run["hours_band"] == pytest.approx([run["hours"] * (1 - run["band"]), run["hours"] * (1 + run["band"])])
    unbacked = estimate_json(capsys, "--gpus", "8xH100-80GB", "--strategy", "zero3", "--dataset-tokens", "1e9")
    assert not time_band(h100).covers("zero3", 8)
    assert unbacked["time_to_train"]["band"] is None and unbacked["time_to_train"]["hours_band"] is None
    assert "cost" in unbacked["time_to_train"] and unbacked["time_to_train"]["cost"] is None


def test_one_partial_step_counts_whole():
    class Timing:
        step_time_s, tokens_per_s = 2.0, 500.0  # 1,000 tokens a step

    class Candidate:
        timing, speed_evidenced = Timing(), False

    d = duration(RunSize(dataset_tokens=1001), Candidate(), gpus=4)
    assert (d.steps, d.seconds, d.gpu_hours) == (2, 4.0, 4.0 * 4 / 3600)
    assert "no band" in d.text() and "2 steps of 1,000 tokens" in d.text()


def test_plan_writes_the_time_to_train_into_plan_json_and_plan_md(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "gpt2", "--gpus", "1xH100-80GB", "--seq", "1024", "--global-batch", "8",
                 "--strategies", "ddp", "--dataset-tokens", "1e8", "--gpu-hour-price", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    run = plan["predicted"]["time_to_train"]
    assert run["steps"] == math.ceil(1e8 / (8 * 1024)) and run["gpus"] == 1
    assert f"{run['steps']:,} steps" in printed and "time to train" in (out / "PLAN.md").read_text()


@pytest.mark.parametrize("argv, words", [
    (["--epochs", "2"], "--epochs needs --dataset-tokens or --data"),
    (["--gpu-hour-price", "2"], "--gpu-hour-price needs --dataset-tokens or --data"),
    (["--dataset-tokens", "1e9", "--gpu-hour-price", "-1"], "--gpu-hour-price must be"),
    (["--dataset-tokens", "1e9", "--epochs", "0"], "--epochs must be"),
    (["--dataset-tokens", "lots"], "--dataset-tokens 'lots' is not a count"),
    (["--dataset-tokens", "1e9", "--seq", "max"], "not --seq max"),
])
def test_bad_run_sizes_are_refused_in_one_line(capsys, argv, words):
    try:
        code = main(["estimate", "gpt2", *argv])
    except SystemExit as exc:  # a value argparse's type refuses
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_the_python_api_times_the_run_as_the_command_does(capsys):
    import toolkit.api as tk

    argv = ["--gpus", "8xH100-80GB", "--strategy", "ddp", "--micro-batch", "4", "--accumulation", "2"]
    printed = estimate_json(capsys, *argv, "--dataset-tokens", "1.5B", "--epochs", "2", "--gpu-hour-price", "3")
    e = tk.estimate("gpt2", "8xH100-80GB", strategy="ddp", seq_len=1024, micro_batch=4, grad_accum=2)
    assert e.time_to_train(1.5e9, epochs=2, gpu_hour_price=3).to_dict() == printed["time_to_train"]
    with pytest.raises(UserError, match="epochs"):
        e.time_to_train(1e9, epochs=float("nan"))


# ----------------------------------------------------------------------------------------------------------------
# --data: the tokens counted with the model's own tokenizer (toolkit.run.data_tokens)


def _documents(n: int) -> list[str]:
    """`n` documents of varied length from the stdlib corpus (deterministic)."""
    from toolkit.run.tiny import corpus_text

    lines = [line for line in corpus_text(400_000).splitlines() if line.strip()]
    return [" ".join(lines[(i * 7) % len(lines):(i * 7) % len(lines) + 1 + i % 5]) for i in range(n)]


def _jsonl(path, texts: list[str]):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _own_count(model_dir, texts: list[str]) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts)  # + EOS, as packed


def test_data_tokens_are_the_tokenizers_own_count(tiny_llama_dir, tmp_path, capsys):
    texts = _documents(300)
    data = _jsonl(tmp_path / "train.jsonl", texts)
    out = json.loads(_ok(capsys, "estimate", str(tiny_llama_dir), "--seq", "64", "--gpus", "1xH100-80GB", "--json",
                         "--data", str(data), "--epochs", "2"))
    run = out["time_to_train"]
    assert run["dataset_tokens"] == _own_count(tiny_llama_dir, texts)
    assert run["dataset_tokens_source"] == "counted" and "all 300 documents" in run["dataset_tokens_detail"]
    assert run["steps"] == math.ceil(run["dataset_tokens"] * 2 / run["tokens_per_step"])
    printed = _ok(capsys, "estimate", str(tiny_llama_dir), "--seq", "64", "--gpus", "1xH100-80GB", "--data",
                  str(data))
    assert f"{run['dataset_tokens']:,} tokens ({data}, counted: all 300 documents tokenized)" in printed


def test_big_data_is_sampled_and_scaled_by_the_record_count_within_two_percent(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from toolkit.run.data_tokens import SAMPLE_RECORDS, count_tokens

    texts = _documents(20_000)
    data = _jsonl(tmp_path / "big.jsonl", texts)
    counted = count_tokens(str(data), AutoTokenizer.from_pretrained(tiny_llama_dir), seq_len=64)
    assert (counted.sampled, counted.records, counted.tokenized) == (True, 20_000, SAMPLE_RECORDS)
    assert counted.tokens == pytest.approx(_own_count(tiny_llama_dir, texts), rel=0.02)
    assert f"sampled: {SAMPLE_RECORDS:,} of 20,000 documents tokenized, scaled" in counted.detail(str(data))


def test_chat_data_counts_one_padded_sequence_per_trainable_conversation(tiny_llama_dir, tmp_path, capsys):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(12)))
    out = json.loads(_ok(capsys, "plan", str(tiny_llama_dir), "--seq", "64", "--gpus", "1xH100-80GB",
                         "--global-batch", "4", "--strategies", "ddp", "--json", "--data", str(data)))
    run = out["chosen"]["time_to_train"]
    assert (run["dataset_tokens"], run["steps"], run["dataset_tokens_source"]) == (12 * 64, 3, "counted")


def _ok(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["{model}", "--data", "{tmp}/missing.jsonl"], "missing.jsonl does not exist"),
    (["{model}", "--data", "{tmp}/bad.jsonl"], "is not valid JSON Lines (line 1"),
    (["{model}", "--data", "{tmp}/data.xyz"], "unknown kind (.xyz)"),
    (["{model}", "--data", "{tmp}/good.jsonl", "--dataset-tokens", "1e9"], "give the count or the data, not both"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "512", "--data", "{tmp}/good.jsonl"],
     "give --dataset-tokens N instead of --data"),
    (["{model}", "--data", "{tmp}/good.jsonl", "--seq", "max"], "--data times a run at one sequence length"),
    (["{tmp}/config-only", "--data", "{tmp}/good.jsonl"], "the folder holds no tokenizer files"),
    (["plan", "{model}", "--data", "{tmp}/good.jsonl", "--seq", "max"], "--data does not apply to --seq max"),
    (["plan", "{model}", "--dataset-tokens", "1e9", "--seq", "max"], "--dataset-tokens does not apply to --seq max"),
])
def test_bad_data_is_refused_in_one_line(tiny_llama_dir, tmp_path, capsys, argv, words):
    (tmp_path / "bad.jsonl").write_text("this is not json\n")
    (tmp_path / "data.xyz").write_text("text\n")
    _jsonl(tmp_path / "good.jsonl", ["some text"])
    (tmp_path / "config-only").mkdir()
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config-only")  # a model folder with no tokenizer
    argv = [w.replace("{model}", str(tiny_llama_dir)).replace("{tmp}", str(tmp_path)) for w in argv]
    command = argv.pop(0) if argv[0] == "plan" else "estimate"
    code = main([command, *argv, *([] if "--seq" in argv else ["--seq", "64"])])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err


def test_the_python_api_counts_data_as_the_command_does(tiny_llama_dir, tmp_path, capsys):
    """Estimate / PlanResult .time_to_train(data=...) count with the model's own tokenizer, as --data does; a
    tokenizer= given by name counts the same; both or neither sizes are one line."""
    from toolkit import api
    from toolkit.errors import UserError

    texts = _documents(120)
    data = _jsonl(tmp_path / "train.jsonl", texts)
    printed = json.loads(_ok(capsys, "estimate", str(tiny_llama_dir), "--seq", "64", "--gpus", "1xH100-80GB",
                             "--strategy", "ddp", "--json", "--data", str(data), "--epochs", "2"))
    e = api.estimate(str(tiny_llama_dir), "1xH100-80GB", strategy="ddp", seq_len=64)
    run = e.time_to_train(data=data, epochs=2)
    assert run.run.dataset_tokens == _own_count(tiny_llama_dir, texts) == printed["time_to_train"]["dataset_tokens"]
    assert run.to_dict() == printed["time_to_train"]
    spec_only = api.estimate(api.model(str(tiny_llama_dir)), "1xH100-80GB", strategy="ddp", seq_len=64)
    assert spec_only.time_to_train(data=data, tokenizer=str(tiny_llama_dir), epochs=2).steps == run.steps
    with pytest.raises(UserError, match="pass tokenizer="):
        spec_only.time_to_train(data=data)
    with pytest.raises(UserError, match="not both or neither"):
        e.time_to_train(1e9, data=data)
    p = api.plan(str(tiny_llama_dir), "1xH100-80GB", seq_len=64, global_batch=4, strategies="ddp")
    assert p.time_to_train(data=data).run.dataset_tokens == run.run.dataset_tokens
