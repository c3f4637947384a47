"""Small helpers on ``torch.nn`` modules that any layer may use."""

from __future__ import annotations

from torch import nn


def set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    """Place ``module`` at dotted ``path`` under ``root``, making empty parents as needed."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if not hasattr(node, name):
            setattr(node, name, nn.Module())
        node = getattr(node, name)
    setattr(node, leaf, module)
