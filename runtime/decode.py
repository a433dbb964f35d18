"""One decode step of the whole model over a StaticTaleCache, captured as a CUDA graph (gpt-fast style).

The step has fixed shapes: input ids [B, 1] and positions [B, 1] live in static buffers, every cache
region is read over its whole capacity with lengths on the device, and the new token goes into the
residual at a device-held slot. What runs only every few steps (the flush of the residual, demotions)
stays outside this graph: after each replay, `StaticTaleCache.advance()` counts the token on the host
and runs that fixed-size work when the schedule says so (demotions as CUDA graphs of their own).

Inside a graph, Python costs nothing but every kernel launch still costs a few microseconds: the HF
forward launches ~40 kernels per layer (RMSNorm as ~6 ops, RoPE ~10, residual adds, casts). With
`compile=True` the step is `DecodeStep`: the decoder layer written out, with the code between the
matmuls and the TALE attention (residual add + RMSNorm + q/k/latent projections + RoPE before it,
output projection + residual add + RMSNorm + MLP after it) as two torch.compile graphs that every
layer shares (the layer's modules are graph inputs: one compile for all layers). Attention (the
Triton kernel) and the cache writes stay ordinary calls, captured with the rest.

Each call opens one step on the cache (`cache.step(T)`, runtime/cache.py) around the layers' writes; a captured step
is opened with graph=True, and the decoder calls `cache.advance()` after each replay.

    decoder = CudaGraphDecoder(model, cache)     # after the prefill filled `cache`
    logits = decoder(ids, position_ids)          # [B, V]; valid until the next call
    decoder = graph_decoder(model, cache)        # the model's decoder for `cache` (made once, remade when the
                                                 # cache's buffers change): what model.generate uses
"""

from __future__ import annotations

import time
import types
import warnings
import weakref

import torch

from . import families
from .backends import ReferenceCalls
from .model import TaleAttention, cache_arg, rotate, rotation
from .static_cache import StaticTaleCache


# The compiled pieces of DecodeStep. `d` is the previous layer's MLP output, not yet added to the residual
# stream `x` (None before the first layer): adding it here fuses the add into the RMSNorm's kernel.
def _embed(model, ids: torch.Tensor, pos: torch.Tensor):
    x = model.model.embed_tokens(ids)  # [B, T, d]
    cos, sin = model.model.rotary_emb(x, pos)  # [B, T, n] each
    return x, cos, sin


def _pre(layer, x: torch.Tensor, d: torch.Tensor | None, cos, sin, Q: torch.Tensor | None):
    """Residual add, RMSNorm, q/k/latent projections, RoPE: x [B, T, d] -> x, q [B, H, T, n], k [B, K, T, n],
    h [B, G, T, R] (q and k rotated by Q when the cache rotates keys)."""
    if d is not None:
        x = x + d
    a = layer.self_attn
    xn = layer.input_layernorm(x)
    q, k = a.qk(xn, cos, sin)
    return x, rotate(q, Q).contiguous(), rotate(k, Q).contiguous(), a.latents(xn).contiguous()


def _post(layer, x: torch.Tensor, z: torch.Tensor):
    """Output projection of the latent attention output z [B, T, H, R], residual add, RMSNorm, MLP: -> x, d."""
    x = x + layer.self_attn.output(z)
    return x, layer.mlp(layer.post_attention_layernorm(x))


def _head(model, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(x + d))[:, -1]  # [B, V]


def _own_copy(f):
    """f with a code object of its own. Dynamo keeps compiled graphs per code object, up to its recompile limit (8):
    shared by every model, the fifth model of another shape in a process failed to compile (fullgraph); copied per
    model (_compiled), each model's graphs are its own and go with it."""
    return types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)


# The compiled pieces per model and torch.compile backend, shared by every DecodeStep of that model: a new cache (each
# model.generate call makes one) reuses what dynamo and inductor built for the first, as transformers' static cache
# compiles once per process. Weak keys: the pieces go with their model.
_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(model, backend) -> tuple:
    per_model = _PIECES.setdefault(model, {})
    if backend not in per_model:
        kw = dict(backend=backend, fullgraph=True)
        per_model[backend] = tuple(torch.compile(_own_copy(f), **kw) for f in (_embed, _pre, _post, _head))
    return per_model[backend]


