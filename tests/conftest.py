"""Test-wide set-up: usage profiles go to a temporary user cache folder, never the real one; moestream
is imported before any test module imports torch, so the suite runs with the OpenMP wait policy a user
gets (PASSIVE: spinning OpenMP threads made a streamed run of test_exact_under_timing.py cost 2.1-2.7 s
of CPU instead of 0.2-0.4 s on this loaded 2-core machine); the CPU kernels' build (keyed by source and
CPU, so safe to share) stays in the real user cache, so no test process rebuilds it.

Without a CUDA GPU, Triton kernels (moestream.fused_moe) run under Triton's interpreter: the
variable must be set before Triton decorates them (when moestream.fused_moe is first imported), so
it is set here, at collection."""

import os

import pytest

import moestream  # noqa: F401 -- sets OMP_WAIT_POLICY before torch loads (moestream/__init__.py)

KERNELS = os.environ.get("MOESTREAM_KERNEL_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moestream", "cpu-kernels")


def _interpret_triton_without_a_gpu() -> None:
    import torch  # here, not at the top: after moestream (above)

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()


@pytest.fixture(autouse=True, scope="session")
def _session_cache_in_tmp(tmp_path_factory):
    """The same for the module- and session-scoped fixtures, which pytest sets up before any function-scoped one
    (a module's server started before this was in place rebuilt the kernels under its own cache: 100 s)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache-session")))
        mp.setenv("MOESTREAM_KERNEL_CACHE", KERNELS)
        mp.setenv("MOESTREAM_DEVICE", "cpu")
        yield


@pytest.fixture(autouse=True)
def _user_cache_in_tmp(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    monkeypatch.setenv("MOESTREAM_KERNEL_CACHE", KERNELS)
    # tests written for the CPU stay on it on a machine with a GPU; the GPU tests name cuda
    monkeypatch.setenv("MOESTREAM_DEVICE", "cpu")
