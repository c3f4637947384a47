"""Model families, one module each, found by config.json's ``model_type``.

A family module provides ``MODEL_TYPES``, ``ModelArgs.from_config(cfg)``,
``Model(args)`` (a :class:`~moestream.models.base.CausalLM`), and ``synth_config`` /
``synth_tensors`` for ``moestream synth``. Adding a family means adding its module: every
module of this package that declares ``MODEL_TYPES`` is found by itself.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from functools import cache
from pathlib import Path
from types import ModuleType

from ..errors import ConfigError
from .base import check_shared_fields


@cache
def _families() -> dict[str, str]:
    """model_type -> module name, read from each module's ``MODEL_TYPES`` without importing it."""
    out = {}
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.ispkg:
            continue
        tree = ast.parse((Path(__file__).parent / f"{info.name}.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_TYPES" for t in node.targets):
                for mt in ast.literal_eval(node.value):
                    out[mt] = f"{__name__}.{info.name}"
    return out


def supported_model_types() -> list[str]:
    return sorted(_families())


def family_for(cfg: dict, where: str = "config.json") -> ModuleType:
    """The family module for a config's ``model_type``, once the fields every family reads
    the same way are checked (:func:`moestream.models.base.check_shared_fields`: RoPE base and
    scaling, norm eps, end-of-sequence ids).

    Raises:
        ConfigError: naming the ``model_type`` when it is missing or not supported, or the
            shared field at fault; prefixed with ``where``.
    """
    mt = cfg.get("model_type")
    if not isinstance(mt, str):
        raise ConfigError(f"{where}: no model_type field")
    module = _families().get(mt)
    if module is None:
        raise ConfigError(
            f"{where}: model_type {mt!r} is not supported; moestream streams {', '.join(supported_model_types())}"
        )
    family = importlib.import_module(module)
    try:
        check_shared_fields(cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return family