class _OverCache:
    """Holds its cache weakly (graph_decoder's table is keyed by the cache: a strong reference would keep it alive)."""

    _cache: weakref.ref

    @property
    def cache(self):
        c = self._cache()
        if c is None:
            raise RuntimeError("the cache this decoder ran over was freed")
        return c


class DecodeStep(_OverCache):
    """`step(ids, position_ids)` -> logits [B, V]: the model's forward over a TALE cache (T new tokens after a
    prefill), layer by layer, with the pieces between the matmuls and attention compiled (see the module
    docstring). Same result as `model(...)` up to the rounding of fused kernels; `backend` is torch.compile's
    ("eager" or "aot_eager" in CPU tests: the tracing without inductor)."""

    def __init__(self, model, cache, backend="inductor"):
        if not supports_step(model):
            raise ValueError("DecodeStep needs Llama-style decoder layers with TALE attention")
        self.model, self._cache = model, weakref.ref(cache)
        self.embed, self.pre, self.post, self.head = _compiled(model, backend)

    def warm(self, ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Compile every piece on these shapes without touching the cache: layer 0's pieces with and without the
        previous MLP output (a zero attention output stands in for the kernel's)."""
        m = self.model
        x, cos, sin = self.embed(m, ids, position_ids)
        layer = m.model.layers[0]
        a = layer.self_attn
        Q = rotation(self.cache, a.head_dim, x.device)
        for d in (None, torch.zeros_like(x)):  # not x itself: dynamo would guard on the aliasing and recompile
            x1, *_ = self.pre(layer, x, d, cos, sin, Q)
        z = torch.zeros(*ids.shape, a.H, a.R, dtype=torch.float32, device=x.device)  # [B, T, H, R]
        self.head(m, *self.post(layer, x1, z))

    def __call__(self, ids: torch.Tensor, position_ids: torch.Tensor, graph: bool = False) -> torch.Tensor:
        """One forward pass over the cache, in a step of its own (graph: being captured)."""
        m, cache = self.model, self.cache
        x, cos, sin = self.embed(m, ids, position_ids)
        layers = m.model.layers
        Q = rotation(cache, layers[0].self_attn.head_dim, x.device)
        d = None
        with cache.step(ids.shape[1], graph=graph):
            for i, layer in enumerate(layers):
                a = layer.self_attn
                x, q, k, h = self.pre(layer, x, d, cos, sin, Q)
                z = cache.attend(i, q, k, h, a.scaling, a.sliding_window)  # [B, T, H, R] float32
                cache.update(k, h, i, rope=(cos, sin))  # read by caches that hold keys before RoPE
                x, d = self.post(layer, x, z)
        return self.head(m, x, d)


def supports_step(model) -> bool:
    """Whether DecodeStep can run `model`: decoder layers of input_layernorm, TALE attention,
    post_attention_layernorm and mlp (Llama's layer: families.LLAMA_LAYER), with a rotary embedding, a final norm and
    lm_head. Gemma 3 (norms around attention and MLP, RoPE per layer type) runs the model's own forward."""
    if getattr(getattr(model, "config", None), "model_type", None) not in families.LLAMA_LAYER:
        return False
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "norm", "layers")):
        return False
    if not hasattr(model, "lm_head"):
        return False
    return all(
        isinstance(getattr(layer, "self_attn", None), TaleAttention)
        and all(hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp"))
        for layer in inner.layers
    )


class CudaGraphDecoder(_OverCache):
    """compile: run the steps as DecodeStep (torch.compile of the code around attention, fewer kernels per
    step) when the model supports it; False: the model's own forward. If compiling fails, the decoder warns and
    uses the model's forward (`compile_error` says why)."""

    def __init__(self, model, cache: StaticTaleCache, compile: bool = True):
        if not isinstance(cache, StaticTaleCache) or cache.book is None:
            raise ValueError("CudaGraphDecoder needs a StaticTaleCache filled by a prefill")
        self.model, self._cache = model, weakref.ref(cache)  # weak: graph_decoder's table is keyed by the cache
        self.generation = cache.generation  # the buffers the graph reads: remade when they change
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warm = False  # one plain step ran eagerly (on a side stream) before the capture
        self.ids = self.pos = self.logits = None
        self.error: str | None = None  # why capturing failed; the steps then stay eager
        self.step_calls = ReferenceCalls()  # the decode attention calls of one replay (cache.reference_calls)
        self.step: DecodeStep | None = DecodeStep(model, cache) if compile and supports_step(model) else None
        self.compiled = False  # the step's graphs were compiled (by _compile, before any step touched the cache)
        self.compile_s = 0.0  # seconds _compile took (dynamo + inductor + Triton; 0 from the caches when warm)
        self.compile_error: str | None = None

    def _compile(self, ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Compile the step's pieces on this batch's shapes without touching the cache (a failure leaves the cache
        as it was, and the model's forward takes over)."""
        t = time.perf_counter()
        try:
            self.step.warm(ids, position_ids)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (inductor/Triton missing or failing: the plain forward still works)
            self.step, self.compile_error = None, f"{type(e).__name__}: {e}"
            warnings.warn(
                f"compiling the decode step failed, using the model's forward: {self.compile_error}", stacklevel=3
            )
        self.compiled = True
        self.compile_s = time.perf_counter() - t

    def _forward(self, ids: torch.Tensor, position_ids: torch.Tensor, graph: bool = False) -> torch.Tensor:
        if self.step is not None:
            if not self.compiled:
                self._compile(ids, position_ids)
            if self.step is not None:
                return self.step(ids, position_ids, graph)
        out = self.model(
            input_ids=ids,
            position_ids=position_ids,
            **cache_arg(self.cache),
            use_cache=True,
            logits_to_keep=1,
            tale_graph=graph,
        )
        return out.logits[:, -1]

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """ids, position_ids: [B, 1] long on the model's device -> logits [B, V]."""
        if self.ids is None:
            self.ids = torch.empty_like(ids, memory_format=torch.contiguous_format)
            self.pos = torch.empty_like(position_ids, memory_format=torch.contiguous_format)
        # every step reads the same static buffers: the compiled pieces then see the same strides at the warm-up, the
        # capture and in eager steps (HF hands in slices of growing tensors, whose strides would trigger recompiles)
        self.ids.copy_(ids)
        self.pos.copy_(position_ids)
        plain = self.cache.capturable()
        if not plain or not self.warm or self.error:  # eager; the first plain step warms up on a side stream
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                logits = self._forward(self.ids, self.pos)
            torch.cuda.current_stream().wait_stream(s)
            self.warm = self.warm or plain
            return logits
        calls = self.cache.reference_calls
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            before = calls.copy()
            try:
                # a recompile inside the capture would compile and benchmark kernels there: fail at once instead
                with torch._dynamo.config.patch(error_on_recompile=True), torch.cuda.graph(self.graph):
                    self.logits = self._forward(self.ids, self.pos, graph=True)
            except Exception as e:  # noqa: BLE001  (the captured work never ran; the host counts did not move)
                calls.restore(before)
                self.graph, self.error = None, f"{type(e).__name__}: {e}"
                warnings.warn(f"CUDA graph capture failed, decoding eagerly: {self.error}", stacklevel=2)
                self.cache.sync_device()  # device counters from the host's, should anything of the capture have run
                return self(ids, position_ids)
            # the capture counted one step's attention calls (the reference's included) that only replays run
            self.step_calls = calls.since(before)
            calls.restore(before)
        self.graph.replay()
        calls.add(self.step_calls)
        self.cache.advance()
        return self.logits


# The graph decoders of model.generate (load.TaleGenerationMixin), per static cache and model. Weak keys, and decoders
# hold their cache weakly: an entry lives as long as its cache, and keeps it alive no longer.
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder_of(model, cache: StaticTaleCache, compile: bool = True) -> CudaGraphDecoder | None:
    """The decoder graph_decoder made for `model` over `cache`, if any (None once the cache's buffers changed)."""
    dec = _DECODERS.get(cache, {}).get((id(model), compile))
    return dec if dec is not None and dec.model is model and dec.generation == cache.generation else None


def graph_decoder(model, cache: StaticTaleCache, compile: bool = True) -> CudaGraphDecoder:
    """The decoder of `model` over `cache`: made at the first decode step, remade when the cache's buffers changed
    (a new prefill, reset, batch_repeat_interleave) or for another model."""
    per_model = _DECODERS.setdefault(cache, {})
    key = (id(model), compile)
    dec = per_model.get(key)
    if dec is None or dec.model is not model or dec.generation != cache.generation:
        dec = per_model[key] = CudaGraphDecoder(model, cache, compile=compile)
    return dec
