"""The image resolution as a plan's knob (issue 31, Must show): `plan --explain` of Qwen2.5-VL-7B, Gemma-3-12B and
Qwen3.5-27B (their real configs in tests/arch_configs) at 448 x 448 and 896 x 896 images. The vision encoder's share
of the chosen row moves by what the processor's patch grid says: the tower's model states not at all, its
activations by the ratio of patches (the tower saves the same bytes for every patch: attention windows and CUDA's
sdpa footprint hold no patches x patches term); Gemma-3's processor resizes every image to its tower's square, so
its share does not move. In-process, no weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from toolkit.cli import main

MODELS = Path(__file__).resolve().parent / "arch_configs"
SIDES = (448, 896)


def _plan(capsys, name: str, side: int) -> dict:
    code = main(["plan", str(MODELS / f"{name}.json"), "--gpus", "8xH100-80GB", "--seq", "512",
                 "--images-per-sample", "1", "--image-size", f"{side}x{side}", "--strategies", "zero3",
                 "--micro-batch", "1", "--checkpointing", "on", "--explain", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


@pytest.mark.parametrize("name", ["qwen2.5-vl-7b-instruct", "gemma-3-12b-it", "qwen3.5-27b"])
def test_the_vision_share_moves_with_the_image_resolution_by_the_patches(name, capsys):
    from toolkit.inputs.images import image_tokens
    from toolkit.inputs.modelconfig import load_config

    config = load_config(str(MODELS / f"{name}.json"))
    found = {side: image_tokens(config, side, side) for side in SIDES}
    plans = {side: _plan(capsys, name, side) for side in SIDES}
    shares, per_image = {}, {}
    for side, plan in plans.items():
        explained = plan["chosen_explained"]
        assert plan["images"]["image_tokens"] == found[side].tokens
        assert plan["images"]["seq_len"] == 512 + found[side].tokens
        share = explained["vision_share"]
        tower = next(t["bytes"] for t in explained["terms"] if t["name"] == "  of which vision encoder")
        assert share["activations_bytes"] == tower > 0
        # the note names the tower's bytes for one image (the pixels in the batch + what it saves for backward);
        # one image a sample at micro-batch 1
        note = next(n for n in explained["notes"] if n.startswith("vision encoder + projector traced alone"))
        pixels, saved = (int(v.replace(",", "")) for v in re.search(
            r"([\d,]+) bytes of float32 in the batch\): ([\d,]+) bytes saved for backward per image", note).groups())
        assert pixels + saved == tower, note
        shares[side], per_image[side] = share, saved
    states = ("weights_bytes", "gradients_bytes", "optimizer_bytes")
    assert all(shares[448][k] == shares[896][k] > 0 for k in states)  # weights do not depend on the images
    small, large = (found[side].pixel_shape[0] for side in SIDES)  # patches the processor makes of one image
    if found[448].grid is None:  # Gemma-3: every image resized to the tower's 896 square, 256 tokens
        assert (small, found[448].tokens) == (large, found[896].tokens) == (1, 256)
        assert shares[448]["activations_bytes"] == shares[896]["activations_bytes"]
    else:  # the Qwen towers: 448 -> (448 / patch)^2 patches, 896 -> 4 x as many
        assert large == 4 * small
        assert per_image[896] == 4 * per_image[448]  # the same bytes for every patch
        assert shares[896]["activations_bytes"] > 3.9 * shares[448]["activations_bytes"]
