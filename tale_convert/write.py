"""Write the artifact (DESIGN.md 6): sharded safetensors + index streamed as layers finish, model
files, and the move of the finished directory into place."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import queue
import re
import shutil
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from tale_runtime import console
from tale_runtime.artifact import MANIFEST, write_json

from . import ConvertError

INDEX = "model.safetensors.index.json"


@dataclass
class Entry:
    """One tensor of the artifact, known before it is computed."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.finfo(self.dtype).bits // 8


def parse_size(s: str | int) -> int:
    """'2GB', '500MB', '1.5GiB' or a byte count."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(s), re.I)
    if not m:
        raise ConvertError(f"bad size {s!r}: use e.g. 2GB, 500MB or a byte count")
    base = 1024 if m.group(3) else 1000
    size = int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))
    if size < 1:
        raise ConvertError(f"bad size {s!r}: must be positive")
    return size


def plan_shards(entries: list[Entry], shard_size: int) -> list[list[Entry]]:
    """Consecutive entries in shards of at most shard_size bytes (a bigger tensor gets a shard of its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


class ShardWriter:
    """Writes the planned safetensors shards tensor by tensor as they are produced, so the artifact
    never exists whole in memory. Every entry's shape and dtype are known up front, so each shard's
    header is written first and the tensors' bytes are appended in order (safetensors' own
    save_file needs the whole shard as one dict). A background thread writes and hashes while the
    caller computes the next layer.

    A shard is written to `<name>.part` and renamed when complete; `done` (file -> sha256) names
    complete shards of an interrupted run with the same plan, which are kept, not rewritten."""

    def __init__(
        self,
        root: Path,
        entries: list[Entry],
        shard_size: int,
        done: dict[str, str] | None = None,
        on_shard: Callable[[str, str], None] | None = None,
        pending_bytes: int = 1 << 30,
    ):
        self.root, self.on_shard = root, on_shard
        self.pending_bytes = pending_bytes  # handed over but not yet written, at most (a bigger tensor may wait alone)
        self.shards = plan_shards(entries, shard_size)
        n = len(self.shards)
        self.files = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        self.shard_of = {e.name: k for k, shard in enumerate(self.shards) for e in shard}
        self.hashes = {f: h for f, h in (done or {}).items() if f in self.files and (root / f).is_file()}
        self.kept = set(self.hashes)
        self._todo = iter([e for k, shard in enumerate(self.shards) if self.files[k] not in self.kept for e in shard])
        self._entry: Entry | None = None
        self._left = 0  # bytes of self._entry still to come
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._cond = threading.Condition()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tale-shard-writer", daemon=True)
        self._thread.start()

    def needed(self, name: str) -> bool:
        """Whether `name` must still be written (not in a shard kept from an interrupted run)."""
        return self.files[self.shard_of[name]] not in self.kept

    def write_tensor(self, name: str, t: torch.Tensor) -> None:
        """The next tensor of the plan, or the next row chunk of it; ignored if its shard is kept."""
        if not self.needed(name):
            return
        if self._entry is None or self._left == 0:
            self._entry, self._left = next(self._todo, None), None
            if self._entry is not None:
                self._left = self._entry.nbytes
        e = self._entry
        if e is None or e.name != name or t.dtype != e.dtype:
            raise RuntimeError(
                f"artifact writer: got {name} {t.dtype}, expected {e.name if e else 'nothing'} {e.dtype if e else ''}"
            )
        data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if data.numel() > self._left:
            raise RuntimeError(f"artifact writer: {name} is larger than its planned shape {list(e.shape)}")
        self._left -= data.numel()
        with self._cond:
            while self._pending and self._pending + data.numel() > self.pending_bytes and self.error is None:
                self._cond.wait()
            self._pending += data.numel()
        self._raise()
        self._queue.put((self.shard_of[name], data))

    def close(self) -> dict[str, str]:
        """Wait for the last shard, write the index; returns {file: sha256} for every shard."""
        if next(self._todo, None) is not None or self._left:
            raise RuntimeError("artifact writer: closed before every planned tensor was written")
        self._queue.put(None)
        self._thread.join()
        self._raise()
        entries = [e for shard in self.shards for e in shard]
        write_json(
            self.root / INDEX,
            {
                "metadata": {"total_size": sum(e.nbytes for e in entries)},
                "weight_map": {e.name: self.files[self.shard_of[e.name]] for e in entries},
            },
        )
        return {f: self.hashes[f] for f in self.files}

    def abort(self) -> None:
        """Stop without finishing (an error or Ctrl-C in the caller); the shard being written stays a .part."""
        self._stop = True
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _raise(self) -> None:
        if self.error is not None:
            e = self.error
            if isinstance(e, OSError):
                # full disk, no permission: the console's one message for these; anything else names the artifact
                why = console.environment_error(e) or f"cannot write the artifact in {self.root}: {e.strerror or e}"
                raise ConvertError(why) from None
            raise e

    def _run(self) -> None:
        f = h = None
        k_open, left = -1, 0
        try:
            while (item := self._queue.get()) is not None:
                k, data = item
                try:
                    if self._stop or self.error is not None:
                        continue
                    if f is None:
                        f, h, left = self._open(k)
                        k_open = k
                    assert k == k_open, "tensors arrive in shard order"
                    buf = data.numpy()
                    f.write(buf)
                    h.update(buf)
                    left -= len(buf)
                    if left == 0:
                        f.close()
                        f = None
                        name = self.files[k]
                        os.chmod(self.root / (name + ".part"), 0o644)  # an artifact is meant to be shared
                        os.replace(self.root / (name + ".part"), self.root / name)
                        self.hashes[name] = h.hexdigest()
                        if self.on_shard:
                            self.on_shard(name, self.hashes[name])
                finally:
                    with self._cond:
                        self._pending -= data.numel()
                        self._cond.notify_all()
        except BaseException as e:  # handed to the caller at its next write_tensor/close
            self.error = e
            with self._cond:
                self._cond.notify_all()
        finally:
            if f is not None:
                f.close()

    def _open(self, k: int):
        head = _header(self.shards[k])
        f = open(self.root / (self.files[k] + ".part"), "wb")
        h = hashlib.sha256()
        f.write(head)
        h.update(head)
        return f, h, sum(e.nbytes for e in self.shards[k])


def _header(entries: list[Entry]) -> bytes:
    """A safetensors file's header (its length, then the JSON) for these tensors, stored in this order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {
            "dtype": _ST_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def stream_file(path: Path, entries: list[Entry], tensors: Iterable[torch.Tensor]) -> None:
    """One safetensors file written tensor by tensor (`tensors` yields them in the order of `entries`), so only one
    is in memory at a time (readable by all, like the shards)."""
    with open(path, "wb") as f:
        f.write(_header(entries))
        for e, t in zip(entries, tensors, strict=True):
            if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
                raise RuntimeError(f"{path.name}: {e.name} is {t.dtype} {list(t.shape)}, planned {list(e.shape)}")
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    os.chmod(path, 0o644)  # shared like the shards


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse before any work: an existing output needs --overwrite, and only a TALE artifact
    (or an empty directory) may be replaced. Checked again at publish time (publish)."""
    if str(out) in ("", "."):
        raise ConvertError("--out is empty: name the artifact directory to write")
    here = Path.cwd().absolute()
    if out == here or out in here.parents:
        raise ConvertError(f"--out {out}: is the current directory or one above it; name a new directory")
    for above in out.parents:
        if (above / MANIFEST).is_file():
            raise ConvertError(f"--out {out}: inside the TALE artifact {above}; write the new artifact elsewhere")
    if not out.exists() and not out.is_symlink():
        if out.parent.exists() and not out.parent.is_dir():
            raise ConvertError(f"cannot write {out}: {out.parent} is not a directory")
        return
    if not overwrite:
        raise ConvertError(f"{out} exists (pass --overwrite to replace it)")
    if why := not_replaceable(out):
        raise ConvertError(f"refusing to overwrite {out}: {why}")
    if os.path.ismount(out) and not os.access(out, os.W_OK):  # written in place (tmp_dir): it must take files
        raise ConvertError(f"--out {out}: a mount point that is not writable (read-only?); mount it read-write")


def tmp_dir(out: Path) -> Path:
    """Where a conversion writes before publish: beside `out`, renamed into place; inside `out` where it is a mount
    point (a volume, a bind mount: not renamed nor removed, and another file system than its parent)."""
    if os.path.ismount(out):
        return out / f".{out.name}.tmp-{os.getpid()}"
    return out.with_name(f"{out.name}.tmp-{os.getpid()}")


def _ours(out: Path, p: Path) -> bool:
    """Whether `p` lies in a temp dir of a conversion into the mount point `out` (tmp_dir)."""
    top = p.relative_to(out).parts[0]
    return top.startswith(f".{out.name}.tmp-")


def not_replaceable(out: Path) -> str | None:
    """Why `out` may not be replaced by a new artifact (None: it may). Only an empty directory or a TALE
    artifact holding nothing but its own files (the manifest and what it lists) is replaced: never a
    directory of the user's, nor an artifact with files of the user's added. Our temp dirs in it do not count."""
    if out.is_symlink() or not out.is_dir():
        return "it is not a TALE artifact"
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if not p.is_dir() and not _ours(out, p)}
    if not names:
        return None
    if MANIFEST not in names:
        return "it is not a TALE artifact"
    try:
        listed = set(json.loads((out / MANIFEST).read_text()).get("files") or {})
    except (OSError, ValueError, AttributeError):
        return "it is not a TALE artifact (unreadable manifest)"
    extra = sorted(names - listed - {MANIFEST})
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        return f"it holds files that are not part of the artifact ({', '.join(extra[:3])}{more}): move them away first"
    return None


