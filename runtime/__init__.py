"""TALE runtime: load a tale-convert artifact and generate with the token-adaptive lazy cache."""

from .artifact import ArtifactError, Level, Schedule
from .cache import TaleLayerCache, latent_attention
from .load import load, new_cache, resolve, set_output_path, use_kernels
from .model import TaleAttention, TaleCache
from .static_cache import StaticTaleCache

__version__ = "0.1.0"
__all__ = [
    "ArtifactError",
    "Level",
    "Schedule",
    "StaticTaleCache",
    "TaleAttention",
    "TaleCache",
    "TaleLayerCache",
    "latent_attention",
    "load",
    "new_cache",
    "resolve",
    "set_output_path",
    "use_kernels",
]
