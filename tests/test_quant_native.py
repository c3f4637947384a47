"""moestream's compiled CPU kernels (moestream.quant.native) against a float64 product of the dequantized
weights, on every path this machine compiles (each test's id names the path; a path this CPU lacks is
skipped with the reason), plus determinism, batch and thread invariance, and the fallback without a compiler.

Bound: float32 accumulation on weights dequantized in float32 (one rounding each), so
``max |y - y64| <= 1e-5 * max |y64|`` (``y64`` the float64 product) on float32 outputs.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moestream.quant import affine, fp8, mxfp4, native
from moestream.quant.formats import ExpertFormat, LinearFormat, Scheme

from .helpers import at_threads
from .quant_helpers import fp8_quantize, mlx_quantize, mxfp4_quantize

BOUND = 1e-5
PATHS = ("portable", "avx2", "avx512")
# what each SIMD path needs from /proc/cpuinfo (the build uses -march=native)
NEEDS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                                      "avx512vbmi"}}


def cpu_has(path: str) -> bool:
    flags = set(native.cpu_flags().split(": ", 1)[-1].split())
    return path == "portable" or NEEDS[path] <= flags


def on(path: str):
    """Skip unless ``path`` is compiled here; fail if the CPU has it but the build does not."""
    have = native.paths()
    if not have:
        pytest.skip(f"the CPU kernels are not built here ({native._state['error']})")
    if path not in have:
        assert not cpu_has(path), f"this CPU has {sorted(NEEDS[path])} but the build lacks the {path} path"
        pytest.skip(f"this CPU has no {path} path")
    return native.use(path)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def affine_linear(out_f, in_f, bits, group, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    packed, scales, biases, _ = mlx_quantize(w, bits, group)
    t = {"w": packed, "w.scales": scales.to(dtype), "w.biases": biases.to(dtype)}
    lf = LinearFormat("w", Scheme("affine", bits, group), out_f, in_f)
    ref = affine.dequantize(packed, t["w.scales"], t["w.biases"], bits, group, torch.float64)
    return t, lf, ref


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", affine.BITS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_affine_odd_shapes(path, bits, group):
    """37 rows (not a multiple of 4, 8 or 16) at one group and at three; 1, 2, 7 and 64 tokens; float32 and bf16
    inputs; bf16 and fp16 scales."""
    with on(path):
        for in_f, sdt in ((group, torch.bfloat16), (3 * group, torch.float16)):
            t, lf, ref = affine_linear(37, in_f, bits, group, sdt, seed=bits + group)
            for n in (1, 2, 7, 64):
                x = torch.randn(n, in_f, generator=torch.Generator().manual_seed(n))
                for xd in (torch.float32, torch.bfloat16):
                    xi = x.to(xd)
                    got = native.linear(xi, t, lf, out_dtype=torch.float32)
                    err = rel_err(got, xi.double() @ ref.t())
                    assert err <= BOUND, f"{path} {bits}-bit g{group} in {in_f} n={n} {xd}: {err:.2e}"
            assert native.linear(xi, t, lf).dtype == torch.bfloat16


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_affine_at_the_expert_width(path, bits):
    """The Qwen3-30B-A3B expert's gate [768, 2048] and down [2048, 768], group 64, where the row blocks
    and the buffered many-token path engage."""
    with on(path):
        for out_f, in_f in ((768, 2048), (2048, 768)):
            t, lf, ref = affine_linear(out_f, in_f, bits, 64, seed=bits)
            for n in (1, 8, 19):
                x = torch.randn(n, in_f, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
                err = rel_err(native.linear(x, t, lf, out_dtype=torch.float32), x.double() @ ref.t())
                assert err <= BOUND, f"{path} {bits}-bit [{out_f}, {in_f}] n={n}: {err:.2e}"


@pytest.mark.parametrize("path", ["avx2", "avx512"])
def test_simd_and_portable_agree(path):
    """Each SIMD path and the portable one agree within the bound, at every width."""
    with on(path):
        pass
    for bits in affine.BITS:
        t, lf, ref = affine_linear(200, 512, bits, 64, seed=bits)
        x = torch.randn(5, 512)
        with native.use("portable"):
            want = native.linear(x, t, lf)
        with native.use(path):
            got = native.linear(x, t, lf)
        assert rel_err(got, want.double()) <= 2 * BOUND, f"{path} vs portable, {bits}-bit"


def fp8_linear(out_f, in_f, block, sdt=torch.float32, seed=0):
    """An fp8 linear in blocks ``block`` ((128, 128); (1, 0) per channel; (0, 0) per tensor), its float64 weight."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    bn, bk = fp8.resolve_block(block, (out_f, in_f))
    q, _, _ = fp8_quantize(w, max(bn, bk))  # the codes of one square block size, rescaled below
    rows, cols = -(-out_f // bn), -(-in_f // bk)
    scale = (torch.rand(rows, cols, generator=g) + 0.5) * 1e-3
    t = {"w": q, "w.weight_scale_inv": scale.to(sdt) if block != (0, 0) else scale.reshape(1).to(sdt)}
    lf = LinearFormat("w", Scheme("fp8", 8, bk, block), out_f, in_f)
    return t, lf, fp8.dequantize(q, t["w.weight_scale_inv"], block, torch.float64)


FP8_CASES = [((128, 128), torch.float32), ((128, 128), torch.bfloat16), ((32, 32), torch.float16),
             ((1, 0), torch.float32), ((0, 0), torch.bfloat16)]


def _assert_linear_near(t, lf, ref, what: str) -> None:
    """``native.linear`` of float32 and bf16 inputs of 1, 2, 7 and 64 rows within BOUND of the float64 product
    with ``ref`` (the dequantized weight)."""
    for n in (1, 2, 7, 64):
        x = torch.randn(n, lf.in_features, generator=torch.Generator().manual_seed(n))
        for xd in (torch.float32, torch.bfloat16):
            xi = x.to(xd)
            err = rel_err(native.linear(xi, t, lf, out_dtype=torch.float32), xi.double() @ ref.t())
            assert err <= BOUND, f"{what} n={n} {xd}: {err:.2e}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("block,sdt", FP8_CASES, ids=["b128-f32", "b128-bf16", "b32-f16", "channel", "tensor"])
def test_fp8_odd_shapes(path, block, sdt):
    """FP8 e4m3 with block, per-channel and per-tensor scales: 37 and 200 rows, one block and a partial one."""
    with on(path):
        for out_f, in_f in ((37, 128), (200, 352)):
            t, lf, ref = fp8_linear(out_f, in_f, block, sdt, seed=out_f)
            _assert_linear_near(t, lf, ref, f"{path} fp8 {block} [{out_f}, {in_f}]")


def mxfp4_linear(out_f, in_f, packed=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks, scales, _ = mxfp4_quantize(torch.randn(out_f, in_f, generator=g) * 0.05)
    w = blocks.reshape(out_f, in_f // 2) if packed else blocks  # compressed-tensors [out, in/2], gpt-oss blocks
    t = {"w": w, "w.scales": scales}
    return t, LinearFormat("w", Scheme("mxfp4", 4, 32), out_f, in_f), mxfp4.dequantize(blocks, scales, torch.float64)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("packed", [False, True], ids=["gpt-oss", "compressed-tensors"])
def test_mxfp4_odd_shapes(path, packed):
    with on(path):
        for out_f, in_f in ((37, 32), (100, 96)):
            t, lf, ref = mxfp4_linear(out_f, in_f, packed, seed=out_f)
            _assert_linear_near(t, lf, ref, f"{path} mxfp4 [{out_f}, {in_f}]")


@pytest.mark.parametrize("path", PATHS)
def test_fp8_and_mxfp4_at_real_widths(path):
    """Laguna-XS.2's FP8 expert gate [512, 2048] and Kimi K3's MXFP4 expert gate [3072, 3584]."""
    with on(path):
        cases = [fp8_linear(512, 2048, (128, 128), seed=1), mxfp4_linear(3072, 3584, True, seed=2)]
        for t, lf, ref in cases:
            for n in (1, 8, 19):
                x = torch.randn(n, lf.in_features, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
                err = rel_err(native.linear(x, t, lf, out_dtype=torch.float32), x.double() @ ref.t())
                assert err <= BOUND, f"{path} {lf.scheme.tag} n={n}: {err:.2e}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("linear_beta", [None, 4.0])
def test_fused_situ_expert(path, linear_beta):
    """Kimi K3's SiTU-GLU expert in one call on MXFP4 pieces, against float64 on the dequantized weights."""
    with on(path):
        pieces, lins, deq = {}, {}, {}
        for i, (role, (o, k)) in enumerate((("gate", (96, 128)), ("up", (96, 128)), ("down", (128, 96)))):
            t, lf, ref = mxfp4_linear(o, k, True, seed=i)
            pieces[role], pieces[role + ".scales"] = t["w"], t["w.scales"]
            lins[role], deq[role] = LinearFormat(role, lf.scheme, o, k), ref
        fmt = ExpertFormat(lins)
        beta = 3.0
        for n in (1, 7):
            x = torch.randn(n, 128, generator=torch.Generator().manual_seed(n))
            g, u = x.double() @ deq["gate"].t(), x.double() @ deq["up"].t()
            a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
            want = (a * (u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta))) @ deq["down"].t()
            got = native.expert(x, pieces, fmt, "situ", beta=beta, linear_beta=linear_beta)
            assert rel_err(got, want) <= BOUND, f"{path} situ n={n}"


def swiglu_expert(bits, group, inter=768, hidden=2048, fused=False, seed=0):
    pieces, lins, deq = {}, {}, {}
    g = torch.Generator().manual_seed(seed)
    roles = (("gate_up", (2 * inter, hidden)),) if fused else (("gate", (inter, hidden)), ("up", (inter, hidden)))
    for role, (o, i) in (*roles, ("down", (hidden, inter))):
        w = torch.randn(o, i, generator=g) * 0.03
        packed, s, b, _ = mlx_quantize(w, bits, group)
        pieces[role], pieces[role + ".scales"], pieces[role + ".biases"] = packed, s.bfloat16(), b.bfloat16()
        lins[role] = LinearFormat(role, Scheme("affine", bits, group), o, i)
        deq[role] = affine.dequantize(packed, s.bfloat16(), b.bfloat16(), bits, group, torch.float64)
    if fused:
        deq["gate"], deq["up"] = deq["gate_up"][0::2], deq["gate_up"][1::2]
    return pieces, ExpertFormat(lins, fused), deq


def swiglu64(x: torch.Tensor, deq: dict) -> torch.Tensor:
    xd = x.double()
    return (F.silu(xd @ deq["gate"].t()) * (xd @ deq["up"].t())) @ deq["down"].t()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fused", [False, True])
def test_fused_swiglu_expert(path, fused):
    """The whole expert in one call (gate, up, SiLU, down; an interleaved gate_up too) at the real shape."""
    with on(path):
        pieces, fmt, deq = swiglu_expert(4, 64, fused=fused)
        for n in (1, 2, 7, 64):
            x = torch.randn(n, 2048, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
            err = rel_err(native.swiglu(x, pieces, fmt, out_dtype=torch.float32), swiglu64(x, deq))
            assert err <= BOUND, f"{path} fused={fused} n={n}: {err:.2e}"


@pytest.mark.parametrize("path", PATHS)
def test_same_bits_any_run_threads_and_batch(path):
    """Deterministic: the same bits twice, with 1 or 2 threads, and for a token alone or among 63 others."""
    with on(path):
        pieces, fmt, _ = swiglu_expert(3, 64, seed=3)
        x = torch.randn(64, 2048, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
        one, two = at_threads(lambda: native.swiglu(x, pieces, fmt, out_dtype=torch.float32), 1, 2)
        again = native.swiglu(x, pieces, fmt, out_dtype=torch.float32)
        assert torch.equal(one, two) and torch.equal(one, again)
        for i in (0, 5, 63):
            assert torch.equal(native.swiglu(x[i : i + 1], pieces, fmt, out_dtype=torch.float32), one[i : i + 1])
        assert torch.equal(native.swiglu(x[:7], pieces, fmt, out_dtype=torch.float32), one[:7])


def test_the_build_matches_this_cpu():
    """The SIMD paths compiled are exactly those this CPU supports, and the build key names the CPU's flags."""
    have = native.paths()
    if not have:
        pytest.skip(f"the CPU kernels are not built here ({native._state['error']})")
    for path in ("avx2", "avx512"):
        if Path("/proc/cpuinfo").exists() and os.uname().machine == "x86_64":
            assert (path in have) == cpu_has(path), f"{path}: compiled {path in have}, CPU has it {cpu_has(path)}"
    print(f"compiled paths: {have}; selected {native.selected()}")


def test_build_key_depends_on_the_cpu(monkeypatch):
    key = native.build_key()
    monkeypatch.setattr(native, "cpu_flags", lambda: "some other cpu: avx2 fma")
    assert native.build_key() != key


def test_bad_pieces_name_the_piece():
    t, lf, _ = affine_linear(64, 256, 4, 64)
    bad = dict(t, **{"w.scales": t["w.scales"][:, :2]})
    with native.use("auto"):
        if native.selected() == "torch":
            pytest.skip("the CPU kernels are not built here")
        with pytest.raises(ValueError, match="w: scales"):
            native.linear(torch.randn(1, 256), bad, lf)


def test_selection_by_environment(monkeypatch):
    monkeypatch.setenv(native.ENV, "torch")
    assert native.selected() == "torch"
    monkeypatch.setenv(native.ENV, "fastest")
    with pytest.raises(ValueError, match="MOESTREAM_CPU_KERNELS='fastest'"):
        native.selected()


def test_without_a_compiler_the_pytorch_path_computes(tmp_path):
    """No compiler (CXX names none) and an empty build cache: one line on stderr, and qlinear still computes."""
    code = """
import torch
from moestream.quant import native
from moestream.quant.formats import LinearFormat, Scheme
from moestream.quant.kernels import qlinear
from moestream.quant.affine import quantize, dequantize
w = torch.randn(64, 128)
q, s, b = quantize(w, 4, 32)
lf = LinearFormat("w", Scheme("affine", 4, 32), 64, 128)
x = torch.randn(3, 128)
y = qlinear(x, {"w": q, "w.scales": s, "w.biases": b}, lf)
y = qlinear(x, {"w": q, "w.scales": s, "w.biases": b}, lf)
ref = x.double() @ dequantize(q, s, b, 4, 32, torch.float64).t()
assert native.selected() == "torch"
assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
"""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), MOESTREAM_KERNEL_CACHE=str(tmp_path / "cache"))
    env.pop(native.ENV, None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    notes = [ln for ln in run.stderr.splitlines() if "CPU kernels could not be built" in ln]
    assert len(notes) == 1 and "no C++ compiler" in notes[0], run.stderr


@pytest.mark.skipif(not shutil.which("make"), reason="no make on this machine")
def test_make_setup_builds_the_kernels_without_echoing_the_command(tmp_path):
    """``make setup``'s kernel step prints moestream's own lines, not its raw ``python -c ...`` recipe, and a
    failed build does not fail the set-up (the recipe's ``-`` kept). The set-up runs for real against stand-ins:
    a Python without torch (so the venv branch), a pip that does nothing, the venv's python this one, and a
    compiler that fails at once (so the build notice prints and the step fails quickly)."""
    repo = Path(__file__).resolve().parent.parent
    (tmp_path / "pyproject.toml").write_text("")
    bin_ = tmp_path / "v" / "bin"
    bin_.mkdir(parents=True)
    scripts = {tmp_path / "py": '[ "$1" = "-c" ] && exit 1; exit 0',  # no torch here; `-m venv` succeeds
               bin_ / "pip": "exit 0", bin_ / "python": f'exec "{sys.executable}" "$@"'}
    for path, body in scripts.items():
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    env = dict(os.environ, CXX=shutil.which("false") or "false", MOESTREAM_KERNEL_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(repo))
    env.pop(native.ENV, None)
    run = subprocess.run(["make", "-f", str(repo / "Makefile"), "VENV=v", f"PYTHON={tmp_path / 'py'}", "setup"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "v" / ".installed").exists()
    assert "moestream.quant.native" not in run.stdout + run.stderr, run.stdout  # the raw recipe, echoed
    assert "v/bin/pip install -q -e '.[dev]'" in run.stdout  # make still echoes the other steps
    notes = [ln for ln in run.stderr.splitlines() if ln.startswith("moestream: building the CPU kernels")]
    assert len(notes) == 1 and notes[0].startswith(
        f"moestream: building the CPU kernels for this CPU once ({len(native.SOURCES)} units, "), notes
    assert f"into {tmp_path / 'cache'}/" in notes[0], notes
    assert "CPU kernels could not be built" in run.stderr


def test_a_build_says_each_unit_and_computes_like_the_cached_one(tmp_path):
    """A fresh build (into an empty cache, as a new machine's first run) prints one progress line per translation
    unit, and the library it makes computes what the cached one does, bit for bit. It is built at ``-O0``
    (``$MOESTREAM_CXXFLAGS``, appended last): a third of the time, and the bits must not depend on the optimizer
    (explicit intrinsics, ``-ffp-contract=off``)."""
    env = dict(os.environ, MOESTREAM_KERNEL_CACHE=str(tmp_path / "cache"), MOESTREAM_CXXFLAGS="-O0")
    env.pop(native.ENV, None)
    code = ("import torch; from moestream.quant import native; torch.manual_seed(0); w = torch.randn(40, 100); "
            "x = torch.randn(3, 100); y = native.float_linear(x, w); import sys; "
            "sys.stdout.write(y.numpy().tobytes().hex())")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    units = [ln for ln in run.stderr.splitlines() if ln.startswith("moestream: [")]
    assert len(units) == len(native.SOURCES), run.stderr
    assert sorted(ln.split()[2] for ln in units) == sorted(native.SOURCES)
    torch.manual_seed(0)
    w, x = torch.randn(40, 100), torch.randn(3, 100)
    assert run.stdout == native.float_linear(x, w).numpy().tobytes().hex()


# turboquant: codebook codes behind the blockwise Hadamard rotation (moestream.quant.turboquant)

TQ_CODEBOOKS = {2: [-0.7979, 0.7979], 4: [-1.5107, -0.4529, 0.4529, 1.5107],
                8: [-2.1523, -1.3438, -0.7559, -0.2451, 0.2451, 0.7559, 1.3438, 2.1523],
                16: [round(-2.7 + 0.36 * i, 4) for i in range(16)], 3: [-1.2236, 0.0, 1.2236]}


def tq_linear(out_f, in_f, levels, group, seed=0):
    """Random codes and fp16 scales in the turboquant layout (packed by the test's own packer), its float64
    rotated-domain weight, and fp16 +-1 signs."""
    from .test_turboquant import pack

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, levels, (out_f, in_f), generator=g)
    scales = (torch.rand(out_f, in_f // group, generator=g) * 0.05 + 0.01).half()
    cb = torch.tensor(TQ_CODEBOOKS[levels], dtype=torch.float16)
    w64 = cb.double()[codes] * scales.double().repeat_interleave(group, -1)
    signs = (torch.randint(0, 2, (in_f,), generator=g) * 2 - 1).half()
    return pack(codes.numpy(), levels), scales, cb, signs, w64


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n_in", [2048, 2880, 768, 1792, 96, 240])
def test_rotation_is_blockwise_hadamard_bit_for_bit(path, n_in):
    """The kernels' input rotation gives blockwise_hadamard's bits for every block shape (m = 1, 12, 20, 28)."""
    from moestream.quant.turboquant import blockwise_hadamard

    with on(path):
        x = torch.randn(3, n_in, generator=torch.Generator().manual_seed(n_in)).to(torch.bfloat16)
        signs = (torch.randint(0, 2, (n_in,), generator=torch.Generator().manual_seed(1)) * 2 - 1).half()
        assert torch.equal(native.rotate(x, signs), blockwise_hadamard(x.float() * signs.float()))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("levels", [2, 4, 8, 16, 3], ids=["1bit", "2bit", "3bit", "4bit", "ternary"])
def test_codebook_odd_shapes(path, levels):
    """Codebook codes of every width, groups of 16-128, 37 rows, rows whose words end mid-word (3-bit: 10
    codes per word, ternary 20), 1, 2, 7, 64 tokens, float32 and bf16 inputs, rotated and not."""
    from moestream.quant.turboquant import blockwise_hadamard

    with on(path):
        for in_f, group in ((48, 16), (96, 32), (320, 64), (384, 128)):
            packed, scales, cb, signs, w64 = tq_linear(37, in_f, levels, group, seed=in_f + levels)
            for n in (1, 2, 7, 64):
                x = torch.randn(n, in_f, generator=torch.Generator().manual_seed(n))
                for xd, rot in ((torch.float32, False), (torch.bfloat16, True)):
                    xi = x.to(xd)
                    spec = native.codebook_spec(packed, scales, cb, in_f, signs if rot else None)
                    got = native.codebook_linear(xi, spec, torch.float32)
                    xr = blockwise_hadamard(xi.float() * signs.float()) if rot else xi.float()
                    err = rel_err(got, xr.double() @ w64.t())
                    assert err <= BOUND, f"{path} levels {levels} [37, {in_f}] g{group} n={n} {xd}: {err:.2e}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("levels", [4, 8])
def test_turboquant_expert_in_one_call(path, levels):
    """A turboquant SwiGLU expert of the Qwen3.6-35B shape (512 x 2048, group 32) in one call, each projection
    rotating its own input, with an expert bias on down, against float64 on the rotated reference inputs."""
    from moestream.quant.turboquant import blockwise_hadamard

    with on(path):
        parts = {r: tq_linear(o, i, levels, 32, seed=k)
                 for k, (r, (o, i)) in enumerate((("gate", (512, 2048)), ("up", (512, 2048)), ("down", (2048, 512))))}
        bias = torch.randn(2048, generator=torch.Generator().manual_seed(3)).half()
        specs = tuple(native.codebook_spec(p[0], p[1], p[2], p[4].shape[1], p[3], bias if r == "down" else None)
                      for r, p in parts.items())
        for n in (1, 8):
            x = torch.randn(n, 2048, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)

            def lin(v, role):
                p = parts[role]
                return blockwise_hadamard(v.float() * p[3].float()).double() @ p[4].t()

            h = F.silu(lin(x, "gate")) * lin(x, "up")
            want = lin(h.float(), "down") + bias.double()
            err = rel_err(native.codebook_expert(x, specs, torch.float32), want)
            assert err <= BOUND, f"{path} levels {levels} n={n}: {err:.2e}"
