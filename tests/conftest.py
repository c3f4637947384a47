"""Test-wide set-up: usage profiles go to a temporary user cache folder, never the real one; moestream
is imported before any test module imports torch, so the suite runs with the OpenMP wait policy a user
gets (PASSIVE: spinning OpenMP threads made a streamed run of test_exact_under_timing.py cost 2.1-2.7 s
of CPU instead of 0.2-0.4 s on this loaded 2-core machine)."""

import pytest

import moestream  # noqa: F401 -- sets OMP_WAIT_POLICY before torch loads (moestream/__init__.py)


@pytest.fixture(autouse=True)
def _user_cache_in_tmp(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    # tests written for the CPU stay on it on a machine with a GPU; the GPU tests name cuda
    monkeypatch.setenv("MOESTREAM_DEVICE", "cpu")