class OutLock:
    """`<out>.lock` beside the output: one tale-convert writes an --out at a time.

    Held with fcntl.flock, so a process that dies (even by SIGKILL) releases it; the file holds the
    owner's pid for the message. A lock file left by a dead process is taken over; it is removed on
    release (after checking it is still the file we locked, so two waiting processes cannot both win)."""

    def __init__(self, out: Path):
        self.path = out.with_name(out.name + ".lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        p = self.path
        if p.is_symlink() or (p.exists() and not p.is_file()):
            raise ConvertError(f"cannot lock {p}: it exists and is not a lock file of tale-convert")
        if p.is_file() and p.stat().st_size and not re.fullmatch(rb"\d+\n?", p.read_bytes()[:32]):
            raise ConvertError(f"cannot lock {p}: it exists and is not a lock file of tale-convert (move it away)")
        for _ in range(50):
            fd = os.open(p, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                owner = _read_pid(p)
                who = f"another tale-convert (pid {owner})" if owner else "another tale-convert"
                raise ConvertError(
                    f"{who} is writing {self.path.with_name(self.path.name[: -len('.lock')])}: "
                    f"wait for it to finish or choose another --out (lock: {p})"
                ) from None
            try:  # the file we locked may have been removed by its previous owner meanwhile: lock the new one
                same = os.fstat(fd).st_ino == os.stat(p).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self.fd = fd
                return
            os.close(fd)
        raise ConvertError(f"cannot lock {p}: it keeps changing")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still held: nobody else can be holding this file
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def _read_pid(p: Path) -> int | None:
    try:
        text = p.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


class PublishError(ConvertError):
    """--out changed while the conversion ran: the finished artifact is kept at `kept` (or nowhere)."""


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` only if nothing is at `dst` (FileExistsError otherwise): renameat2's
    RENAME_NOREPLACE where the kernel has it, so an empty directory made at `dst` meanwhile is not
    silently replaced the way rename(2) replaces one."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        AT_FDCWD, RENAME_NOREPLACE = -100, 1
        if renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST or err == errno.ENOTEMPTY:
            raise FileExistsError(err, os.strerror(err), str(dst))
        if err not in (errno.ENOSYS, errno.EINVAL):  # not supported here (old kernel, some file systems): fall back
            raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def publish(tmp: Path, out: Path, overwrite: bool = False) -> None:
    """Move the finished temp dir into place. Nothing that this run did not create is removed: if --out
    appeared while the conversion ran (without --overwrite), or is no longer something --overwrite may
    replace, it is left as it is and the new artifact is kept beside it (PublishError says where). With
    --overwrite an old artifact is replaced only once the new one is complete."""

    def keep(why: str):
        kept = out.with_name(f"{out.name}.new-{os.getpid()}")
        try:
            _rename_noreplace(tmp, kept)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PublishError(f"{why}; left it untouched (the new artifact was not kept)") from None
        raise PublishError(f"{why}; left it untouched, the new artifact is at {kept}")

    if tmp.parent == out:  # a mount point: its contents replaced in place (it cannot be renamed)
        if why := not_replaceable(out):
            shutil.rmtree(tmp, ignore_errors=True)
            raise PublishError(f"refusing to overwrite {out}: {why}; left it untouched (the new artifact was not kept)")
        for f in out.rglob("*"):  # the old artifact's files (directories such as lost+found stay)
            if not f.is_dir() and not _ours(out, f):
                f.unlink()
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
        tmp.rmdir()
        return
    try:
        _rename_noreplace(tmp, out)
        return
    except FileExistsError:
        pass
    if not overwrite:
        keep(f"{out} appeared while converting (pass --overwrite to replace it)")
    if why := not_replaceable(out):
        keep(f"refusing to overwrite {out}: {why}")
    old = out.with_name(f"{out.name}.tmp-{os.getpid()}-old")
    os.rename(out, old)
    if why := not_replaceable(old):  # changed between the check and the move: put it back
        _rename_noreplace(old, out)
        keep(f"refusing to overwrite {out}: {why}")
    try:
        _rename_noreplace(tmp, out)
    except FileExistsError:  # something else appeared at out meanwhile: the old artifact stays beside it
        keep(f"{out} appeared while converting (the old artifact is at {old})")
    shutil.rmtree(old)


def copy_model_files(root: Path, config, tokenizer, generation_config, dtype: torch.dtype) -> None:
    """config.json (dtype set to what is stored; model_type "tale" with the auto_map of modeling_tale.py, also
    written: tale_runtime.remote_code), tokenizer files, generation_config.json."""
    from tale_runtime import remote_code

    config.dtype = dtype
    config.save_pretrained(root)
    remote_code.write_hub_files(root)
    tokenizer.save_pretrained(root)
    generation_config.save_pretrained(root)
