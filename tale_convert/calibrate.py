"""Calibration: sample token sequences, then stream them through the model one decoder layer
at a time, accumulating C = X^T X of each layer's v_proj input X (DESIGN.md 3.1).

Only the layer being processed sits on the device (float32); hidden states for all samples stay
there in float32 (samples * seq_len * hidden * 4 bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tale_runtime import families
from tale_runtime.artifact import sha256_file

from . import ConvertError

TOKENS_PER_BATCH = 4096  # bounds the float64 copy of X and the attention scratch per step


def load_documents(files: list[Path] | None) -> tuple[list[str], dict]:
    """Documents plus a manifest record of where they came from.

    Default: the bundled CC0 corpus (tale_calib). Otherwise local files: each .txt is one
    document, each .json/.jsonl record one document (its `text` field); all read with the
    standard library. .parquet needs `datasets` (the `convert` extra)."""
    if not files:
        from tale_calib import calib_paths, documents

        paths = calib_paths()
        docs = [doc for p in paths for doc in documents(p)]
        return docs, {"source": "tale_calib", "files": {p.name: sha256_file(p) for p in paths}}
    for f in files:
        if f.is_dir():
            raise ConvertError(f"--calib {f}: is a directory; give the files (e.g. --calib {f}/a.txt, repeatable)")
        if not f.is_file():
            raise ConvertError(f"calibration file not found: {f}" if not f.exists() else f"--calib {f}: not a file")
        if f.suffix.lower() not in READERS:
            raise ConvertError(f"calibration file {f}: unsupported type (use {', '.join(READERS)})")
    docs = []
    for suffixes, reader in ((".txt", _text), ((".json", ".jsonl"), _json), (".parquet", _parquet)):
        # text files first, then json, as before
        docs += [t for f in files if f.suffix.lower() in suffixes for t in reader(f) if t]
    return docs, {"source": "files", "files": {Path(f).name: sha256_file(f) for f in files}}


def _text(f: Path) -> list[str]:
    try:
        return [f.read_text(encoding="utf-8-sig")]  # -sig: a leading byte-order mark is not text
    except (OSError, UnicodeDecodeError) as e:
        raise ConvertError(f"cannot read calibration file {f}: {e}") from None


def _json(f: Path) -> list[str]:
    """A .jsonl file (one object per line), or a .json file holding one object or a list of them."""
    try:
        raw = f.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ConvertError(f"cannot read calibration file {f}: {str(e).splitlines()[0]}") from None
    if f.suffix.lower() == ".json":
        try:
            records = json.loads(raw)
            return _texts(f, records if isinstance(records, list) else [records])
        except json.JSONDecodeError:
            pass  # a .json file may hold JSON lines too
    records = []
    for n, line in enumerate(raw.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConvertError(f"calibration file {f}, line {n}: not JSON ({e.msg}, column {e.colno})") from None
    return _texts(f, records)


def _parquet(f: Path) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise ConvertError(
            f"calibration file {f}: reading .parquet needs the `datasets` package: pip install 'tale-kv[convert]'"
        ) from None
    try:
        ds = datasets.load_dataset("parquet", data_files=[str(f)], split="train")
    except Exception as e:  # datasets raises many types for unreadable input; all mean a bad --calib file
        raise ConvertError(f"cannot read calibration file {f}: {str(e).splitlines()[0]}") from None
    return _texts(f, ds.to_list())


def _texts(f: Path, records: list) -> list[str]:
    if not records or not all(isinstance(r, dict) and isinstance(r.get("text"), str) for r in records):
        bad = next((r for r in records if not (isinstance(r, dict) and isinstance(r.get("text"), str))), None)
        fields = sorted(bad) if isinstance(bad, dict) else type(bad).__name__
        raise ConvertError(f"calibration file {f}: a record has no 'text' field (fields: {fields})")
    return [r["text"] for r in records]


READERS = {".txt": _text, ".json": _json, ".jsonl": _json, ".parquet": _parquet}  # suffix -> reader


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
def embed(weight: torch.Tensor, tokens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Calibration hidden states entering layer 0, float32 on weight's device: [samples, seq_len, d]. `scale`: the
    factor a scaled embedding (Gemma) multiplies them by."""
    hidden = torch.cat(
        [
            torch.nn.functional.embedding(t.to(weight.device), weight).float()
            for t in tokens.split(_batch(tokens.shape[1]))
        ]
    )
    if scale is not None:
        hidden *= scale
    check_finite(hidden, "in the embeddings")
    return hidden


@torch.no_grad()
def rotary(model, seq_len: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, cos/sin for positions 0..seq_len-1, shared by every sample (and by the layers of one RoPE: Gemma 3's
    sliding and global layers have one each). A fresh copy of the model's rotary module: its inv_freq buffers are
    computed from the config (the model may be on meta)."""
    rope = type(model.model.rotary_emb)(config=model.config).to(device)
    pos = torch.arange(seq_len, device=device)[None]
    x = torch.zeros(1, device=device)
    tables = {}
    for t in dict.fromkeys(types := families.rope_types(model.config)):
        tables[t] = rope(x, pos) if t is None else rope(x, pos, t)
    return [tables[t] for t in types]


@torch.no_grad()
def run_layer(layer, hidden: torch.Tensor, rope, index: int, covariance: bool) -> torch.Tensor | None:
    """Replace `hidden` (on the device) by the layer's output, in place, mini-batch by mini-batch.
    `layer` is on the same device, in float32.

    Returns C = X^T X in float64 of the v_proj inputs if `covariance`, else None (a layer
    whose factors are already known only needs to pass the hidden states on)."""
    d = hidden.shape[-1]
    C = torch.zeros(d, d, dtype=torch.float64, device=hidden.device) if covariance else None
    for s in range(0, len(hidden), _batch(hidden.shape[1])):
        h = hidden[s : s + _batch(hidden.shape[1])]
        if C is not None:
            x = v_proj_input(layer, h).reshape(-1, d).double()
            C.addmm_(x.T, x)
        # attention_mask=None: SDPA runs causal (the calibration batch has no padding)
        out = layer(h, attention_mask=None, position_embeddings=rope)
        h.copy_(out[0] if isinstance(out, tuple) else out)
    check_finite(hidden, f"after layer {index}")
    return C


def check_finite(hidden: torch.Tensor, where: str) -> None:
    if not torch.isfinite(hidden).all():
        raise ConvertError(f"non-finite activations {where}: the checkpoint overflows float32 or is corrupt")


def _batch(seq_len: int) -> int:
    return max(1, TOKENS_PER_BATCH // seq_len)
