"""Layer rules, one module per layer family; importing this package registers them all."""

import importlib

from backprism.engine.rule import Call, Rule, get_rule, register_rule

for _name in (
    "linear", "conv", "convtranspose", "embedding", "norm", "prelu", "broadcast", "generic",
    "attention", "transformers",
):
    try:
        importlib.import_module(f"backprism.rules.{_name}")
    except ModuleNotFoundError as _err:  # a family still being written
        if _err.name != f"backprism.rules.{_name}":
            raise

__all__ = ["Call", "Rule", "get_rule", "register_rule"]
