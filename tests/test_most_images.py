"""`--images-per-sample max` / `--image-size max` (issue 31, Deliver 3): the largest image count or size a strategy
fits at the job's text length, searched with the planner's own evaluation (toolkit.estimate.mostimages). The tiny
Qwen2.5-VL of tests/test_image_job.py (1024 positions, 448 x 280 images of 160 tokens); in-process."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.test_image_job import _gemma3_config, _run, _tiny_config

TEXT = 96


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen2.5-vl-max")
    _tiny_config().save_pretrained(out)
    return out


def _search_parts(folder: Path, gpus: str = "1xH100-80GB"):
    from toolkit.estimate.search import evaluate
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.inputs.strategy import parse_strategy

    spec = resolve_model(str(folder))
    hw = parse_hardware(gpus)
    strategy = parse_strategy("ddp")
    grid = ParallelGrid.for_strategy(strategy, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node)
    job = Job(seq_len=TEXT + 160, images_per_sample=1, image_size="448x280", image_tokens=160)
    return spec, hw, strategy, grid, job, evaluate


def test_most_images_fits_and_one_more_does_not(tiny_vl_dir):
    """On a GPU of the memory 4 images a sample require on an H100, the search answers 3: 3 fits and 4 does not,
    judged by the same evaluation (a smaller GPU's reserve leaves less room)."""
    from toolkit.estimate.mostimages import COUNT, most_images
    from toolkit.estimate.traces import traces_linear_in_seq

    spec, hw, strategy, grid, job, evaluate = _search_parts(tiny_vl_dir)

    def at(hw, n):
        probe = replace(job, seq_len=TEXT + n * 160, images_per_sample=n)
        with traces_linear_in_seq():
            return evaluate(spec, hw, strategy, probe, grid)

    small = replace(hw, gpu=replace(hw.gpu, memory_bytes=at(hw, 4).memory.required_bytes))
    found = most_images(spec, small, strategy, grid, job, COUNT)
    n = found.candidate.job.images_per_sample
    assert found.found and found.capped_by == "" and found.candidate.job.seq_len == TEXT + n * 160
    assert at(small, n).feasible and not at(small, n + 1).feasible
    assert at(small, n).memory.required_bytes == found.candidate.memory.required_bytes
    assert n == 3 and [p[0] for p in found.probes] == ["1", "2", "3", "4"]  # doubling to 4 (refused), then 3


def test_estimate_images_per_sample_max_stops_at_the_models_positions(tiny_vl_dir, capsys):
    """On an H100 memory never stops the tiny model: (1024 - 96) // 160 = 5 images, its positions' limit."""
    argv = ["estimate", str(tiny_vl_dir), "--gpus", "1xH100-80GB", "--seq", str(TEXT), "--image-size", "448x280",
            "--images-per-sample", "max", "--strategy", "ddp"]
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    assert "ddp: at most 5 images of 448x280 a sample, 160 tokens each: 96 text + 5 x 160 = 896 tokens" in out
    assert "stops at the model's 1,024 positions; pass --images-per-sample 5" in out
    code, out, _ = _run(capsys, *argv, "--json")
    data = json.loads(out)
    assert (data["images_per_sample"], data["seq_len"], data["text_tokens"], data["fits"]) == (5, 896, 96, True)
    assert data["capped_by"] == "the model's 1,024 positions" and data["per_gpu"]["required_bytes"] > 0


def test_estimate_image_size_max_steps_by_the_processors_patch_times_merge(tiny_vl_dir, capsys):
    """Square sides in steps of 14 x 2 = 28 pixels (k x k merged patches, k^2 tokens): two images a sample of at most
    1024 - 96 = 928 tokens leave k^2 <= 464, k = 21: 588 x 588, 441 tokens; the processor's max_pixels
    (28 x 28 x 1280) would allow 980 x 980."""
    from toolkit.estimate.mostimages import image_steps
    from toolkit.inputs.images import image_tokens

    config = _tiny_config()
    steps = image_steps(config)
    assert (steps.step_px, steps.first, steps.last) == (28, 2, 35)
    assert "max_pixels (1,003,520): a larger image is resized down to about 980x980" in steps.limit
    assert image_tokens(config, 980, 980).tokens == 35 * 35 == image_tokens(config, 1400, 1400).tokens
    code, out, _ = _run(capsys, "estimate", str(tiny_vl_dir), "--gpus", "1xH100-80GB", "--seq", str(TEXT),
                        "--images-per-sample", "2", "--image-size", "max", "--strategy", "ddp", "--json")
    data = json.loads(out)
    assert code == 0 and (data["image_size"], data["image_tokens"], data["seq_len"]) == ("588x588", 441, 978)
    assert data["capped_by"] == "the model's 1,024 positions"


def test_gemma_3s_processor_has_one_size():
    """Gemma-3 resizes every image to its SigLIP square: `--image-size max` has one size to answer with."""
    from toolkit.estimate.mostimages import image_steps

    config = _gemma3_config()
    steps = image_steps(config)
    assert (steps.first, steps.last, steps.size(1)) == (1, 1, (56, 56))
    assert steps.limit == "Gemma3ImageProcessorPil resizes every image to 56x56: a larger one buys nothing"


@pytest.mark.parametrize("extra, message", [
    (["--images-per-sample", "max", "--image-size", "max", "--seq", "96"], "the search moves one of them"),
    (["--images-per-sample", "max", "--image-size", "448x280", "--seq", "max"], "not --seq max"),
    (["--images-per-sample", "max", "--seq", "96"], "--images-per-sample needs --image-size"),
    (["--image-size", "max", "--seq", "96"], "--image-size needs --images-per-sample N"),
    (["--images-per-sample", "max", "--image-size", "448x280", "--seq", "96", "--trace-world"],
     "--trace-world prices one image count and size"),
])
def test_max_refusals_are_one_line(tiny_vl_dir, capsys, extra, message):
    code, out, err = _run(capsys, "estimate", str(tiny_vl_dir), "--gpus", "1xH100-80GB", *extra)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, err


def test_max_on_a_text_model_is_one_line(capsys):
    model = Path(__file__).resolve().parent / "arch_configs" / "qwen3-0.6b.json"
    code, out, err = _run(capsys, "estimate", str(model), "--gpus", "1xH100-80GB", "--seq", "512",
                          "--images-per-sample", "max", "--image-size", "448x448")
    assert code == 2 and "has no vision encoder" in err and len(err.strip().splitlines()) == 1


def test_plan_writes_the_row_that_fits_the_most_images(tiny_vl_dir, tmp_path, capsys):
    """Every row reaches the tiny model's positions (5 images of 160 tokens beside 96 text tokens); the plan folder
    carries that count."""
    out = tmp_path / "plan"
    code, text, _ = _run(capsys, "plan", str(tiny_vl_dir / "config.json"), "--gpus", "1xH100-80GB", "--seq", "96",
                         "--images-per-sample", "max", "--image-size", "448x280", "--strategies", "ddp",
                         "--out", str(out))
    assert code == 0 and "ddp: at most 5 images of 448x280 a sample" in text
    assert "chosen: ddp with --images-per-sample 5" in text
    plan = json.loads((out / "plan.json").read_text())
    assert (plan["images_per_sample"], plan["image_size"], plan["image_tokens"], plan["seq_len"]) == \
        (5, "448x280", 160, 896)
    code, _, err = _run(capsys, "plan", str(tiny_vl_dir), "--gpus", "1xH100-80GB", "--seq", "96",
                        "--images-per-sample", "max", "--image-size", "448x280", "--global-batch", "8")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--global-batch does not apply to --images-per-sample max" in err
