"""SVD-LLM whitening of the value projection, per head group (DESIGN.md 3.2-3.3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ConvertError

EPS0, EPS_MAX = 1e-6, 1.0


@dataclass
class Factors:
    A: torch.Tensor  # [G, d, R] float64: x A_c is the latent of group c
    B: torch.Tensor  # [G, R, R] float64: A_c B_c = W_c
    S: torch.Tensor  # [G, R] float64: whitened singular values, descending
    eps: float  # Cholesky jitter used (0: none needed)


def cholesky(C: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Lower L with L L^T = C + eps*mean(diag C)*I, eps = 0 if C is positive definite,
    else the first of 1e-6, 1e-5, ... that works."""
    eps = 0.0
    scale = C.diagonal().mean()
    eye = torch.eye(len(C), dtype=C.dtype, device=C.device)
    while True:
        L, info = torch.linalg.cholesky_ex(C + eps * scale * eye if eps else C)
        if info == 0:
            return L, eps
        eps = EPS0 if eps == 0 else eps * 10
        if eps > EPS_MAX:
            raise ConvertError(
                "the activation covariance is not positive definite even with jitter (degenerate calibration data?)"
            )


def shrunk(C: torch.Tensor, alpha: float) -> torch.Tensor:
    """(1 - alpha) C + alpha mean(diag C) I: the covariance pulled toward a scaled identity. A calibration corpus
    estimates the low-variance directions worst, and the rank cut is fitted to them: shrinking hedges the basis
    toward the weights' own (alpha = 1: a plain SVD of W) for text the corpus did not cover."""
    if alpha == 0:
        return C
    eye = torch.eye(len(C), dtype=C.dtype, device=C.device)
    return (1 - alpha) * C + alpha * C.diagonal().mean() * eye


def whiten(C: torch.Tensor, W: torch.Tensor, g: int, n: int, shrink: float = 0.0) -> Factors:
    """C: [d, d] covariance of the v_proj input; W: [d, K*n] value projection (row-vector layout); shrink: see
    `shrunk` (0: SVD-LLM as is).

    Per group c: L^T W_c = U S V^T, A_c = L^{-T} U S^{1/2}, B_c = S^{1/2} V^T. Truncating
    both to the first r columns/rows is then the best rank-r fit in ||X (W_c - A_r B_r)||_F."""
    C, W = shrunk(C.double(), shrink), W.to(device=C.device, dtype=torch.float64)
    L, eps = cholesky(C)
    d, R = W.shape[0], g * n
    Wg = W.view(d, -1, R).transpose(0, 1)  # [G, d, R]: group c = KV heads c*g .. c*g+g-1
    U, S, Vh = torch.linalg.svd(L.T @ Wg, full_matrices=False)
    s = S.sqrt()
    A = torch.linalg.solve_triangular(L.T, U * s[:, None, :], upper=True)  # L^{-T} U S^{1/2}, no inverse
    B = s[:, :, None] * Vh
    return Factors(A, B, S, eps)


def rotate_latents(f: Factors, block: int) -> Factors:
    """A Q and Q^T B with Q block-diagonal normalized Hadamard matrices of `block` channels: the same A B (values
    unchanged), but each block's latents carry its channels' energy evenly instead of the first channel most, so a
    per-token quantization group of `block` channels loses less (docs/notes.md, "rotated latents"). Truncation
    at multiples of `block` stays the whitened SVD truncation (the blocks do not cross it); S stays as it was."""
    from tale_runtime.artifact import rotation_fits
    from tale_runtime.model import hadamard

    R = f.A.shape[-1]
    if not rotation_fits(block, R):
        raise ConvertError(f"latent rotation blocks must be a power of two >= 2 dividing R={R}, got {block}")
    h = hadamard(block, f.A.device, torch.float64)
    A = (f.A.unflatten(-1, (R // block, block)) @ h).flatten(-2)  # [G, d, R]
    B = (h.T @ f.B.unflatten(-2, (R // block, block))).flatten(-3, -2)  # [G, R, R]
    return Factors(A, B, f.S, f.eps)


def energy_kept(S: torch.Tensor, r: int) -> float:
    """Fraction of ||X W||_F^2 (over all groups of the layer) kept at rank r."""
    e = S.double() ** 2
    return float(e[:, :r].sum() / e.sum())
