"""Decode-attention backends: one interface, one registry, one choice per cache.

A backend computes latent attention of the new tokens over a cache's region view (regions.LayerView):

    z = backend(q, k_new, h_new, view, scaling, window)   # q [B, H, T, n], k_new [B, K, T, n],
                                                           # h_new [B, G, T, R] -> z [B, T, H, R] float32

and says, before any cache exists, whether it serves a cache of a given CacheSpec (`supports` -> None, or the reason
it does not). `choose` asks the registered backends, fastest first, when a cache is made; the cache carries the one
chosen, and its static layout follows from it (`layout`: "row" or "frag", runtime/frag.py). Nobody else decides.

The torch reference is registered here and serves everything. Kernels live in other packages and register
themselves through the entry-point group "tale_runtime.backends" (tale_kernels does: kernels/plugin.py): the runtime
names no kernel module. A backend may also offer accelerated cache writes (`ops`, see `op`).

A call of more than one new token (a prefill chunk after a prefix) always runs on the reference: the kernels are
decode kernels. Backends must not sync with the host on a decode step: a static cache's step is a CUDA graph.

No decode step runs on anything slower than the backend the cache names without saying so. What a backend cannot
serve is refused from the spec, when the cache is made (`supports`); a kernel's entry point refuses a decode step it
cannot serve (ValueError) instead of running the reference in its name. What only the call shows (`declines`: the
queries' dtype, the device of a layer) runs on the reference, and the cache counts it (`ReferenceCalls`): a warning
the first time, and tale-run's stats line beside the backend's name.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from .spec import CacheSpec

ENTRY_POINTS = "tale_runtime.backends"


@dataclass(frozen=True)
class AttentionBackend:
    """name: what users pass (`load(backend=...)`, `tale-run --backend`); label: what the stats line prints;
    priority: higher is tried first by "auto"; layout: the static cache layout it reads; config: its tuning knobs
    (one object, the backend's own dataclass; `configure` replaces it)."""

    name: str
    label: str
    priority: int = 0
    layout: str = "row"
    config: object | None = None
    auto: bool = True  # "auto" may pick it (False: only by name)

    def supports(self, spec: CacheSpec) -> str | None:
        """None if this backend serves a cache of `spec`, else a one-line reason."""
        return None

    def declines(self, q, k_new, h_new, view) -> str | None:
        """Why this backend does not serve this decode call of a cache it accepted (a condition of the call that its
        spec cannot show: the queries' dtype, the device of a layer), else None. The cache then runs the call on the
        torch reference and counts it (CacheStep.attend). Everything the spec decides belongs in `supports`."""
        return None

    def run(self, q, k_new, h_new, view, scaling: float, window: int | None) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, q, k_new, h_new, view, scaling: float, window: int | None = None) -> torch.Tensor:
        if q.shape[2] != 1:  # a chunk of several new tokens: the decode kernels take one
            return TORCH.run(q, k_new, h_new, view, scaling, window)
        return self.run(q, k_new, h_new, view, scaling, window)

    def configure(self, config) -> AttentionBackend:
        if config is not None and self.config is not None and type(config) is not type(self.config):
            raise ValueError(f"backend {self.name!r} takes a {type(self.config).__name__}, not {type(config).__name__}")
        if config is not None and self.config is None:
            raise ValueError(f"backend {self.name!r} takes no configuration")
        return self if config is None else replace(self, config=config)

    def describe(self, layout: str) -> str:
        """The stats line's name of this backend over a cache of `layout`."""
        return self.label + (" (fragment layout)" if layout == "frag" else "")


@dataclass(frozen=True)
class TorchReference(AttentionBackend):
    name: str = "torch"
    label: str = "torch reference"

    def run(self, q, k_new, h_new, view, scaling, window):
        from .attention import latent_attention

        return latent_attention(q, k_new, h_new, view, scaling, window)


TORCH = TorchReference()


