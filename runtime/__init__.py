"""TALE runtime: load a tale-convert artifact and generate with the token-adaptive lazy cache.

The names below are imported on first use (PEP 562): `tale-run --help` and the other CLIs' option checks start
without importing torch and transformers.
"""

from __future__ import annotations

from .lazy import lazy_exports

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "Arch": "spec",
    "ArtifactError": "artifact",
    "Output": "textgen",
    "RunOptions": "textgen",
    "CacheSpec": "spec",
    "Level": "artifact",
    "RegionStore": "cache",
    "Schedule": "artifact",
    "StaticTaleCache": "static_cache",
    "TaleAttention": "model",
    "TaleCache": "model",
    "TaleLayerCache": "cache",  # RegionStore's former name
    "TaleSpec": "spec",
    "cache_arg": "model",
    "chat": "textgen",
    "generate_text": "textgen",
    "latent_attention": "attention",
    "load": "load",
    "new_cache": "load",
    "resolve": "load",
    "set_backend": "load",
    "set_output_path": "load",
    "set_prefill_chunk": "model",
}
__all__ = sorted([*_EXPORTS, "backends"])


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, submodules=("backends",))
