"""Partial progress of a conversion, kept in <tmp>/.partial so that --resume can reuse it.

- settings.json: everything the factors depend on (model files, group, calibration tokens).
- layer_NNNN.safetensors: a finished layer's A, B, S (float64) and eps: a few MB each; with a key basis wanted, also
  the layer's basis (key_enc, key_dec, key_mean, float32), fitted in the same pass, and its coefficients' energy
  (key_energy, float64: what --key-rank-policy energy allocates by).
- hidden.safetensors: the calibration hidden states entering layer k. Checkpointed at most
  every HIDDEN_EVERY_S seconds, because it is large (samples*seq_len*hidden*4 bytes); on
  resume, finished layers after the checkpoint are replayed forward only (no covariance, no SVD).
- shards.json: the artifact shards already complete in <tmp> (file -> sha256) and the shard plan
  they belong to; a resumed run keeps them and rewrites only the others (from the source weights
  and the saved factors: no calibration needed for finished layers).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .whiten import Factors

DIR = ".partial"
BASIS = ("key_enc", "key_dec", "key_mean")  # a layer's key basis, as save_layer stores it
KEY_ENERGY = "key_energy"  # beside it: its coefficients' calibration energy [Kb, nb] (--key-rank-policy energy)
HIDDEN_EVERY_S = 60.0


class Partial:
    def __init__(self, root: Path, settings: dict):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.root / "settings.json", lambda p: p.write_text(json.dumps(settings, indent=1)))

    def done(self) -> set[int]:
        if not self.root.is_dir():  # removed once the artifact is complete
            return set()
        names = (re.fullmatch(r"layer_(\d+)\.safetensors", f.name) for f in self.root.iterdir())
        return {int(m.group(1)) for m in names if m}

    def save_layer(self, i: int, f: Factors, seconds: float, basis: dict[str, torch.Tensor] | None = None) -> None:
        tensors = {"A": f.A.cpu().contiguous(), "B": f.B.cpu().contiguous(), "S": f.S.cpu().contiguous()}
        tensors.update({k: t.cpu().contiguous() for k, t in (basis or {}).items()})
        meta = {"eps": repr(f.eps), "seconds": repr(seconds)}
        _atomic_write(self._layer(i), lambda p: save_file(tensors, p, metadata=meta))

    def load_layer(self, i: int) -> tuple[Factors, float]:
        with safe_open(self._layer(i), "pt") as st:
            meta = st.metadata()
            t = {k: st.get_tensor(k) for k in st.keys()}
        return Factors(t["A"], t["B"], t["S"], float(meta["eps"])), float(meta["seconds"])

    def load_basis(self, i: int) -> dict[str, torch.Tensor]:
        """The key basis saved with layer i (key_enc, key_dec, key_mean)."""
        with safe_open(self._layer(i), "pt") as st:
            return {k: st.get_tensor(k) for k in BASIS if k in st.keys()}

    def load_key_energy(self, i: int) -> torch.Tensor | None:
        """The calibration energy of layer i's key basis coefficients [Kb, nb], or None (a partial run from before it
        was saved)."""
        with safe_open(self._layer(i), "pt") as st:
            return st.get_tensor(KEY_ENERGY) if KEY_ENERGY in st.keys() else None

    def shards(self, plan: str) -> dict[str, str]:
        """Complete shards of the shard plan `plan` (a hash of names, shapes, dtype, shard size)."""
        try:
            rec = json.loads((self.root / "shards.json").read_text())
        except (OSError, ValueError):
            return {}
        return rec["done"] if isinstance(rec, dict) and rec.get("plan") == plan else {}

    def save_shard(self, plan: str, name: str, sha256: str) -> None:
        done = {**self.shards(plan), name: sha256}
        _atomic_write(self.root / "shards.json", lambda p: p.write_text(json.dumps({"plan": plan, "done": done})))

    def save_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        _atomic_write(
            self.root / "hidden.safetensors",
            lambda p: save_file({"hidden": hidden.cpu()}, p, metadata={"layer": str(layer)}),
        )

    def load_hidden(self) -> tuple[int, torch.Tensor] | None:
        """(k, hidden states entering layer k), or None if never checkpointed."""
        f = self.root / "hidden.safetensors"
        if not f.is_file():
            return None
        with safe_open(f, "pt") as st:
            return int(st.metadata()["layer"]), st.get_tensor("hidden")

    def _layer(self, i: int) -> Path:
        return self.root / f"layer_{i:04d}.safetensors"


def finished(tmp: Path) -> int:
    """How many finished layers the temp dir `tmp` holds (0: nothing worth keeping)."""
    return len(list((tmp / DIR).glob("layer_*.safetensors")))


def leftovers(out: Path) -> list[Path]:
    """Temp dirs of `out` that interrupted runs left (their process gone): beside it, or inside it where `out` is a
    mount point (write.tmp_dir)."""
    found = [*out.parent.glob(f"{out.name}.tmp-*"), *(out.glob(f".{out.name}.tmp-*") if out.is_dir() else [])]
    return [
        t for t in found if t.is_dir() and t.name.rsplit("-", 1)[-1].isdigit() and not _alive(t.name.rsplit("-", 1)[-1])
    ]


def same_settings(tmp: Path, settings: dict) -> bool:
    try:
        return json.loads((tmp / DIR / "settings.json").read_text()) == settings
    except (OSError, ValueError):
        return False


def find(out: Path, settings: dict) -> Path | None:
    """The temp dir of `out` left by an interrupted run with the same settings (most layers done)."""
    best, most = None, -1
    for tmp in leftovers(out):
        if same_settings(tmp, settings) and (k := finished(tmp)) > most:
            best, most = tmp, k
    return best


def _alive(pid: str) -> bool:
    """Whether another live process owns that temp dir (our own pid: an earlier call of ours)."""
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    return True


def _atomic_write(path: Path, write) -> None:
    """A crash mid-write must not leave a truncated file that a later --resume would trust."""
    tmp = path.with_name(path.name + ".part")
    write(tmp)
    os.replace(tmp, path)
