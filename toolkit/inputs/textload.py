"""Which model a text-only run of a multimodal checkpoint loads: the class AutoModelForCausalLM builds for its config
(the whole class for Gemma-3, the language model alone for Qwen3.5), and whether transformers can load the language
model alone from the class's checkpoint, found with transformers' own key renaming (conversion_mapping.py, the
transforms from_pretrained applies), not a table: the class and its text model are built on the meta device and
every weight the text model needs must come out of the class's weight names.

Torch and transformers only; called by toolkit.inputs.modelspec.build_spec, whose spec is cached.
"""

from __future__ import annotations

from typing import Any


def text_alone_problem(config: Any) -> str | None:
    """Why transformers cannot load `config`'s language model alone from the multimodal class's checkpoint (one
    phrase), or None when every weight of AutoModelForCausalLM(text config) is found under its renamed keys."""
    import copy
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    text_config = config.get_text_config()
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            whole = AutoModelForImageTextToText.from_config(copy.deepcopy(config))
            text = AutoModelForCausalLM.from_config(copy.deepcopy(text_config))
    except ValueError:
        return f"transformers maps no causal LM to its text config ({text_config.model_type})"
    transforms = get_model_conversion_mapping(text)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    wanted = text.state_dict()
    found = {rename_source_key(key, renamings, converters, base_model_prefix=text.base_model_prefix,
                               meta_state_dict=wanted)[0] for key in whole.state_dict()}
    missing = [key for key in wanted if key not in found]
    if missing:
        return (f"{type(text).__name__} would find {len(missing)} of its {len(wanted)} weights in no "
                f"{type(whole).__name__} checkpoint key (no key mapping for {text_config.model_type} in "
                "transformers' conversion_mapping; e.g. " + missing[0] + ")")
    return None


def unloaded_tower_params(config: Any, loaded_params: int) -> int:
    """Parameters of the multimodal class that the causal-LM class (`loaded_params`) leaves unloaded: its vision
    encoder and projector (0 when the two classes are the same)."""
    import copy
    import warnings

    import torch
    from transformers import AutoModelForImageTextToText

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            whole = AutoModelForImageTextToText.from_config(copy.deepcopy(config))
    except ValueError:
        return 0
    return max(0, sum({id(p): p.numel() for p in whole.parameters()}.values()) - loaded_params)
