"""moestream's compiled CPU kernels: every linear of a token (quantized or float), the gated expert, and
the rest of the token's arithmetic (attention over the KV cache, RMSNorm, activations).

``csrc/`` (``kernels.h`` describes it) computes ``y = x W^T`` with ``W`` [out, in] in its stored form --
MLX affine (2, 3, 4, 5, 6, 8 bits; bf16, fp16 or float32 scales and biases), FP8 e4m3 with
block, per-channel or per-tensor scales, MXFP4 (gpt-oss and compressed-tensors bytes),
turboquant codebooks, ggml blocks of GGUF files (Q4_0-Q8_0, Q2_K-Q6_K, IQ1_S-IQ4_XS, MXFP4, TQ1_0,
TQ2_0) and float32/bf16/fp16 weights (also stored input-major, ``x @ W``) -- straight from the tensors the
expert store read: nothing is repacked per read. Each weight is dequantized in a float32 register and
multiplied into float32 accumulators (FMA); activations are never quantized, except in the opt-in q8 mode of
GGUF and MLX affine 4- and 8-bit weights (``--activations q8``, ``csrc/q8.h``): 8-bit activation blocks and
integer dot products (for GGUF, llama.cpp's).

**One reduction.** Every output (row, token) is one 16-lane accumulator fed vector by vector in order and
summed by one fixed tree (``kernels.h``), on every compiled path (AVX-512, AVX2 as two 8-lane halves, the
portable C++): threads split the output rows, never a reduction, so a result depends only on its inputs --
the same bits every run, for any thread count, any number of tokens beside it, any address of the
operands, on every path of one CPU and across CPUs. The attention kernel (:func:`attention`) reduces each
query over its visible positions in position order, so its bits do not depend on the KV cache's capacity
or how a prompt was split into chunks; :func:`rms_norm` and :func:`activation` likewise per row and per
element, with the canonical ``exp`` (``exp_c``: fma steps only, so the same bits everywhere).

Paths (``paths()``): ``avx512`` (AVX-512 F/BW/VL/VBMI), ``avx2`` (AVX2 + FMA + F16C) and
``portable`` (plain C++; compiles anywhere, ARM64 included). The build targets the machine it runs on
(``-march=native``) and is cached under ``~/.cache/moestream/cpu-kernels/<key>`` (or
``$MOESTREAM_KERNEL_CACHE``), the key a hash of the sources, flags (``$MOESTREAM_CXXFLAGS`` appended last),
compiler and the CPU's model and flags, so a build is never used on a CPU it was not made for. It is a
plain C library (no PyTorch headers) in translation units by path and format group, compiled as many
at a time as the machine has cores (a line per unit on stderr), called through :mod:`ctypes`, which
releases the GIL while it computes; output rows are split over OpenMP threads of the runtime PyTorch
loaded, so ``torch.set_num_threads`` applies. The first use builds it (said on stderr); ``make setup`` builds it
ahead.

Selection: ``MOESTREAM_CPU_KERNELS`` = ``auto`` (default: the best compiled path),
``avx512``, ``avx2``, ``portable``, or ``torch`` (the PyTorch path of
:mod:`.kernels`, the reference; its float linears and attention are PyTorch's own, whose bits depend on
the shapes and the thread count). Without a compiler, or when the build fails, moestream
runs on the PyTorch path and says so once on stderr.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from ..errors import ConfigError
from . import formats, fp8, ggml, mxfp4, registry  # noqa: F401  (formats: registers the formats read here)
from .hadamard import block_size, sloane_matrix

ENV = "MOESTREAM_CPU_KERNELS"
CHOICES = ("auto", "avx512", "avx2", "portable", "torch")
CSRC = Path(__file__).parent / "csrc"
# The translation units: csrc/unit.cpp once per (path, format group) -- its rows function -- then the entry
# points and the ops; the slowest first, so a build with few cores ends sooner. name -> (source, defines).
_UNITS = {f"{p}_{g}": ("unit.cpp", [f"-DMS_PATH={pi}", f"-DMS_GROUP={gi}"])
          for p, pi in (("portable", 0), ("avx512", 2), ("avx2", 1)) for g, gi in (("g", 1), ("q", 0), ("x", 2))}
_UNITS.update({"capi": ("capi.cpp", []), "ops": ("ops.cpp", []), "q8": ("q8.cpp", [])})
SOURCES = tuple(_UNITS)
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=off"]
LIBRARY = "libmoestream_cpu.so"
# kinds (csrc/kernels.h Kind, as the registry declares them) and the spec layout of csrc/capi.cpp (make_lin)
AFFINE, FP8, MXFP4, CODEBOOK, GGML, FLOAT, FLOAT_T = (registry.KINDS[k] for k in (
    "affine", "fp8", "mxfp4", "codebook", "ggml", "float", "float_t"))
# ggml block types: each registry entry's type code (csrc/kernels.h GgmlType, a row of csrc/traits.h) and the
# weights sharing one scale the kernels decode at a time; _load checks them against the library's table
GGML_TYPES = {t: f.cpu.type_code for t, f in registry.ggml_formats().items()}
GGML_GROUP = {t: f.cpu.group for t, f in registry.ggml_formats().items()}
SPEC, PTRS = 16, 8
# q8 activation mode (csrc/q8.h): the ggml types it computes on, and the activation block each takes (ggml's
# vec_dot_type: Q8_K for the K-quants, Q8_0 for Q8_0, Q4_0, Q5_0 and IQ4_NL): the entries' CpuKernel.q8
ACT_FLOAT, ACT_Q8 = 0, 1
Q8_TYPES = {t: f.cpu.q8 for t, f in registry.ggml_formats().items() if f.cpu.q8}
_Q8_CODE = {"Q8_K": 1, "Q8_0": 2}  # csrc/q8.h Q8Type
_Q8_AFFINE = {4: 3, 8: 4}  # csrc/q8.h Q8_A4, Q8_A8 (| group << 4)
STREAM, TEN3, TRITS = 0, 1, 2  # codebook packings
TRIT, LEVEL_BITS = 3, {2: 1, 4: 2, 8: 3, 16: 4}  # turboquant codebook length -> code bits (3: ternary)
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_PATH_CODE = {"portable": 0, "avx2": 1, "avx512": 2}
_PATH_BITS = (("portable", 1), ("avx2", 2), ("avx512", 4))
_FP4 = torch.tensor(mxfp4.FP4_VALUES, dtype=torch.float32)  # the e2m1 values, the kernels' table

class KernelChoiceError(ConfigError, ValueError):
    """``MOESTREAM_CPU_KERNELS`` names no path."""


_lock = threading.Lock()
_state: dict = {"lib": None, "tried": False, "error": None}
_forced: list[str] = []  # use(): a path chosen in-process (tests, benchmarks), innermost last


def _arch_flags() -> list[str]:
    m = platform.machine().lower()
    if m in ("x86_64", "amd64", "i686", "i386"):
        return ["-march=native"]
    if m in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


def _user_flags() -> list[str]:
    """``$MOESTREAM_CXXFLAGS`` split as a shell would, appended after moestream's flags (so a given ``-O`` wins);
    part of the build key. Not ``$CXXFLAGS``: environments set that for other builds (conda's ``-march=nocona``
    would drop the AVX paths)."""
    return shlex.split(os.environ.get("MOESTREAM_CXXFLAGS", ""))


def cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo`` flags or Features) and model, for the build key."""
    flags, model = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":")[0].strip()
            if key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
            elif key in ("model name", "CPU part") and not model:
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{model}: {flags}" if flags else (platform.processor() or platform.machine())


