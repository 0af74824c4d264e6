"""Image-and-text jobs (issue 31, Deliver 3): --images-per-sample / --image-size on estimate and plan. The language
model's sequence is text + images x the processor's tokens per image, traced as any sequence; the vision encoder and
projector are traced alone under FakeTensorMode (toolkit.estimate.visiontower) and checked against a real CPU
forward / backward of a tiny Qwen2.5-VL. In-process; no hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.cli import main

MODELS = Path(__file__).resolve().parent / "arch_configs"
TEXT, IMAGES, SIZE = 96, 2, "448x280"  # 448 x 280 -> 32 x 20 patches of 14, merged 2 x 2: 160 tokens an image


def _tiny_config():
    from toolkit.inputs.modelconfig import load_config
    from toolkit.run.tiny import shrink_config

    config = shrink_config(load_config(str(MODELS / "qwen2.5-vl-7b-instruct.json")), layers=2,
                           max_positions=1024)
    # the special tokens inside the tiny vocabulary (512)
    config.image_token_id, config.vision_start_token_id, config.vision_end_token_id = 500, 501, 502
    config.video_token_id = 503
    return config


def _tiny_qwen35_config():
    """A tiny Qwen3.5 (Qwen3_5Config, its own classes): 3 gated-delta-net layers and 1 attention layer (the real
    model's 3:1 pattern, full_attention_interval 4), interleaved M-RoPE on a quarter of each head, and its vision
    tower patching 16 pixels: 448 x 280 -> 28 x 18 patches merged 2 x 2, 126 tokens an image."""
    from transformers import Qwen3_5Config

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 0],
                                     mrope_interleaved=True, partial_rotary_factor=0.25))
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
                  num_position_embeddings=64)
    return Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=500, vision_start_token_id=501,
                         vision_end_token_id=502, video_token_id=503)


TINY = {"qwen2.5-vl": _tiny_config, "qwen3.5": _tiny_qwen35_config}
"""The tiny image-text models the real CPU steps check the estimate against."""


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen2.5-vl")
    _tiny_config().save_pretrained(out)
    return out


def _measured_saved_bytes(config, tower: str, tokens: int, pixel_shape, grid) -> int:
    """A real CPU forward of the tiny class on IMAGES images and TEXT text tokens: the unique storages autograd
    saves (parameters excluded), then its backward."""
    import torch

    from toolkit.inputs.modelconfig import auto_model_class

    torch.manual_seed(0)
    model = auto_model_class(config, images=True).from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    if tower == "freeze":
        for name, p in model.named_parameters():
            if name.startswith("model.visual"):
                p.requires_grad_(False)
    ids: list[int] = []
    for _ in range(IMAGES):
        ids += torch.randint(0, 400, (TEXT // IMAGES - 2,)).tolist() + [501] + [500] * tokens + [502]
    ids_t = torch.tensor([ids])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set = set()
    total = [0]

    def pack(t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if st.data_ptr() not in params and key not in seen:
            seen.add(key)
            total[0] += st.nbytes()
        return t

    pixels = torch.randn(IMAGES * pixel_shape[0], pixel_shape[1])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids_t, labels=ids_t, pixel_values=pixels,
                    image_grid_thw=torch.tensor([list(grid)] * IMAGES), mm_token_type_ids=(ids_t == 500).long())
    out.loss.backward()
    assert torch.isfinite(out.loss)
    st = pixels.untyped_storage()  # the batch's pixel values: resident, saved by the trained tower or not
    return total[0] + (0 if (st.data_ptr(), st.nbytes()) in seen else st.nbytes())


@pytest.mark.parametrize("arch", list(TINY))
@pytest.mark.parametrize("tower", ["train", "freeze"])
def test_traced_activations_match_a_real_cpu_image_text_step(tower, arch):
    """Language model traced at 96 + 2 x 160 = 416 tokens plus the tower traced alone: the saved bytes of a real
    forward of the tiny Qwen2.5-VL on 2 images, plus the batch's pixel values, within 3% (measured -0.002% trained,
    -0.005% frozen). The tower's share is 2 images x (its one-image trace + the image's float32 pixel values);
    frozen, it saves nothing."""
    from toolkit.estimate.traces import scaled_trace
    from toolkit.estimate.visiontower import trace_tower
    from toolkit.inputs.images import image_job, image_tokens
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    config = TINY[arch]()
    spec = build_spec(arch, config, images=True)
    seq, fields = image_job(spec, IMAGES, SIZE, TEXT)
    tokens = 160 if arch == "qwen2.5-vl" else 126
    assert fields == {"images_per_sample": 2, "image_size": "448x280", "image_tokens": tokens}
    assert seq == TEXT + IMAGES * tokens
    job = Job(seq_len=seq, micro_batch=1, precision="fp32", device_kind="cpu", vision_tower=tower, **fields)
    trace = scaled_trace(spec, job, parse_strategy("ddp"))
    found = image_tokens(config, 448, 280)
    measured = _measured_saved_bytes(config, tower, found.tokens, found.pixel_shape, found.grid)
    assert trace.activations_bytes == pytest.approx(measured, rel=0.03)
    one = trace_tower(config, 448, 280, dtype="float32", trained=tower == "train")
    assert (one.saved_bytes > 1_000_000) == (tower == "train")
    text_only = scaled_trace(spec, Job(seq_len=seq, micro_batch=1, precision="fp32", device_kind="cpu"),
                             parse_strategy("ddp"))
    assert trace.embedding.saved_bytes - text_only.embedding.saved_bytes == IMAGES * (one.saved_bytes
                                                                                        + one.pixel_bytes)
    assert one.pixel_bytes == (640 * 1176 * 4 if arch == "qwen2.5-vl" else 504 * 1536 * 4)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_the_qwen_tower_alone_saves_what_a_real_forward_saves(checkpointing):
    """The tiny Qwen2.5-VL's encoder + merger on one 448 x 280 image, fake vs real CPU (fp32): the bytes the
    forward leaves alive for backward, and with the model's activation checkpointing on (the HF Trainer's, which
    reaches the tower's GradientCheckpointingLayer blocks) each block keeps only its inputs, its checkpoint closure
    the rotary cos / sin: 3,957,784 -> 660,576 bytes measured beside the image's 3,010,560 bytes of float32 pixel
    values (autograd's saved storages alone were 578,560: the closures' 81,920 bytes of cos / sin are not saved
    tensors)."""
    import torch

    from toolkit.estimate.fakestep import enable_checkpointing
    from toolkit.estimate.visiontower import trace_tower
    from toolkit.inputs.modelconfig import auto_model_class
    from toolkit.inputs.images import image_tokens

    config = _tiny_config()
    found = image_tokens(config, 448, 280)
    traced = trace_tower(config, 448, 280, dtype="float32", checkpointing=checkpointing)
    torch.manual_seed(0)
    model = auto_model_class(config, images=True).from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if checkpointing:
        enable_checkpointing(model)
    model.train()
    grid = torch.tensor([list(found.grid)])
    saved = _real_held_bytes(model, torch.randn(found.pixel_shape),
                              lambda pixels: torch.cat(list(model.model.get_image_features(
                                  pixels, image_grid_thw=grid).pooler_output)))
    # the trace takes the grid-derived inputs (window index, cu_seqlens) as constants made outside it: 1,304 and
    # 1,376 bytes of the real forward's are not counted
    assert saved == (660_576 if checkpointing else 3_957_784)
    assert traced.saved_bytes == (659_200 if checkpointing else 3_956_480)


def _real_held_bytes(model, pixels, features) -> int:
    """The bytes a real forward of `features(pixels)` leaves alive for its backward (torch's MemTracker: every
    storage the forward made that is still alive at its end; parameters, the pixel values and the output features
    left out); its backward is run too, as a step would."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from toolkit.estimate.livebytes import _act_bytes, frozen_params_trackable

    tracker = MemTracker()
    tracker.track_external(model, pixels)
    with frozen_params_trackable(), tracker:
        before = _act_bytes(tracker)
        out = features(pixels)
        held = _act_bytes(tracker) - before - out.untyped_storage().nbytes()
    out.sum().backward()
    return held


