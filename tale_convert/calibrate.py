"""Calibration: sample token sequences, then stream them through the model one decoder layer
at a time, accumulating C = X^T X of each layer's v_proj input X (DESIGN.md 3.1).

Only the layer being processed sits on the device; hidden states for all samples stay there
in float32 (samples * seq_len * hidden * 4 bytes)."""

from __future__ import annotations

from pathlib import Path

import torch

from tale_runtime.artifact import sha256_file

from . import ConvertError

TOKENS_PER_BATCH = 4096  # bounds the float64 copy of X and the attention scratch per step


def load_documents(files: list[Path] | None) -> tuple[list[str], dict]:
    """Documents plus a manifest record of where they came from.

    Default: the bundled CC0 corpus (tale_calib). Otherwise local files: each .txt is one
    document, each .json/.jsonl record one document (its `text` field)."""
    if not files:
        from tale_calib import calib_paths, documents

        paths = calib_paths()
        docs = [doc for p in paths for doc in documents(p)]
        return docs, {"source": "tale_calib", "files": {p.name: sha256_file(p) for p in paths}}
    by_kind: dict[str, list[str]] = {"text": [], "json": []}
    for f in files:
        if not f.is_file():
            raise ConvertError(f"calibration file not found: {f}")
        kind = {".txt": "text", ".json": "json", ".jsonl": "json"}.get(f.suffix.lower())
        if kind is None:
            raise ConvertError(f"calibration file {f}: unsupported type (use .txt, .json or .jsonl)")
        by_kind[kind].append(str(f))
    docs = []
    for kind, paths in by_kind.items():
        if paths:
            docs += _load_dataset(kind, paths)
    return docs, {"source": "files", "files": {Path(f).name: sha256_file(f) for f in files}}


def _load_dataset(kind: str, paths: list[str]) -> list[str]:
    import datasets

    extra = {"sample_by": "document"} if kind == "text" else {}
    try:
        ds = datasets.load_dataset(kind, data_files=paths, split="train", **extra)
    except Exception as e:  # datasets raises many types for unreadable input; all mean bad --calib files
        raise ConvertError(f"cannot read calibration files {', '.join(paths)}: {str(e).splitlines()[0]}") from None
    if "text" not in ds.column_names:
        raise ConvertError(f"calibration files {', '.join(paths)} have no 'text' field (fields: {ds.column_names})")
    return [t for t in ds["text"] if t]


def sample_tokens(tokenizer, docs: list[str], samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """[samples, seq_len] token ids: docs joined with EOS, cut into seq_len chunks, `samples`
    of them drawn without replacement with `seed`."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids += doc + ([eos] if eos is not None else [])
    n = len(ids) // seq_len
    if n < samples:
        raise ConvertError(
            f"calibration text too short: {len(ids)} tokens make {n} sequences of {seq_len}, "
            f"need {samples} (add --calib text, or lower --samples / --seq-len)"
        )
    chunks = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    pick = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:samples]
    return chunks[pick]


def v_proj_input(layer, hidden: torch.Tensor) -> torch.Tensor:
    """X, the input of the layer's v_proj: the pre-attention norm of the residual stream."""
    return layer.input_layernorm(hidden)


@torch.no_grad()
def embed(model, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    emb = model.model.embed_tokens.to(device)
    hidden = torch.cat([emb(t.to(device)).float() for t in tokens.split(_batch(tokens.shape[1]))])
    model.model.embed_tokens.to("cpu")
    check_finite(hidden, "in the embeddings")
    return hidden


@torch.no_grad()
def rotary(model, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions 0..seq_len-1, shared by every sample and layer."""
    rope = model.model.rotary_emb.to(device)
    pos = torch.arange(seq_len, device=device)[None]
    return rope(torch.zeros(1, device=device), pos)


@torch.no_grad()
def run_layer(layer, hidden: torch.Tensor, rope, index: int, covariance: bool) -> torch.Tensor | None:
    """Replace `hidden` (on the device) by the layer's output, in place, mini-batch by mini-batch.

    Returns C = X^T X in float64 of the v_proj inputs if `covariance`, else None (a layer
    whose factors are already known only needs to pass the hidden states on)."""
    dtype = next(layer.parameters()).dtype
    device = hidden.device
    layer.to(device=device, dtype=torch.float32)
    d = hidden.shape[-1]
    C = torch.zeros(d, d, dtype=torch.float64, device=device) if covariance else None
    try:
        for s in range(0, len(hidden), _batch(hidden.shape[1])):
            h = hidden[s : s + _batch(hidden.shape[1])]
            if C is not None:
                x = v_proj_input(layer, h).reshape(-1, d).double()
                C.addmm_(x.T, x)
            # attention_mask=None: SDPA runs causal (the calibration batch has no padding)
            out = layer(h, attention_mask=None, position_embeddings=rope)
            h.copy_(out[0] if isinstance(out, tuple) else out)
        check_finite(hidden, f"after layer {index}")
    finally:
        layer.to(device="cpu", dtype=dtype)  # exact: the weights were upcast, never changed
    return C


def check_finite(hidden: torch.Tensor, where: str) -> None:
    if not torch.isfinite(hidden).all():
        raise ConvertError(f"non-finite activations {where}: the checkpoint overflows float32 or is corrupt")


def _batch(seq_len: int) -> int:
    return max(1, TOKENS_PER_BATCH // seq_len)
