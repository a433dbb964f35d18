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
from dataclasses import dataclass, field
from pathlib import Path

from tale_runtime import console
from tale_runtime.artifact import MANIFEST, ArtifactError
from tale_runtime.console import UserError

from .evaluation import DEFAULT_LM_EVAL_OUT, Overrides


@dataclass
class LmEvalOptions:
    """tale-eval --lm-eval's options (docs/eval.md, "Standard benchmarks")."""

    tasks: tuple[str, ...]  # lm_eval task names, globs or task YAML files
    out: str | Path = DEFAULT_LM_EVAL_OUT  # a new directory for lm_eval's result files
    limit: float | None = None  # examples per task (a fraction if < 1)
    num_fewshot: int | None = None  # None: the task's
    include_path: str | None = None  # a directory of task YAML files of your own
    batch_size: int = 1  # requests per batch
    overrides: Overrides = field(default_factory=Overrides)  # the TALE schedule's, as in evaluate()
    dtype: str = "bf16"  # bf16 or fp32
    device: str | None = None  # None: cuda if available
    threads: int | None = None  # torch CPU threads
    json_out: str | Path | None = None  # lm_eval's results with tale_cache added; "-": stdout instead of the table
    overwrite: bool = False  # replace an earlier run's out (and json_out)
    quiet: bool = False  # print nothing but errors (and json_out "-"'s object)


def _task_list(tasks: tuple[str, ...], include_path: str | None):
    """lm_eval's TaskManager and the tasks to load (names, or the configs of YAML files), or a one-line refusal."""
    try:
        from lm_eval.tasks import TaskManager
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:
        raise UserError("--lm-eval needs lm-evaluation-harness: pip install 'tale-kv[lm-eval]'") from None
    names = list(dict.fromkeys(t.strip() for t in tasks if t.strip()))
    if not names:
        raise UserError("--lm-eval is empty: name at least one task")
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include-path {include_path}: not a directory")
    manager = TaskManager(include_path=include_path)
    out: list = []
    for name in names:
        if name.endswith((".yaml", ".yml")):  # a task file of the user's (a glob of them)
            found = [load_yaml(f, resolve_func=True) for f in sorted(glob.glob(str(Path(name).expanduser())))]
        else:
            found = [t for t in manager.match_tasks([name]) if t not in out]
        if not found:
            raise UserError(
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
            raise UserError(
                f"--lm-eval {cfg.get('task', t)}: its dataset {path} is not in the local datasets cache "
                f"({datasets.config.HF_DATASETS_CACHE}) and the Hub is unreachable (offline): run it once online to "
                "cache it, or give the task a local copy (a task YAML with dataset_path: /a/local/dir)"
            ) from None


def _check_out(out: Path, artifact: str, overwrite: bool) -> None:
    from .lmeval import replaceable

    if str(out) in ("", "."):
        raise UserError("--lm-eval-out is empty: name a new directory for the results")
    art = Path(artifact).expanduser()
    if (out / MANIFEST).is_file() or (art.exists() and out.absolute() == art.absolute()):
        raise UserError(f"--lm-eval-out {out}: is the TALE artifact itself; write the results elsewhere")
    if where := console.inside_artifact(out):
        raise UserError(
            f"--lm-eval-out {out}: inside the TALE artifact {where} (it would no longer load); write it elsewhere"
        )
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise UserError(f"--lm-eval-out {out} exists (pass --overwrite to replace an earlier run's results)")
        if why := replaceable(out):
            raise UserError(f"--lm-eval-out {out}: refusing to replace it: {why}")
    console.writable_dir(out, "--lm-eval-out")


def run_lm_eval(artifact: str, opts: LmEvalOptions) -> dict:
    """Run lm_eval's tasks on the artifact (a directory or Hub id) with a fresh TALE cache for every generation
    request; print lm_eval's table and the measured ratio (unless quiet), write opts.out (and json_out) and return
    lm_eval's results with `tale_cache` added."""
    limit, num_fewshot, batch_size, threads = opts.limit, opts.num_fewshot, opts.batch_size, opts.threads
    dtype, json_out, quiet = opts.dtype, opts.json_out, opts.quiet
    if limit is not None and limit <= 0:
        raise UserError(f"--limit must be > 0 (a count, or a fraction below 1), got {limit}")
    if limit is not None and limit >= 1 and limit != int(limit):
        raise UserError(f"--limit {limit}: a count of examples is a whole number (a fraction is below 1)")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    for name, v in (("--batch-size", batch_size), ("--threads", threads)):
        if v is not None and v < 1:
            raise UserError(f"{name} must be >= 1, got {v}")
    if dtype not in ("bf16", "fp32"):
        raise UserError(f"--dtype must be bf16 or fp32, got {dtype!r}")
    out_dir = Path(opts.out).expanduser()
    _check_out(out_dir, artifact, opts.overwrite)
    to_stdout = json_out == "-"
    json_path = None
    if json_out is not None and not to_stdout:
        json_path = Path(json_out)
        console.writable_file(json_path, "--json", opts.overwrite)
    device = str(console.device(opts.device))
    manager, task_list = _task_list(opts.tasks, opts.include_path)
    _check_datasets(manager, task_list)
    if threads:
        import torch

        torch.set_num_threads(threads)

    from .lmeval import TaleLM, evaluate, publish

    knobs = opts.overrides.given()
    try:
        lm = TaleLM(artifact, device=device, dtype=dtype, batch_size=batch_size, **knobs)
    except (ArtifactError, ValueError) as e:
        raise UserError(str(e)) from None
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
    return results
