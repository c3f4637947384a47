"""Test-wide set-up: usage profiles go to a temporary user cache folder, never the real one.

Without a CUDA GPU, Triton kernels (moestream.fused_moe) run under Triton's interpreter: the
variable must be set before Triton decorates them, so it is set here, at collection.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _user_cache_in_tmp(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    # tests written for the CPU stay on it on a machine with a GPU; the GPU tests name cuda
    monkeypatch.setenv("MOESTREAM_DEVICE", "cpu")