def test_gemma_3s_siglip_tower_traced_alone_saves_what_a_real_forward_saves():
    """Gemma-3's tower reads no tensor values: SigLIP on its square image (56 x 56 here: 4 x 4 patches of 14)
    and the projector's 2 x 2 pooling to mm_tokens_per_image 4. The fake trace's saved bytes are a real CPU
    forward's (fp32, eager attention as Gemma-3 picks, and sdpa)."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.estimate.visiontower import trace_tower
    from toolkit.inputs.images import image_tokens

    config = _gemma3_config()
    found = image_tokens(config, 640, 480)
    assert found.tokens == 4 and found.pixel_shape == (1, 3, 56, 56)
    for attention in ("eager", "sdpa"):
        traced = trace_tower(config, 640, 480, dtype="float32", attention=attention)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
        model.train()
        saved = _real_held_bytes(model, torch.randn(found.pixel_shape),
                                  lambda pixels: model.model.get_image_features(pixels).pooler_output)
        assert traced.saved_bytes == saved > 0, attention


@pytest.mark.parametrize("arch", ["qwen2.5-vl", "gemma-3"])
def test_a_flash_attention_tower_is_traced_through_the_kernels_stand_in(arch):
    """--attention flash_attention_2 on an image job: transformers sets a from_pretrained string on every
    sub-model, so the tower runs flash-attention too; its trace takes the flash kernel's stand-in, as the language
    model's does (the flash-attn package is not installed here: the tower's build raised ImportError before, a
    traceback out of estimate and plan). The stand-in keeps what sdpa's fused CPU kernel keeps (q, k, v, out, an
    fp32 logsumexp), so the saved bytes are sdpa's."""
    from toolkit.estimate.visiontower import trace_tower

    config = _tiny_config() if arch == "qwen2.5-vl" else _gemma3_config()
    sdpa = trace_tower(config, 448, 280, dtype="bfloat16", attention="sdpa")
    flash = trace_tower(config, 448, 280, dtype="bfloat16", attention="flash_attention_2")
    assert flash.saved_bytes == sdpa.saved_bytes > 0
    assert flash.backward_extra_bytes == sdpa.backward_extra_bytes


