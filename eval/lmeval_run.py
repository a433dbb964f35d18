"""`tale-eval ARTIFACT --lm-eval TASKS`: lm-evaluation-harness tasks with the TALE cache (tale_eval.lmeval), under
tale-eval's rules: everything the user can get wrong is refused in one line before the model loads, the results go
to a new directory (never inside an artifact; an earlier run's replaced only with --overwrite), and a failed run
leaves nothing behind."""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from tale_runtime import ArtifactError, console
from tale_runtime.artifact import MANIFEST
from tale_runtime.console import fail


def _task_list(tasks: str, include_path: str | None):
    """lm_eval's TaskManager and the tasks to load (names, or the configs of YAML files), or a one-line refusal."""
    try:
        from lm_eval.tasks import TaskManager
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:
        fail("--lm-eval needs lm-evaluation-harness: pip install 'tale-kv[lm-eval]'")
    names = list(dict.fromkeys(t.strip() for t in tasks.split(",") if t.strip()))
    if not names:
        fail("--lm-eval is empty: name at least one task")
    if include_path is not None and not Path(include_path).is_dir():
        fail(f"--include-path {include_path}: not a directory")
    manager = TaskManager(include_path=include_path)
    out: list = []
    for name in names:
        if name.endswith((".yaml", ".yml")):  # a task file of the user's (a glob of them)
            found = [load_yaml(f, resolve_func=True) for f in sorted(glob.glob(str(Path(name).expanduser())))]
        else:
            found = [t for t in manager.match_tasks([name]) if t not in out]
        if not found:
            fail(
                f"unknown lm-eval task {name!r}: `lm-eval ls tasks` lists the installed ones; for a task of your own "
                "pass its YAML file or --include-path DIR"
            )
        out += found
    return manager, out


def _offline() -> bool:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, or the Hub's host unreachable (one connection try, 3 s at most)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return True
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return False
    except OSError:
        return True


def _check_datasets(manager, task_list) -> None:
    """Offline, each task's dataset must be a local directory or in the local datasets cache: refused now in one
    line, not after the model loaded and a minute of retries. Online, datasets downloads what it lacks."""
    if not _offline():
        return
    import datasets
    from huggingface_hub import constants

    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True  # no retries from here on
    for t in task_list:
        entry = manager.task_index.get(t) if isinstance(t, str) else None
        cfg = t if isinstance(t, dict) else (entry.cfg if entry is not None else None) or {}
        path = cfg.get("dataset_path")
        if not isinstance(path, str) or Path(path).expanduser().exists():
            continue
        try:
            datasets.load_dataset_builder(path, cfg.get("dataset_name"), **(cfg.get("dataset_kwargs") or {}))
        except Exception:
            fail(
                f"--lm-eval {cfg.get('task', t)}: its dataset {path} is not in the local datasets cache "
                f"({datasets.config.HF_DATASETS_CACHE}) and the Hub is unreachable (offline): run it once online to "
                "cache it, or give the task a local copy (a task YAML with dataset_path: /a/local/dir)"
            )


def _check_out(out: Path, artifact: str, overwrite: bool) -> None:
    from .lmeval import replaceable

    if str(out) in ("", "."):
        fail("--lm-eval-out is empty: name a new directory for the results")
    art = Path(artifact).expanduser()
    if (out / MANIFEST).is_file() or (art.exists() and out.absolute() == art.absolute()):
        fail(f"--lm-eval-out {out}: is the TALE artifact itself; write the results elsewhere")
    if where := console.inside_artifact(out):
        fail(f"--lm-eval-out {out}: inside the TALE artifact {where} (it would no longer load); write it elsewhere")
    if out.exists() or out.is_symlink():
        if not overwrite:
            fail(f"--lm-eval-out {out} exists (pass --overwrite to replace an earlier run's results)")
        if why := replaceable(out):
            fail(f"--lm-eval-out {out}: refusing to replace it: {why}")
    console.writable_dir(out, "--lm-eval-out")


def run_lm_eval(
    artifact: str,
    tasks: str,
    out: str,
    limit: float | None,
    num_fewshot: int | None,
    include_path: str | None,
    batch_size: int,
    knobs: dict,
    dtype: str,
    device: str | None,
    threads: int | None,
    json_out: str | None,
    overwrite: bool,
    quiet: bool,
) -> None:
    if limit is not None and limit <= 0:
        fail(f"--limit must be > 0 (a count, or a fraction below 1), got {limit}")
    if limit is not None and limit >= 1 and limit != int(limit):
        fail(f"--limit {limit}: a count of examples is a whole number (a fraction is below 1)")
    if num_fewshot is not None and num_fewshot < 0:
        fail(f"--num-fewshot must be >= 0, got {num_fewshot}")
    for name, v in (("--batch-size", batch_size), ("--threads", threads)):
        if v is not None and v < 1:
            fail(f"{name} must be >= 1, got {v}")
    if dtype not in ("bf16", "fp32"):
        fail(f"--dtype must be bf16 or fp32, got {dtype!r}")
    out_dir = Path(out).expanduser()
    _check_out(out_dir, artifact, overwrite)
    to_stdout = json_out == "-"
    json_path = None
    if json_out is not None and not to_stdout:
        json_path = Path(json_out)
        console.writable_file(json_path, "--json", overwrite)
    device = str(console.device(device))
    manager, task_list = _task_list(tasks, include_path)
    _check_datasets(manager, task_list)
    if threads:
        torch.set_num_threads(threads)

    from .lmeval import TaleLM, evaluate, publish

    knobs = {k: v for k, v in knobs.items() if v is not None}
    try:
        lm = TaleLM(artifact, device=device, dtype=dtype, batch_size=batch_size, **knobs)
    except (ArtifactError, ValueError) as e:
        fail(str(e))
    model_args = ",".join(
        [f"pretrained={artifact}", f"dtype={dtype}"]
        + [f"{k}={'/'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in knobs.items()]
    )
    limit_n = None if limit is None else (limit if limit < 1 else int(limit))
    out_dir.absolute().parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.absolute().with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    try:
        results = evaluate(lm, task_list, manager, tmp, model_args, limit=limit_n, num_fewshot=num_fewshot)
        publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after publish; a failed or interrupted run leaves nothing

    from lm_eval.utils import make_table

    c = results["tale_cache"]
    ratio = "n/a (no generate_until request)" if c["ratio"] is None else f"{c['ratio']:.2f}x"
    summary = (
        f"TALE cache over {c['generate_calls']} generate calls: measured {ratio} "
        f"(16-bit K+V bytes / bytes held; nominal {c['nominal']:.2f}x); loglikelihood requests use no cache"
    )
    if to_stdout:
        sys.stdout.write(json.dumps(results, indent=2) + "\n")
    elif not quiet:
        print(make_table(results))
        if "groups" in results:
            print(make_table(results, "groups"))
    log = console.rich_console(stderr=True, quiet=quiet).print
    log(summary, markup=False)
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2) + "\n")
        log(f"wrote {json_path}", markup=False)
    log(f"wrote lm_eval's results into {out_dir}", markup=False)
