"""The fused MoE kernel (Triton): a layer's routed SwiGLU experts computed in place from their
VRAM slots.

For ``T`` tokens routed to ``K`` experts each (expert ids ``idx`` [T, K], routing weights
``weights`` [T, K]) and a layer's slot table (expert -> slot, int32 [E], on the device), the
experts' weights are read where the VRAM slot pool keeps them (``gate``/``up`` [S, I, H],
``down`` [S, H, I], strided views of one byte pool, :class:`moestream.slot_pool.SlotPool`)
and

    out[t] = sum_{k = 0..K-1} weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t),  e = idx[t, k]

is computed with no host work, no ``torch.stack`` and no atomics:

- **the tl.dot kernels** (vLLM's ``fused_moe`` scheme, arXiv 2309.06180's serving stack; the code here
  is written from its description): the ``T*K`` routing slots go in blocks of :data:`BLOCK_M` rows of one
  expert, and three launches compute gate/up with ``tl.dot`` (float32 accumulation) and SiLU, written in
  the compute dtype; down with ``tl.dot`` times the routing weight (float32, per slot); the sum over k in
  routing order. A prefill chunk groups its slots by expert on the device (a stable sort and prefix
  sums of a fixed size, so no host sync; a fixed grid of at most ``ceil(T*K / BLOCK_M) + min(E, T*K)``
  blocks, the ones past the end exit at once). A decode step (``T * K <= ROWS_MAX``) runs **the same
  kernels with the same tile shapes**, one slot per block (no grouping): so a routing slot's bits are the
  same whether it was computed in a decode step or in a prefill chunk of any length, and whichever other
  slots shared its block (each output element is one chain of tensor-core steps over the same tiles).
- **quantized experts, few tokens**: row kernels on the CUDA cores (one program per (slot, block of I) for
  gate/up and SiLU, float32; one per (slot, block of H) for down times the weight; the sum over k), faster
  than dequantizing tiles for the tensor cores at one token; their bits differ from the tl.dot kernels'
  (docs/gpu.md). MLX affine 2/4/8-bit codes go through :func:`_gate_up_affine` / :func:`_down_affine`: each
  int32 word loaded once, its codes made exact floats by the magic-number trick (:func:`_codes`), the raw
  codes' dot with x per group, then ``scale * dot + bias * sum(x)`` per group; other formats through
  :func:`_gate_up_rows` / :func:`_down_rows`.

Determinism: each output element is written by exactly one program with a fixed loop order,
and the tile shapes depend only on the model's ``(K, H, I, dtype)``, never on ``T``. So the bits
depend only on the inputs, the routing and the model -- never on which slot an expert sits in,
which tier it came from, which other slots share a block or how many tokens the call carries
(quantized experts: the same within a decode step or within a prefill chunk). Source of the math: Qwen3-MoE's expert,
``down(silu(gate x) * up x)`` (transformers' ``Qwen3MoeMLP``), Shazeer 2020 (GLU variants).

On a machine without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
set before this module is imported), which is how the CPU tests check their logic.
"""

import os
from dataclasses import dataclass, replace

import torch

try:  # Triton ships with CUDA builds of PyTorch; the CPU wheel has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None

ROWS_MAX = 64  # T*K up to this: a decode step (one slot per block; quantized: the row kernels)


def interpreted() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``): kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreter_loops_to_runtime_bounds() -> None:
    """Under Triton 3.6's interpreter a scalar (a kernel argument, a loaded value) is a NumPy array of shape
    (1,), which NumPy 2 no longer converts to an index: ``range(lo, hi)`` over such values fails, where the
    compiled kernel loops to them. Give the interpreter's tensors an ``__index__`` that reads the one element
    (only the interpreter changes; the compiled kernels are untouched)."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover - another Triton
        return
    patch = getattr(interp, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_moestream", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._moestream = True
    interp._patch_lang_tensor = patched


def _interpreter_dot_in_float64() -> None:
    """Triton's interpreter computes ``tl.dot`` with ``np.matmul`` in the accumulator's dtype, that is
    OpenBLAS's sgemm, whose bits for one row depend on the row's place in the tile on some CPUs (its
    Haswell and Zen kernels; not SkylakeX's): a row's bits would then depend on the rows beside it, which
    the GPU's tensor cores never do. Multiply in float64 instead (a product of two float32 is exact there,
    and the sums' rounding lies far below float32's), then round to the accumulator's dtype: the same bits
    whatever the CPU, the BLAS kernel or the row's place. Only the interpreter changes."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover - another Triton
        return
    builder = getattr(interp, "InterpreterBuilder", None)
    dot = getattr(builder, "create_dot", None)
    if dot is None or getattr(dot, "_moestream", False):
        return
    import numpy as np

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = d.data.dtype
        floats = a.dtype.is_floating() and b.dtype.is_floating() and np.issubdtype(out, np.floating)
        if not floats or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return interp.TensorHandle(prod.astype(out) + d.data, d.dtype.scalar)

    create_dot._moestream = True
    builder.create_dot = create_dot


if triton is not None and interpreted():
    _interpreter_loops_to_runtime_bounds()
    _interpreter_dot_in_float64()


def available(device: torch.device | str) -> bool:
    """Whether the fused kernel can run on ``device``: Triton is importable and the device is a
    CUDA GPU, or the interpreter is on (any device)."""
    if triton is None:
        return False
    return interpreted() or torch.device(device).type == "cuda"