def _gemma3_config():
    from transformers import Gemma3Config

    return Gemma3Config(
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           image_size=56, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=4, image_token_index=511)


def _real_flops(config, trained: bool, checkpointing: bool) -> tuple[int, int]:
    """(forward, backward) FLOPs torch's FlopCounterMode counts over a real CPU forward and backward of the tiny
    class's tower + projector on one image, eager attention (whose QK^T and AV are bmm, which FlopCounterMode
    counts; it has no formula for the CPU's fused attention kernel)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from toolkit.estimate.fakestep import enable_checkpointing
    from toolkit.inputs.modelconfig import auto_model_class
    from toolkit.inputs.images import image_tokens

    found = image_tokens(config, 448, 280)
    torch.manual_seed(0)
    model = auto_model_class(config, images=True).from_config(config, dtype=torch.float32, attn_implementation="eager")
    if checkpointing:
        enable_checkpointing(model)
    model.train()
    for p in model.parameters():
        p.requires_grad_(trained)
    kwargs = {"image_grid_thw": torch.tensor([list(found.grid)])} if found.grid else {}
    with FlopCounterMode(display=False) as counter:
        out = model.model.get_image_features(torch.randn(found.pixel_shape), **kwargs).pooler_output
        out = torch.cat(list(out))
        forward = counter.get_total_flops()
        if out.requires_grad:
            out.backward(torch.ones_like(out))
    return forward, counter.get_total_flops() - forward


@pytest.mark.parametrize("model, trained, checkpointing", [
    ("qwen2.5-vl", True, False), ("qwen2.5-vl", True, True), ("qwen2.5-vl", False, False),
    ("qwen2.5-vl", False, True), ("gemma-3", True, False), ("gemma-3", False, False)])
def test_the_towers_traced_flops_are_a_real_towers(model, trained, checkpointing):
    """The FLOPs the tower's fake trace counts (sdpa) against torch's FlopCounterMode over a real CPU forward and
    backward (eager attention), one image: within 1% (measured equal). Qwen2.5-VL on 448 x 280 (640 patches):
    forward 91,684,864; backward 135,200,768 trained, 165,609,472 checkpointed (the blocks' recompute), 0 frozen,
    83,361,792 frozen but checkpointed (enable_input_require_grads sends input gradients through the blocks)."""
    from toolkit.estimate.visiontower import trace_tower

    config = _tiny_config() if model == "qwen2.5-vl" else _gemma3_config()
    traced = trace_tower(config, 448, 280, dtype="float32", trained=trained, checkpointing=checkpointing)
    forward, backward = _real_flops(config, trained, checkpointing)
    assert forward > 1_000_000 and traced.forward_flops == pytest.approx(forward, rel=0.01)
    assert traced.backward_flops == pytest.approx(backward, rel=0.01)
    assert (backward > 0) == (trained or checkpointing)
    assert 0 < traced.attention_flops < traced.forward_flops + traced.backward_flops


@pytest.mark.parametrize("tower", ["train", "freeze"])
def test_the_towers_model_flops_are_read_off_the_checkpointed_trace(tower):
    """MFU's model FLOPs of the tower are a step's without checkpointing whether the job checkpoints or not, read
    off the one trace the job makes: its backward less the blocks' recompute (trained), nothing (frozen). The
    checkpointed trace's recompute is its backward's excess over the plain trace's (trained: 308,740,096 -
    230,621,184 on 448 x 280, float32)."""
    from toolkit.estimate.efficiency import COMPUTE
    from toolkit.estimate.visiontime import vision_time
    from toolkit.estimate.visiontower import trace_tower
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.images import image_job
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    spec = build_spec("qwen2_5_vl", _tiny_config())
    seq, fields = image_job(spec, IMAGES, SIZE, TEXT)
    model = {}
    for checkpointing in (False, True):
        job = Job(seq_len=seq, micro_batch=1, vision_tower=tower, checkpointing=checkpointing, **fields)
        model[checkpointing] = vision_time(spec, parse_strategy("ddp"), job, parse_hardware("1xH100-80GB"),
                                           peak_flops=1e15, compute_model=COMPUTE).model_flops_per_sample
    plain, checkpointed = (trace_tower(_tiny_config(), 448, 280, dtype="float32", trained=tower == "train",
                                       checkpointing=c) for c in (False, True))
    assert plain.recompute_flops == 0 < checkpointed.recompute_flops
    if tower == "train":
        assert checkpointed.backward_flops - checkpointed.recompute_flops == plain.backward_flops > 0
    else:  # checkpointing sends input gradients through the frozen blocks; without it no backward reaches them
        assert checkpointed.backward_flops - checkpointed.recompute_flops > plain.backward_flops == 0
    assert model[True] == model[False] == IMAGES * (plain.forward_flops + plain.backward_flops) > 0


def _timing(tower: str, images: bool, checkpointing: bool = False):
    from toolkit.estimate.timing import step_time
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.images import image_job
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    spec = build_spec("qwen2_5_vl", _tiny_config())
    seq, fields = image_job(spec, IMAGES, SIZE, TEXT)
    job = Job(seq_len=seq, micro_batch=1, grad_accum=2, vision_tower=tower, checkpointing=checkpointing,
              **(fields if images else {}))
    return step_time(spec, parse_strategy("ddp"), job, parse_hardware("1xH100-80GB"))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_images_add_the_towers_time_to_the_step_and_a_frozen_tower_costs_less(checkpointing):
    """The same 416 tokens with and without the 2 images: the step grows by the tower's time exactly (its FLOPs at
    the language model's efficiency constants), counted in compute; a frozen tower (no backward reaches it, or
    only the input gradients checkpointing makes run) takes less than a trained one. MFU counts the tower's model
    FLOPs: the image step's MFU is above what the language model's FLOPs alone give over its longer step."""
    trained, frozen, text = (_timing("train", True, checkpointing), _timing("freeze", True, checkpointing),
                             _timing("train", False, checkpointing))
    for imaged in (trained, frozen):
        assert imaged.vision_s > 0
        assert imaged.step_time_s - text.step_time_s == pytest.approx(imaged.vision_s, rel=1e-9)
        assert imaged.compute_s - text.compute_s == pytest.approx(imaged.vision_s, rel=1e-9)
        assert imaged.mfu > text.mfu * text.step_time_s / imaged.step_time_s
        assert imaged.to_dict()["vision_s"] == imaged.vision_s
        assert any(n.startswith("vision encoder + projector: ") for n in imaged.assumptions)
    assert frozen.vision_s < trained.vision_s
    assert "vision_s" not in text.to_dict()


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_estimate_and_plan_carry_the_images_and_their_tokens(tiny_vl_dir, capsys):
    common = ["--gpus", "1xH100-80GB", "--seq", str(TEXT), "--images-per-sample", str(IMAGES), "--image-size", SIZE]
    code, out, _ = _run(capsys, "estimate", str(tiny_vl_dir), *common, "--strategy", "ddp")
    assert code == 0
    assert ("images: 2 x 448x280 per sample, 160 tokens each (the model's image processor): they add 320 tokens to "
            "96 text tokens; the language model sees 416; the vision encoder's compute is in the step time (its "
            "FLOPs counted from its traced ops)") in out
    code, out, _ = _run(capsys, "estimate", str(tiny_vl_dir), *common, "--strategy", "ddp", "--json")
    job = json.loads(out)["job"]
    assert (job["seq_len"], job["text_tokens"], job["images_per_sample"], job["image_size"], job["image_tokens"]) \
        == (416, 96, 2, "448x280", 160)
    code, text_out, _ = _run(capsys, "estimate", str(tiny_vl_dir), "--gpus", "1xH100-80GB", "--seq", "416",
                             "--strategy", "ddp", "--json")
    # the same 416 tokens as text: the images add exactly the tower's saved bytes, named in the vision share
    imaged, text = json.loads(out), json.loads(text_out)
    tower = next(t["bytes"] for t in imaged["terms"] if t["name"] == "  of which vision encoder")
    assert tower > 0 and imaged["vision_share"]["activations_bytes"] == tower
    assert imaged["per_gpu"]["activations_bytes"] - text["per_gpu"]["activations_bytes"] == tower
    assert "activations_bytes" not in text["vision_share"]
    # the tower's compute is part of the step's, in --json and on the --explain line of the vision encoder
    assert imaged["timing"]["vision_s"] > 0 and "vision_s" not in text["timing"]
    ti, tt = imaged["timing"], text["timing"]
    if ti.get("host_s", 0) >= ti["step_time_s"]:  # the tiny model's step on a GPU is the host's dispatch (a floor)
        assert ti["step_time_s"] == pytest.approx(ti["host_s"]) and tt["step_time_s"] == pytest.approx(tt["host_s"])
    else:
        assert ti["step_time_s"] - tt["step_time_s"] == pytest.approx(ti["vision_s"], rel=1e-6)
    code, out, _ = _run(capsys, "estimate", str(tiny_vl_dir), *common, "--strategy", "ddp", "--explain")
    share = next(line for line in out.splitlines() if "vision encoder's share" in line)
    assert f"its compute {imaged['timing']['vision_s']:.3f} s of the step's" in share
    band = next(line for line in out.splitlines() if line.startswith("time band: "))
    assert f"the vision encoder's {imaged['timing']['vision_s']:.3f} s of it is outside the band's evidence" in band
    code, out, err = _run(capsys, "plan", str(tiny_vl_dir), *common, "--global-batch", "8", "--strategies", "ddp",
                          "--json")
    assert code == 0 and json.loads(out)["images"] == {"images_per_sample": 2, "image_size": "448x280",
                                                       "image_tokens": 160, "seq_len": 416, "text_tokens": 96}
    assert "they add 320 tokens to 96 text tokens" in err
    code, out, _ = _run(capsys, "plan", str(tiny_vl_dir), *common, "--global-batch", "8", "--strategies", "ddp")
    assert code == 0 and "step time of #1: the vision encoder's " in out


def test_plan_json_and_plan_md_carry_the_image_fields(tiny_vl_dir):
    from dataclasses import replace

    from toolkit.emit.user_settings import plan_md_section
    from toolkit.plan.job import job_from_plan, job_to_plan_fields
    from toolkit.plan.schema import parse_plan
    from toolkit.run.rehearsal import plan_for_model

    plan = plan_for_model(tiny_vl_dir, "ddp", gpus_per_node=1, seq_len=416)
    assert "images_per_sample" not in plan.to_json()  # a text plan reads as before
    job = replace(job_from_plan(plan), images_per_sample=2, image_size="448x280", image_tokens=160)
    imaged = replace(plan, **job_to_plan_fields(job))
    data = json.loads(imaged.to_json())
    assert (data["images_per_sample"], data["image_size"], data["image_tokens"]) == (2, "448x280", 160)
    assert job_from_plan(parse_plan(json.loads(imaged.to_json()))) == job
    assert any("they add 320 tokens to 96 text tokens" in line for line in plan_md_section(imaged))
    # toolkit.train (and launch's preflight, through the same check) takes the image plan for this model
    # (tests/test_image_train.py trains one)
    from toolkit.train.model import check_matches_plan, load_config

    check_matches_plan(load_config(str(tiny_vl_dir)), plan, str(tiny_vl_dir))
    check_matches_plan(load_config(str(tiny_vl_dir)), imaged, str(tiny_vl_dir))


def test_a_repeated_image_plan_reads_the_towers_trace_from_the_disk_cache(tiny_vl_dir, tmp_path, monkeypatch,
                                                                          capsys):
    """The tower's trace is kept on disk by the spec's source key, as the language model's are
    (toolkit.estimate.traces.job_tower): a second plan in a process whose in-memory traces are emptied traces no
    tower (trace_tower's own per-process cache stays empty) and prints the same plan, its explained vision share
    included."""
    from toolkit.estimate import traces, visiontower

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TOOLKIT_NO_CACHE", raising=False)
    argv = ["plan", str(tiny_vl_dir), "--gpus", "1xH100-80GB", "--seq", "128", "--images-per-sample", "1",
            "--image-size", SIZE, "--strategies", "ddp", "--micro-batch", "1", "--checkpointing", "on",
            "--explain", "--json"]
    plans, traced = [], []
    for _ in range(2):
        monkeypatch.setattr(traces, "_TOWER_CACHE", {})
        monkeypatch.setattr(visiontower, "_CACHE", {})
        monkeypatch.setattr(visiontower, "_BY_PIXELS", {})
        assert main(argv) == 0
        plans.append(json.loads(capsys.readouterr().out))
        traced.append(len(visiontower._CACHE))
    assert traced == [1, 0]  # checkpointed (the MFU's model FLOPs read off it too); then none
    assert plans[0] == plans[1] and plans[0]["chosen_explained"]["vision_share"]["activations_bytes"] > 0


def test_plan_md_tells_a_users_script_to_load_qwen35s_image_text_class(tmp_path):
    """A user's script on a Qwen3.5 image plan must load Qwen3_5ForConditionalGeneration: AutoModelForCausalLM's
    class for qwen3_5 is the language model alone, which takes pixel_values and ignores them (measured: toolkit.train
    with it ran, its loss fell, and the saved model had no tower). PLAN.md names the auto class for the image plan, the
    text plan's scripts keep AutoModelForCausalLM."""
    from dataclasses import replace

    from toolkit.emit.user_settings import auto_class_name, plan_md_section
    from toolkit.plan.job import job_from_plan, job_to_plan_fields
    from toolkit.run.rehearsal import plan_for_model

    _tiny_qwen35_config().save_pretrained(tmp_path)
    plan = plan_for_model(tmp_path, "ddp", gpus_per_node=1, seq_len=TEXT + 2 * 126, images=True)
    imaged = replace(plan, **job_to_plan_fields(replace(job_from_plan(plan), images_per_sample=2, image_size=SIZE,
                                                        image_tokens=126)))
    assert auto_class_name(imaged) == "AutoModelForImageTextToText"
    assert auto_class_name(plan_for_model(tmp_path, "ddp", gpus_per_node=1, seq_len=64)) == "AutoModelForCausalLM"
    text = "\n".join(plan_md_section(imaged))
    assert "`model = AutoModelForImageTextToText.from_pretrained(MODEL)`" in text
    assert f"the images resized to {SIZE} before the collator" in text


@pytest.mark.parametrize("argv, message", [
    (["--images-per-sample", "2", "--image-size", "448x448"], "has no vision encoder (it is not a multimodal class)"),
    (["--images-per-sample", "2"], "--images-per-sample needs --image-size WIDTHxHEIGHT"),
    (["--image-size", "448x448"], "--image-size needs --images-per-sample N"),
])
def test_images_on_a_text_model_or_half_given_are_one_line(argv, message, capsys):
    model = "qwen3-0.6b"
    if "--model-config" in argv:
        model, argv = argv[-1], argv[:-2]
    code, out, err = _run(capsys, "estimate", str(MODELS / f"{model}.json"), "--gpus", "1xH100-80GB", "--seq",
                          "512", *argv)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_a_qwen35_image_job_counts_the_whole_class_part_by_part():
    """Qwen3.5's AutoModelForCausalLM builds its language model alone (a text job loads that); an image job builds
    the class that runs images, Qwen3_5ForConditionalGeneration (AutoModelForImageTextToText's), found from
    transformers' auto mappings: its counts are the real model's, part by part, and its language model is the text
    job's."""
    from transformers import AutoModelForImageTextToText

    from toolkit.inputs.modelspec import build_spec

    config = _tiny_qwen35_config()
    text, imaged = build_spec("qwen3.5", config), build_spec("qwen3.5", config, images=True)
    model = AutoModelForImageTextToText.from_config(config)
    assert (text.model_class, text.multimodal) == ("Qwen3_5ForCausalLM", False)
    assert imaged.model_class == type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    visual = model.model.visual
    assert imaged.params == sum(p.numel() for p in model.parameters()) == 324_200
    assert imaged.projector_params == sum(p.numel() for p in visual.merger.parameters()) == 24_832
    assert imaged.vision_params == sum(p.numel() for p in visual.parameters()) - 24_832 == 66_240
    assert imaged.language_params == text.params == sum(p.numel() for p in model.model.language_model.parameters()) \
        + model.lm_head.weight.numel()
    assert imaged.vision_modules == ("model.visual", "model.visual.merger")
    assert any("loads the whole class Qwen3_5ForConditionalGeneration (AutoModelForImageTextToText's class for "
               "qwen3_5) to run the images" in n for n in imaged.notes)


def test_a_qwen35_moe_image_job_counts_its_image_text_class_from_the_same_mappings():
    """Qwen3.5-MoE falls out of the same code: its image job counts Qwen3_5MoeForConditionalGeneration exactly, its
    experts found in the language model."""
    from transformers import AutoModelForImageTextToText, Qwen3_5MoeConfig

    from toolkit.inputs.modelspec import build_spec

    dense = _tiny_qwen35_config()
    text = {**dense.text_config.to_dict(), "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
            "num_experts": 4, "num_experts_per_tok": 2}
    for key in ("model_type", "intermediate_size", "layer_types"):
        text.pop(key, None)
    config = Qwen3_5MoeConfig(text_config=text, vision_config=dense.vision_config.to_dict(), image_token_id=500,
                              vision_start_token_id=501, vision_end_token_id=502, video_token_id=503)
    spec = build_spec("qwen3.5-moe", config, images=True)
    model = AutoModelForImageTextToText.from_config(config)
    assert spec.model_class == type(model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert (spec.vision_params, spec.projector_params) == (66_240, 24_832)
    assert (spec.moe_experts, spec.moe_top_k) == (4, 2)


def test_estimate_plans_qwen35_on_images_with_its_tower_and_the_processors_tokens(tmp_path, capsys):
    """`estimate` of a Qwen3.5 folder with images: its processor's 126 tokens an image (patch 16, merge 2: 448 x 280
    -> 28 x 18 patches), the class's parts, the tower's share traced; the same folder without images plans the
    language model alone, as before."""
    _tiny_qwen35_config().save_pretrained(tmp_path)
    common = ["--gpus", "1xH100-80GB", "--seq", str(TEXT), "--strategy", "ddp", "--json"]
    code, out, err = _run(capsys, "estimate", str(tmp_path), *common, "--images-per-sample", "2", "--image-size", SIZE)
    assert code == 0, err
    imaged = json.loads(out)
    assert (imaged["job"]["seq_len"], imaged["job"]["image_tokens"]) == (TEXT + 2 * 126, 126)
    assert imaged["vision_share"]["activations_bytes"] > 0 and imaged["timing"]["vision_s"] > 0
    code, out, _ = _run(capsys, "estimate", str(tmp_path), *common)
    text = json.loads(out)
    assert code == 0 and "vision_s" not in text["timing"]
    assert imaged["model"]["params"] - text["model"]["params"] == 66_240 + 24_832


def test_a_size_the_processor_refuses_and_seq_max_are_one_line(tiny_vl_dir, capsys):
    for command, extra, message in (
            ("estimate", ["--image-size", "100x30000", "--seq", "96"], "Qwen2VLImageProcessorPil refuses it"),
            ("plan", ["--image-size", "100x30000", "--seq", "96", "--global-batch", "8"], "refuses it"),
            ("estimate", ["--image-size", "448x280", "--seq", "max"], "not --seq max"),
            ("plan", ["--image-size", "448x280", "--seq", "max"], "not --seq max"),
            ("estimate", ["--image-size", "448x280", "--seq", "900", "--images-per-sample", "1"],
             "900 text tokens + 1 x 160 image tokens = 1060 is longer than"),  # the tiny model's 1024 positions
    ):
        argv = [command, str(tiny_vl_dir), "--gpus", "1xH100-80GB", *extra]
        if "--images-per-sample" not in extra:
            argv += ["--images-per-sample", "2"]
        code, out, err = _run(capsys, *argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (command, extra, err)


@pytest.mark.parametrize("arch", list(TINY))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("tower", ["train", "freeze"])
def test_whole_step_peak_matches_a_real_cpu_image_text_step(tower, checkpointing, arch):
    """The estimate's whole-step peak (DDP, fp32, one CPU process) against torch's MemTracker over a real steady
    step of the tiny Qwen2.5-VL on 2 images of 448 x 280 with AdamW: within 3% (measured -0.02% trained, -0.03%
    frozen, where the batch's float32 pixel values are most of the tower's share). With the model's activation
    checkpointing the peak is in the tower's backward, its blocks recomputed while the pixel values and the input
    embeddings' gradient are alive (the tower's traced backward, toolkit.estimate.visiontower): measured +0.71%
    trained, -0.002% frozen (a frozen tower recomputes too: enable_input_require_grads makes its patch embedding's
    output require grad); it was -6.8% / -5.4% with the tower's backward left out."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from toolkit.estimate.fakestep import enable_checkpointing
    from toolkit.estimate.livebytes import frozen_params_trackable
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.modelconfig import auto_model_class
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.images import image_job, image_tokens
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    config = TINY[arch]()
    spec = build_spec(arch, config, images=True)
    seq, fields = image_job(spec, IMAGES, SIZE, TEXT)
    job = Job(seq_len=seq, micro_batch=1, precision="fp32", device_kind="cpu", vision_tower=tower,
              attention="sdpa", checkpointing=checkpointing, **fields)
    predicted = estimate_memory(spec, parse_strategy("ddp"), job, parse_hardware("1xH200")).peak_bytes
    torch.manual_seed(0)
    model = auto_model_class(config, images=True).from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if checkpointing:
        enable_checkpointing(model)
    model.train()
    if tower == "freeze":
        for name, p in model.named_parameters():
            if name.startswith("model.visual"):
                p.requires_grad_(False)
    found = image_tokens(config, 448, 280)
    ids: list[int] = []
    for _ in range(IMAGES):
        ids += torch.randint(0, 400, (TEXT // IMAGES - 2,)).tolist() + [501] + [500] * found.tokens + [502]
    ids_t = torch.tensor([ids])
    batch = dict(input_ids=ids_t, labels=ids_t,
                 pixel_values=torch.randn(IMAGES * found.pixel_shape[0], found.pixel_shape[1]),
                 image_grid_thw=torch.tensor([list(found.grid)] * IMAGES), mm_token_type_ids=(ids_t == 500).long())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)

    def step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's states exist: what follows is a steady step
    tracker = MemTracker()
    tracker.track_external(model, optimizer, *batch.values())
    with frozen_params_trackable(), tracker:
        step()
    measured = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    assert predicted == pytest.approx(measured, rel=0.03)


def test_lora_with_the_tower_in_modules_to_save_trains_the_tower_in_the_estimate():
    """LoRA on the language model with the whole vision tower trained (PEFT's modules_to_save: `visual`, Qwen2.5-VL's
    tower with its merger inside): a real CPU step of the tiny Qwen2.5-VL on 2 images of 448 x 280 (fp32, no
    checkpointing) against the estimate. The tower's trace trains and the language model's input embeddings
    require grad (they carry the image features' graph). On benchmarks/accuracy.py's tiny Qwen2.5-VL (96 text
    tokens + 2 x 448 x 280, LoRA r8 all-linear) activations 0.9999, peak 0.9995; they were 0.599 / 0.660 with the
    tower taken as frozen under every adapter (with checkpointing 0.9874 / 0.9909, was 0.9496 / 0.9662). Naming the
    merger alone leaves the tower frozen."""
    import dataclasses

    from toolkit.estimate.profile import measure_step, predict_step
    from toolkit.estimate.traces import tower_trains
    from toolkit.inputs.images import image_job
    from toolkit.inputs.job import Job
    from toolkit.inputs.lora import Adapter
    from toolkit.inputs.modelspec import build_spec

    config = TINY["qwen2.5-vl"]()
    adapter = Adapter(method="lora", r=8, targets="all-linear", modules_to_save="visual")
    kw = dict(seq_len=TEXT, micro_batch=1, precision="fp32", attention="sdpa", images=IMAGES, image_size=SIZE,
              adapter=adapter)
    measured = measure_step(config, steps=1, **kw)
    predicted = predict_step(config, device_kind="cpu", **kw)
    assert predicted["activations_bytes"] == pytest.approx(measured.activations_bytes, rel=0.01)
    assert predicted["peak_bytes"] == pytest.approx(measured.peak_bytes, rel=0.01)
    spec = build_spec("qwen2.5-vl", config, images=True)
    seq, fields = image_job(spec, IMAGES, SIZE, TEXT)
    job = Job(seq_len=seq, micro_batch=1, precision="fp32", device_kind="cpu", adapter=adapter, **fields)
    assert tower_trains(spec, job)
    assert not tower_trains(spec, dataclasses.replace(job, adapter=dataclasses.replace(adapter, modules_to_save="merger")))
    assert not tower_trains(spec, dataclasses.replace(job, vision_tower="freeze"))


@pytest.mark.parametrize("name, keyword", [("gemma-3-12b-it", "token_type_ids"),
                                           ("qwen2.5-vl-7b-instruct", "mm_token_type_ids"),
                                           ("qwen3.5-27b", None), ("llama-3.1-8b", None)])
def test_the_trace_feeds_the_processors_image_marks_where_the_traced_forward_takes_them(name, keyword):
    """Gemma-3's and Qwen2.5-VL's processors mark the image tokens (return_mm_token_type_ids) and the class the
    trace builds takes them (Gemma-3 as token_type_ids, its processor's name for them); Qwen3.5's image job traces
    Qwen3_5ForCausalLM, whose forward takes none; a text model's processor marks nothing."""
    from toolkit.inputs.images import image_marks_keyword
    from toolkit.inputs.modelconfig import load_config

    assert image_marks_keyword(load_config(str(MODELS / f"{name}.json"))) == keyword


@pytest.mark.parametrize("tower, checkpointing", [("train", False), ("freeze", True)])
def test_gemma_3s_image_step_is_traced_with_its_bidirectional_image_mask(tower, checkpointing):
    """Gemma-3's processor marks each image's tokens (token_type_ids) and Gemma3Model builds an explicit mask from
    them in which an image's tokens attend each other both ways; SDPA then keeps that mask made additive in every
    layer and the grouped key / value heads repeated. The trace feeds the marks with the ids: benchmarks/accuracy.py's
    tiny Gemma-3 row (2 layers, 96 text tokens + 2 x 448x280 images, fp32, sdpa) against a real CPU step, measured
    activations +0.04% / peak -0.07% trained, +0.17% / -1.57% frozen and checkpointed (the same -1.57% without the
    marks on both sides); the ids alone, causal, traced -7.2% / -4.2% of the activations."""
    import sys

    from toolkit.estimate.profile import measure_step, predict_step

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from accuracy import tiny_image_config

    config = tiny_image_config("gemma-3-4b-it", 2)
    kw = dict(seq_len=TEXT, micro_batch=1, precision="fp32", attention="sdpa", checkpointing=checkpointing,
              images=IMAGES, image_size=SIZE, vision_tower=tower)
    measured = measure_step(config, steps=1, **kw)
    predicted = predict_step(config, **kw)
    assert predicted["activations_bytes"] == pytest.approx(measured.activations_bytes, rel=0.005)
    assert predicted["peak_bytes"] == pytest.approx(measured.peak_bytes, rel=0.03)


def test_an_anchored_trace_keeps_the_trained_towers_input_gradient():
    """A length between two powers of two is traced at both and interpolated (traces._seq_anchored), on text jobs
    that drop the images: the input embeddings' gradient of a LoRA job whose tower trains (modules_to_save visual)
    is read from the job with its images, so the anchored trace equals the exact one (it lost the embedding's
    880,648 backward bytes and its host op before)."""
    import dataclasses

    from toolkit.estimate.traces import activation_trace, traces_linear_in_seq
    from toolkit.inputs.images import image_job
    from toolkit.inputs.job import Job
    from toolkit.inputs.lora import Adapter
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    config = TINY["qwen2.5-vl"]()
    getattr(config, "text_config", config).max_position_embeddings = 8192  # room for the 2048-token anchor
    spec = build_spec("qwen2.5-vl", config, images=True)
    seq, fields = image_job(spec, IMAGES, SIZE, 1400)
    job = Job(seq_len=seq, micro_batch=1, precision="fp32", device_kind="cpu",
              adapter=Adapter(method="lora", r=8, targets="all-linear", modules_to_save="visual"), **fields)
    strategy = parse_strategy("ddp")
    exact = activation_trace(spec, job, strategy, 1)
    with traces_linear_in_seq():
        anchored = activation_trace(spec, job, strategy, 1)
    assert seq == 1720 and exact.embedding.backward_extra_bytes > 0
    assert dataclasses.asdict(anchored) == dataclasses.asdict(exact)