@dataclass
class ReferenceCalls:
    """A cache's decode attention calls (one per layer and step) and, per reason, those its backend handed to the torch
    reference (`AttentionBackend.declines`). A CUDA graph replays its captured calls: graph decoders add them per
    replay (`add`)."""

    calls: int = 0
    reference: Counter = field(default_factory=Counter)

    def count(self, backend: AttentionBackend, why: str | None) -> None:
        self.calls += 1
        if why is None:
            return
        if not self.reference[why]:
            msg = f"attention backend {backend.name!r}: a decode call it does not serve runs on the torch reference: {why}"
            warnings.warn(msg, stacklevel=3)
        self.reference[why] += 1

    def copy(self) -> ReferenceCalls:
        return ReferenceCalls(self.calls, Counter(self.reference))

    def since(self, before: ReferenceCalls) -> ReferenceCalls:
        """The calls counted after `before` (a copy taken earlier)."""
        return ReferenceCalls(self.calls - before.calls, self.reference - before.reference)

    def add(self, other: ReferenceCalls) -> None:
        self.calls += other.calls
        self.reference.update(other.reference)

    def restore(self, before: ReferenceCalls) -> None:
        self.calls, self.reference = before.calls, Counter(before.reference)

    def note(self) -> str:
        """What the stats line adds to the backend's name: '' when every decode call ran on the backend."""
        if not self.reference:
            return ""
        many = len(self.reference) > 1
        why = "; ".join(f"{r} ({n} call{'s' if n > 1 else ''})" if many else r for r, n in self.reference.items())
        return f"{sum(self.reference.values())} of {self.calls} decode calls ran the torch reference: {why}"


@dataclass
class _Registry:
    backends: dict[str, AttentionBackend] = field(default_factory=dict)
    ops: dict[str, object] = field(default_factory=dict)
    discovered: bool = False


_REG = _Registry(backends={TORCH.name: TORCH})


def register(backend: AttentionBackend, ops: dict | None = None) -> None:
    """Add (or replace) a backend by name; `ops` adds accelerated cache writes by name (see `op`)."""
    _REG.backends[backend.name] = backend
    _REG.ops.update(ops or {})


def _discover() -> None:
    """Import the registered plugins once (entry points of the installed distributions). A plugin that fails to
    import (Triton missing, a broken install) is skipped with a warning: the reference still serves."""
    if _REG.discovered:
        return
    _REG.discovered = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        try:
            ep.load()()
        except ImportError:
            pass  # an optional stack not installed (Triton on a CPU-only machine)
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"attention backend plugin {ep.name!r} failed to load: {e}", stacklevel=2)


def registered() -> list[AttentionBackend]:
    """Every backend, fastest first."""
    _discover()
    return sorted(_REG.backends.values(), key=lambda b: -b.priority)


def get(name: str) -> AttentionBackend:
    _discover()
    if name not in _REG.backends:
        raise ValueError(f"no attention backend {name!r} (registered: {', '.join(b.name for b in registered())})")
    return _REG.backends[name]


def op(name: str):
    """An accelerated cache-write routine a plugin registered (e.g. "quant", "frag_pack"), or None."""
    _discover()
    return _REG.ops.get(name)


def choose(spec: CacheSpec, want: str = "auto", config=None, layout: str | None = None) -> AttentionBackend:
    """The backend for a cache of `spec`: `want` by name (ValueError with its reason if it does not serve this
    cache), or "auto": on a GPU the fastest that does, elsewhere the torch reference. `config` replaces the chosen
    backend's knobs. `layout`: a static layout asked for ("row" or "frag"): only backends that read it (the torch
    reference reads both)."""

    def reads(b: AttentionBackend) -> bool:
        return layout is None or b.layout == layout or b.name == TORCH.name

    if want != "auto":
        b = get(want)
        if why := b.supports(spec):
            raise ValueError(f"attention backend {want!r} does not serve this cache: {why}")
        if not reads(b):
            raise ValueError(f"attention backend {want!r} reads the {b.layout} layout, not {layout!r}")
        return b.configure(config)
    if spec.device.type != "cuda":  # the kernels are GPU kernels (the interpreter serves tests, by name)
        return TORCH
    for b in registered():
        if b.auto and reads(b) and b.supports(spec) is None:
            if config is not None and b.config is not None and type(config) is type(b.config):
                return b.configure(config)
            return b
    return TORCH


def reasons(spec: CacheSpec) -> dict[str, str | None]:
    """Per backend name, why it does not serve a cache of `spec` (None: it does)."""
    return {b.name: b.supports(spec) for b in registered()}
