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
* ``trained``: ``spread``, except the embedding, layer 0's token mixer and the routers,
  built so that routing reuses experts over time as trained models do
  (:mod:`moestream.synth_trained`; Qwen3-MoE, Qwen3-Next and Qwen3.5 MoE).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import INDEX_FILE, safetensors_dtype, shard_bytes
from .errors import ConfigError, MoestreamError
from .models import family_for
from .models.base import SynthTensor
from .synth_trained import TrainedInit
from .tokenizer import BUNDLED_QWEN3, TOKENIZER_FILES

INITS = ("spread", "plain", "trained")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_CONFIG_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def init_std(t: SynthTensor, init: str, layers: int) -> float | None:
    """Standard deviation of ``t`` under ``init``; None for constant tensors (norms, zeros)."""
    if t.init in ("norm", "zeros"):
        return None
    if init == "plain":
        return 0.02  # "spread" and "trained" (for the tensors it leaves as they are) from here
    if t.init == "embed":
        return 1.0
    if t.init == "out":
        return 0.02 / math.sqrt(2 * max(1, layers))
    return 0.02


def _tensor(t: SynthTensor, std: float | None, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    if std is None:
        return (torch.ones if t.init == "norm" else torch.zeros)(t.shape, dtype=dtype)
    g = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(t.name.encode()))
    x = torch.randn(t.shape, generator=g, dtype=torch.float32, device=device)
    return x.mul_(std).to(dtype).cpu()


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


@dataclass
class SynthPlan:
    """A checked synth job: the config to write, its tensors and sizes, the tokenizer source."""

    config: dict
    tensors: list[SynthTensor]
    dtype: str
    seed: int
    init: str
    shard_bytes: int
    tokenizer: Path

    @property
    def itemsize(self) -> int:
        return torch.tensor([], dtype=DTYPES[self.dtype]).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the checkpoint will hold."""
        return sum(math.prod(t.shape) for t in self.tensors) * self.itemsize


def plan_synth(
    config: str | Path | dict,
    layers: int | None = None,
    dtype: str = "bf16",
    seed: int = 0,
    tokenizer: str | Path | None = None,
    init: str = "spread",
    shard_gb: float = 5.0,
) -> SynthPlan:
    """Check every argument of :func:`synth` but ``out`` and ``progress`` (nothing is written) and plan the checkpoint.

    Raises:
        ConfigError: naming the config path, field or argument at fault.
    """
    where = "config" if isinstance(config, dict) else str(config)
    if isinstance(config, dict):
        cfg = dict(config)
    else:
        try:
            cfg = json.loads(Path(config).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{config}: cannot read a JSON config ({e})") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{config}: not a JSON object")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if init not in INITS:
        raise ConfigError(f"--init {init!r}: expected {', '.join(INITS)}")
    nbytes_shard = shard_bytes(shard_gb)
    src = Path(tokenizer) if tokenizer else BUNDLED_QWEN3
    if not (src.is_dir() and any((src / f).is_file() for f in TOKENIZER_FILES)):
        raise ConfigError(f"--tokenizer {src}: no tokenizer files there ({', '.join(TOKENIZER_FILES)})")
    family = family_for(cfg, where)
    if layers is not None:
        total = cfg.get("num_hidden_layers")
        if layers < 1 or (isinstance(total, int) and layers > total):
            raise ConfigError(f"--layers {layers}: must be between 1 and the config's {total} layers")
        cfg = family.synth_config(cfg, layers)
    for key in ("torch_dtype", "dtype"):
        if key in cfg or key == "torch_dtype":
            cfg[key] = _CONFIG_DTYPE[dtype]
    try:
        tensors = family.synth_tensors(cfg)
        if init == "trained":
            TrainedInit(cfg)  # refuses a family it is not made for
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return SynthPlan(cfg, tensors, dtype, seed, init, nbytes_shard, src)


def tensor_maker(plan: SynthPlan, device: str = "cpu") -> Callable[[SynthTensor], torch.Tensor]:
    """The function giving each planned tensor's values (in the plan's dtype): a function of the seed,
    the init and the tensor's name alone (and of ``device``, whose generator draws them)."""
    torch_dt = DTYPES[plan.dtype]
    # multimodal configs (Qwen3.5 MoE, Kimi K3) nest the decoder's fields under text_config
    layers = plan.config.get("num_hidden_layers") or plan.config.get("text_config", {}).get("num_hidden_layers", 1)
    trained = TrainedInit(plan.config) if plan.init == "trained" else None

    def make(t: SynthTensor) -> torch.Tensor:
        if trained is not None:
            x = trained.tensor(t, plan.seed)
            if x is not None:
                return x.to(torch_dt)
        return _tensor(t, init_std(t, plan.init, layers), torch_dt, plan.seed, device)

    return make