def _compiler() -> str | None:
    """``$CXX`` when set (only it), else the first of c++, g++, clang++ on PATH."""
    if os.environ.get("CXX"):
        return os.environ["CXX"] if shutil.which(os.environ["CXX"]) else None
    return next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def build_key() -> str:
    """Hash of what a build depends on: the sources, flags, compiler, CPU model and flags (never shared across CPUs)."""
    h = hashlib.sha256()
    cxx = _compiler() or ""
    files = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))
    units = repr([(u, _UNITS[u], _cold(u)) for u in SOURCES]).encode()
    flags = " ".join(FLAGS + _arch_flags() + _user_flags()).encode()
    for part in (*(f.name.encode() + f.read_bytes() for f in files), flags, units,
                 cxx.encode(), _compiler_version(cxx).encode(), platform.machine().encode(), cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where this machine's build lives: ``$MOESTREAM_KERNEL_CACHE`` or ``~/.cache/moestream/cpu-kernels``, per key."""
    root = os.environ.get("MOESTREAM_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moestream", "cpu-kernels")
    return Path(root) / build_key()


def _compile(cxx: str, out: Path, openmp: bool, say=None) -> None:
    """Compile the sources, as many at a time as there are cores, into ``out``; a line per unit to ``say``;
    RuntimeError with the compiler's first error line."""
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    try:
        omp = ["-fopenmp"] if openmp else []
        jobs = max(1, min(len(SOURCES), os.cpu_count() or 1))
        todo, running, objs, errors, finished = list(SOURCES), [], [], [], 0
        t0 = time.perf_counter()
        while todo or running:
            while todo and len(running) < jobs and not errors:
                src = todo.pop(0)
                obj = tmp / (src + ".o")
                path, defines = _UNITS[src]
                cmd = [cxx, *FLAGS, *_arch_flags(), *omp, *defines, *_cold(src), *_user_flags(),
                       "-c", str(CSRC / path), "-o", str(obj)]
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                running.append((src, obj, proc, time.perf_counter()))
                objs.append(obj)
            if errors and not running:
                break
            src, obj, proc, started = running.pop(0)
            _, err = proc.communicate()
            if proc.returncode:
                errors.append(next((ln for ln in err.splitlines() if "error" in ln), err.strip()[-300:]))
            elif say is not None:
                finished += 1
                say(f"moestream: [{finished}/{len(SOURCES)}] {src} compiled in {time.perf_counter() - started:.0f} s "
                    f"({time.perf_counter() - t0:.0f} s so far)")
        if errors:
            raise RuntimeError(f"{cxx} failed: {errors[0]}")
        lib = tmp / LIBRARY
        link = subprocess.run([cxx, "-shared", *omp, *(str(o) for o in objs), "-o", str(lib)],
                              capture_output=True, text=True)
        if link.returncode:
            raise RuntimeError(f"{cxx} failed to link: {link.stderr.strip()[-300:]}")
        os.replace(lib, out)  # atomic: a concurrent build leaves one whole library
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cold(unit: str) -> list[str]:
    """Flags of a unit the machine does not run by default: on x86 the portable path (the SIMD paths compute
    there) is compiled at -O2, half the build time; elsewhere it is the path in use and keeps -O3."""
    return ["-O2"] if unit.startswith("portable") and _arch_flags() == ["-march=native"] else []


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _load() -> ctypes.CDLL:
    where = cache_dir()
    lib, failed = where / LIBRARY, where / "FAILED"
    if not lib.exists():
        if failed.exists():  # this source, compiler and CPU failed before: do not retry in every process
            raise RuntimeError(f"{failed.read_text().strip()} (delete {where} to retry)")
        cxx = _compiler()
        if cxx is None:
            raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'c++, g++ or clang++'}) found")
        jobs = max(1, min(len(SOURCES), os.cpu_count() or 1))
        print(f"moestream: building the CPU kernels for this CPU once ({len(SOURCES)} units, {jobs} at a time), "
              f"into {where}", file=sys.stderr, flush=True)
        where.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            _compile(cxx, lib, openmp=True, say=_say)
        except RuntimeError as first:
            try:  # a compiler without OpenMP (Apple clang): one thread per linear
                _compile(cxx, lib, openmp=False, say=_say)
            except RuntimeError:
                failed.write_text(str(first))
                raise first from None
        print(f"moestream: CPU kernels built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    dll = ctypes.CDLL(str(lib))
    _check_traits(dll)
    dll.ms_paths.restype = ctypes.c_int
    args = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    dll.ms_linear.restype = dll.ms_expert.restype = dll.ms_rotate.restype = ctypes.c_int
    dll.ms_linear.argtypes = args
    dll.ms_rotate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    dll.ms_expert.argtypes = args + [ctypes.c_int, ctypes.c_void_p]
    dll.ms_attention.restype = dll.ms_rmsnorm.restype = dll.ms_act.restype = ctypes.c_int
    dll.ms_delta_rule.restype = ctypes.c_int
    dll.ms_attn_block.restype = ctypes.c_int
    dll.ms_attn_block.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    dll.ms_q8_quantize.restype = ctypes.c_int64
    dll.ms_q8_quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    dll.ms_moe.restype = ctypes.c_int
    dll.ms_moe.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                           ctypes.c_void_p]
    dll.ms_attention.argtypes = dll.ms_rmsnorm.argtypes = dll.ms_delta_rule.argtypes = [ctypes.c_void_p,
                                                                                         ctypes.c_void_p]
    dll.ms_act.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                           ctypes.c_float]
    dll.ms_route_softmax.restype = dll.ms_decoder_layer.restype = ctypes.c_int
    dll.ms_route_softmax.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    dll.ms_decoder_layer.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 10
    dll.ms_decoder_stack.restype = ctypes.c_int64
    dll.ms_decoder_stack.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return _Metered(dll)


def library_ggml_traits(dll) -> dict[str, tuple[int, int, int, int, str | None, str]]:
    """The library's ggml type-traits table (``csrc/traits.h``, through ``ms_ggml_traits``): name -> (type
    code, weights per block, bytes per block, weights per decoded sub-block, q8 activation block or None,
    decoder group ``g`` or ``x``)."""
    fn = dll.ms_ggml_traits
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p)]
    out, name = (ctypes.c_int64 * 6)(), ctypes.c_char_p()
    got = {}
    for i in range(fn(-1, None, None)):
        fn(i, out, ctypes.byref(name))
        q8 = {1: "Q8_K", 2: "Q8_0"}.get(out[4])
        got[name.value.decode()] = (out[0], out[1], out[2], out[3], q8, "gx"[out[5] - 1])
    return got


def _check_traits(dll) -> None:
    """RuntimeError naming the first ggml type whose registry entry disagrees with the library's table."""
    have = library_ggml_traits(dll)
    want = {t: (f.cpu.type_code, f.block, f.type_size, f.cpu.group, f.cpu.q8)
            for t, f in registry.ggml_formats().items()}
    for t in sorted(set(have) | set(want)):
        if have.get(t, (None,) * 5)[:5] != want.get(t):
            raise RuntimeError(f"ggml type {t}: the kernels' traits {have.get(t)} disagree with the format registry's "
                               f"{want.get(t)} (csrc/traits.h against moestream/quant/formats.py)")


_kernel_cpu = [0.0]  # CPU seconds (the process's, all threads) spent inside the compiled kernels' calls


class _Metered:
    """The library with every ``ms_*`` call timed on the process CPU clock into :func:`kernel_cpu_seconds`."""

    def __init__(self, dll: ctypes.CDLL):
        self._dll = dll
        for name in ("ms_paths", "ms_linear", "ms_rotate", "ms_expert", "ms_moe", "ms_attention", "ms_attn_block",
                     "ms_rmsnorm", "ms_act", "ms_delta_rule", "ms_route_softmax", "ms_decoder_layer",
                     "ms_decoder_stack"):
            fn = getattr(dll, name)
            setattr(self, name, fn if name == "ms_paths" else self._timed(fn))

    @staticmethod
    def _timed(fn):
        clock, total = time.process_time, _kernel_cpu

        def call(*args):
            c0 = clock()
            try:
                return fn(*args)
            finally:
                total[0] += clock() - c0

        call.__name__ = fn.__name__
        return call

    def __getattr__(self, name):  # anything else (a helper's new entry point): as the library has it
        return getattr(self._dll, name)


def kernel_cpu_seconds() -> float:
    """CPU seconds (user + system, every thread of the process) spent inside the compiled kernels so far: the
    token's compiled arithmetic, for the stats' split of CPU time (threads doing other work meanwhile, the
    expert store's readers, count too: :mod:`moestream.generation` takes them out)."""
    return _kernel_cpu[0]


