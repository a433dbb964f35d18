"""Low-rank keys (Level.key_rank): the keys of a layer's KV heads before RoPE, joined, on a calibrated basis.

Keys before RoPE are far from full rank across a layer's heads (Palu, ShadowKV); after RoPE they are not, since
each position rotates them differently. A level with `key_rank` r holds, per token and basis block, the first r
coefficients c = k_pre E[:, :r] of the block's pre-RoPE keys (the joined key [K n] of all KV heads, or one head's
[n]), quantized like keys (per coefficient over token groups, or per token), and reads them back as k_pre ~ c D[:r]
before RoPE is applied (Schedule.key_rope "pre"). E and D = E^-1 (float32, per block) come from the artifact's
key_basis.safetensors (tale-convert --key-basis):
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
    """One layer's basis in `blocks` independent blocks of the joined key [K n]: 1 block spans every KV head
    (joint), K / g blocks one latent group of g heads each (per group), K blocks one head each (per head). Block j:
    c_j = (k_j - mean_j) enc[j, :, :r], k_j ~ mean_j + c_j dec[j, :r] (enc [Kb, nb, C], dec [Kb, C, nb], mean [K n]
    with nb = K n / Kb; C <= nb directions, most important first; float32). Rebuilding a token's keys costs Kb r nb
    multiply-adds: a per-head basis costs K times less than the joint one at the same number of coefficients."""

    enc: torch.Tensor
    dec: torch.Tensor
    mean: torch.Tensor
    heads: int  # K
    head_dim: int  # n
    # tensor parallelism over a joint basis: each rank holds its heads' rows of enc and columns of dec (shard), encodes
    # its heads' share of every coefficient, and the shares are summed over this process group
    group: object | None = None
    tp: int = 1  # the tensor-parallel ranks the model's blocks are split over (shard): blocks x tp of them in all

    def __post_init__(self):
        if self.enc.ndim == 2:  # [K n, C]: one joint block
            self.enc, self.dec = self.enc[None], self.dec[None]

    @property
    def blocks(self) -> int:
        return self.enc.shape[0]

    @property
    def directions(self) -> int:
        return self.enc.shape[2]

    def encode(self, k: torch.Tensor, rank: int) -> torch.Tensor:
        """k [B, K, T, n] (before RoPE) -> its first `rank` coefficients per block [B, Kb, T, rank], in k's dtype
        (computed in float32)."""
        B, K, T, n = k.shape
        Kb = self.blocks
        x = k.float().transpose(1, 2).reshape(B, T, K * n) - self.mean.to(k.device)
        c = torch.einsum("btjn,jnr->bjtr", x.view(B, T, Kb, K * n // Kb), self.enc[:, :, :rank].to(k.device))
        if self.group is not None:  # functional (traceable): the static cache's compiled writes call this too
            from torch.distributed import _functional_collectives as funcol

            c = funcol.all_reduce(c, "sum", self.group)
        return c.to(k.dtype)

    def decode(self, c: torch.Tensor) -> torch.Tensor:
        """Coefficients [B, Kb, T, r] -> keys before RoPE [B, K, T, n], in c's dtype."""
        B, Kb, T, r = c.shape
        k = torch.einsum("bjtr,jrn->btjn", c, self.dec[:, :r].to(c)).reshape(B, T, self.heads * self.head_dim)
        return (k + self.mean.to(c)).view(B, T, self.heads, self.head_dim).transpose(1, 2)


def fit(
    m2: torch.Tensor, mean: torch.Tensor, q2: torch.Tensor | None, blocks: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(enc [Kb, nb, nb], dec [Kb, nb, nb]) from the keys' second moment m2 [C, C] and mean [C] and the queries'
    per-channel second moments q2 [C] (None: plain principal directions), one basis per diagonal block of m2
    (blocks = 1: joint over the heads; K / g: per latent group; K: per head). enc = W^1/2 U, dec = U^T W^-1/2 with U
    the eigenvectors of the weighted covariance W^1/2 (m2 - mean mean^T) W^1/2, largest first: the truncation keeps
    what the logits see most (pass q2 through pair_mean: RoPE mixes a channel with its pair)."""
    cov, sw = _weighted(m2, mean, q2)
    nb = cov.shape[0] // blocks
    encs, decs = [], []
    for j in range(blocks):
        s = slice(j * nb, (j + 1) * nb)
        _, U = torch.linalg.eigh(cov[s, s])
        U = U.flip(-1)
        encs.append(sw[s, None] * U)
        decs.append(U.T / sw[None, s])
    return torch.stack(encs).float().contiguous(), torch.stack(decs).float().contiguous()


def energy(m2: torch.Tensor, mean: torch.Tensor, q2: torch.Tensor | None, blocks: int = 1) -> torch.Tensor:
    """[Kb, nb] float64: the eigenvalues of fit's weighted covariance per block, largest first (those of its
    directions): the calibration energy, in the queries' norm (a share of the logits' variance), of each key basis
    coefficient. A rank r keeps the sum of the first r of each block (tale_convert.rank_policy.key_ranks)."""
    cov, _ = _weighted(m2, mean, q2)
    nb = cov.shape[0] // blocks
    ev = [torch.linalg.eigvalsh(cov[j * nb : (j + 1) * nb, j * nb : (j + 1) * nb]).flip(-1) for j in range(blocks)]
    return torch.stack(ev).clamp_min(0)


def _weighted(m2: torch.Tensor, mean: torch.Tensor, q2: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(W^1/2 (m2 - mean mean^T) W^1/2 [C, C], W^1/2 [C]) in float64, W the queries' per-channel second moments."""
    w = torch.ones(m2.shape[0], dtype=torch.float64) if q2 is None else q2.double().clamp_min(1e-12)
    sw, mu = w.sqrt(), mean.double()
    return sw[:, None] * (m2.double() - mu[:, None] * mu[None]) * sw[None], sw


