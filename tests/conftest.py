"""Test-wide set-up: usage profiles go to a temporary user cache folder, never the real one; moestream
is imported before any test module imports torch; the suite's workers (two processes on two cores) wait
for OpenMP work by sleeping (OMP_WAIT_POLICY=PASSIVE, set here, inherited by the CLI and server processes the
tests start: spinning OpenMP threads made a streamed run of test_exact_under_timing.py cost 2.1-2.7 s of CPU
instead of 0.2-0.4 s on this loaded 2-core machine; moestream's own default, a short spin, suits a machine a
run has to itself); the CPU kernels' build (keyed by source and
CPU, so safe to share) stays in the real user cache, so no test process rebuilds it.

Without a CUDA GPU, Triton kernels (moestream.fused_moe) run under Triton's interpreter: the
variable must be set before Triton decorates them (when moestream.fused_moe is first imported), so
it is set here, at collection."""

import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (moestream/__init__.py)

import moestream  # noqa: E402, F401 -- before torch

KERNELS = os.environ.get("MOESTREAM_KERNEL_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moestream", "cpu-kernels")


def _interpret_triton_without_a_gpu() -> None:
    import torch  # here, not at the top: after moestream (above)

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()

# Seconds each of the heavier test files took (its tests' set-up, call and tear-down, summed) in one run of the whole
# suite with `make test`'s options on the loaded 2-core development machine (2 workers). `--dist loadfile` sends one
# file at a time to a free worker, in the order of its queue; xdist's own order (most tests first) left the files of
# few but long tests (the CLI, server and benchmark runs) to the end, where one worker ran them while the other had
# nothing left: 1,270 s against 1,065 s of the two workers' tests in that run. Longest first, the two end within
# seconds of each other. Only the order depends on these figures: a file not listed (or one grown since) runs after
# those listed, and nothing is skipped. Refresh them from `--junitxml` (sum each file's testcase times).
FILE_SECONDS = {
    "test_fused_moe_quant.py": 405, "test_hostile_inputs.py": 177, "test_reliability_server.py": 132,
    "test_bench_smoke_quantized.py": 130, "test_server_batch.py": 113, "test_synth_cli.py": 106,
    "test_gguf_tokenizer.py": 105, "test_errors.py": 86, "test_bench_smoke.py": 86, "test_cli_rough_edges.py": 80,
    "test_quant_native.py": 80, "test_synth_trained.py": 77, "test_attention_kernel.py": 57, "test_fused_moe.py": 47,
    "test_family_deepseek.py": 39, "test_family_qwen3_hybrid.py": 37, "test_scheduler.py": 36, "test_server.py": 35,
    "test_family_kimi.py": 34, "test_synth_mla.py": 32, "test_activations_q8.py": 31,
    "test_activations_q8_affine.py": 30,
    "test_invariant_kernels.py": 30, "test_gguf.py": 29, "test_family_laguna.py": 24, "test_gguf_types.py": 24,
    "test_reliability_state.py": 22, "test_exact_under_timing.py": 21, "test_expert_parallel.py": 20,
    "test_streaming_exact.py": 19, "test_usage.py": 16, "test_family_olmoe.py": 14, "test_family_gpt_oss.py": 14,
    "test_io.py": 13, "test_load_plan.py": 13, "test_family_minimax_m2.py": 12, "test_reference.py": 12,
    "test_family_hunyuan_v1_moe.py": 12, "test_read_paths.py": 11, "test_quant_convert.py": 11,
    "test_mlx_format.py": 11,
}


def pytest_configure(config):
    """xdist's scheduler keeps the collection order (below) rather than sorting files by their number of tests,
    unless --loadscope-reorder is given."""
    if hasattr(config.option, "loadscopereorder") and "--loadscope-reorder" not in config.invocation_params.args:
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (by the scope of parametrized fixtures)
def pytest_collection_modifyitems(items):
    """The heaviest files first (:data:`FILE_SECONDS`); a stable sort, so each file's tests keep their order and the
    files not listed theirs (by path), after the rest."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))


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
