"""`toolkit models`: the model catalog, one line a model: its size, dense or MoE, layers and positions."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    sub.add_parser("models", help="list the model catalog (size, dense / MoE, layers, positions)") \
        .set_defaults(func=cmd_models)


def cmd_models(args) -> int:
    from toolkit.commands.common import human
    from toolkit.inputs.modelconfig import catalog_names

    rows = [catalog_row(name) for name in catalog_names()]
    print(f"{'model':<18}{'params':>9}  {'kind':<24}{'layers':>7}{'positions':>11}")
    for r in rows:
        print(f"{r['name']:<18}{human(r['params']):>9}  {r['kind']:<24}{r['layers']:>7}"
              f"{r['positions'] if r['positions'] else '-':>11}")
    return 0


def catalog_row(name: str) -> dict:
    """One catalog entry read through its transformers config class: parameters (the count the catalog states,
    which tests/test_catalog.py checks against a meta-device build, else that build's count), dense or MoE (the
    experts the config declares), decoder layers and positions (toolkit.inputs.modelconfig.model_positions). Cached
    by the entry's text, so a warm listing imports neither torch nor transformers."""
    from toolkit import cache
    from toolkit.paths import MODEL_CATALOG_DIR

    data = json.loads((MODEL_CATALOG_DIR / f"{name}.json").read_text())
    row = cache.get("catalog-row", [name, data], code=catalog_row)
    if isinstance(row, dict):
        return row
    from toolkit.inputs.modelconfig import load_config, model_positions, moe_shape, text_config

    config = load_config(name)
    text = text_config(config)
    experts, top_k = moe_shape(text)
    row = {"name": name, "params": data.get("_published_params") or meta_params(name),
           "kind": f"MoE, {top_k} of {experts} experts" if experts else "dense",
           "layers": text.num_hidden_layers, "positions": model_positions(config)}
    cache.put("catalog-row", [name, data], row, code=catalog_row)
    return row


def meta_params(name: str) -> int:
    """Parameters of the model built on the meta device (no memory, no weights; tied weights once): a catalog entry
    whose count no source states exactly."""
    import torch

    from toolkit.inputs.modelconfig import auto_model_class, load_config

    with torch.device("meta"):
        config = load_config(name)
        model = auto_model_class(config).from_config(config)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