def pair_mean(q2: torch.Tensor, K: int, n: int) -> torch.Tensor:
    """Per-channel query second moments [K n] averaged over each RoPE pair (c, c + n/2) of a head."""
    e = q2.view(K, n)
    return (0.5 * (e + e.roll(n // 2, -1))).flatten()


def shard(basis: KeyBasis, rank: int, size: int, group) -> KeyBasis:
    """A tensor-parallel rank's part of a layer's basis; the rank holds KV heads [rank K/size, (rank + 1) K/size) (whole
    latent groups). Per head or per latent group: those heads' blocks. Joint: every coefficient, from those heads' rows
    of enc and for their columns of dec; encoding sums the ranks' shares over `group` (each rank caches all the
    coefficients and rebuilds its own heads)."""
    K, n = basis.heads, basis.head_dim
    k = K // size
    lo, hi = rank * k * n, (rank + 1) * k * n
    if basis.blocks > 1:  # blocks of whole heads, never split by whole latent groups
        per = basis.blocks // size
        part = slice(rank * per, (rank + 1) * per)
        return KeyBasis(basis.enc[part], basis.dec[part], basis.mean[lo:hi], k, n, tp=size)
    enc, dec = basis.enc[:, lo:hi].contiguous(), basis.dec[:, :, lo:hi].contiguous()
    return KeyBasis(enc, dec, basis.mean[lo:hi].contiguous(), k, n, group)


def missing(schedule, basis: KeyBasis | list[KeyBasis] | None, layer: int | None = None) -> str | None:
    """Why the schedule's levels with low-rank keys cannot read `basis` (every layer's, a list; or layer `layer`'s;
    or one basis for any layer: layer None), or None when they can: the one check behind load(), tale-eval's overrides
    and RegionStore. key_rank counts coefficients per block, so the basis must have the schedule's key_blocks, and
    each layer's basis at least the directions that layer's levels hold (Schedule.key_rank)."""
    kr = schedule.max_key_rank(layer)
    if not kr:
        return None
    if basis is None:
        return f"key_rank {kr} needs the artifact's key basis (tale-convert --key-basis)"
    bases = basis if isinstance(basis, list) else [basis]
    # key_blocks is 1 (joint), K / g (per latent group) or K (per head); a tensor-parallel rank holds 1 / tp of them
    # (a joint block is never split by blocks: each rank keeps it, tp 1)
    if any(b.blocks * b.tp != schedule.key_blocks for b in bases):
        return (
            f"the schedule counts key_rank in {schedule.key_blocks} key basis block(s), the key basis has "
            f"{bases[0].blocks}"
        )
    for i, b in enumerate(bases):
        need = schedule.max_key_rank(i) if isinstance(basis, list) else kr
        if need > b.directions:
            return f"key_rank {need} exceeds the key basis ({b.directions} directions)"
    return None


def load_file(root: Path, num_layers: int, heads: int, head_dim: int, device) -> list[KeyBasis] | None:
    """The artifact's key basis per layer, or None when it has none (blocks of whole KV heads; missing() checks them
    against the schedule)."""
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
                if enc.ndim == 2:  # one joint block (the first format)
                    enc, dec = enc[None], dec[None]
                Kb = enc.shape[0] if enc.ndim == 3 else 0
                nb = C // Kb if Kb and heads % Kb == 0 else 0
                if not nb or enc.shape[1] != nb or dec.shape != (Kb, enc.shape[2], nb) or mean.shape != (C,):
                    raise ArtifactError(
                        f"{f}: layer {i}: key basis of shapes {tuple(enc.shape)}, {tuple(dec.shape)}; "
                        f"the model's keys have {heads} heads x {head_dim} channels (blocks of whole heads)"
                    )
                out.append(KeyBasis(enc, dec, mean, heads, head_dim))
    except SafetensorError as e:
        raise ArtifactError(f"{f}: unreadable safetensors file ({e})") from None
    return out
