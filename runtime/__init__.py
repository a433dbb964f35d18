"""TALE runtime: load a tale-convert artifact and generate with the token-adaptive lazy cache."""

from . import backends
from .artifact import ArtifactError, Level, Schedule
from .attention import latent_attention
from .cache import TaleLayerCache
from .load import load, new_cache, resolve, set_backend, set_output_path
from .model import TaleAttention, TaleCache, cache_arg
from .spec import Arch, CacheSpec, TaleSpec
from .static_cache import StaticTaleCache

__version__ = "0.1.0"
__all__ = [
    "Arch",
    "ArtifactError",
    "CacheSpec",
    "TaleSpec",
    "backends",
    "Level",
    "Schedule",
    "StaticTaleCache",
    "TaleAttention",
    "TaleCache",
    "TaleLayerCache",
    "cache_arg",
    "latent_attention",
    "load",
    "new_cache",
    "resolve",
    "set_backend",
    "set_output_path",
]
