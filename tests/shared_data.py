"""Where the shared data beside the checkout lives (real model configs, the Qwen3 tokenizer, bench texts).

``MOESTREAM_SHARED`` when set; else ``../shared`` beside the checkout; else ``/work/shared`` (a clone placed
elsewhere on the development machines)."""

import os
from pathlib import Path


def _find() -> Path:
    env = os.environ.get("MOESTREAM_SHARED")
    if env:
        return Path(env)
    for p in (Path(__file__).resolve().parents[2] / "shared", Path("/work/shared")):
        if (p / "models" / "configs").is_dir():
            return p
    return Path("/work/shared")


SHARED = _find()
CONFIGS = SHARED / "models" / "configs"
