"""``moestream synth``: write a Hugging Face checkpoint of a real config's shapes with random weights.

No model can be downloaded on the machines this project is built on, so tests and
benchmarks stream checkpoints made here. The writer never holds the model in memory: it
plans every shard's safetensors header from the shapes alone, then generates and
writes one tensor at a time (two tensors are generated in parallel, in order).

Initializations (``--init``):

* ``spread`` (default): embedding rows of unit variance; projections back into the
  residual stream (attention ``o_proj``, expert and shared-expert ``down_proj``) at std
  0.02/sqrt(2 x layers), GPT-2's scaled initialization (Radford et al. 2019); norms 1;
  everything else, routers included, std 0.02. Measured on the Qwen3-30B-A3B shape,
  routing then stays near uniform through all layers, as in a load-balanced trained
  model: the hard case for a cache, hence the honest default.
* ``plain``: every weight at std 0.02 (norms 1). Routing collapses onto a few experts
  with depth, which flatters any cache; kept for comparison.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .checkpoint import INDEX_FILE, safetensors_dtype
from .errors import ConfigError, MoestreamError
from .models import family_for
from .models.base import SynthTensor
from .tokenizer import BUNDLED_QWEN3, TOKENIZER_FILES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_CONFIG_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def init_std(t: SynthTensor, init: str, layers: int) -> float | None:
    """Standard deviation of ``t`` under ``init``; None for constant tensors (norms, zeros)."""
    if t.init in ("norm", "zeros"):
        return None
    if init == "plain":
        return 0.02
    if t.init == "embed":
        return 1.0
    if t.init == "out":
        return 0.02 / math.sqrt(2 * max(1, layers))
    return 0.02


def _tensor(t: SynthTensor, std: float | None, dtype: torch.dtype, seed: int) -> torch.Tensor:
    if std is None:
        return (torch.ones if t.init == "norm" else torch.zeros)(t.shape, dtype=dtype)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(t.name.encode()))
    x = torch.randn(t.shape, generator=g, dtype=torch.float32)
    return x.mul_(std).to(dtype)


def _plan_shards(tensors: list[SynthTensor], itemsize: int, shard_bytes: int) -> list[list[SynthTensor]]:
    shards, current, size = [], [], 0
    for t in tensors:
        n = math.prod(t.shape) * itemsize
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += n
    if current:
        shards.append(current)
    return shards


def _header(tensors: list[SynthTensor], st_dtype: str, itemsize: int) -> tuple[bytes, list[SynthTensor]]:
    """The safetensors header of a shard, tensors ordered by name as the safetensors library writes them."""
    ordered = sorted(tensors, key=lambda t: t.name)
    header, pos = {}, 0
    for t in ordered:
        n = math.prod(t.shape) * itemsize
        header[t.name] = {"dtype": st_dtype, "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, ordered


def synth(
    config: str | Path | dict,
    out: str | Path,
    layers: int | None = None,
    dtype: str = "bf16",
    seed: int = 0,
    tokenizer: str | Path | None = None,
    init: str = "spread",
    shard_gb: float = 5.0,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write a random-weight checkpoint of ``config``'s shapes into the folder ``out``.

    Args:
        config: a config.json path (or its parsed dict) of a supported family.
        out: the folder to create; it is written as ``out.partial`` and renamed when
            complete, so an interrupted run never leaves a half checkpoint under ``out``.
        layers: keep only the first ``layers`` decoder layers (default: all).
        dtype: ``bf16``, ``fp16`` or ``fp32``.
        seed: weights are a function of (seed, tensor name) alone.
        tokenizer: folder whose tokenizer files are copied as they are (default: the
            bundled Qwen3 tokenizer).
        init: ``spread`` or ``plain`` (see the module docstring).
        shard_gb: shard size in GB (10^9 bytes), as Hugging Face shards (about 5 GB).
        progress: called with the bytes of each tensor written.

    Returns:
        The checkpoint folder.

    Raises:
        ConfigError: a bad config, dtype, init or layer count.
        MoestreamError: ``out`` already exists.
    """
    if isinstance(config, dict):
        cfg = dict(config)
    else:
        try:
            cfg = json.loads(Path(config).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{config}: cannot read a JSON config ({e})") from None
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if init not in ("spread", "plain"):
        raise ConfigError(f"--init {init!r}: expected spread or plain")
    family = family_for(cfg, str(config) if not isinstance(config, dict) else "config")
    if layers is not None:
        total = cfg.get("num_hidden_layers")
        if layers < 1 or (isinstance(total, int) and layers > total):
            raise ConfigError(f"--layers {layers}: must be between 1 and the config's {total} layers")
        cfg = family.synth_config(cfg, layers)
    for key in ("torch_dtype", "dtype"):
        if key in cfg or key == "torch_dtype":
            cfg[key] = _CONFIG_DTYPE[dtype]
    tensors = family.synth_tensors(cfg)
    n_layers = cfg["num_hidden_layers"]
    torch_dt = DTYPES[dtype]
    st_dtype, itemsize = safetensors_dtype(torch_dt), torch.tensor([], dtype=torch_dt).element_size()

    out = Path(out)
    if out.exists():
        raise MoestreamError(f"{out}: already exists; remove it or choose another --out")
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    shards = _plan_shards(tensors, itemsize, int(shard_gb * 1e9))
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="moestream-synth") as pool:
        for shard, name in zip(shards, names):
            head, ordered = _header(shard, st_dtype, itemsize)
            with open(tmp / name, "wb") as f:
                f.write(head)
                make = lambda t: _tensor(t, init_std(t, init, n_layers), torch_dt, seed)  # noqa: E731
                window = [pool.submit(make, t) for t in ordered[:2]]
                for i, t in enumerate(ordered):
                    data = window.pop(0).result()
                    if i + 2 < len(ordered):
                        window.append(pool.submit(make, ordered[i + 2]))
                    f.write(memoryview(data.contiguous().view(torch.uint8).numpy()))
                    weight_map[t.name] = name
                    if progress is not None:
                        progress(data.numel() * itemsize)
    if len(shards) > 1:
        total_size = sum(math.prod(t.shape) * itemsize for t in tensors)
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    src = Path(tokenizer) if tokenizer else BUNDLED_QWEN3
    copied = 0
    extra = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
    for f in sorted(src.iterdir()) if src.is_dir() else []:
        if f.name in TOKENIZER_FILES or f.name in extra:
            shutil.copyfile(f, tmp / f.name)
            copied += 1
    if not copied:
        shutil.rmtree(tmp)
        raise ConfigError(f"--tokenizer {src}: no tokenizer files there")
    tmp.rename(out)
    return out


def synth_nbytes(config: dict, layers: int | None, dtype: str) -> int:
    """Bytes of tensor data :func:`synth` would write for ``config`` (for planning disk use)."""
    family = family_for(config)
    cfg = family.synth_config(config, layers) if layers else config
    itemsize = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    return sum(math.prod(t.shape) for t in family.synth_tensors(cfg)) * itemsize
