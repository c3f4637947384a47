"""Loading: a checkpoint becomes a ready model with resident weights, an expert store and
an expert cache (and, when asked, its tokenizer).

``load()`` ties the layers together in their one-way order: checkpoint -> expert layout
-> expert store -> expert cache -> family model.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from types import ModuleType

import torch

from .cache import ExpertCache, parse_budget
from .checkpoint import Checkpoint, resolve_model
from .errors import BudgetError, CheckpointError, ConfigError, LayoutError
from .layout import ExpertLayout, discover_experts
from .memory import available_bytes
from .models import family_for
from .models.base import CausalLM, checkpoint_dtype, load_resident, resident_nbytes
from .store import ExpertStore

GB = 1e9
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def progress_bar(total: int, desc: str, enabled: bool | None = None):
    """A tqdm byte-progress bar shown only on a terminal (``enabled=None``)."""
    from tqdm.auto import tqdm

    disable = (not sys.stderr.isatty()) if enabled is None else not enabled
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=disable, leave=False)


@dataclass
class Engine:
    """A loaded streamed model.

    Attributes:
        checkpoint, layout, store, cache, model: the layers, in data-flow order.
        family: the family module; dtype: compute dtype; device: compute device.
        resident_bytes: bytes of weights held in memory besides the expert cache.
        load_seconds: wall time of :func:`load` (tokenizer included).
        tokenizer: a transformers tokenizer, or None when loaded without one.
        unused_tensors: checkpoint tensors the model does not use (reported once).
    """

    checkpoint: Checkpoint
    layout: ExpertLayout
    store: ExpertStore
    cache: ExpertCache
    model: CausalLM
    family: ModuleType
    dtype: torch.dtype
    device: torch.device
    resident_bytes: int
    load_seconds: float = 0.0
    tokenizer: object = None
    unused_tensors: list[str] = field(default_factory=list)

    def close(self) -> None:
        """Stop reader threads and close shard files."""
        self.store.close()
        self.checkpoint.close()


def _check_layout(model: CausalLM, layout: ExpertLayout, where) -> dict[int, int]:
    blocks = {b.layer: b for b in model.moe_blocks()}
    if set(blocks) != set(layout.layers):
        raise LayoutError(
            f"{where}: the config makes layers {sorted(blocks)} MoE layers, but the checkpoint holds routed "
            f"experts for layers {sorted(layout.layers)}"
        )
    inter, hidden = model.expert_shape()
    for i, lay in layout.layers.items():
        want = blocks[i].gate.weight.shape[0]
        if lay.num_experts != want:
            raise LayoutError(f"{where}: {lay.block} holds {lay.num_experts} experts; the config says {want}")
        gate = lay.experts[0][0]
        if tuple(gate.shape) != (inter, hidden):
            raise LayoutError(
                f"{where}: {lay.block} experts have gate shape {list(gate.shape)}; "
                f"the config implies [{inter}, {hidden}]"
            )
    return {i: lay.num_experts for i, lay in layout.layers.items()}


def load(
    model: str | os.PathLike,
    cache_budget_gb: str | float | None = 3,
    workers: int = 8,
    device: str = "cpu",
    dtype: str = "auto",
    tokenizer: bool = True,
    progress: bool | None = None,
) -> Engine:
    """Open a checkpoint and make it ready to generate.

    Args:
        model: a checkpoint folder or a Hugging Face Hub id.
        cache_budget_gb: expert cache budget in GB (10^9 bytes), or ``"all"`` / None to
            keep every expert resident (preloaded here).
        workers: reader threads for expert reads.
        device: compute device (``"cpu"``).
        dtype: compute dtype (``"auto"``: the checkpoint's embedding dtype; or bf16, fp16, fp32).
        tokenizer: also load the checkpoint's tokenizer.
        progress: show progress bars (None: only on a terminal).

    Raises:
        CheckpointError, ConfigError, LayoutError, BudgetError: with the file, field or
            numbers at fault.
    """
    t0 = time.perf_counter()
    budget = parse_budget(cache_budget_gb)
    ckpt = Checkpoint(resolve_model(model))
    try:
        family = family_for(ckpt.config, str(ckpt.path / "config.json"))
        args = family.ModelArgs.from_config(ckpt.config)
        layout = discover_experts(ckpt.tensors)
        if dtype == "auto":
            compute_dtype = checkpoint_dtype(ckpt)
        elif dtype in _DTYPES:
            compute_dtype = _DTYPES[dtype]
        else:
            raise ConfigError(f"--dtype {dtype!r}: expected auto, bf16, fp16 or fp32")
        dev = torch.device(device)
        with torch.device("meta"):
            net = family.Model(args)
        num_experts = _check_layout(net, layout, ckpt.path)
        resident_names = [n for n, _ in net.named_parameters()]
        total = sum(ckpt.tensors[n].nbytes for n in resident_names if n in ckpt.tensors)
        with progress_bar(total, "loading resident weights", progress) as bar:
            unused = load_resident(net, ckpt, layout.expert_tensors, compute_dtype, bar.update)
        net.to(dev).eval()
        store = ExpertStore(ckpt, layout, compute_dtype, dev, workers)
        cache = ExpertCache(store, budget, num_experts)
        for block in net.moe_blocks():
            block.attach(cache)
        resident = resident_nbytes(net)
        if budget is None:
            need = layout.total_bytes
            avail = available_bytes()
            if need > avail:
                raise BudgetError(
                    f"--cache-budget-gb all needs {need / GB:.2f} GB for every expert, but only {avail / GB:.2f} GB "
                    f"of memory is available to this process (resident weights already take {resident / GB:.2f} GB); "
                    "give a budget in GB instead"
                )
            keys = [(i, e) for i, lay in layout.layers.items() for e in range(lay.num_experts)]
            with progress_bar(need, "preloading every expert", progress) as bar:
                cache.preload(keys, bar.update)
        tok = None
        if tokenizer:
            from .tokenizer import load_tokenizer

            tok = load_tokenizer(ckpt.path)
        return Engine(
            checkpoint=ckpt, layout=layout, store=store, cache=cache, model=net, family=family,
            dtype=compute_dtype, device=dev, resident_bytes=resident,
            load_seconds=time.perf_counter() - t0, tokenizer=tok, unused_tensors=unused,
        )
    except BaseException:
        ckpt.close()
        raise


__all__ = ["Engine", "load", "CheckpointError"]
