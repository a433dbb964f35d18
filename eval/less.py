"""LESS (Dong et al. 2024): a Λ-shaped eviction cache (sinks + recent window, 16-bit) plus, per layer and KV head, a
constant-size state that absorbs every evicted pair through learned kernels:

    H = sum_evicted psi(k)^T v   [R, n]      z = sum_evicted psi(k)   [R]
    out(q) = (sum_kept exp(l) v + phi(q) H) / (sum_kept exp(l) + phi(q) z^T),   l = q.k / sqrt(n)

phi, psi: [n] -> [R], small two-layer MLPs per layer (phi per query head, psi per KV head), kept positive as
exp(MLP): phi(q) psi(k) = sum_r exp(a_r(q) + b_r(k)) stands in for exp(l) of the tokens no longer held. They are
trained per layer to match full attention outputs on the calibration text (less_train.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .caches import CountedCache, FullLayer
from .sparse import partial_attention

LOG_MAX = 30.0  # log-features are clamped here: exp(30) summed over 1e6 tokens stays far from float32's limit


class LessKernels(nn.Module):
    """One layer's phi (H query heads) and psi (K KV heads): x * sqrt(scaling) -> W2 gelu(W1 x + b1) + b2, the
    log of the features."""

    def __init__(self, H: int, K: int, n: int, rank: int = 8, hidden: int = 32):
        super().__init__()
        self.H, self.K, self.n, self.rank, self.hidden = H, K, n, rank, hidden

        def mlp(heads):
            return nn.ParameterDict(
                dict(
                    w1=nn.Parameter(torch.randn(heads, n, hidden) / n**0.5),
                    b1=nn.Parameter(torch.zeros(heads, hidden)),
                    w2=nn.Parameter(torch.randn(heads, hidden, rank) / hidden**0.5),
                    b2=nn.Parameter(torch.zeros(heads, rank)),
                )
            )

        self.phi_mlp, self.psi_mlp = mlp(H), mlp(K)

    @staticmethod
    def _log_features(p: nn.ParameterDict, x: torch.Tensor, scaling: float) -> torch.Tensor:
        """x [B, heads, T, n] -> [B, heads, T, R] float32."""
        x = x.float() * scaling**0.5
        h = nn.functional.gelu(torch.einsum("bhtn,hnd->bhtd", x, p["w1"]) + p["b1"][:, None])
        return (torch.einsum("bhtd,hdr->bhtr", h, p["w2"]) + p["b2"][:, None]).clamp(-LOG_MAX, LOG_MAX)

    def log_phi(self, q: torch.Tensor, scaling: float) -> torch.Tensor:
        return self._log_features(self.phi_mlp, q, scaling)

    def log_psi(self, k: torch.Tensor, scaling: float) -> torch.Tensor:
        return self._log_features(self.psi_mlp, k, scaling)

    def config(self) -> dict:
        return dict(H=self.H, K=self.K, n=self.n, rank=self.rank, hidden=self.hidden)


def read_state(
    log_phi: torch.Tensor, m: torch.Tensor, H: torch.Tensor, z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """phi(q) H and phi(q) z^T on the scale exp(l - m) of the kept tokens' sums.
    log_phi [B, Hq, T, R]; m [B, Hq, T]; H [B, K, (T,) R, n]; z [B, K, (T,) R] (per query when a T axis is there)."""
    B, Hq, T, R = log_phi.shape
    K = H.shape[1]
    w = torch.exp((log_phi - m[..., None]).clamp(max=LOG_MAX)).view(B, K, Hq // K, T, R)
    if H.dim() == 4:
        num = torch.einsum("bkitr,bkrn->bkitn", w, H)
        den = torch.einsum("bkitr,bkr->bkit", w, z)
    else:
        num = torch.einsum("bkitr,bktrn->bkitn", w, H)
        den = torch.einsum("bkitr,bktr->bkit", w, z)
    return num.reshape(B, Hq, T, -1), den.reshape(B, Hq, T)


class LessLayer(FullLayer):
    """`sinks` first tokens + the `window` most recent ones at 16 bits; every evicted pair is added to H, z (float32)
    through psi (no kernels: dropped, i.e. the sparse policy alone)."""

    def __init__(self, sinks: int, window: int, kernels: LessKernels | None, scaling: float):
        super().__init__()
        if window < 1:
            raise ValueError(f"LESS window must be >= 1 token, got {window}")
        self.sinks, self.window, self.kernels, self.scaling = sinks, window, kernels, scaling
        self.H: torch.Tensor | None = None  # [B, K, R, n]
        self.z: torch.Tensor | None = None  # [B, K, R]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, n] over the held tokens, the state and the new k, v [B, K, T, n] (then cached). -> [B, H, T, n]."""
        num, den, m = partial_attention(q, k, v, self.keys, self.values, self.scaling)
        if self.H is not None:
            with torch.no_grad():
                extra_num, extra_den = read_state(self.kernels.log_phi(q, self.scaling), m, self.H, self.z)
            num, den = num + extra_num, den + extra_den
        self.update(k, v)
        return (num / den[..., None]).to(q.dtype)

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        s, w = self.sinks, self.window
        if keys.shape[-2] > s + w:
            if self.kernels is not None:
                self._absorb(keys[..., s:-w, :], values[..., s:-w, :])
            self.keys = torch.cat([keys[..., :s, :], keys[..., -w:, :]], dim=-2)
            self.values = torch.cat([values[..., :s, :], values[..., -w:, :]], dim=-2)
        return keys, values

    @torch.no_grad()
    def _absorb(self, k: torch.Tensor, v: torch.Tensor) -> None:
        e = torch.exp(self.kernels.log_psi(k, self.scaling))  # [B, K, L, R]
        H = torch.einsum("bklr,bkln->bkrn", e, v.float())
        z = e.sum(-2)
        self.H, self.z = (H, z) if self.H is None else (self.H + H, self.z + z)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = 0 if self.keys is None else self.keys.shape[-2]
        return held + query_length, self.seen - held

    def nbytes(self) -> int:
        state = sum(t.numel() * t.element_size() for t in (self.H, self.z) if t is not None)
        return super().nbytes() + state


class LessCache(CountedCache):
    """LESS layers: EvalAttention runs their own attention (LessLayer.attend)."""


def less_cache(sinks: int, window: int, kernels: list[LessKernels] | None, scaling: float, layers: int) -> LessCache:
    ks = kernels or [None] * layers
    return LessCache(layers=[LessLayer(sinks, window, k, scaling) for k in ks])