def write_synth(plan: SynthPlan, out: str | Path, progress: Callable[[int], None] | None = None,
                device: str = "cpu") -> Path:
    """Write the planned checkpoint into the new folder ``out``.

    ``device`` draws the random values there (``cuda``: a GPU's generator, tens of times faster for
    the benchmarks' full-size checkpoints; other values than the CPU's for the same seed).

    The folder is written as ``out.partial`` and renamed when complete, so an interrupted
    or failed run never leaves a half checkpoint under ``out`` (the partial folder is
    removed on failure). ``progress`` is called with the bytes of each tensor written.

    Raises:
        MoestreamError: ``out`` already exists or cannot be written.
    """
    out = Path(out)
    if out.exists():
        raise MoestreamError(f"{out}: already exists; remove it or choose another --out")
    tmp = out.with_name(out.name + ".partial")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        _write(plan, tmp, progress, device)
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise MoestreamError(f"{out}: cannot write the checkpoint: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write(plan: SynthPlan, folder: Path, progress: Callable[[int], None] | None, device: str = "cpu") -> None:
    torch_dt, itemsize = DTYPES[plan.dtype], plan.itemsize
    st_dtype = safetensors_dtype(torch_dt)
    shards = _plan_shards(plan.tensors, itemsize, plan.shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )

    make = tensor_maker(plan, device)
    weight_map = {}
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="moestream-synth") as pool:
        for shard, name in zip(shards, names):
            head, ordered = _header(shard, st_dtype, itemsize)
            with open(folder / name, "wb") as f:
                f.write(head)
                window = [pool.submit(make, t) for t in ordered[:2]]  # generate ahead while writing
                for i, t in enumerate(ordered):
                    data = window.pop(0).result()
                    if i + 2 < len(ordered):
                        window.append(pool.submit(make, ordered[i + 2]))
                    f.write(memoryview(data.contiguous().view(torch.uint8).numpy()))
                    weight_map[t.name] = name
                    if progress is not None:
                        progress(data.numel() * itemsize)
    if len(shards) > 1:
        index = {"metadata": {"total_size": plan.nbytes}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
    extra = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
    for f in sorted(plan.tokenizer.iterdir()):
        if f.name in TOKENIZER_FILES or f.name in extra:
            shutil.copyfile(f, folder / f.name)
    if not (folder / "tokenizer.json").is_file():
        # AutoTokenizer picks the tokenizer class by model_type for some families (qwen3_5_moe ->
        # Qwen3_5Tokenizer), and such a class reads only tokenizer.json: write it from vocab and merges
        from transformers import AutoTokenizer

        backend = getattr(AutoTokenizer.from_pretrained(str(plan.tokenizer), local_files_only=True),
                          "backend_tokenizer", None)
        if backend is not None:
            backend.save(str(folder / "tokenizer.json"))


def synth(config: str | Path | dict, out: str | Path, *args, progress: Callable[[int], None] | None = None,
          **kwargs) -> Path:
    """Write a random-weight checkpoint of ``config``'s shapes into the new folder ``out``.

    ``layers``, ``dtype``, ``seed``, ``tokenizer``, ``init`` and ``shard_gb`` (by position after ``out``, or by
    name) go to :func:`plan_synth`, whose defaults they take.

    Args:
        config: a config.json path (or its parsed dict) of a supported family.
        out: the folder to create (see :func:`write_synth`).
        layers: keep only the first ``layers`` decoder layers (default: all).
        dtype: ``bf16``, ``fp16`` or ``fp32``.
        seed: weights are a function of (seed, tensor name) alone.
        tokenizer: folder whose tokenizer files are copied as they are (default: the
            bundled Qwen3 tokenizer).
        init: ``spread``, ``plain`` or ``trained`` (see the module docstring).
        shard_gb: shard size in GB (10^9 bytes), as Hugging Face shards (about 5 GB).
        progress: called with the bytes of each tensor written.

    Returns:
        The checkpoint folder.

    Raises:
        ConfigError: a bad config, dtype, init, layer count, shard size or tokenizer folder.
        MoestreamError: ``out`` already exists or cannot be written.
    """
    return write_synth(plan_synth(config, *args, **kwargs), out, progress)
