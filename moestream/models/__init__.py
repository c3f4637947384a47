"""Model families, one module each, found by config.json's ``model_type``.

A family module provides ``MODEL_TYPES``, ``ModelArgs.from_config(cfg)``,
``Model(args)`` (a :class:`~moestream.models.base.CausalLM`), and ``synth_config`` /
``synth_tensors`` for ``moestream synth``, and optionally ``GGUF``: the
:class:`~moestream.gguf_format.GGUFArchitecture` (or a tuple of them) by which llama.cpp's files of the family
are read (:func:`gguf_architectures`). Adding a family means adding its module: every module of this package
that declares ``MODEL_TYPES`` is found by itself, its ``GGUF`` with it.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from functools import cache
from pathlib import Path
from types import ModuleType

from ..errors import ConfigError
from ..gguf_format import GGUFArchitecture
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


@cache
def gguf_architectures() -> dict[str, GGUFArchitecture]:
    """``general.architecture`` -> the :class:`~moestream.gguf_format.GGUFArchitecture` a family module declares
    as ``GGUF`` (one, or a tuple), over every family module (each imported once, when a GGUF file is opened).

    Raises:
        ValueError: two families declare one architecture.
    """
    out: dict[str, GGUFArchitecture] = {}
    for module in sorted(set(_families().values())):
        declared = getattr(importlib.import_module(module), "GGUF", ())
        for spec in declared if isinstance(declared, tuple) else (declared,):
            if spec.name in out and out[spec.name] is not spec:
                raise ValueError(f"GGUF architecture {spec.name!r} is declared by two families ({module})")
            out[spec.name] = spec
    return dict(sorted(out.items(), key=lambda kv: kv[1].added))