def library() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None (said once on stderr) when it cannot be built."""
    if _state["tried"]:
        return _state["lib"]
    with _lock:
        if not _state["tried"]:
            try:
                _state["lib"] = _load()
            except Exception as e:  # no compiler, a failed build: the PyTorch path computes instead
                _state["error"] = str(e).strip() or type(e).__name__
                print(f"moestream: note: the CPU kernels could not be built ({_state['error']}); quantized linears "
                      "run on the slower PyTorch path", file=sys.stderr, flush=True)
            _state["tried"] = True
    return _state["lib"]


def paths() -> list[str]:
    """The compiled paths, slowest first: ``portable`` always, then ``avx2``, ``avx512`` where built; [] if none."""
    lib = library()
    if lib is None:
        return []
    mask = lib.ms_paths()
    return [name for name, bit in _PATH_BITS if mask & bit]


def selected() -> str:
    """The path quantized CPU linears take now: ``avx512``, ``avx2``, ``portable`` or ``torch``.

    From :func:`use` (innermost), else ``MOESTREAM_CPU_KERNELS`` (default ``auto``: the
    fastest compiled path). A named path not compiled here falls back to ``torch``.

    Raises:
        ConfigError: ``MOESTREAM_CPU_KERNELS`` is not one of :data:`CHOICES` (a ``ValueError`` too).
    """
    raw = _forced[-1] if _forced else os.environ.get(ENV)
    got = _chosen.get(raw)
    if got is not None:  # the same choice as the last call (on every kernel call: keep it cheap)
        return got
    got = _choose(raw)
    _chosen.clear()
    _chosen[raw] = got
    return got


_chosen: dict = {}  # the last choice of selected(), by the raw setting it came from


def _choose(raw: str | None) -> str:
    want = (raw or "auto").strip().lower() or "auto"
    if want not in CHOICES:
        raise KernelChoiceError(f"environment variable {ENV}={os.environ.get(ENV)!r}: expected one of "
                                f"{', '.join(CHOICES)}")
    if want == "torch":
        return "torch"
    have = paths()
    if not have:
        return "torch"
    if want == "auto":
        return have[-1]
    return want if want in have else "torch"


@contextlib.contextmanager
def use(path: str):
    """Compute quantized CPU linears on ``path`` (one of :data:`CHOICES`) inside the block (tests, benchmarks)."""
    if path not in CHOICES:
        raise ValueError(f"path {path!r}: expected one of {', '.join(CHOICES)}")
    _forced.append(path)
    try:
        yield
    finally:
        _forced.pop()


class Spec:
    """One stored linear as the kernel reads it: the spec fields, the pieces (kept alive) and their pointers."""

    __slots__ = ("fields", "tensors", "out", "inn", "_c")

    def __init__(self, fields: list[int], tensors: list[torch.Tensor | None]):
        self.fields, self.tensors = fields, tensors + [None] * (PTRS - len(tensors))
        self.out, self.inn = fields[4], fields[5]
        self._c = None

    def ptrs(self) -> list[int]:
        return [0 if t is None else t.data_ptr() for t in self.tensors]

    def c_arrays(self):
        """(fields, pointers) as the C arrays one call takes, made once (the pieces do not move)."""
        if self._c is None:
            self._c = ((ctypes.c_int64 * SPEC)(*self.fields), (ctypes.c_void_p * PTRS)(*self.ptrs()))
        return self._c


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"moestream kernels: {what}")


def linear_spec(lf, t: dict[str, torch.Tensor], role: str | None = None, rows: tuple[int, int] = (0, 1),
                out: int | None = None) -> Spec | None:
    """The kernel's view of one stored linear, or None when the kernels do not cover it.

    Args:
        lf: its :class:`~moestream.quant.formats.LinearFormat` ([out, in] and scheme; None: float).
        t: the stored pieces (CPU tensors), by scheme:

            - affine: ``<role>`` uint32 [rows, in * bits / 32] (or its raw bytes),
              ``<role>.scales`` and ``<role>.biases`` [rows, in / group] in float32, bf16 or fp16;
            - fp8: ``<role>`` float8_e4m3fn [rows, in] and ``<role>.<scale_param>``
              [ceil(rows / bn), ceil(in / bk)] in float32, bf16 or fp16 (per-tensor: [1]);
            - mxfp4: ``<role>`` uint8 [rows, in / 32, 16] (gpt-oss) or [rows, in / 2]
              (compressed-tensors), ``<role>.<scale_param>`` uint8 e8m0 [rows, in / 32];
            - gguf: ``<role>`` uint8 [rows, row bytes], ggml blocks (:mod:`.ggml`).
        role: the key of the weight in ``t`` (default ``lf.role``).
        rows: (first, step): output row ``r`` is stored row ``first + r * step`` (gate and up
            of an interleaved ``gate_up``).
        out: output rows (default ``lf.out_features``).

    Raises:
        ValueError: a piece whose shape or dtype disagrees with ``lf`` (names it).
    """
    s = lf.scheme
    role = role or lf.role
    out = out or lf.out_features
    inn = lf.in_features
    fmt = None if s is None else s.format
    kind = None if fmt is None or fmt.cpu is None else fmt.cpu.kind
    if kind not in _SPEC_PARTS or inn % 32:  # the codebook kind has its own: codebook_spec
        return None
    w = t[role]
    if kind == "ggml":
        return _ggml_spec(lf, w, role, rows, out)
    sc = t.get(role + "." + s.scale_param)
    if sc is None or w.device.type != "cpu" or w.dim() < 2:
        return None
    need = rows[0] + (out - 1) * rows[1] + 1
    stored = w.shape[0]
    _check(stored >= need, f"{role}: weight {list(w.shape)} holds fewer than {need} rows")
    row_bytes = w.numel() * w.element_size() // stored
    parts = _SPEC_PARTS[kind](s, t, role, w, sc, stored, inn)
    if parts is None:
        return None
    want, head, tail, bias, table = parts
    _check(row_bytes == want, f"{role}: weight {list(w.shape)} ({w.dtype}) has {row_bytes} bytes per row; "
           f"[{out}, {inn}] as {s.tag} needs {want}")
    act = ACT_Q8 if s.act == "q8" else ACT_FLOAT  # spec[8]; affine 4/8-bit only (formats.with_activations)
    fields = head + [out, inn, rows[0], rows[1], act, row_bytes] + tail
    fields += [0] * (SPEC - len(fields))
    return Spec(fields, [_contig(w), _contig(sc), None if bias is None else _contig(bias), table])


def _affine_parts(s, t, role, w, sc, stored, inn):
    bias = t.get(role + ".biases")
    if s.bits not in AFFINE_BITS or s.group_size % 32 or bias is None or sc.dtype not in _DT or bias.dtype not in _DT:
        return None
    groups = inn // s.group_size
    _check(sc.shape[-1] == groups and sc.numel() == stored * groups and bias.shape == sc.shape,
           f"{role}: scales {list(sc.shape)} and biases {list(bias.shape)} are not [{stored}, {groups}]")
    return inn * s.bits // 8, [AFFINE, s.bits, s.group_size, 1], [groups, _DT[sc.dtype], _DT[bias.dtype]], bias, None


def _fp8_parts(s, t, role, w, sc, stored, inn):
    bn, bk = fp8.resolve_block(s.block, (stored, inn))
    if bk % 16 or sc.dtype not in _DT or w.element_size() != 1:
        return None
    brows, bcols = -(-stored // bn), -(-inn // bk)
    _check(sc.numel() == brows * bcols, f"{role}: scales {list(sc.shape)} are not the {brows} x {bcols} blocks "
           f"of {bn} x {bk} a [{stored}, {inn}] weight has")
    return inn, [FP8, 8, bk, bn], [bcols, _DT[sc.dtype], 0], None, None


def _mxfp4_parts(s, t, role, w, sc, stored, inn):
    if w.element_size() != 1 or sc.element_size() != 1:
        return None
    _check(sc.numel() == stored * (inn // 32), f"{role}: scales {list(sc.shape)} are not [{stored}, {inn // 32}]")
    return inn // 2, [MXFP4, 4, 32, 1], [inn // 32, 0, 0], None, _FP4


# a stored format's CpuKernel.kind -> (row bytes, spec head, spec tail, biases, value table) of its linear, or
# None when the kernels do not cover its pieces; ggml: _ggml_spec
_SPEC_PARTS = {"affine": _affine_parts, "fp8": _fp8_parts, "mxfp4": _mxfp4_parts, "ggml": None}


def _ggml_spec(lf, w: torch.Tensor, role: str, rows: tuple[int, int], out: int) -> Spec | None:
    """The kernel's view of a linear stored as ggml blocks [rows, row bytes] (:mod:`.ggml`)."""
    kind = lf.scheme.ggml
    cpu = lf.scheme.format.cpu
    if w.device.type != "cpu" or w.dim() < 2 or w.element_size() != 1:
        return None
    inn, stored = lf.in_features, w.shape[0]
    need = rows[0] + (out - 1) * rows[1] + 1
    _check(stored >= need, f"{role}: weight {list(w.shape)} holds fewer than {need} rows")
    row_bytes = w.numel() // stored
    want = ggml.row_bytes(kind, inn)
    _check(row_bytes == want, f"{role}: weight {list(w.shape)} has {row_bytes} bytes per row; [{out}, {inn}] as "
           f"{lf.scheme.tag} needs {want}")
    act = ACT_Q8 if lf.scheme.act == "q8" and cpu.q8 else ACT_FLOAT  # spec[8]: the activation mode
    fields = [GGML, cpu.type_code, cpu.group, 1, out, inn, rows[0], rows[1], act, row_bytes]
    fields += [0] * (SPEC - len(fields))
    return Spec(fields, [_contig(w), _grid_table(kind) if kind in ggml.GRID_TYPES else None])


@functools.lru_cache(maxsize=None)
def _grid_table(kind: str) -> torch.Tensor:
    """A codebook type's grid as the kernels read it (the scales pointer): the gguf package's table
    (:func:`.ggml.grid`) as bytes [entries * 8 or 4], int8 for IQ1's -1, 0, 1, else uint8 (exact)."""
    g = ggml.grid(kind)
    t = g.to(torch.int8 if kind.startswith("IQ1") else torch.uint8).flatten().contiguous()
    if not torch.equal(t.float(), g.flatten()):  # a gguf release whose grid no longer fits a byte
        raise ValueError(f"the gguf package's {kind} grid does not fit the kernels' byte table")
    return t


def _cached(t: torch.Tensor, make):
    """``make(t)``, kept on the tensor until it changes (resident codebooks, signs, norms)."""
    got = getattr(t, "_moestream_kernel_form", None)
    if got is None or got[0] != t._version or got[1] is not make:
        got = (t._version, make, make(t))
        t._moestream_kernel_form = got
    return got[2]


