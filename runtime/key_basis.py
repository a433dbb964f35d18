"""Low-rank keys (Level.key_rank): the keys of a layer's KV heads before RoPE, joined, on a calibrated basis.

Keys before RoPE are far from full rank across a layer's heads (Palu, ShadowKV); after RoPE they are not, since
each position rotates them differently. A level with `key_rank` r holds, per token, the first r coefficients
c = k_pre E[:, :r] of the joined pre-RoPE key k_pre [K n], quantized like keys (per coefficient over token
groups, or per token), and reads them back as k_pre ~ c D[:r] before RoPE is applied (Schedule.key_rope "pre").
E and D = E^-1 ([K n, K n], float32) come from the artifact's key_basis.safetensors (tale-convert --key-basis):
the principal directions of the calibration keys' second moment, in the norm of the queries' per-channel second
moments, so truncation drops what the logits see least.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

FILE = "key_basis.safetensors"


def names(layer: int) -> tuple[str, str, str]:
    return f"layers.{layer}.key_enc", f"layers.{layer}.key_dec", f"layers.{layer}.key_mean"


@dataclass
class KeyBasis:
    """One layer's basis: c = (k - mean) enc[:, :r], k ~ mean + c dec[:r] (enc [K n, C], dec [C, K n], mean [K n];
    C <= K n directions, most important first; float32)."""

    enc: torch.Tensor
    dec: torch.Tensor
    mean: torch.Tensor
    heads: int  # K
    head_dim: int  # n

    def encode(self, k: torch.Tensor, rank: int) -> torch.Tensor:
        """k [B, K, T, n] (before RoPE) -> its first `rank` coefficients [B, 1, T, rank], in k's dtype (computed
        in float32)."""
        B, K, T, n = k.shape
        x = k.float().transpose(1, 2).reshape(B, T, K * n) - self.mean.to(k.device)
        return (x @ self.enc[:, :rank].to(k.device))[:, None].to(k.dtype)

    def decode(self, c: torch.Tensor) -> torch.Tensor:
        """Coefficients [B, 1, T, r] -> keys before RoPE [B, K, T, n], in c's dtype."""
        B, _, T, r = c.shape
        k = torch.addmm(self.mean.to(c), c[:, 0].flatten(0, 1), self.dec[:r].to(c))
        return k.view(B, T, self.heads, self.head_dim).transpose(1, 2)


def fit(m2: torch.Tensor, mean: torch.Tensor, q2: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(enc, dec) from the keys' second moment m2 [C, C] and mean [C] and the queries' per-channel second moments
    q2 [C] (None: plain principal directions). enc = W^1/2 U, dec = U^T W^-1/2 with U the eigenvectors of the
    weighted covariance W^1/2 (m2 - mean mean^T) W^1/2, largest first: the truncation keeps what the logits see
    most (pass q2 through pair_mean: RoPE mixes a channel with its pair)."""
    C = m2.shape[0]
    w = torch.ones(C, dtype=torch.float64) if q2 is None else q2.double().clamp_min(1e-12)
    sw, mu = w.sqrt(), mean.double()
    _, U = torch.linalg.eigh(sw[:, None] * (m2.double() - mu[:, None] * mu[None]) * sw[None])
    U = U.flip(-1)
    return (sw[:, None] * U).float().contiguous(), (U.T / sw[None]).float().contiguous()


def pair_mean(q2: torch.Tensor, K: int, n: int) -> torch.Tensor:
    """Per-channel query second moments [K n] averaged over each RoPE pair (c, c + n/2) of a head."""
    e = q2.view(K, n)
    return (0.5 * (e + e.roll(n // 2, -1))).flatten()


def missing(levels, basis: KeyBasis | list[KeyBasis] | None) -> str | None:
    """Why levels with low-rank keys cannot read `basis` (one layer's, or every layer's), or None when they can:
    the one check behind load(), tale-eval's overrides and TaleLayerCache."""
    kr = max((lv.key_rank for lv in levels), default=0)
    if not kr:
        return None
    if basis is None:
        return f"key_rank {kr} needs the artifact's key basis (tale-convert --key-basis)"
    have = min(b.enc.shape[1] for b in (basis if isinstance(basis, list) else [basis]))
    return f"key_rank {kr} exceeds the key basis ({have} directions)" if kr > have else None


def load_file(root: Path, num_layers: int, heads: int, head_dim: int, device) -> list[KeyBasis] | None:
    """The artifact's key basis per layer, or None when it has none."""
    from safetensors import SafetensorError, safe_open

    from .artifact import ArtifactError

    f = Path(root) / FILE
    if not f.is_file():
        return None
    out = []
    try:
        with safe_open(f, framework="pt", device=str(device)) as st:
            have = set(st.keys())
            for i in range(num_layers):
                if not set(names(i)) <= have:
                    raise ArtifactError(f"{f}: no key basis for layer {i}")
                enc, dec, mean = (st.get_tensor(x).float() for x in names(i))
                C = heads * head_dim
                if enc.ndim != 2 or enc.shape[0] != C or dec.shape != (enc.shape[1], C) or mean.shape != (C,):
                    raise ArtifactError(
                        f"{f}: layer {i}: key basis of shapes {tuple(enc.shape)}, {tuple(dec.shape)}; "
                        f"the model's joined keys have {C} channels"
                    )
                out.append(KeyBasis(enc, dec, mean, heads, head_dim))
    except SafetensorError as e:
        raise ArtifactError(f"{f}: unreadable safetensors file ({e})") from None
    return out
