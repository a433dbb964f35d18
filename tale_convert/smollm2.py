"""The embedded default model, SmolLM2-135M-Instruct: the names other modules import (tale_convert.bundled holds
the code for every bundled model)."""

from __future__ import annotations

from pathlib import Path

from .bundled import SMOLLM2, cache_root

__all__ = ["ALIAS", "HUB_ID", "SUBDIR", "cache_root", "gguf_path", "smollm2_dir"]

ALIAS = SMOLLM2.alias
HUB_ID = SMOLLM2.hub_id
SUBDIR = SMOLLM2.subdir


def gguf_path() -> Path:
    return SMOLLM2.gguf_file()


def smollm2_dir() -> Path:
    """The checkpoint directory, built once per machine (~20 s) and cached."""
    return SMOLLM2.path()