if triton is not None:
    # Loop extents (K, H, I) are run-time arguments on the GPU (one compiled kernel for every top-k):
    # the JIT reads this annotation's object, None. Triton's interpreter reads the annotation's text,
    # "constexpr", and makes them compile-time constants, which it needs (it cannot loop to a run-time
    # bound under NumPy 2.4). No ``from __future__ import annotations`` in this module.
    constexpr = tl.constexpr if interpreted() else None

    @triton.jit
    def _wload(q_ptr, s_ptr, b_ptr, slot, r, c, m, sq0, sq1, ss0, ss1, sb0, sb1,
               FMT: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr):
        # weights [r, c] of the expert in `slot` as float32, dequantized in registers; r (output rows) and c
        # (input columns) are broadcastable int index tensors, m their mask. Codes are bytes (uint8 views).
        r64 = r.to(tl.int64)
        if FMT == 0:  # float, the compute dtype
            w = tl.load(q_ptr + slot * sq0 + r64 * sq1 + c, mask=m, other=0.0).to(tl.float32)
        elif FMT == 1:  # MLX affine: one little-endian bit stream per row; scale * q + bias per group
            bit = c * BITS
            byte = bit >> 3
            sh = bit & 7
            base = q_ptr + slot * sq0 + r64 * sq1 + byte
            v = tl.load(base, mask=m, other=0).to(tl.int32)
            if BITS == 3 or BITS == 5 or BITS == 6:  # a code may straddle two bytes
                v = v | (tl.load(base + 1, mask=m & (sh + BITS > 8), other=0).to(tl.int32) << 8)
            q = ((v >> sh) & ((1 << BITS) - 1)).to(tl.float32)
            g = c // GS
            sc = tl.load(s_ptr + slot * ss0 + r64 * ss1 + g, mask=m, other=0.0).to(tl.float32)
            bi = tl.load(b_ptr + slot * sb0 + r64 * sb1 + g, mask=m, other=0.0).to(tl.float32)
            w = q * sc + bi
        elif FMT == 2:  # fp8 e4m3fn times the scale of its (BR x GS) block
            v = tl.load(q_ptr + slot * sq0 + r64 * sq1 + c, mask=m, other=0).to(tl.int32)
            e = (v >> 3) & 15
            mant = v & 7
            sign = (v & 0x80) << 24
            normal = (sign | ((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
            sub = mant.to(tl.float32) * 0.001953125  # e == 0: mant * 2^-9
            w = tl.where(e == 0, tl.where(sign != 0, sub * -1.0, sub), normal)
            w = tl.where((v & 0x7F) == 0x7F, float("nan"), w)
            sc = tl.load(s_ptr + slot * ss0 + (r64 // BR) * ss1 + c // GS, mask=m, other=0.0).to(tl.float32)
            w = w * sc
        else:  # MXFP4: e2m1 nibbles (low nibble = even column) times 2^(e8m0 - 127) per 32 columns
            v = tl.load(q_ptr + slot * sq0 + r64 * sq1 + (c >> 1), mask=m, other=0).to(tl.int32)
            nib = (v >> ((c & 1) * 4)) & 15
            ex = (nib >> 1) & 3
            mb = nib & 1
            val = tl.where(ex == 0, mb, (2 + mb) << tl.maximum(ex - 1, 0)).to(tl.float32) * 0.5
            val = tl.where(nib >= 8, val * -1.0, val)  # -0.0 kept: Triton's -x is 0 - x
            se = tl.load(s_ptr + slot * ss0 + r64 * ss1 + c // 32, mask=m, other=127).to(tl.int32)
            scale = tl.where(se == 0, 5.877471754111438e-39, (se << 23).to(tl.float32, bitcast=True))
            w = val * scale
        return w

    @triton.jit
    def _codes(words, J: tl.constexpr, BITS: tl.constexpr):
        # code J of every int32 word (bits [BITS*J, BITS*J + BITS), little-endian) as an exact float32 times
        # 2^(BITS*p), p its place in its 16-bit half: the half ORed with the bits of 2^23 (0x4B000000, all above
        # bit 15), the code kept in place by one AND, the float minus 2^23 (the magic-number trick: no shift
        # or int-to-float conversion per code). The caller scales x's column by 2^(-BITS*p), exactly.
        MASK: tl.constexpr = (1 << BITS) - 1
        HALF: tl.constexpr = 16 // BITS
        if J < HALF:
            v = (words | 0x4B000000) & ((MASK << (BITS * J)) | 0x4B000000)
        else:
            v = ((words >> 16) | 0x4B000000) & ((MASK << (BITS * (J - HALF))) | 0x4B000000)
        return v.to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _group_scales(s_ptr, b_ptr, slot, r64, nmask, gi, gm, ss0, ss1, sb0, sb1):
        # the scales and biases of groups gi, rows r64: float32 [NG, BN] each (0 where masked)
        m = gm[:, None] & nmask[None, :]
        sc = tl.load(s_ptr + slot * ss0 + r64[None, :] * ss1 + gi[:, None], mask=m, other=0.0).to(tl.float32)
        bi = tl.load(b_ptr + slot * sb0 + r64[None, :] * sb1 + gi[:, None], mask=m, other=0.0).to(tl.float32)
        return sc, bi

    @triton.jit
    def _gate_up_affine(x_ptr, idx_ptr, table_ptr, wg_ptr, sg_ptr, bg_ptr, wu_ptr, su_ptr, bu_ptr, h_ptr,
                        K: constexpr, H: constexpr, NI: constexpr, sx, q0, q1, s0, s1, b0, b1, sh,
                        BITS: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr):
        # one program: routing slot s = t*K + k, gate/up rows n in [nb*BN, nb*BN + BN) of MLX affine 2/4/8-bit
        # codes (int32 words), NG groups of GS columns a step: each word loaded once, its codes unpacked in
        # registers (_codes), then per group scale * sum_i q_i x_i + bias * sum_i x_i (float32), in an order
        # fixed by position: per word the codes in order, the words of a group by tl.sum, the groups of a step
        # by tl.sum, the steps in order. x and its group sums are shared by gate and up. The tiles are
        # [groups, rows, words] (groups outermost: Triton then spreads a warp's threads over groups and words,
        # so each thread holds few columns of x and several rows).
        PER: tl.constexpr = 32 // BITS
        WPG: tl.constexpr = GS // PER
        HALF: tl.constexpr = 16 // BITS
        s = tl.program_id(0)
        nb = tl.program_id(1)
        t = s // K
        e = tl.load(idx_ptr + s)
        slot = tl.load(table_ptr + e).to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        nmask = n < NI
        r64 = n.to(tl.int64)
        accg = tl.zeros([BN], dtype=tl.float32)
        accu = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, H, NG * GS):
            gi = k0 // GS + tl.arange(0, NG)
            gm = gi < H // GS
            wi = gi[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [NG, WPG] words of the row
            woff = r64[None, :, None] * q1 + wi[:, None, :]
            m3 = gm[:, None, None] & nmask[None, :, None]
            wdg = tl.load(wg_ptr + slot * q0 + woff, mask=m3, other=0)
            wdu = tl.load(wu_ptr + slot * q0 + woff, mask=m3, other=0)
            scg, big = _group_scales(sg_ptr, bg_ptr, slot, r64, nmask, gi, gm, s0, s1, b0, b1)
            scu, biu = _group_scales(su_ptr, bu_ptr, slot, r64, nmask, gi, gm, s0, s1, b0, b1)
            pg = tl.zeros([NG, BN, WPG], dtype=tl.float32)
            pu = tl.zeros([NG, BN, WPG], dtype=tl.float32)
            xs = tl.zeros([NG, WPG], dtype=tl.float32)
            for j in tl.static_range(PER):
                xj = tl.load(x_ptr + t * sx + wi * PER + j, mask=gm[:, None], other=0.0).to(tl.float32)
                xs += xj
                xj = xj * (1.0 / (1 << (BITS * (j % HALF))))  # _codes' power of 2 taken back
                pg += _codes(wdg, j, BITS) * xj[:, None, :]
                pu += _codes(wdu, j, BITS) * xj[:, None, :]
            xsum = tl.sum(xs, axis=1)[:, None]
            accg += tl.sum(scg * tl.sum(pg, axis=2) + big * xsum, axis=0)
            accu += tl.sum(scu * tl.sum(pu, axis=2) + biu * xsum, axis=0)
        h = accg / (1.0 + tl.exp(-accg)) * accu
        tl.store(h_ptr + s * sh + n, h, mask=nmask)

    @triton.jit
    def _down_affine(h_ptr, w_ptr, idx_ptr, table_ptr, wd_ptr, sd_ptr, bd_ptr, y_ptr, K: constexpr, H: constexpr,
                     NI: constexpr, sh, q0, q1, s0, s1, b0, b1, sy,
                     BITS: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr):
        # one program: routing slot s, down rows n in [nb*BN, nb*BN + BN): y[s, n] = weight * down_e(h_s)
        # (float32), the reduction over I and the tiles as _gate_up_affine's; _sum_k then adds a token's K rows
        PER: tl.constexpr = 32 // BITS
        WPG: tl.constexpr = GS // PER
        HALF: tl.constexpr = 16 // BITS
        s = tl.program_id(0)
        nb = tl.program_id(1)
        n = nb * BN + tl.arange(0, BN)
        nmask = n < H
        r64 = n.to(tl.int64)
        e = tl.load(idx_ptr + s)
        slot = tl.load(table_ptr + e).to(tl.int64)
        acc = tl.zeros([BN], dtype=tl.float32)
        for i0 in range(0, NI, NG * GS):
            gi = i0 // GS + tl.arange(0, NG)
            gm = gi < NI // GS
            wi = gi[:, None] * WPG + tl.arange(0, WPG)[None, :]
            wd = tl.load(wd_ptr + slot * q0 + r64[None, :, None] * q1 + wi[:, None, :],
                         mask=gm[:, None, None] & nmask[None, :, None], other=0)
            sc, bi = _group_scales(sd_ptr, bd_ptr, slot, r64, nmask, gi, gm, s0, s1, b0, b1)
            p = tl.zeros([NG, BN, WPG], dtype=tl.float32)
            xs = tl.zeros([NG, WPG], dtype=tl.float32)
            for j in tl.static_range(PER):
                hj = tl.load(h_ptr + s * sh + wi * PER + j, mask=gm[:, None], other=0.0)
                xs += hj
                hj = hj * (1.0 / (1 << (BITS * (j % HALF))))
                p += _codes(wd, j, BITS) * hj[:, None, :]
            acc += tl.sum(sc * tl.sum(p, axis=2) + bi * tl.sum(xs, axis=1)[:, None], axis=0)
        wt = tl.load(w_ptr + s).to(tl.float32)
        tl.store(y_ptr + s.to(tl.int64) * sy + n, acc * wt, mask=nmask)

    @triton.jit
    def _mxfp4_dot(q_ptr, s_ptr, slot, n, nmask, k0, xv, NK: constexpr, sq0, sq1, ss0, ss1,
                   BN: tl.constexpr, BK: tl.constexpr):
        # rows n of one slot's MXFP4 weight times x columns [k0, k0 + BK): the bytes loaded once each
        # (vectorized), both nibbles decoded in registers, then per 32 columns 2^(e - 127) * sum_i v_i x_i
        NB: tl.constexpr = BK // 2
        NG: tl.constexpr = BK // 32
        bi = k0 // 2 + tl.arange(0, NB)
        r64 = n.to(tl.int64)
        v = tl.load(q_ptr + slot * sq0 + r64[:, None] * sq1 + bi[None, :],
                    mask=nmask[:, None] & (bi[None, :] < NK // 2), other=0).to(tl.int32)
        nib = (v[:, :, None] >> (tl.arange(0, 2) * 4)[None, None, :]) & 15  # low nibble = even column
        ex = (nib >> 1) & 3
        mb = nib & 1
        val = tl.where(ex == 0, mb, (2 + mb) << tl.maximum(ex - 1, 0)).to(tl.float32) * 0.5
        val = tl.where(nib >= 8, val * -1.0, val)  # -0.0 kept: Triton's -x is 0 - x
        val = tl.reshape(val, (BN, NG, 32))
        dot = tl.sum(val * tl.reshape(xv, (NG, 32))[None, :, :], axis=2)
        gi = k0 // 32 + tl.arange(0, NG)
        se = tl.load(s_ptr + slot * ss0 + r64[:, None] * ss1 + gi[None, :],
                     mask=nmask[:, None] & (gi[None, :] < NK // 32), other=127).to(tl.int32)
        scale = tl.where(se == 0, 5.877471754111438e-39, (se << 23).to(tl.float32, bitcast=True))
        return tl.sum(dot * scale, axis=1)

    @triton.jit
    def _gate_up_rows(x_ptr, idx_ptr, table_ptr, wg_ptr, sg_ptr, bg_ptr, wu_ptr, su_ptr, bu_ptr, h_ptr,
                      K: constexpr, H: constexpr, NI: constexpr, sx, q0, q1, s0, s1, b0, b1, sh,
                      BN: tl.constexpr, BK: tl.constexpr, F: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                      BR: tl.constexpr, VEC: tl.constexpr):
        # one program: routing slot s = t*K + k, gate/up output features n in [nb*BN, nb*BN + BN)
        s = tl.program_id(0)
        nb = tl.program_id(1)
        t = s // K
        e = tl.load(idx_ptr + s)
        slot = tl.load(table_ptr + e).to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        nmask = n < NI
        accg = tl.zeros([BN], dtype=tl.float32)
        accu = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < H
            xv = tl.load(x_ptr + t * sx + kk, mask=km, other=0.0).to(tl.float32)
            if VEC:  # MXFP4: whole bytes
                accg += _mxfp4_dot(wg_ptr, sg_ptr, slot, n, nmask, k0, xv, H, q0, q1, s0, s1, BN, BK)
                accu += _mxfp4_dot(wu_ptr, su_ptr, slot, n, nmask, k0, xv, H, q0, q1, s0, s1, BN, BK)
            else:
                m2 = nmask[:, None] & km[None, :]
                g = _wload(wg_ptr, sg_ptr, bg_ptr, slot, n[:, None], kk[None, :], m2, q0, q1, s0, s1, b0, b1,
                           F, BITS, GS, BR)
                u = _wload(wu_ptr, su_ptr, bu_ptr, slot, n[:, None], kk[None, :], m2, q0, q1, s0, s1, b0, b1,
                           F, BITS, GS, BR)
                accg += tl.sum(g * xv[None, :], axis=1)
                accu += tl.sum(u * xv[None, :], axis=1)
        h = accg / (1.0 + tl.exp(-accg)) * accu
        tl.store(h_ptr + s * sh + n, h, mask=nmask)

    @triton.jit
    def _down_dot(h_ptr, s, sh, wd_ptr, sd_ptr, bd_ptr, slot, n, nmask, NI: constexpr, q0, q1, s0, s1, b0, b1,
                  BN: tl.constexpr, BK: tl.constexpr, F: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                  BR: tl.constexpr, VEC: tl.constexpr):
        # down rows n of the expert in `slot` times routing slot s's hidden row h[s] (float32, NI wide): [BN]
        acc = tl.zeros([BN], dtype=tl.float32)
        for i0 in range(0, NI, BK):
            ii = i0 + tl.arange(0, BK)
            im = ii < NI
            hv = tl.load(h_ptr + s * sh + ii, mask=im, other=0.0)
            if VEC:  # MXFP4: whole bytes
                acc += _mxfp4_dot(wd_ptr, sd_ptr, slot, n, nmask, i0, hv, NI, q0, q1, s0, s1, BN, BK)
            else:
                d = _wload(wd_ptr, sd_ptr, bd_ptr, slot, n[:, None], ii[None, :], nmask[:, None] & im[None, :],
                           q0, q1, s0, s1, b0, b1, F, BITS, GS, BR)
                acc += tl.sum(d * hv[None, :], axis=1)
        return acc

    @triton.jit
    def _down_rows(h_ptr, w_ptr, idx_ptr, table_ptr, wd_ptr, sd_ptr, bd_ptr, y_ptr, K: constexpr, H: constexpr,
                   NI: constexpr, sh, q0, q1, s0, s1, b0, b1, sy,
                   BN: tl.constexpr, BK: tl.constexpr, F: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                   BR: tl.constexpr, VEC: tl.constexpr):
        # one program: routing slot s, output features n in [nb*BN, nb*BN + BN): y[s, n] = weight * down_e(h_s)
        # (float32); _sum_k then adds a token's K rows in routing order. Quantized experts: a program per
        # (slot, rows) keeps the GPU busy where one per (token, rows) looping over K waits on its loads.
        s = tl.program_id(0)
        nb = tl.program_id(1)
        n = nb * BN + tl.arange(0, BN)
        nmask = n < H
        e = tl.load(idx_ptr + s)
        slot = tl.load(table_ptr + e).to(tl.int64)
        wt = tl.load(w_ptr + s).to(tl.float32)
        acc = _down_dot(h_ptr, s, sh, wd_ptr, sd_ptr, bd_ptr, slot, n, nmask, NI, q0, q1, s0, s1, b0, b1,
                        BN, BK, F, BITS, GS, BR, VEC)
        tl.store(y_ptr + s.to(tl.int64) * sy + n, acc * wt, mask=nmask)

    @triton.jit(do_not_specialize=["TK", "E"])
    def _gate_up_blocks(x_ptr, rows_ptr, bexp_ptr, table_ptr, wg_ptr, sg_ptr, bg_ptr, wu_ptr, su_ptr, bu_ptr, h_ptr,
                        K: constexpr, TK, E, H: constexpr, NI: constexpr, sx, q0, q1, s0, s1, b0, b1, sh,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                        UPCAST: tl.constexpr, F: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                        BR: tl.constexpr):
        # one program: a block of BM routing slots of one expert, gate/up features [nb*BN, nb*BN + BN)
        b = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(bexp_ptr + b)
        if e >= E:  # past the last block of this routing
            return
        slot = tl.load(table_ptr + e).to(tl.int64)
        rows = tl.load(rows_ptr + b * BM + tl.arange(0, BM))
        rmask = rows < TK
        tok = (rows // K).to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        nmask = n < NI
        accg = tl.zeros([BM, BN], dtype=tl.float32)
        accu = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < H
            a = tl.load(x_ptr + tok[:, None] * sx + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            m2 = km[:, None] & nmask[None, :]
            g = _wload(wg_ptr, sg_ptr, bg_ptr, slot, n[None, :], kk[:, None], m2, q0, q1, s0, s1, b0, b1,
                       F, BITS, GS, BR)
            u = _wload(wu_ptr, su_ptr, bu_ptr, slot, n[None, :], kk[:, None], m2, q0, q1, s0, s1, b0, b1,
                       F, BITS, GS, BR)
            if UPCAST:  # the interpreter's tl.dot mistakes 16-bit floats
                a = a.to(tl.float32)
            else:  # tensor-core operands in the input's dtype (float weights come as they are stored)
                g, u = g.to(x_ptr.dtype.element_ty), u.to(x_ptr.dtype.element_ty)
            accg = tl.dot(a, g, accg, input_precision=PREC)
            accu = tl.dot(a, u, accu, input_precision=PREC)
        h = accg / (1.0 + tl.exp(-accg)) * accu
        tl.store(h_ptr + rows[:, None].to(tl.int64) * sh + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=rmask[:, None] & nmask[None, :])

    @triton.jit(do_not_specialize=["TK", "E"])
    def _down_blocks(h_ptr, w_ptr, rows_ptr, bexp_ptr, table_ptr, wd_ptr, sd_ptr, bd_ptr, y_ptr, TK, E,
                     H: constexpr, NI: constexpr, sh, q0, q1, s0, s1, b0, b1, sy,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                     UPCAST: tl.constexpr, F: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr):
        # one program: a block of BM routing slots of one expert, output features [nb*BN, nb*BN + BN)
        b = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(bexp_ptr + b)
        if e >= E:
            return
        slot = tl.load(table_ptr + e).to(tl.int64)
        rows = tl.load(rows_ptr + b * BM + tl.arange(0, BM))
        rmask = rows < TK
        r64 = rows.to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        nmask = n < H
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for i0 in range(0, NI, BK):
            ii = i0 + tl.arange(0, BK)
            im = ii < NI
            a = tl.load(h_ptr + r64[:, None] * sh + ii[None, :], mask=rmask[:, None] & im[None, :], other=0.0)
            d = _wload(wd_ptr, sd_ptr, bd_ptr, slot, n[None, :], ii[:, None], im[:, None] & nmask[None, :],
                       q0, q1, s0, s1, b0, b1, F, BITS, GS, BR)
            if UPCAST:
                a = a.to(tl.float32)
            else:
                d = d.to(h_ptr.dtype.element_ty)
            acc = tl.dot(a, d, acc, input_precision=PREC)
        wt = tl.load(w_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + r64[:, None] * sy + n[None, :], acc * wt[:, None], mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _sum_k(y_ptr, out_ptr, K: constexpr, H: constexpr, sy, so, BN: tl.constexpr):
        # one program: token t, features [nb*BN, nb*BN + BN): sum over k = 0..K-1 in routing order
        t = tl.program_id(0)
        nb = tl.program_id(1)
        n = nb * BN + tl.arange(0, BN)
        nmask = n < H
        acc = tl.zeros([BN], dtype=tl.float32)
        for j in range(0, K):
            acc += tl.load(y_ptr + (t * K + j).to(tl.int64) * sy + n, mask=nmask, other=0.0)
        tl.store(out_ptr + t.to(tl.int64) * so + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)


    @triton.jit
    def _rms_norm(x_ptr, w_ptr, out_ptr, D: constexpr, sx, so, eps, BD: tl.constexpr):
        # one program: one row; as RMSNorm.forward: float32 norm, rounded to x's dtype, times the weight
        r = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BD)
        m = d < D
        x = tl.load(x_ptr + r * sx + d, mask=m, other=0.0).to(tl.float32)
        h = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * so + d, (w * h).to(out_ptr.dtype.element_ty), mask=m)


if triton is not None:

    @triton.jit
    def _softmax_topk(l_ptr, w_ptr, i_ptr, E, sl, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                      RENORM: tl.constexpr):
        # one program: one token's router logits -> softmax (float32) -> the K largest, largest first (the
        # lowest expert id among equals) -> renormalized to sum 1 (RENORM)
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BE)
        m = e < E
        x = tl.load(l_ptr + t * sl + e, mask=m, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = tl.where(m, p, 0.0)
        prob = p / tl.sum(p, axis=0)
        vals = tl.where(m, prob, -1.0)
        kk = tl.arange(0, KP)
        top = tl.zeros([KP], dtype=tl.float32)
        ids = tl.zeros([KP], dtype=tl.int64)
        for j in tl.static_range(K):
            best = tl.max(vals, axis=0)
            at = tl.min(tl.where(vals == best, e, BE), axis=0)
            top = tl.where(kk == j, best, top)
            ids = tl.where(kk == j, at.to(tl.int64), ids)
            vals = tl.where(e == at, -1.0, vals)
        if RENORM:
            top = top / tl.sum(top, axis=0)
        km = kk < K
        tl.store(w_ptr + t * K + kk, top.to(w_ptr.dtype.element_ty), mask=km)
        tl.store(i_ptr + t * K + kk, ids, mask=km)


def softmax_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moestream.models.moe.softmax_topk` (Qwen3-MoE's router) in one launch: softmax over ``logits``
    [T, E] in float32, the ``top_k`` largest (largest first; the lowest id among equal ones), renormalized
    when ``norm_topk_prob``; ``(weights [T, K] in logits' dtype, ids [T, K] int64)``. The reductions are
    Triton's (the low bits of the weights may differ from PyTorch's; one form for every path on the GPU)."""
    t, e = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    w = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    idx = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _softmax_topk[(t,)](logits, w, idx, e, logits.stride(0), K=top_k, KP=triton.next_power_of_2(top_k),
                            BE=triton.next_power_of_2(e), RENORM=bool(norm_topk_prob), num_warps=1)
    return w, idx


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`moestream.models.layers.RMSNorm`'s function in one launch: ``weight * (x * rsqrt(mean(x^2) + eps))``
    over the last dimension, the norm in float32 and rounded to x's dtype before the weight multiplies
    (as transformers' ``Qwen3MoeRMSNorm``). ``x`` [..., D], ``weight`` [D]; the result in the promoted dtype
    of the two. The reduction order is Triton's, so the low bits may differ from PyTorch's; the same
    for every budget (the GPU uses this one everywhere once chosen)."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        bd = triton.next_power_of_2(d)
        _rms_norm[(x2.shape[0],)](x2, weight, out, d, x2.stride(0), out.stride(0), eps, BD=bd,
                                  num_warps=max(1, min(8, bd // 256)))
    return out.view(x.shape)


BLOCK_M = 16  # routing slots per block of the tl.dot kernels: one size for every call (see block_m)
BLOCK_N, BLOCK_K = 64, 128  # output features per program and the reduction's step, for every call (H200 sweep)
NUM_WARPS, NUM_STAGES = 4, 3  # the tl.dot kernels' launch (benchmarks/gpu_fused_sweep.py)


def block_m(t: int, k: int, e: int) -> int:
    """Rows per block of the tl.dot kernels: :data:`BLOCK_M` whatever the shapes, so that a slot's bits
    never depend on how many tokens share the call (a decode step, a prefill chunk of any length)."""
    return BLOCK_M


_ONE_ROW: dict[tuple, torch.Tensor] = {}


def one_row_blocks(tk: int, bm: int, device) -> torch.Tensor:
    """``rows`` for blocks of one routing slot each (a decode step through the tl.dot kernels): block ``b``
    holds slot ``b`` and padding (``tk``). Made once per (tk, bm, device)."""
    key = (tk, bm, str(device))
    rows = _ONE_ROW.get(key)
    if rows is None:
        rows = torch.full((tk, bm), tk, dtype=torch.int32)
        rows[:, 0] = torch.arange(tk, dtype=torch.int32)
        rows = _ONE_ROW[key] = rows.reshape(-1).to(device)
    return rows


def align_blocks(flat: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group routing slots into blocks of ``bm`` rows of one expert, on the device, with no host sync.

    Args:
        flat: int64 [T*K] expert ids in routing order (slot ``s = t*K + k``).
        num_experts: E (ids are in ``[0, E)``); bm: rows per block.

    Returns:
        ``rows`` int32 [B*bm]: each block's slot positions, ascending within an expert
        (``T*K`` marks padding); ``block_expert`` int64 [B]: the expert of each block, ``E``
        for the blocks past the end. ``B = ceil(T*K / bm) + min(E, T*K)``, a bound that
        depends only on the shapes, so the grid is fixed.
    """
    tk = flat.numel()
    dev = flat.device
    nblocks = -(-tk // bm) + min(num_experts, tk)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.index_add_(0, flat, torch.ones_like(flat))  # integer counts: exact whatever the order
    blocks = (counts + bm - 1) // bm
    block_end = torch.cumsum(blocks, 0)
    first_row = (block_end - blocks) * bm  # where each expert's first block starts, in rows
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, ascending within one
    sorted_e = flat[order]
    run_start = torch.cumsum(counts, 0) - counts
    dest = first_row[sorted_e] + torch.arange(tk, device=dev) - run_start[sorted_e]
    rows = torch.full((nblocks * bm,), tk, dtype=torch.int32, device=dev)
    rows[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(nblocks, device=dev), right=True)
    return rows, block_expert


def _rows_config(h: int, i: int) -> tuple[int, int, int, int]:
    """(BN, BK) of the gate/up row kernel and of the down row kernel: wide loads along the
    contiguous dimension, enough programs to fill the GPU for one token."""
    return 16, min(256, triton.next_power_of_2(h)), 8, min(1024, triton.next_power_of_2(i))


FLOAT, AFFINE, FP8, MXFP4 = 0, 1, 2, 3  # the kernels' weight formats (their FMT constant)
# decode block sizes for fp8, MXFP4 and 3/5/6-bit affine experts (rows per program, columns per step of
# gate/up and of down): more, smaller programs than for float experts, whose loads are wider (H200 sweep)
QUANT_ROWS = {"bn1": 8, "bk1": 512, "bn2": 16, "bk2": 256}
# the affine word kernels' decode launch: rows per program (bn), words of a row per step (wk: whole groups, at
# least one) and warps (w) of gate/up (1) and of down (2); one setting for every call (an H200 sweep at 4 bits,
# group 64, H 2048, I 768: benchmarks/gpu_quant.py --sweep-affine, docs/benchmarks.md)
AFFINE_ROWS = {"bn1": 8, "wk1": 128, "w1": 2, "bn2": 16, "wk2": 32, "w2": 1}
# what the kernels dequantize in registers: a stored format's registry entry (Scheme.format) names the bits
# (gpu_bits), _PROJ its projection


@dataclass(frozen=True)
class Proj:
    """One projection of every slot as the kernels read it (rows ``out`` x columns ``in`` per slot).

    ``q``: float weights [S, out, in] in the compute dtype (``fmt`` FLOAT), else the codes as bytes
    (uint8 [S, out, row bytes]: affine's bit stream, fp8 bytes, MXFP4 nibble pairs); ``s``/``b``:
    scales and biases [S, rows, groups] (affine), block scales [S, ceil(out/br), ceil(in/gs)]
    (fp8), e8m0 scales [S, out, in/32] (MXFP4); ``q`` again where a format has none (never read).
    ``bits``, ``gs`` (columns per scale), ``br`` (rows per fp8 scale block): the format's constants.
    """

    q: torch.Tensor
    s: torch.Tensor
    b: torch.Tensor
    fmt: int = FLOAT
    bits: int = 16
    gs: int = 1
    br: int = 1
    out_features: int = 0
    in_features: int = 0  # not q's last dimension where that holds the codes' bytes

    @classmethod
    def float(cls, w: torch.Tensor) -> "Proj":
        """A float weight view [S, out, in] (last two dimensions contiguous)."""
        if w.stride(-1) != 1 or w.stride(-2) != w.shape[-1]:
            raise ValueError("expert views must be contiguous in their last two dimensions")
        return cls(w, w, w, FLOAT, 16, 1, 1, w.shape[1], w.shape[2])

    def strides(self) -> tuple[int, ...]:
        """(slot, row) strides of q, s and b, in their elements."""
        return (self.q.stride(0), self.q.stride(1), self.s.stride(0), self.s.stride(1),
                self.b.stride(0), self.b.stride(1))

    def consts(self) -> dict:
        return dict(F=self.fmt, BITS=self.bits, GS=self.gs, BR=self.br)

    def affine_words(self) -> "Proj | None":
        """This projection with ``q`` as int32 words [S, out, in * bits / 32] for the decode kernels' word path
        (:func:`_gate_up_affine`, :func:`_down_affine`), else None: MLX affine 2, 4 or 8 bits whose group holds
        a power of 2 of whole words (32, 64 or 128 columns) and whose codes' rows are 4-byte aligned."""
        if self.fmt != AFFINE or self.bits not in (2, 4, 8) or self.gs not in (32, 64, 128):
            return None
        q = self.q
        if q.data_ptr() % 4 or q.stride(0) % 4 or q.stride(1) % 4 or q.shape[-1] % 4:
            return None
        return replace(self, q=q.view(torch.int32))

    def groups_per(self, words: int) -> int:
        """Groups in ``words`` int32 words of a row of affine codes (at least one): the word kernels' NG."""
        return max(1, words * (32 // self.bits) // self.gs)

    def rows(self, start: int, step: int) -> "Proj":
        """Every ``step``-th row from ``start`` (gpt-oss style interleaved ``gate_up``: gate the even rows)."""
        if self.fmt == FP8:  # a block scale would span gate and up rows
            raise ValueError("an interleaved gate_up in fp8 blocks is not a layout the kernels read")
        q = self.q[:, start::step]
        if self.fmt == FLOAT:
            s = b = q
        else:
            s = self.s[:, start::step]
            b = self.b[:, start::step] if self.fmt == AFFINE else s
        return replace(self, q=q, s=s, b=b, out_features=-(-(self.out_features - start) // step))


def gpu_format(scheme) -> str | None:
    """Why the kernels cannot read weights of ``scheme`` (a :class:`moestream.quant.formats.Scheme`),
    or None when they can (float, MLX affine 2-8 bits, fp8 e4m3 with block/channel/tensor scales, MXFP4)."""
    if scheme is None:
        return None
    fmt = scheme.format
    if fmt is None or fmt.name not in _PROJ or fmt.gpu_reason(scheme.bits) is not None:
        return f"{scheme.tag} weights have no GPU kernel (float, MLX affine 2-8 bit, fp8 e4m3 and MXFP4 do)"
    return None


def quant_proj(views: dict[str, torch.Tensor], lf) -> Proj:
    """The :class:`Proj` of linear ``lf`` (a :class:`moestream.quant.formats.LinearFormat`) from the slot
    pool's views (role -> [S, *piece shape]: ``gate``, ``gate.scales``, ``gate.biases``, ...).

    Raises:
        ValueError: a format the kernels do not read (see :func:`gpu_format`), or pieces whose shapes
            disagree with ``lf``.
    """
    role, sch, out_f, in_f = lf.role, lf.scheme, lf.out_features, lf.in_features
    why = gpu_format(sch)
    if why is not None:
        raise ValueError(f"{role}: {why}")
    w = views[role]
    if sch is None:
        return Proj.float(w)
    nslots = w.shape[0]
    q = w.view(torch.uint8).view(nslots, out_f, -1)  # the slot pool's views: contiguous within a slot
    return _PROJ[sch.format.name](views, role, sch, q, views[role + "." + sch.scale_param], out_f, in_f)


def _affine_proj(views, role, sch, q, sc, out_f, in_f) -> Proj:
    nslots = q.shape[0]
    if q.shape[-1] * 8 != in_f * sch.bits:
        raise ValueError(f"{role}: {q.shape[-1]} bytes per row do not hold {in_f} {sch.bits}-bit codes")
    bi = views[role + ".biases"]
    return Proj(q, sc.view(nslots, out_f, -1), bi.view(nslots, out_f, -1), AFFINE, sch.bits, sch.group_size, 1,
                out_f, in_f)


def _fp8_proj(views, role, sch, q, sc, out_f, in_f) -> Proj:
    br, bc = sch.block[0] or out_f, sch.block[1] or in_f
    sc = sc.reshape(q.shape[0], -(-out_f // br), -(-in_f // bc))  # a per-tensor [] or [1] too
    return Proj(q, sc, sc, FP8, 8, bc, br, out_f, in_f)


def _mxfp4_proj(views, role, sch, q, sc, out_f, in_f) -> Proj:
    sc = sc.view(q.shape[0], out_f, in_f // 32)  # MXFP4: blocks [out, in/32, 16] or packed [out, in/2]
    return Proj(q, sc, sc, MXFP4, 4, 32, 1, out_f, in_f)


# the GPU projection of each stored format the kernels read (registry name -> Proj of its slot views)
_PROJ = {"affine": _affine_proj, "fp8": _fp8_proj, "mxfp4": _mxfp4_proj}


def expert_projections(views: dict[str, torch.Tensor], fmt=None) -> tuple[Proj, Proj, Proj]:
    """(gate, up, down) :class:`Proj` of a SwiGLU layer's slots, for experts stored as ``fmt`` (a
    :class:`moestream.quant.formats.ExpertFormat`, None: float ``gate``/``up``/``down``). An
    interleaved ``gate_up`` (gpt-oss's layout) is read as its even (gate) and odd (up) rows.

    Raises:
        ValueError: from :func:`quant_proj`.
    """
    if fmt is None:
        return Proj.float(views["gate"]), Proj.float(views["up"]), Proj.float(views["down"])
    lin = fmt.linears
    if fmt.fused_gate_up:
        gu = quant_proj(views, lin["gate_up"])
        gate, up = gu.rows(0, 2), gu.rows(1, 2)
    else:
        gate, up = quant_proj(views, lin["gate"]), quant_proj(views, lin["up"])
        if gate.consts() != up.consts():
            raise ValueError(f"gate ({lin['gate'].scheme.tag if lin['gate'].scheme else 'float'}) and up "
                             f"({lin['up'].scheme.tag if lin['up'].scheme else 'float'}) must be stored alike "
                             "for the fused kernel")
    return gate, up, quant_proj(views, lin["down"])


def fused_moe(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, table: torch.Tensor,
              gate, up, down, out: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's routed SwiGLU experts from their slots, summed over k in routing order.

    Args:
        x: [T, H] expert input (bf16, fp16 or fp32), last dimension contiguous.
        weights: [T, K] routing weights (float32 or x's dtype); multiplied in float32.
        idx: [T, K] int64 (or int32) expert ids in routing order.
        table: int32 [E] on x's device: expert -> slot; every id in ``idx`` must map to a slot
            that holds that expert (the pipeline fetches the layer's experts first).
        gate, up: [S, I, H]; down: [S, H, I]: the slot pool's float views in x's dtype (any slot
            stride; the last two dimensions contiguous), or :class:`Proj` (quantized experts
            as stored: :func:`expert_projections`), dequantized in registers, never in memory.
        out: optional [T, H] output buffer in x's dtype.

    Returns:
        [T, H] in x's dtype: ``sum_k weights[t, k] * down(silu(gate x_t) * up x_t)``, accumulated
        in float32 over k = 0..K-1 and rounded once. Quantized weights are dequantized to float32
        (exact for fp8 and MXFP4; affine ``scale * q + bias`` in float32, or in decode for 2/4/8 bits
        ``scale * sum(q x) + bias * sum(x)`` per group); on the prefill path they then enter the
        tensor cores in x's dtype.

    Raises:
        RuntimeError: when Triton is missing (see :func:`available`).
        ValueError: weight shapes that do not fit the input's width.
    """
    if triton is None:
        raise RuntimeError("the fused MoE kernel needs Triton (pip install triton), which this PyTorch lacks")
    gate, up, down = (w if isinstance(w, Proj) else Proj.float(w) for w in (gate, up, down))
    t, h = x.shape
    k = idx.shape[1]
    i_, h2 = gate.out_features, gate.in_features
    if (h2 != h or (down.out_features, down.in_features) != (h, i_)
            or (up.out_features, up.in_features) != (i_, h)):
        raise ValueError(f"expert shapes gate {[i_, h2]}, up {[up.out_features, up.in_features]}, "
                         f"down {[down.out_features, down.in_features]} do not fit the input's width {h}")
    if out is None:
        out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    flat = idx.reshape(-1)
    wflat = weights.reshape(-1)
    tk = t * k
    gu = (gate.q, gate.s, gate.b, up.q, up.s, up.b)
    dn = (down.q, down.s, down.b)
    quant = gate.fmt != FLOAT or down.fmt != FLOAT
    if tk <= ROWS_MAX and quant:  # quantized decode: row kernels, affine 2/4/8 bits from whole words
        hbuf = torch.empty(tk, i_, dtype=torch.float32, device=x.device)
        y = torch.empty(tk, h, dtype=torch.float32, device=x.device)
        gw, uw, dw = gate.affine_words(), up.affine_words(), down.affine_words()
        ar = AFFINE_ROWS
        if gw is not None and uw is not None:
            _gate_up_affine[(tk, triton.cdiv(i_, ar["bn1"]))](
                x, flat, table, gw.q, gw.s, gw.b, uw.q, uw.s, uw.b, hbuf, k, h, i_, x.stride(0), *gw.strides(),
                hbuf.stride(0), BITS=gw.bits, GS=gw.gs, BN=ar["bn1"], NG=gw.groups_per(ar["wk1"]),
                num_warps=ar["w1"])
        else:
            bn1, bk1 = _rows_config(h, i_)[:2]
            if gate.fmt != FLOAT:
                bn1, bk1 = QUANT_ROWS["bn1"], min(QUANT_ROWS["bk1"], triton.next_power_of_2(h))
            _gate_up_rows[(tk, triton.cdiv(i_, bn1))](
                x, flat, table, *gu, hbuf, k, h, i_, x.stride(0), *gate.strides(), hbuf.stride(0),
                BN=bn1, BK=bk1, **gate.consts(), VEC=gate.fmt == MXFP4 and bk1 % 32 == 0, num_warps=4)
        if dw is not None:
            _down_affine[(tk, triton.cdiv(h, ar["bn2"]))](
                hbuf, wflat, flat, table, dw.q, dw.s, dw.b, y, k, h, i_, hbuf.stride(0), *dw.strides(),
                y.stride(0), BITS=dw.bits, GS=dw.gs, BN=ar["bn2"], NG=dw.groups_per(ar["wk2"]), num_warps=ar["w2"])
        else:
            bn2, bk2 = _rows_config(h, i_)[2:]
            if down.fmt != FLOAT:
                bn2, bk2 = QUANT_ROWS["bn2"], min(QUANT_ROWS["bk2"], triton.next_power_of_2(i_))
            _down_rows[(tk, triton.cdiv(h, bn2))](
                hbuf, wflat, flat, table, *dn, y, k, h, i_, hbuf.stride(0), *down.strides(), y.stride(0),
                BN=bn2, BK=bk2, **down.consts(), VEC=down.fmt == MXFP4 and bk2 % 32 == 0, num_warps=4)
        _sum_k[(t, triton.cdiv(h, 128))](y, out, k, h, y.stride(0), out.stride(0), BN=128, num_warps=4)
        return out
    e = table.numel()
    bm = block_m(t, k, e)
    flat = flat.to(torch.int64)
    if tk <= ROWS_MAX:  # a decode step: the same kernels, one slot per block (no grouping on the device)
        rows, bexp = one_row_blocks(tk, bm, x.device), flat
    else:
        rows, bexp = align_blocks(flat, e, bm)
    nblocks = bexp.numel()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    up16 = interpreted() and x.dtype != torch.float32
    bn, bk = BLOCK_N, BLOCK_K
    hbuf = torch.empty(tk, i_, dtype=x.dtype, device=x.device)
    _gate_up_blocks[(nblocks, triton.cdiv(i_, bn))](
        x, rows, bexp, table, *gu, hbuf, k, tk, e, h, i_, x.stride(0), *gate.strides(),
        hbuf.stride(0), BM=bm, BN=bn, BK=bk, PREC=prec, UPCAST=up16, **gate.consts(), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    y = torch.empty(tk, h, dtype=torch.float32, device=x.device)
    _down_blocks[(nblocks, triton.cdiv(h, bn))](
        hbuf, wflat, rows, bexp, table, *dn, y, tk, e, h, i_, hbuf.stride(0), *down.strides(),
        y.stride(0), BM=bm, BN=bn, BK=bk, PREC=prec, UPCAST=up16, **down.consts(), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    _sum_k[(t, triton.cdiv(h, 128))](y, out, k, h, y.stride(0), out.stride(0), BN=128, num_warps=4)
    return out


def reference_moe(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, experts: dict[int, dict]) -> torch.Tensor:
    """The same function in float64 on the CPU, expert by expert (the tests' independent reference).

    ``experts``: id -> {"gate" [I, H], "up" [I, H], "down" [H, I]}. Returns [T, H] float64.
    """
    xd = x.double().cpu()
    out = torch.zeros(xd.shape, dtype=torch.float64)
    for t in range(xd.shape[0]):
        for j in range(idx.shape[1]):
            w = experts[int(idx[t, j])]
            g = w["gate"].double().cpu() @ xd[t]
            u = w["up"].double().cpu() @ xd[t]
            out[t] += float(weights[t, j]) * (w["down"].double().cpu() @ (torch.nn.functional.silu(g) * u))
    return out
