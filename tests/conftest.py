"""Test-wide set-up: usage profiles go to a temporary user cache folder, never the real one."""

import pytest


@pytest.fixture(autouse=True)
def _user_cache_in_tmp(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    # tests written for the CPU stay on it on a machine with a GPU; the GPU tests name cuda
    monkeypatch.setenv("MOESTREAM_DEVICE", "cpu")
