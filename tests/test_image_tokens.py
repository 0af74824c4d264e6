"""Image tokens per sample from the model's own image processor (issue 31, Deliver 3): the processor class
transformers maps the config to, at the tower's patch / merge / input size, run on a dummy image. In-process, no
model weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.errors import UserError

MODELS = Path(__file__).resolve().parent / "arch_configs"


def _config(name: str):
    from toolkit.inputs.modelconfig import load_config

    return load_config(str(MODELS / f"{name}.json"))


@pytest.mark.parametrize("name, width, height, grid, tokens", [
    # 448 = 16 x 28: no resize; 32 x 32 patches of 14, merged 2 x 2
    ("qwen2.5-vl-7b-instruct", 448, 448, (1, 32, 32), 256),
    # smart_resize rounds 1280 x 720 to multiples of 28: 1288 x 728, i.e. 92 x 52 patches
    ("qwen2.5-vl-7b-instruct", 1280, 720, (1, 52, 92), 1196),
    # Qwen3.5's tower patches 16 pixels (factor 32): 448 -> 28 x 28 patches; 1280 x 720 -> 1280 x 704
    ("qwen3.5-27b", 448, 448, (1, 28, 28), 196),
    ("qwen3.5-27b", 1280, 720, (1, 44, 80), 880),
])
def test_qwen_image_tokens_are_the_processors_patch_grid_over_the_merge(name, width, height, grid, tokens):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # no torchvision here

    from toolkit.inputs.images import image_processor, image_tokens

    config = _config(name)
    found = image_tokens(config, width, height)
    processor = image_processor(config)
    assert (processor.patch_size, processor.merge_size) == (config.vision_config.patch_size,
                                                              config.vision_config.spatial_merge_size)
    assert found.grid == grid and found.tokens == tokens
    # the processor's own counts: smart_resize at patch x merge, and get_number_of_image_patches
    factor = processor.patch_size * processor.merge_size
    h, w = smart_resize(height, width, factor=factor, min_pixels=processor.size.shortest_edge,
                        max_pixels=processor.size.longest_edge)
    assert (h // processor.patch_size, w // processor.patch_size) == grid[1:]
    patches = processor.get_number_of_image_patches(height, width, {})
    assert patches == found.pixel_shape[0] and patches // processor.merge_size ** 2 == tokens


@pytest.mark.parametrize("name", ["gemma-3-4b-it", "gemma-3-12b-it"])
def test_gemma_3_puts_its_fixed_tokens_per_image_at_any_resolution(name):
    """Gemma-3 resizes every image to its SigLIP's square (896, the tower's image_size, where the class default is
    224) and pools it to mm_tokens_per_image: (896 / 14)^2 / 4^2 = 256 at both resolutions."""
    from toolkit.inputs.images import image_tokens

    config = _config(name)
    side = config.vision_config.image_size
    pooled = (side // config.vision_config.patch_size) ** 2 // 4 ** 2  # Gemma3MultiModalProjector: 4 x 4 avg pool
    for width, height in ((448, 448), (1280, 720)):
        found = image_tokens(config, width, height)
        assert found.tokens == config.mm_tokens_per_image == pooled == 256
        assert found.pixel_shape == (1, 3, side, side) == (1, 3, 896, 896) and found.grid is None


def test_a_size_the_processor_refuses_and_images_on_a_text_model_are_one_line():
    from toolkit.inputs.images import image_tokens, parse_image_size

    with pytest.raises(UserError, match=r"--image-size 100x30000: Qwen2VLImageProcessorPil refuses it \(absolute "
                                        r"aspect ratio must be smaller than 200"):
        image_tokens(_config("qwen2.5-vl-7b-instruct"), 100, 30000)
    with pytest.raises(UserError, match="qwen3 is a text-only model"):
        image_tokens(_config("qwen3-0.6b"), 448, 448)
    assert parse_image_size("1280x720") == (1280, 720)
    for bad in ("1280", "0x10", "axb"):
        with pytest.raises(UserError, match="give WIDTHxHEIGHT in pixels"):
            parse_image_size(bad)
