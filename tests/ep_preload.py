"""Imported once by the expert-parallel tests' forkserver, so that each rank it forks starts with
torch, moestream and the meta-device machinery already imported (seconds per rank otherwise)."""

import torch

import moestream.engine  # noqa: F401
import moestream.generation  # noqa: F401
import moestream.parallel  # noqa: F401

with torch.device("meta"):  # the first meta-device module imports torch's reference ops (~800 modules)
    torch.nn.Embedding(4, 4)
