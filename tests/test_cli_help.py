"""CLI friendliness: --help with an example and the choices, the status line, --require-fit, fp16 rates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.cli import build_parser, main


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_every_command_help_has_an_example(capsys):
    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    for name in commands:
        text = _help(capsys, name)
        assert "example" in text and f"toolkit {name}" in text.split("example", 1)[1], name
    estimate = _help(capsys, "estimate")
    assert "{fp32,bf16,fp16,bf16-pure}" in estimate and "{eager,sdpa,flash_attention_2}" in estimate
    assert "--require-fit" in estimate


def test_require_fit_exits_1_only_when_it_does_not_fit(capsys):
    small = ["estimate", "gpt2", "--gpus", "1xH100-80GB", "--seq", "1024", "--require-fit"]
    assert main(small) == 0
    assert main(["estimate", "llama-3-70b", "--gpus", "1xH100-80GB", "--seq", "4096", "--require-fit"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["estimate", "llama-3-70b", "--gpus", "1xH100-80GB", "--seq", "4096"]) == 0  # a report, not a test


def test_gpus_without_bf16_show_their_fp16_rate(capsys):
    assert main(["gpus"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "fp16   125.0 TFLOP/s" in lines["V100-16GB"] and "bf16 0.0" not in lines["V100-16GB"]
    h100 = next(line for name, line in lines.items() if name.startswith("H100"))
    assert " bf16 " in h100


def test_status_line_only_on_a_terminal(monkeypatch):
    import io
    import sys

    from toolkit.commands import help as cli_help

    fake = io.StringIO()
    fake.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stderr", fake)
    with cli_help.status("planning"):
        pass
    assert "planning" in fake.getvalue()
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with cli_help.status("planning"):
        pass
    assert sys.stderr.getvalue() == ""


def test_models_lists_size_kind_layers_and_positions(capsys):
    """`toolkit models` once printed bare names: each line now says what the model is, read from its config."""
    assert main(["models"]) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["gpt2"] == ["gpt2", "124.44M", "dense", "12", "1024"]
    assert lines["qwen3-0.6b"] == ["qwen3-0.6b", "596.05M", "dense", "28", "40960"]
    assert lines["qwen3-30b-a3b"] == ["qwen3-30b-a3b", "30.53B", "MoE,", "8", "of", "128", "experts", "48", "40960"]
    assert lines["mixtral-8x7b"][1:4] == ["46.70B", "MoE,", "2"]
    # DeepSeek-V3: YaRN x40 over 4096 original positions (toolkit.inputs.modelconfig.model_positions).
    assert lines["deepseek-v3"] == ["deepseek-v3", "671.03B", "MoE,", "8", "of", "256", "experts", "61", "163840"]


def test_estimate_of_a_new_catalog_entry(capsys):
    assert main(["estimate", "qwen3-0.6b", "--gpus", "1xH100-80GB", "--seq", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 596_049_920 and out["fits"]


def test_svg_chart_cuts_over_capacity_lines_where_they_leave_it():
    """plan --seq max's memory_vs_seq.svg once clamped six over-capacity lines onto one point of its top edge:
    each line now ends where it crosses the chart's top, at its own length, with a marker and a legend note."""
    import xml.etree.ElementTree as ET

    from toolkit.estimate.longest import Longest, svg_chart

    cap = 80 * 1024**3
    results = [Longest(key=f"s{i}", seq_len=1024 * 2**i, candidate=None,
                       curve=tuple((1024 * 2**k, int(cap * (0.5 + 0.5 * k) * (1 + 0.25 * i))) for k in range(9)))
               for i in range(6)]
    svg = ET.fromstring(svg_chart(results, cap, "t"))
    ns = "{http://www.w3.org/2000/svg}"
    tops = []
    for line in svg.iter(f"{ns}polyline"):
        ys = [float(p.split(",")[1]) for p in line.get("points").split()]
        assert min(ys) >= 36 - 1e-6  # nothing drawn above the plot area (T = 36)
        tops.append(line.get("points").split()[-1])
    markers = [p for p in svg.iter(f"{ns}path") if p.get("fill") != "black"]
    assert len(markers) == 6 and len(set(tops)) == 6  # six lines, six different exits
    assert any("line leaves the chart: above 160 GiB" in (t.text or "") for t in svg.iter(f"{ns}text"))


def _profile_numbers(capsys, model: Path, *flags: str) -> dict:
    assert main(["profile", str(model), "--seq", "32", "--steps", "1", "--json", *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    return {"predicted": out["predicted"], "measured": {k: v for k, v in out["measured"].items()
                                                        if k in ("peak_bytes", "activations_bytes")}}


def test_profile_passes_method_optimizer_and_liger_on(tiny_llama_dir, capsys):
    """profile took --method, --optimizer and --liger and measured a plain full fine-tuning AdamW step anyway; each
    now changes both the prediction and the real step it measures, and they still agree."""
    plain = _profile_numbers(capsys, tiny_llama_dir)
    for flags in (["--method", "lora"], ["--optimizer", "sgd"], ["--liger"]):
        numbers = _profile_numbers(capsys, tiny_llama_dir, *flags)
        assert numbers["predicted"]["peak_bytes"] != plain["predicted"]["peak_bytes"], flags
        assert numbers["measured"]["peak_bytes"] != plain["measured"]["peak_bytes"], flags
        assert numbers["predicted"]["peak_bytes"] == pytest.approx(numbers["measured"]["peak_bytes"], rel=0.05), flags
