"""`toolkit models`: the model catalog's names."""

from __future__ import annotations


def add_parser(sub) -> None:
    sub.add_parser("models", help="list the model catalog").set_defaults(func=cmd_models)


def cmd_models(args) -> int:
    from toolkit.inputs.modelspec import catalog_names

    print("\n".join(catalog_names()))
    return 0
