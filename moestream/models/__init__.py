"""Model families, one module each, found by config.json's ``model_type``.

A family module provides ``MODEL_TYPES``, ``ModelArgs.from_config(cfg)``,
``Model(args)`` (a :class:`~moestream.models.base.CausalLM`), and ``synth_config`` /
``synth_tensors`` for ``moestream synth``. Adding a family means adding its module and
one line here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import ConfigError

_FAMILIES = {
    "qwen3_moe": "moestream.models.qwen3_moe",
}


def supported_model_types() -> list[str]:
    return sorted(_FAMILIES)


def family_for(cfg: dict, where: str = "config.json") -> ModuleType:
    """The family module for a config's ``model_type``.

    Raises:
        ConfigError: naming the ``model_type`` when it is missing or not supported.
    """
    mt = cfg.get("model_type")
    if not isinstance(mt, str):
        raise ConfigError(f"{where}: no model_type field")
    module = _FAMILIES.get(mt)
    if module is None:
        raise ConfigError(
            f"{where}: model_type {mt!r} is not supported; moestream streams {', '.join(supported_model_types())}"
        )
    return importlib.import_module(module)