def _code_table(codebook: torch.Tensor) -> torch.Tensor:
    """A turboquant codebook as the kernels' 16-entry float32 table, periodic in the code width (the
    kernels look codes up without masking the next code's bits away)."""
    levels = codebook.shape[0]
    width = 4 if levels == 3 else levels  # ternary: 2-bit codes 0..2 (3 unused, 0)
    cb = torch.zeros(width)
    cb[:levels] = codebook.detach().float().cpu()
    return cb.repeat(16 // width).contiguous()


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().cpu().contiguous()


def ones_column(t: torch.Tensor) -> torch.Tensor:
    """float32 ones [len(t), 1]: unit scales, one group per row (turboquant's QJL sign bits)."""
    return torch.ones(t.shape[0], 1)


@functools.lru_cache(maxsize=None)
def _blocks(inn: int) -> tuple[int, int, int, torch.Tensor | None]:
    """(B, m, float32 bits of 1/sqrt(B), H_m or None) of the blockwise Hadamard over ``inn`` inputs."""
    b, m = block_size(inn)
    scale = torch.tensor(1.0 / math.sqrt(b), dtype=torch.float32)  # as blockwise_hadamard rounds it
    return b, m, int(scale.view(torch.int32).item()) & 0xFFFFFFFF, sloane_matrix(m).contiguous() if m > 1 else None


def _rotation(inn: int, signs: torch.Tensor, rot_half: bool = False) -> tuple[list[int], list]:
    """Spec fields 13-15 and the signs and H_m tensors of turboquant's input rotation ``H_B(signs * x)``."""
    b, m, bits, hm = _blocks(inn)
    return [b, m, bits | (int(rot_half) << 32)], [_cached(signs, _float32), hm]


def codebook_spec(packed: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor, inn: int,
                  signs: torch.Tensor | None = None, bias: torch.Tensor | None = None, rot_half: bool = False
                  ) -> Spec | None:
    """The kernel's view of one turboquant linear (:mod:`.turboquant`), or None when not covered.

    Args:
        packed: uint32 codes [out, ceil(in / epw)] as stored (bit fields LSB-first, ten 3-bit codes
            per word, or 20 base-3 trits per word).
        scales: [out, in / group] (float16 as stored; float32, bf16 too).
        codebook: [levels] (2, 4, 8, 16, or 3 for ternary): the code values.
        inn: input features.
        signs: [in] +-1 when the input is rotated (``H_B(signs * x)``, :func:`.turboquant.rotate`), else None.
        bias: [out] added to the product (any float dtype), or None.
        rot_half: round the rotated input to fp16 (the QJL term's ``sx``).

    Raises:
        ValueError: pieces whose shapes disagree (names them).
    """
    levels = codebook.shape[0]
    if packed.device.type != "cpu" or packed.dim() != 2 or scales.dtype not in _DT or inn % 16 \
            or (levels != TRIT and levels not in LEVEL_BITS):
        return None
    out, groups = packed.shape[0], scales.shape[-1]
    group = inn // groups
    if group % 16 or inn % groups:
        return None
    epw = 20 if levels == TRIT else 32 // LEVEL_BITS[levels]
    row_bytes = packed.numel() * packed.element_size() // out
    _check(row_bytes == 4 * -(-inn // epw), f"turboquant codes {list(packed.shape)}: {inn} inputs at {epw} "
           f"codes per word need {-(-inn // epw)} words per row")
    _check(scales.numel() == out * groups, f"turboquant scales {list(scales.shape)} are not [{out}, {groups}]")
    bits = 2 if levels == TRIT else LEVEL_BITS[levels]
    pack = TRITS if levels == TRIT else TEN3 if levels == 8 else STREAM
    rot, extra = ([0, 1, 0], [None, None]) if signs is None else _rotation(inn, signs, rot_half)
    ob = None if bias is None else _contig(bias.detach().float())
    fields = [CODEBOOK, bits, group, 1, out, inn, 0, 1, pack, row_bytes, groups, _DT[scales.dtype], 0, *rot]
    table = _cached(codebook, _code_table)
    return Spec(fields, [_contig(packed), _contig(scales), None, table, *extra, ob])


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor | None:
    """turboquant's input rotation ``H_B(signs * x)`` of ``x`` [n, in] in float32, the same bits as
    :func:`.turboquant.blockwise_hadamard`; None on the PyTorch path."""
    if _ready(x) is None:
        return None
    rot, extra = _rotation(x.shape[1], signs)
    fields = (ctypes.c_int64 * SPEC)(*([CODEBOOK, 0, 16, 1, 0, x.shape[1], 0, 1, 0, 0, 0, 0, 0, *rot]))
    ptrs = (ctypes.c_void_p * PTRS)(0, 0, 0, 0, extra[0].data_ptr(), 0 if extra[1] is None else extra[1].data_ptr())
    xf = _contig(x.float())
    out = torch.empty_like(xf)
    library().ms_rotate(fields, ptrs, xf.data_ptr(), x.shape[0], out.data_ptr())
    return out


def codebook_linear(x: torch.Tensor, spec: Spec | None, out_dtype: torch.dtype | None = None
                    ) -> torch.Tensor | None:
    """``x`` [n, in] through one turboquant linear (:func:`codebook_spec`: rotation, product, bias): [n, out].

    None on the PyTorch path or when ``spec`` is None.
    """
    p = _ready(x)
    if p is None or spec is None:
        return None
    _check(x.shape[1] == spec.inn, f"turboquant linear: input has {x.shape[1]} features, the weight takes {spec.inn}")
    return _call(library().ms_linear, p, [spec], x, spec.out, out_dtype)


def codebook_expert(x: torch.Tensor, specs: tuple[Spec | None, Spec | None, Spec | None],
                    out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """One turboquant SwiGLU expert in one call: ``down(silu(gate x) * up x)``, each projection rotating its
    own input; ``specs`` from :func:`codebook_spec` (gate, up, down). [n, H] in ``out_dtype`` (x.dtype)."""
    p = _ready(x)
    if p is None or any(s is None for s in specs):
        return None
    g, u, d = specs
    _check(x.shape[1] == g.inn == u.inn and g.out == u.out == d.inn,
           f"input [{x.shape[1]}], gate [{g.out}, {g.inn}], up [{u.out}, {u.inn}] and down [{d.out}, {d.inn}] "
           "do not chain")
    params = (ctypes.c_float * 2)(1.0, float("nan"))
    return _call(library().ms_expert, p, list(specs), x, d.out, out_dtype, 0, params)


def _ready(x: torch.Tensor) -> str | None:
    if x.device.type != "cpu" or x.dtype not in _DT or x.dim() != 2:
        return None
    p = selected()
    return None if p == "torch" else p


def _call(fn, path: str, specs: list[Spec], x: torch.Tensor, out: int, dtype: torch.dtype | None, *extra
          ) -> torch.Tensor:
    xf = _contig(x.float())
    y = torch.empty(x.shape[0], out, dtype=torch.float32)
    if len(specs) == 1:
        fields, ptrs = specs[0].c_arrays()
    else:
        fields = (ctypes.c_int64 * (SPEC * len(specs)))(*(f for s in specs for f in s.fields))
        ptrs = (ctypes.c_void_p * (PTRS * len(specs)))(*(p for s in specs for p in s.ptrs()))
    rc = fn(_PATH_CODE[path], fields, ptrs, xf.data_ptr(), x.shape[0], y.data_ptr(), *extra)
    if rc:
        raise RuntimeError(f"moestream kernels: path {path} is not compiled in this build")
    dtype = dtype or x.dtype
    return y if dtype == torch.float32 else y.to(dtype)


def linear(x: torch.Tensor, t: dict[str, torch.Tensor], lf, out_dtype: torch.dtype | None = None,
           spec: Spec | None = None) -> torch.Tensor | None:
    """``x`` [n, in] (float32, bf16 or fp16, CPU) times the stored weight of ``lf``, transposed: [n, out].

    ``t`` holds the linear's stored pieces under ``lf.role`` (see :func:`linear_spec`).
    Float32 accumulation, one rounding to ``out_dtype`` (default x.dtype) at the end. Returns None when the
    kernels do not cover this linear (format, device, dtype) or the PyTorch path is
    selected: the caller computes it then. ``spec``: :func:`linear_spec` of these pieces made before.

    Raises:
        ValueError: pieces whose shapes disagree with ``lf`` (names the piece).
    """
    p = _ready(x)
    if p is None:
        return None
    spec = spec or linear_spec(lf, t)
    if spec is None:
        return None
    _check(x.shape[1] == spec.inn, f"{lf.role}: input has {x.shape[1]} features, the weight takes {spec.inn}")
    return _call(library().ms_linear, p, [spec], x, spec.out, out_dtype)


def float_spec(w: torch.Tensor, bias: torch.Tensor | None = None, transposed: bool = False) -> Spec | None:
    """The kernels' view of a float weight (float32, bf16 or fp16 on the CPU, rows contiguous), or None.

    ``w`` [out, in] (``y = x w^T``, ``nn.Linear``'s orientation), or with ``transposed`` [in, out] (``y = x @ w``,
    gpt-oss's experts); rows may lie at any stride (a view of a larger tensor). ``bias`` [out] is added to the
    product in float32 (kept as float32 with the spec).
    """
    if w.device.type != "cpu" or w.dtype not in _DT or w.dim() != 2 or w.stride(1) != 1 or w.shape[0] == 0 \
            or w.shape[1] == 0:
        return None
    es = w.element_size()
    inn, out = (w.shape[0], w.shape[1]) if transposed else (w.shape[1], w.shape[0])
    row_bytes = (w.stride(0) if w.shape[0] > 1 else w.shape[1]) * es
    ob = None if bias is None else bias.detach().to(torch.float32).contiguous()
    if ob is not None and ob.numel() != out:
        raise ValueError(f"moestream kernels: bias of {ob.numel()} for a linear of {out} outputs")
    fields = [FLOAT_T if transposed else FLOAT, _DT[w.dtype], 16, 1, out, inn, 0, 1, 0, row_bytes]
    fields += [0] * (SPEC - len(fields))
    return Spec(fields, [w, None, None, None, None, None, ob])


def spec_of(t: torch.Tensor, make):
    """``make(t)`` kept on the tensor until it changes (resident weights: the spec is built once)."""
    try:
        version = t._version
    except RuntimeError:  # an inference-mode tensor keeps no version: never changed in place
        version = 0
    got = getattr(t, "_moestream_spec", None)
    if got is None or got[0] != version or got[1] != t.data_ptr():
        got = (version, t.data_ptr(), make(t))
        t._moestream_spec = got
    return got[2]


def float_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, transposed: bool = False, spec: Spec | None = None
                 ) -> torch.Tensor | None:
    """``x`` [..., in] times a float weight: ``x w^T`` for ``w`` [out, in] (``x @ w`` for ``transposed``
    ``w`` [in, out]), plus ``bias``: [..., out] in ``out_dtype`` (default x.dtype), float32 accumulation and
    one rounding. The kernels' one reduction (module docstring): its bits depend only on ``x``'s row and
    ``w``. None on the PyTorch path, or when the kernels do not cover the tensors (device, dtype, layout).
    ``spec``: :func:`float_spec` of ``w`` and ``bias`` made before (a resident weight's, reused).
    """
    if x.device.type != "cpu" or x.dtype not in _DT or x.dim() < 1:
        return None
    p = selected()
    if p == "torch":
        return None
    if spec is None:
        spec = float_spec(w, bias, transposed)
        if spec is None:
            return None
    x2 = x.reshape(-1, x.shape[-1])
    _check(x2.shape[1] == spec.inn, f"linear: input has {x2.shape[1]} features, the weight takes {spec.inn}")
    y = _call(library().ms_linear, p, [spec], x2, spec.out, out_dtype)
    return y.view(*x.shape[:-1], spec.out)


def float_expert(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str = "silu",
                 params: tuple[float, float] = (1.0, float("nan")), specs=None, out_dtype: torch.dtype | None = None,
                 biases: tuple | None = None) -> torch.Tensor | None:
    """A gated expert on float weights in one call: ``down(act(gate x, up x))`` for ``x`` [n, H], gate and up
    [I, H], down [H, I] (any of float32, bf16, fp16): [n, H] in ``out_dtype`` (x.dtype). ``act`` and ``params``
    as :func:`expert` (``silu``; ``situ`` with (beta, linear_beta); ``clamped`` with (alpha, limit)); the
    intermediate stays float32. ``specs``: (gate, up, down) :func:`float_spec` views made before; ``biases``:
    (gate, up, down) biases added to each product (gpt-oss), or None. None on the PyTorch path or when the
    kernels do not cover the tensors."""
    p = _ready(x)
    if p is None:
        return None
    if specs is None:
        b = biases or (None, None, None)
        specs = (float_spec(gate, b[0]), float_spec(up, b[1]), float_spec(down, b[2]))
    g, u, d = specs
    if g is None or u is None or d is None:
        return None
    _check(x.shape[1] == g.inn == u.inn and g.out == u.out == d.inn,
           f"input [{x.shape[1]}], gate [{g.out}, {g.inn}], up [{u.out}, {u.inn}] and down [{d.out}, {d.inn}] "
           "do not chain")
    cp = (ctypes.c_float * 2)(*params)
    return _call(library().ms_expert, p, [g, u, d], x, d.out, out_dtype, ACTIVATIONS.index(act), cp)


class ExpertCall:
    """One gated expert as the kernels read it: its gate, up and down :class:`Spec` (kept alive) packed once
    into the C arrays ``ms_moe`` takes (an expert the cache holds is packed once, not per token)."""

    __slots__ = ("specs", "fields", "ptrs", "h_in", "h_out", "c_fields", "c_ptrs")

    def __init__(self, specs: tuple[Spec, Spec, Spec]):
        self.specs = specs
        # the C arrays (at fixed addresses while this object lives: a decoder layer's expert table points at them)
        self.c_fields = (ctypes.c_int64 * (3 * SPEC))(*(f for sp in specs for f in sp.fields))
        self.c_ptrs = (ctypes.c_void_p * (3 * PTRS))(*(p for sp in specs for p in sp.ptrs()))
        self.fields, self.ptrs = bytes(self.c_fields), bytes(self.c_ptrs)
        self.h_in, self.h_out = specs[0].inn, specs[2].out


def expert_call(t: dict[str, torch.Tensor], fmt) -> ExpertCall | None:
    """The :class:`ExpertCall` of an expert's stored pieces ``t``: quantized ones as :func:`expert` reads them
    (``fmt`` their :class:`~moestream.quant.formats.ExpertFormat`), float ones (``fmt`` None: ``gate``, ``up``,
    ``down`` with optional ``<role>.bias``) as :func:`float_expert`; None when the kernels do not cover them."""
    if fmt is None:
        specs = tuple(float_spec(t[r], t.get(r + ".bias")) for r in ("gate", "up", "down"))
    else:
        lin = fmt.linears
        if fmt.fused_gate_up:
            gu = lin["gate_up"]
            inter = gu.out_features // 2
            specs = (linear_spec(gu, t, "gate_up", (0, 2), inter), linear_spec(gu, t, "gate_up", (1, 2), inter),
                     linear_spec(lin["down"], t))
        else:
            specs = (linear_spec(lin["gate"], t), linear_spec(lin["up"], t), linear_spec(lin["down"], t))
    if any(sp is None for sp in specs):
        return None
    g, u, d = specs
    _check(g.inn == u.inn and g.out == u.out == d.inn,
           f"gate [{g.out}, {g.inn}], up [{u.out}, {u.inn}] and down [{d.out}, {d.inn}] do not chain")
    return ExpertCall(specs)


def moe(x: torch.Tensor, calls: list[ExpertCall], rows: list[list[int]], k: int, weights: torch.Tensor,
        act: str = "silu", params: tuple[float, float] = (1.0, float("nan")),
        out: torch.Tensor | None = None) -> torch.Tensor | None:
    """A MoE layer's experts in one call: expert ``i`` (``calls[i]``) on the tokens of its routing slots
    ``rows[i]`` (slot ``s = token * k + j``), each output weighted as the expert pipeline does -- rounded to
    x's dtype, times ``weights[s]``, rounded to the product's promoted dtype, then to ``out``'s dtype.

    Args:
        x: [T, H] the layer's expert input (float32, bf16 or fp16).
        weights: [T * k] routing weights (any float dtype; their dtype sets the product's rounding).
        out: [T * k, H'] the slots to write (x's dtype by default: a new tensor, zeros where no expert wrote).

    Returns:
        ``out``, or None on the PyTorch path. Each slot's bits are those of that expert on that token alone.
    """
    p = _ready(x)
    if p is None:
        return None
    t = x.shape[0]
    h_out = calls[0].h_out if calls else x.shape[1]
    if out is None:
        out = torch.zeros(t * k, h_out, dtype=x.dtype)
    if not calls:
        return out
    _check(all(c.h_in == x.shape[1] and c.h_out == h_out for c in calls) and out.is_contiguous()
           and tuple(out.shape) == (t * k, h_out) and out.dtype in _DT,
           f"moe: input [{t}, {x.shape[1]}] and slots {list(out.shape)} do not fit the experts")
    xf = _contig(x.float())
    wf = _contig(weights.reshape(-1).float())
    flat, starts = [], [0]
    for r in rows:
        flat.extend(r)
        starts.append(len(flat))
    rows_a = (ctypes.c_int64 * len(flat))(*flat)
    starts_a = (ctypes.c_int64 * len(starts))(*starts)
    fields = b"".join(c.fields for c in calls)
    ptrs = b"".join(c.ptrs for c in calls)
    cp = (ctypes.c_float * 2)(*params)
    prod = torch.promote_types(x.dtype, weights.dtype)
    rc = library().ms_moe(_PATH_CODE[p], len(calls), fields, ptrs, rows_a, starts_a, xf.data_ptr(), k, x.shape[1],
                          h_out, wf.data_ptr(), ACTIVATIONS.index(act), cp, _DT[x.dtype], _DT[prod], _DT[out.dtype],
                          out.data_ptr())
    if rc:
        raise RuntimeError(f"moestream kernels: path {p} is not compiled in this build")
    return out


def route_softmax(logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
                  out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Softmax top-k routing of ``logits`` [T, E] (float32, bf16 or fp16, CPU), as transformers'
    ``Qwen3MoeTopKRouter``: ``p = softmax(logits)`` in float32, the ``top_k`` largest (descending; a tie: the
    lower index), divided by their sum when ``norm_topk_prob``, rounded to ``out_dtype`` (default the logits').
    The kernels' operations in a fixed order (``exp_c``, sums left to right): a token's bits depend only on its
    logits. Returns ``(weights [T, K], idx [T, K] int64)``, or None on the PyTorch path."""
    p = selected()
    if p == "torch" or logits.device.type != "cpu" or logits.dtype not in _DT or logits.dim() != 2:
        return None
    t, e = logits.shape
    _check(0 < top_k <= e, f"routing: top_k {top_k} of {e} experts")
    lg = logits if logits.stride(1) == 1 else logits.contiguous()
    odt = out_dtype or logits.dtype
    w = torch.empty(t, top_k, dtype=odt)
    idx = torch.empty(t, top_k, dtype=torch.int64)
    a = (ctypes.c_int64 * 7)(t, e, top_k, int(norm_topk_prob), _DT[lg.dtype], lg.stride(0) if t > 1 else e, _DT[odt])
    rc = library().ms_route_softmax(a, (ctypes.c_void_p * 3)(lg.data_ptr(), w.data_ptr(), idx.data_ptr()))
    _check(rc == 0, "routing: bad arguments")
    return w, idx


class LayerArgs:
    """What :func:`decoder_layer` passes for one decoder layer besides the tokens: the attention block's
    projections (q, k, v, o :class:`Spec`), q/k norm weights, the router's :class:`Spec`, the norms' weights and
    eps, the routing (experts E, top-k K, renormalized), the activation; packed into C arrays once."""

    __slots__ = ("attn", "gate", "w1", "w2", "qn", "kn", "eps", "qk_eps", "e", "k", "norm", "act", "params", "dt",
                 "heads", "kv_heads", "head_dim", "scale", "window", "c_aspecs", "c_aptrs", "c_gate", "c_params")

    def __init__(self, attn: tuple[Spec, Spec, Spec, Spec], gate: Spec, w1: torch.Tensor, w2: torch.Tensor,
                 eps: float, qn: torch.Tensor | None, kn: torch.Tensor | None, qk_eps: float, heads: int,
                 kv_heads: int, head_dim: int, scale: float, window: int | None, top_k: int, norm: bool,
                 act: str = "silu", params: tuple[float, float] = (1.0, float("nan"))):
        self.attn, self.gate, self.w1, self.w2, self.qn, self.kn = attn, gate, w1, w2, qn, kn
        self.eps, self.qk_eps, self.e, self.k, self.norm, self.act, self.params = (
            eps, qk_eps, gate.out, top_k, norm, act, params)
        self.dt = w1.dtype
        self.heads, self.kv_heads, self.head_dim, self.scale, self.window = heads, kv_heads, head_dim, scale, window
        self.c_aspecs = (ctypes.c_int64 * (4 * SPEC))(*(f for sp in attn for f in sp.fields))
        self.c_aptrs = (ctypes.c_void_p * (4 * PTRS))(*(q for sp in attn for q in sp.ptrs()))
        self.c_gate = gate.c_arrays()
        self.c_params = (ctypes.c_float * 2)(*params)


class LayerCall:
    """One decoder layer's call of :func:`decoder_layer` / :func:`decoder_stack`: its C arguments (``c``: the 10
    pointers ``ms_decoder_layer`` takes, the arrays kept alive here) and its outputs -- ``ho`` [T, H] (the layer's
    output, or h1 when it stopped after routing), ``x2`` [T, H], ``weights`` [T, K], ``idx`` [T, K] int64, ``used``
    [2 T K] int64 (the experts in order of first use, then their slot counts), ``info`` [2] int64 (experts used,
    the expert part's CPU nanoseconds)."""

    __slots__ = ("ho", "x2", "weights", "idx", "used", "info", "c", "_keep", "owner")

    def __init__(self, h: torch.Tensor, args: LayerArgs, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, start: int, table):
        t, hid = h.shape
        dt = args.dt
        self.ho, self.x2 = torch.empty_like(h), torch.empty_like(h)
        self.weights = torch.empty(t, args.k, dtype=dt)
        self.idx = torch.empty(t, args.k, dtype=torch.int64)
        self.used = torch.empty(2 * t * args.k, dtype=torch.int64)
        self.info = torch.zeros(2, dtype=torch.int64)
        aa = (ctypes.c_int64 * 13)(t, args.heads, args.kv_heads, args.head_dim, cos.shape[-1], _DT[dt], start,
                                   args.window or 0, keys.stride(0), keys.stride(1), _bits(args.scale),
                                   _bits(args.qk_eps), int(args.qn is not None))
        ap = (ctypes.c_void_p * 8)(0, 0 if args.qn is None else args.qn.data_ptr(),
                                   0 if args.kn is None else args.kn.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                   keys.data_ptr(), values.data_ptr(), 0)
        a = (ctypes.c_int64 * 8)(t, hid, _DT[dt], _bits(args.eps), args.e, args.k, int(args.norm),
                                 ACTIVATIONS.index(args.act))
        io = (ctypes.c_void_p * 9)(h.data_ptr(), args.w1.data_ptr(), args.w2.data_ptr(), self.ho.data_ptr(),
                                   self.x2.data_ptr(), self.weights.data_ptr(), self.idx.data_ptr(),
                                   self.used.data_ptr(), self.info.data_ptr())
        g = args.c_gate
        at = ctypes.addressof
        self.c = (ctypes.c_void_p * 10)(at(a), at(aa), at(args.c_aspecs), at(args.c_aptrs), at(ap), at(g[0]), at(g[1]),
                                        at(table), at(args.c_params), at(io))
        self._keep = (h, a, aa, ap, io, table, args, cos, sin, keys, values)
        self.owner = None  # the module that finishes it (DecoderLayer)

    def hits(self) -> tuple:
        """After a whole layer: (experts, counts, (experts, counts as tensors), expert CPU seconds)."""
        n, ns = self.info.tolist()
        u = self.used[: 2 * n].tolist()
        return u[:n], u[n:], (self.used[:n], self.used[n : 2 * n]), ns * 1e-9


def decoder_layer(h: torch.Tensor, args: LayerArgs, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, start: int, table) -> tuple[int, torch.Tensor, tuple] | None:
    """One pre-norm decoder layer whose feed-forward block is softmax-routed gated experts, in one call:
    ``h1 = h + attn(rmsnorm(h, w1))`` (:func:`attention_block`), ``x2 = rmsnorm(h1, w2)``, the router
    (``round(x2 Wg^T)``, :func:`route_softmax`), the routed experts (:func:`moe` on the experts ``table`` holds) and
    ``h1 + sum_k slots`` (k = 0..K-1 in order, each add rounded to h's dtype, as the expert pipeline sums them):
    the bits of those ops one by one (transformers' ``Qwen3MoeDecoderLayer``).

    Args:
        h: [T, H] the layer's input in the model dtype (``args.dt``), contiguous.
        cos, sin: [T, rot] rotary tables in h's dtype; keys, values: [kv_heads, capacity, head_dim] the layer's
            KV cache (capacity >= start + T), written at ``start..start+T``.
        table: a ctypes array [2E] of the held experts' C arrays (:class:`ExpertCall`'s ``c_fields``, ``c_ptrs``;
            None where not held).

    Returns:
        ``(0, h_out [T, H], (experts, counts, (experts, counts as int64 tensors), expert_cpu_s))`` with every
        routed expert held (experts in order of first use and their slot counts: for the cache's counters);
        ``(1, h1, (x2, weights [T, K], idx [T, K]))`` when one is not held (the caller fetches and runs the
        experts); None on the PyTorch path.

    Raises:
        ValueError: arguments the kernel refuses (shapes that do not chain, an expert id out of range).
    """
    call = layer_call(h, args, cos, sin, keys, values, start, table)
    if call is None:
        return None
    status = run_layer(call)
    if status == 1:
        return 1, call.ho, (call.x2, call.weights, call.idx)
    return 0, call.ho, call.hits()


def layer_call(h: torch.Tensor, args: LayerArgs, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, start: int, table) -> LayerCall | None:
    """The :class:`LayerCall` of :func:`decoder_layer`'s arguments, or None on the PyTorch path."""
    if selected() == "torch":
        return None
    return LayerCall(_contig(h), args, cos, sin, keys, values, start, table)


def run_layer(call: LayerCall) -> int:
    """``ms_decoder_layer`` on ``call``: 0 (the whole layer in ``call.ho``) or 1 (stopped after routing).

    Raises:
        ValueError: the kernel refused the arguments."""
    c = call.c
    rc = library().ms_decoder_layer(_PATH_CODE[selected()], *c)
    _check(rc >= 0, "decoder layer: bad arguments")
    return rc


def decoder_stack(calls: list[LayerCall]) -> tuple[int, bool]:
    """``ms_decoder_stack``: the layers of ``calls`` (chained: each one's input is the previous one's ``ho``) in
    one call, each as :func:`run_layer`. Returns ``(layers done whole, whether the next one stopped after
    routing)``.

    Raises:
        ValueError: the kernel refused the arguments."""
    flat = (ctypes.c_void_p * (10 * len(calls)))()
    for j, call in enumerate(calls):
        flat[10 * j : 10 * j + 10] = call.c[:]
    stopped = ctypes.c_int64(0)
    done = library().ms_decoder_stack(_PATH_CODE[selected()], len(calls), flat, ctypes.byref(stopped))
    _check(done >= 0, "decoder layers: bad arguments")
    return done, bool(stopped.value)


_f32_bits: dict[bytes, int] = {}


def _bits(f: float) -> int:
    """The bits of ``f`` rounded to float32: an eps or a scale, a few values asked on every call, so kept by
    the double's own bytes (-0.0 and 0.0 apart)."""
    key = struct.pack("<d", f)
    got = _f32_bits.get(key)
    if got is None:
        if len(_f32_bits) > 1024:
            _f32_bits.clear()
        got = _f32_bits[key] = int(torch.tensor(f, dtype=torch.float32).view(torch.int32).item()) & 0xFFFFFFFF
    return got


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
              window: int | None = None, k2: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """Softmax attention of queries over one sequence's cached keys and values (CPU, float32 out).

    Args:
        q: [T, Hq, D] queries at positions ``start .. start+T-1`` (any float dtype; D = D1 + D2 with ``k2``).
        k: [Hkv, S, D1] keys of cached positions 0..S-1 (float32, bf16 or fp16; any head and position strides,
            each position's D1 values contiguous); ``k2`` [Hkv, S, D2]: a second part of the keys (MLA's rotary
            part), or None.
        v: [Hkv, S, Dv] values, k's dtype (may be a view of ``k``: MLA's latents).
        start: the position of the first query; scale: the softmax scale.
        window: a query at position p sees positions above p - window only (sliding window), or None.
        sinks: [Hq] float32 sink logits that join each softmax's denominator (gpt-oss), or None.
        mask: bool [T, S], True = may attend (DeepSeek-V3.2's selected keys), or None.
        lib: another build of csrc/ops.cpp to run it in (tests: the portable build against the SIMD one), or None.

    Returns:
        [T, Hq, Dv] float32: per query, ``sum_j e_j v_j / (sum_j e_j + e_sink)`` over its visible positions
        j <= p in position order, ``e_j = exp(s_j - m)``, ``s_j = (q . k_j) * scale`` (the kernels' one
        reduction over D1 then D2), m the largest score (or sink). Its bits depend only on the query, the
        visible keys and values and their positions: never on S beyond them (the cache's capacity), how many
        queries are in the call, or the thread count. None on the PyTorch path.

    Raises:
        ValueError: shapes or dtypes that disagree (named).
    """
    p = selected()
    if p == "torch" or q.device.type != "cpu":
        return None
    T, hq, d = q.shape
    hkv, n_keys, d1 = k.shape
    d2 = 0 if k2 is None else k2.shape[2]
    dv = v.shape[2]
    kvs = [t for t in (k, k2, v) if t is not None]
    _check(d == d1 + d2 and hq % hkv == 0 and all(t.dtype == k.dtype and t.stride(2) == 1 and t.shape[1] == n_keys
                                                 and t.shape[0] == hkv for t in kvs) and k.dtype in _DT,
           f"attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} ({k.dtype}) do not fit")
    qf = q.float().contiguous()
    out = torch.empty(T, hq, dv, dtype=torch.float32)
    sk = None if sinks is None else sinks.detach().float().contiguous()
    mk = None if mask is None else mask.to(torch.uint8).contiguous()
    if mk is not None:
        _check(tuple(mk.shape) == (T, n_keys), f"attention: mask {list(mk.shape)} is not [{T}, {n_keys}]")
    k2s = (0, 0) if k2 is None else (k2.stride(0), k2.stride(1))
    a = [T, hq, hkv, d1, d2, dv, _DT[k.dtype], start, window or 0, n_keys, k.stride(0), k.stride(1), *k2s,
         v.stride(0), v.stride(1), _bits(scale), qf.stride(0), qf.stride(1), out.stride(0), out.stride(1),
         0 if mk is None else mk.stride(0)]
    ptrs = [qf.data_ptr(), k.data_ptr(), 0 if k2 is None else k2.data_ptr(), v.data_ptr(),
            0 if sk is None else sk.data_ptr(), out.data_ptr(), 0 if mk is None else mk.data_ptr()]
    rc = (lib or library()).ms_attention((ctypes.c_int64 * len(a))(*a), (ctypes.c_void_p * len(ptrs))(*ptrs))
    _check(rc == 0, "attention: bad arguments")
    return out


def attention_block(x: torch.Tensor, specs: tuple[Spec, Spec, Spec, Spec], q_norm: torch.Tensor | None,
                    k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, start: int, heads: int, kv_heads: int, head_dim: int, scale: float,
                    window: int | None = None) -> torch.Tensor | None:
    """One sequence's attention block in one call, the same bits as its ops one by one (transformers'
    ``Qwen3MoeAttention``: q, k, v projections, per-head RMSNorm of q and k, rotary on the first ``cos.shape[-1]``
    dims, the keys and values stored, :func:`attention`, the o projection; every intermediate rounded to x's
    dtype where the op-by-op path rounds it).

    Args:
        x: [T, H] the normed input, in the model dtype (float32, bf16 or fp16).
        specs: the q, k, v, o projections' kernel views (no biases).
        q_norm, k_norm: [head_dim] weights in x's dtype, or None for none (then ``eps`` is unused).
        cos, sin: [T, rot] in x's dtype (the ``cat(freqs, freqs)`` layout).
        keys, values: [kv_heads, capacity, head_dim] the layer's cache in x's dtype (capacity >= start + T): the
            chunk's keys and values are written at positions ``start..start+T``.

    Returns:
        [T, H] in x's dtype, or None on the PyTorch path or when not covered (then the caller runs the ops).
    """
    p = selected()
    if p == "torch" or x.device.type != "cpu" or x.dtype not in _DT or x.dim() != 2:
        return None
    dt = x.dtype
    t = x.shape[0]
    if not all(v.dtype == dt and v.is_contiguous() for v in (cos, sin)) or keys.dtype != dt or values.dtype != dt \
            or keys.stride(2) != 1 or keys.stride() != values.stride() or keys.shape[1] < start + t:
        return None
    if (q_norm is None) != (k_norm is None) or any(w is not None and w.dtype != dt for w in (q_norm, k_norm)):
        return None
    xc = _contig(x)
    out = torch.empty_like(xc)
    fields = b"".join(bytes(sp.c_arrays()[0]) for sp in specs)
    ptrs = b"".join(bytes(sp.c_arrays()[1]) for sp in specs)
    a = [t, heads, kv_heads, head_dim, cos.shape[-1], _DT[dt], start, window or 0, keys.stride(0), keys.stride(1),
         _bits(scale), _bits(eps), int(q_norm is not None)]
    qn = 0 if q_norm is None else _contig(q_norm).data_ptr()
    kn = 0 if k_norm is None else _contig(k_norm).data_ptr()
    pp = [xc.data_ptr(), qn, kn, cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr()]
    rc = library().ms_attn_block(_PATH_CODE[p], (ctypes.c_int64 * len(a))(*a), fields, ptrs,
                                 (ctypes.c_void_p * len(pp))(*pp))
    _check(rc == 0, "attention block: bad arguments")
    return out


NORM_MODES = {"weight": 0, "one_plus": 1, "none": 2, "l2": 3, "weight_f32": 4}


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: str = "weight") -> torch.Tensor | None:
    """RMSNorm of ``x`` [..., d] per row (CPU): ``r = 1 / sqrt(mean(x^2) + eps)`` by the kernels' one
    reduction, then ``weight * (x r).to(x.dtype)`` (mode ``weight``, transformers' ``Qwen3MoeRMSNorm``; the
    result in the promoted dtype of the two), ``(x r (1 + weight)).to(x.dtype)`` in float32 (``one_plus``:
    ``Qwen3NextRMSNorm``) or ``(x r).to(x.dtype)`` (``none``); ``l2``: ``x / sqrt(sum(x^2) + eps)`` (as
    ``x r`` with ``r = 1 / sqrt(sum(x^2) + eps)``); ``weight_f32``: ``(weight * x r).to(x.dtype)`` in float32
    (gpt-oss's). None on the PyTorch path or when not covered.
    """
    p = selected()
    if p == "torch" or x.device.type != "cpu" or x.dtype not in _DT or x.shape[-1] == 0:
        return None
    if weight is not None and (weight.dtype not in _DT or weight.device.type != "cpu"):
        return None
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    w = None if weight is None else weight.detach().contiguous()
    if mode == "weight":
        out_dt = torch.promote_types(w.dtype, x.dtype)
    else:
        out_dt = x.dtype
    out = torch.empty(x2.shape[0], d, dtype=out_dt)
    a = [x2.shape[0], d, _DT[x.dtype], _DT[w.dtype] if w is not None else 0, _DT[out_dt], NORM_MODES[mode],
         x2.stride(0), out.stride(0), _bits(eps)]
    ptrs = [x2.data_ptr(), 0 if w is None else w.data_ptr(), out.data_ptr()]
    rc = library().ms_rmsnorm((ctypes.c_int64 * len(a))(*a), (ctypes.c_void_p * len(ptrs))(*ptrs))
    _check(rc == 0, "rms_norm: bad arguments")
    return out.view(*x.shape[:-1], d)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The delta rule one token at a time (Gated DeltaNet: ``g`` [T, H]; KDA: per key channel, ``g`` [T, H, Dk]):
    ``S = S exp(g); S += k (beta (v - S^T k))^T; o = S^T q`` per head (Yang, Kautz & Hatamizadeh 2024,
    arXiv:2412.06464), in float32 with each ``S^T y`` summed over the key channels in order.

    Args:
        q, k: [T, H, Dk]; v: [T, H, Dv]; g: [T, H] or [T, H, Dk] log decays; beta: [T, H] (float32 or any
            float, used as float32); state: [H, Dk, Dv] before the first token.

    Returns:
        (o [T, H, Dv], the state after the last token [H, Dk, Dv]), float32; None on the PyTorch path. The
        same bits whether the tokens come in one call or several.
    """
    p = selected()
    if p == "torch" or q.device.type != "cpu":
        return None
    t, h, dk = q.shape
    dv = v.shape[2]
    per_channel = g.dim() == 3
    qf, kf, vf, gf, bf = (x.float().contiguous() for x in (q, k, v, g, beta))
    _check(tuple(kf.shape) == (t, h, dk) and tuple(vf.shape) == (t, h, dv) and tuple(bf.shape) == (t, h)
           and tuple(gf.shape) == ((t, h, dk) if per_channel else (t, h)) and tuple(state.shape) == (h, dk, dv),
           f"delta rule: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, g {list(g.shape)}, beta "
           f"{list(beta.shape)}, state {list(state.shape)} do not fit")
    st = state.float().contiguous().clone()
    out = torch.empty(t, h, dv, dtype=torch.float32)
    a = [t, h, dk, dv, int(per_channel)]
    ptrs = [qf.data_ptr(), kf.data_ptr(), vf.data_ptr(), gf.data_ptr(), bf.data_ptr(), st.data_ptr(), out.data_ptr()]
    rc = library().ms_delta_rule((ctypes.c_int64 * len(a))(*a), (ctypes.c_void_p * len(ptrs))(*ptrs))
    _check(rc == 0, "delta rule: bad arguments")
    return out, st


_ACTS = {"silu": 0, "sigmoid": 1, "softplus": 2, "exp": 3}


def activation(name: str, x: torch.Tensor, threshold: float = 20.0, out_dtype: torch.dtype | None = None
               ) -> torch.Tensor | None:
    """An elementwise activation of ``x`` (CPU; any shape; float32, bf16 or fp16) computed in float32 with
    the canonical ``exp`` and rounded once to ``out_dtype`` (default x.dtype): ``silu`` x / (1 + e^-x),
    ``sigmoid`` 1 / (1 + e^-x), ``softplus`` (x above ``threshold``: x, else log1p(e^x)), ``exp``. Each value
    depends only on its input (PyTorch's own vectorized and scalar loops give different bits, so the same
    value could come out otherwise at another position or thread count). None on the PyTorch path."""
    p = selected()
    if p == "torch" or x.device.type != "cpu" or x.dtype not in _DT:
        return None
    xc = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype)
    rc = library().ms_act(_ACTS[name], xc.numel(), _DT[x.dtype], xc.data_ptr(), _DT[out.dtype], out.data_ptr(),
                          threshold)
    _check(rc == 0, f"activation {name}: bad arguments")
    return out


ACTIVATIONS = ("silu", "situ", "clamped")


def q8_quantize_affine(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q8 mode's activation quantization of ``x`` [n, in] (float32, CPU) for MLX affine weights of ``bits``
    (4 or 8) and ``group``, as the kernels do it (``csrc/q8.h`` Q8_A4 / Q8_A8): blocks of 32, float32 scale
    ``d = amax / 127``, codes ``round_half_even(x * (127 / amax))``.

    Returns:
        (codes int8 [n, in] in the input's order, scales float32 [n, in / 32], group sums float32 [n, in / group]:
        each group's blocks' ``d * sum(codes)`` added in order). The values are ``codes * scale``.

    Raises:
        ValueError: bits not 4 or 8, ``in`` not a multiple of 64 and of ``group``, or ``group`` not a multiple of
        32. RuntimeError: no compiled kernels.
    """
    if bits not in _Q8_AFFINE:
        raise ValueError(f"q8_quantize_affine: bits {bits} is not 4 or 8")
    lib = library()
    if lib is None:
        raise RuntimeError("moestream kernels: not built")
    xf = _contig(x.detach().to(torch.float32).reshape(-1, x.shape[-1]))
    n, inn = xf.shape
    code = _Q8_AFFINE[bits] | (group << 4)
    stride = lib.ms_q8_quantize(code, None, n, inn, None)
    _check(stride > 0, f"q8_quantize_affine: {inn} values in groups of {group} are not whole 64-value chunks")
    buf = torch.empty(n, stride, dtype=torch.uint8)
    lib.ms_q8_quantize(code, xf.data_ptr(), n, inn, buf.data_ptr())
    codes = buf[:, :inn].view(torch.int8)
    if bits == 4:  # each 64-value chunk is stored as its even values, then its odd ones
        codes = codes.reshape(n, -1, 2, 32).transpose(2, 3).reshape(n, inn)
    lanes = buf[:, inn:2 * inn].contiguous().view(torch.float32).view(n, -1, 16)
    scales = torch.stack([lanes[:, :, 0], lanes[:, :, 4 if bits == 4 else 8]], -1).reshape(n, -1)
    sums = buf[:, 2 * inn:2 * inn + 4 * (inn // group)].contiguous().view(torch.float32)
    return codes.contiguous(), scales, sums


def q8_quantize(x: torch.Tensor, block: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q8 mode's activation quantization of ``x`` [n, in] (float32, CPU), as the kernels do it (``csrc/q8.h``).

    Args:
        block: ``"Q8_K"`` (blocks of 256: ggml's ``quantize_row_q8_K_ref``, float32 scale ``max / -127``) or
            ``"Q8_0"`` (blocks of 32: ggml's x86 ``quantize_row_q8_0``, fp16 scale ``amax / 127``); ``in`` a
            multiple of the block.

    Returns:
        (codes int8 [n, in], scales float32 [n, in / block], sums): int16 [n, in / 16] (Q8_K: each 16 codes'
        sum) or int32 [n, in / 32] (Q8_0: each block's). The values are ``codes * scale``.

    Raises:
        ValueError: another block name, or ``in`` not whole blocks. RuntimeError: no compiled kernels.
    """
    if block not in _Q8_CODE:
        raise ValueError(f"q8_quantize: block {block!r} is not Q8_K or Q8_0")
    lib = library()
    if lib is None:
        raise RuntimeError("moestream kernels: not built")
    xf = _contig(x.detach().to(torch.float32).reshape(-1, x.shape[-1]))
    n, inn = xf.shape
    size = 256 if block == "Q8_K" else 32
    stride = lib.ms_q8_quantize(_Q8_CODE[block], None, n, inn, None)
    _check(stride > 0, f"q8_quantize: {inn} values are not whole {block} blocks of {size}")
    buf = torch.empty(n, stride, dtype=torch.uint8)
    lib.ms_q8_quantize(_Q8_CODE[block], xf.data_ptr(), n, inn, buf.data_ptr())
    nb = inn // size
    codes = buf[:, :inn].view(torch.int8)
    scales = buf[:, inn:inn + 4 * nb].contiguous().view(torch.float32)
    if block == "Q8_K":
        sums = buf[:, inn + 4 * nb:inn + 4 * nb + 2 * (inn // 16)].contiguous().view(torch.int16)
    else:
        sums = buf[:, inn + 4 * nb:inn + 8 * nb].contiguous().view(torch.int32)
    return codes.contiguous(), scales, sums


def expert(x: torch.Tensor, t: dict[str, torch.Tensor], fmt, act: str = "silu", beta: float = 1.0,
           linear_beta: float | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """One gated expert ``down(act(gate x, up x))`` in one call: ``x`` [n, H] -> [n, H] in ``out_dtype``.

    ``t``: the expert's stored pieces as the store hands them (``gate``, ``gate.scales``,
    ``gate.biases``, ``up...``, ``down...``; or an interleaved ``gate_up`` [2I, H] whose even
    rows are gate and odd rows up, when ``fmt.fused_gate_up``). ``fmt``: its
    :class:`~moestream.quant.formats.ExpertFormat`. ``act``: ``silu`` (SwiGLU, ``silu(g) * u``)
    or ``situ`` (Kimi K3's SiTU-GLU, ``beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u /
    linear_beta)``, the up half as is without ``linear_beta``). The gate and up outputs and
    their product stay float32 inside; the result is rounded once to ``out_dtype`` (default
    x.dtype). None when a projection is not covered or the PyTorch path is selected (the
    caller computes it).

    Raises:
        ValueError: pieces whose shapes disagree with ``fmt`` (names the piece), an unknown ``act``.
    """
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r}: expected one of {', '.join(ACTIVATIONS)}")
    p = _ready(x)
    if p is None:
        return None
    lin = fmt.linears
    if fmt.fused_gate_up:
        gu = lin["gate_up"]
        inter = gu.out_features // 2
        g = linear_spec(gu, t, "gate_up", (0, 2), inter)
        u = linear_spec(gu, t, "gate_up", (1, 2), inter)
    else:
        g, u = linear_spec(lin["gate"], t), linear_spec(lin["up"], t)
    d = linear_spec(lin["down"], t)
    if g is None or u is None or d is None:
        return None
    _check(x.shape[1] == g.inn == u.inn and g.out == u.out == d.inn,
           f"input [{x.shape[1]}], gate [{g.out}, {g.inn}], up [{u.out}, {u.inn}] and down [{d.out}, {d.inn}] "
           "do not chain")
    params = (ctypes.c_float * 2)(beta, float("nan") if linear_beta is None else linear_beta)
    return _call(library().ms_expert, p, [g, u, d], x, d.out, out_dtype, ACTIVATIONS.index(act), params)


def swiglu(x: torch.Tensor, t: dict[str, torch.Tensor], fmt, out_dtype: torch.dtype | None = None
           ) -> torch.Tensor | None:
    """One SwiGLU expert ``down(silu(gate x) * up x)``: :func:`expert` with ``act="silu"``."""
    return expert(x, t, fmt, "silu", out_dtype=out_dtype)


def main() -> int:
    """``python -m moestream.quant.native``: build (or find) this CPU's kernels and name the paths."""
    if library() is None:
        return 1
    print(f"moestream CPU kernels: {cache_dir()} (paths: {', '.join(paths())}; selected: {selected()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
