"""The blockwise Hadamard transform turboquant builds rotate their inputs with (MLX's ``hadamard_transform``).

Pure math on tensors: the Sloane matrices H_m (m = 12, 20, 28) as MLX stores them, the block size of a
width, and the orthonormal transform (Sylvester butterflies, then H_m, then 1/sqrt(B)). Used by
:mod:`.turboquant` (the reference path) and :mod:`.native` (the kernels' rotation, bit for bit the same).
"""

from __future__ import annotations

import functools
import math

import torch

# Hadamard matrices of orders 12, 20 and 28 as MLX uses them (mlx/backend/common/hadamard.h,
# from N. J. A. Sloane's library of Hadamard matrices): row j, character i is H_m[j][i].
_SLOANE = {
    12: """
+-++++++++++
--+-+-+-+-+-
+++-++----++
+---+--+-++-
+++++-++----
+-+---+--+-+
++--+++-++--
+--++---+--+
++----+++-++
+--+-++---+-
++++----+++-
+-+--+-++---
""",
    20: """
+----+----++--++-++-
-+----+---+++---+-++
--+----+---+++-+-+-+
---+----+---+++++-+-
----+----++--++-++-+
-+++++-----+--+++--+
+-+++-+---+-+--+++--
++-++--+---+-+--+++-
+++-+---+---+-+--+++
++++-----++--+-+--++
--++-+-++-+-----++++
---++-+-++-+---+-+++
+---++-+-+--+--++-++
++---++-+----+-+++-+
-++---++-+----+++++-
-+--+--++-+----+----
+-+-----++-+----+---
-+-+-+---+--+----+--
--+-+++------+----+-
+--+--++------+----+
""",
    28: """
+------++----++-+--+-+--++--
-+-----+++-----+-+--+-+--++-
--+-----+++---+-+-+----+--++
---+-----+++---+-+-+-+--+--+
----+-----+++---+-+-+++--+--
-----+-----++++--+-+--++--+-
------++----++-+--+-+--++--+
--++++-+-------++--+++-+--+-
---++++-+-----+-++--+-+-+--+
+---+++--+----++-++--+-+-+--
++---++---+----++-++--+-+-+-
+++---+----+----++-++--+-+-+
++++--------+-+--++-++--+-+-
-++++--------+++--++--+--+-+
-+-++-++--++--+--------++++-
+-+-++--+--++--+--------++++
-+-+-++--+--++--+----+---+++
+-+-+-++--+--+---+---++---++
++-+-+-++--+------+--+++---+
-++-+-+-++--+------+-++++---
+-++-+---++--+------+-++++--
-++--++-+-++-+++----++------
+-++--++-+-++-+++-----+-----
++-++---+-+-++-+++-----+----
-++-++-+-+-+-+--+++-----+---
--++-++++-+-+----+++-----+--
+--++-+-++-+-+----+++-----+-
++--++-+-++-+-+----++------+
""",
}


@functools.lru_cache(maxsize=None)
def _sloane(m: int) -> torch.Tensor:
    return sloane_matrix(m)


def sloane_matrix(m: int) -> torch.Tensor:
    """H_m (m in 12, 20, 28) as a float32 [m, m] tensor of +-1, rows as MLX stores them."""
    rows = _SLOANE[m].split()
    return torch.tensor([[1.0 if c == "+" else -1.0 for c in r] for r in rows], dtype=torch.float32)


def block_size(n: int) -> tuple[int, int]:
    """(B, m): the largest ``B = m * 2^k`` (m in 1, 12, 20, 28) dividing ``n``, and its m.

    Examples: 2048 -> (2048, 1), 6656 -> (512, 1), 2880 -> (320, 20).
    """
    best = (1, 1)
    for m in (1, 12, 20, 28):
        if n % m:
            continue
        b = m
        while n % (2 * b) == 0:
            b *= 2
        if b > best[0]:
            best = (b, m)
    return best


def blockwise_hadamard(x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """The orthonormal blockwise Hadamard transform of ``x`` [..., n] along its last dim, in float32.

    Each contiguous block of ``B`` values (:func:`block_size`) is viewed as m rows of 2^k
    (row-major); each row gets the unscaled Sylvester transform (butterflies ``(a, b) ->
    (a + b, a - b)`` at strides 1, 2, 4, ...: ``H[i, j] = (-1)^popcount(i & j)``), then each
    column is mixed by ``H_m`` (summed i = 0..m-1 in order), then everything is multiplied
    by ``fp32(1 / sqrt(B))``, as MLX's ``hadamard_transform``. ``transpose``: apply ``H^T``
    (``H_m^T``; Sylvester is symmetric), the inverse, used to un-rotate weights.
    """
    n = x.shape[-1]
    b, m = block_size(n)
    p = b // m
    v = x.float().reshape(-1, n // b, m, p)
    h = 1
    while h < p:  # Sylvester butterflies, stage h = 1, 2, 4, ...
        v = v.reshape(*v.shape[:3], p // (2 * h), 2, h)
        a, c = v[..., 0, :], v[..., 1, :]
        v = torch.stack((a + c, a - c), -2).reshape(*v.shape[:3], p)
        h *= 2
    if m > 1:
        hm = _sloane(m)
        if transpose:
            hm = hm.t()
        # out[j] = sum_i H_m[j][i] v[i], accumulated i = 0..m-1 (multiplying by +-1 is exact)
        acc = hm[:, 0, None] * v[:, :, :1]
        for i in range(1, m):
            acc = acc + hm[:, i, None] * v[:, :, i : i + 1]
        v = acc
    scale = torch.tensor(1.0 / math.sqrt(b), dtype=torch.float32)
    return (v * scale).reshape(x.shape)
