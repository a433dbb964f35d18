"""tale-eval's policy table and its frontier, as one call: `evaluate(artifact, EvalOptions(...))`.

Every policy runs on the same model (attention.prepare), the same held-out windows and the same
pass-key samples: decode-mode perplexity (delta against the full 16-bit cache), the measured
compression (16-bit K+V bytes of the same tokens over the bytes the cache holds, at the end of
the run) and pass-key accuracy. Everything the options can get wrong is refused (UserError, one line) before the
model loads. torch, transformers and the policies are imported by the call, not by this module: `tale-eval --help`
starts without them.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from tale_calib import TEST_FILES
from tale_runtime import console
from tale_runtime.console import UserError

from .names import FAMILIES, NAMED, PASSKEY_DEPTHS, PASSKEY_LENGTHS


@dataclass
class RunSize:
    """How much tale-eval runs (`--preset ci|full`, the CLI's name): windows of held-out text, pass-key and retrieval
    samples, the policies of the table. Not a schedule: tale-convert's --preset (tale_runtime.schedule.Preset) is."""

    ctx: int  # tokens per held-out window
    windows: int  # windows (one batch)
    prefill: int  # exact prefix per window
    chunk: int  # tokens per decode call (1: pure decode)
    lengths: tuple[str, ...]  # pass-key haystack lengths
    depths: tuple[float, ...]  # pass-key needle depths
    policies: tuple[str, ...]
    rank_policies: tuple[str, ...]
    texts: tuple[str, ...]  # held-out texts (tale_calib.text_path)
    retrieval_lengths: tuple[str, ...] = ()  # long-context retrieval (retrieval.py): prompt lengths
    retrieval_samples: int = 1  # per task family and length


TEST_TEXTS = tuple(TEST_FILES)
DEFAULT_FRONTIER_OUT = "out/frontier"  # relative to the current directory; make frontier writes docs/frontier
DEFAULT_LM_EVAL_OUT = "out/lm-eval"  # relative to the current directory
RUN_SIZES = {
    # about 10 minutes on a shared 2-core CPU with --threads 1 (docs/eval.md)
    "ci": RunSize(
        512,
        2,
        64,
        4,
        ("1k",),
        (0.1, 0.3, 0.5, 0.7, 0.9),
        ("full", "tale", "kivi2", "kivi4", "quanto4", "hqq4", "streaming", "palu"),
        (),
        ("dev",),
    ),
    # the numbers of docs/quality.md
    "full": RunSize(
        1024,
        5,
        128,
        4,
        tuple(PASSKEY_LENGTHS),
        PASSKEY_DEPTHS,
        NAMED,
        ("energy", "fisher", "progressive"),
        TEST_TEXTS,
    ),
}
# --frontier: many points, each cheaper (ci: about 1-2 min on one thread; full: docs/quality.md)
FRONTIER_RUN_SIZES = {
    "ci": RunSize(256, 1, 32, 8, ("1k",), (0.5,), (), (), ("botchan",)),
    "full": RunSize(1024, 1, 128, 8, ("1k",), (0.3, 0.5, 0.7), (), (), TEST_TEXTS),
}


@dataclass
class Overrides:
    """Overrides of the artifact's TALE schedule (tale-eval's --sinks ... --key-axis); None keeps the artifact's.
    In this order they go into lm_eval's model_args."""

    sinks: int | None = None
    recent: tuple[float, ...] | None = None  # the share of each level above the middle, oldest first
    r0: float | None = None  # the middle level's rank, a fraction of R, all layers (the other levels keep theirs)
    residual: int | None = None  # 16-bit residual tokens
    key_meta: str | None = None  # key scale/zero storage: 16, 8/16 or 8/8
    value_meta: str | None = None  # latent scale/zero storage: 16, 8/16 or 8/8
    key_channel_group: int | None = None  # channels per key group at per-token levels
    rotate: str | None = None  # none or hadamard
    key_rope: str | None = None  # post or pre
    bits: tuple[int, ...] | None = None  # per level, oldest first
    key_bits: tuple[int, ...] | None = None
    key_axis: tuple[str, ...] | None = None  # channel or token, per level

    def given(self) -> dict:
        """The knobs set, as tale_runtime.schedule.override_schedule and tale_eval.lmeval.TaleLM take them."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items() if v is not None}


@dataclass
class EvalOptions:
    """tale-eval's options (docs/eval.md, "Options"); None: the run size's."""

    preset: str = "ci"  # the run size (--preset): ci or full (FRONTIER_RUN_SIZES with frontier); not a schedule
    policies: tuple[str, ...] | None = None  # named rows (names.NAMED)
    rank_policies: tuple[str, ...] | None = None  # extra TALE rows (); () for none
    energy: float = 0.9  # the energy rank policy's threshold
    texts: tuple[str, ...] | None = None  # dev and the test texts
    frontier: bool = False  # sweep every family over its knobs: a markdown table and a PNG plot
    families: tuple[str, ...] | None = None  # frontier: names.FAMILIES
    tale_variants: str | None = None  # frontier: ';'-separated overrides (frontier.parse_variants)
    frontier_out: str | Path | None = None  # frontier: PATH.md and PATH.png (DEFAULT_FRONTIER_OUT)
    ctx: int | None = None  # tokens per held-out window
    windows: int | None = None
    prefill: int | None = None  # exact prefix tokens per window
    chunk: int | None = None  # tokens per decode call
    passkey_lengths: tuple[str, ...] | None = None  # (): no pass-key task
    passkey_depths: tuple[float, ...] | None = None
    retrieval_lengths: tuple[str, ...] | None = None  # 4k, 8k or tokens; (): no retrieval task
    retrieval_tasks: tuple[str, ...] | None = None  # names.RETRIEVAL_FAMILIES
    retrieval_samples: int | None = None  # per task family and length
    shared_prefill: bool = True  # retrieval: one prefill per prompt for every policy whose prefill is exact
    kvpress: tuple[str, ...] | None = None  # kvpress's presses PRESS:RATIO instead of the table (kvpress_baselines)
    overrides: Overrides = field(default_factory=Overrides)
    dtype: str = "bf16"  # compute dtype: bf16 or fp32 (bytes are measured in it)
    device: str | None = None  # None: cuda if available
    threads: int | None = None  # torch CPU threads
    json_out: str | Path | None = None  # a JSON file (rows to FILE.partial as they finish); "-": stdout, no table
    overwrite: bool = False  # replace existing json_out / frontier_out files
    quiet: bool = False  # print nothing but errors (and json_out "-"'s object)


@dataclass
class _Plan:
    """The options resolved against the run size and checked."""

    p: RunSize
    ctx: int
    windows: int
    prefill: int
    chunk: int
    texts: tuple[str, ...]
    ranks: tuple[str, ...]
    depths: tuple[float, ...]
    samples: list
    rt_tokens: tuple[int, ...]
    rt_tasks: tuple[str, ...]
    rt_samples: int
    pols: list
    device: str
    json_path: Path | None = None
    to_stdout: bool = False
    frontier_out: Path | None = None
    specs: list | None = None  # kvpress's presses (kvpress_baselines.Spec), the full cache's row first


def evaluate(artifact: str, opts: EvalOptions | None = None) -> dict:
    """Run every policy of `opts` on the artifact (a directory or Hub id) side by side, or with `opts.frontier` sweep
    every family over its knobs; print the table(s) (unless quiet), write what `opts` asks for and return
    {"config": ..., "results": [one row per policy]}, the object `tale-eval --json` writes."""
    opts = opts or EvalOptions()
    plan = _plan(opts)
    _check_outputs(opts, plan)
    import torch

    from . import policies
    from .attention import prepare

    if opts.threads:
        torch.set_num_threads(opts.threads)
    t0 = time.perf_counter()
    log = console.rich_console(stderr=True, quiet=opts.quiet).print
    if plan.specs is not None:  # kvpress's presses on the base model: its rows hold the full cache's
        rows, ids, rt_samples, model_id, sched_dict = _kvpress_rows(artifact, opts, plan, log)
        model = None
    else:
        model, tok, ids, rt_samples = _load(artifact, opts, plan)
        prepare(model)
        sched = model.tale_spec.schedule
        pols = plan.pols
        for name, rs in _rank_schedules(model, tok, sched, plan.ranks, opts.energy, log).items():
            pols.append(policies.Tale(schedule=rs, tag=name))
        for pol in pols:  # LESS's kernels, TailorKV's layer split: on the calibration text, before any run
            pol.prepare(model, tok, log)
        rows = _rows(model, tok, plan, opts, ids, rt_samples, log)
        model_id, sched_dict = model.tale_spec.manifest.get("base", {}).get("id"), sched.to_dict()
    delta_vs, ref = _reference(model, rows, ids, plan.prefill)
    config = {
        "artifact": str(artifact),
        "model": model_id,
        "preset": opts.preset,
        "frontier": opts.frontier,
        "texts": list(plan.texts),
        "ctx": plan.ctx,
        "windows": plan.windows,
        "prefill": plan.prefill,
        "chunk": plan.chunk,
        "dtype": opts.dtype,
        "passkey_samples": len(plan.samples),
        "retrieval_samples": len(rt_samples),
        "retrieval_lengths": list(plan.rt_tokens),
        "retrieval_tasks": list(plan.rt_tasks),
        "delta_vs": delta_vs,
        "ref_ppl": ref,
        "energy": opts.energy,
        "schedule": sched_dict,
        "seconds": time.perf_counter() - t0,
    }
    if plan.specs is not None:
        from .kvpress_baselines import versions

        names = [sp.name for sp in plan.specs if sp.press]
        config["kvpress"] = dict(versions(), presses=names, shared=opts.shared_prefill)
    result = {"config": config, "results": rows}
    _publish(result, opts, plan, log)
    return result


def _given(flag: str, items: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """A list option; given but empty is refused (it would silently mean the run size's default)."""
    if items is not None and not items:
        raise UserError(f"{flag} is empty: leave it out for the preset's, or name at least one")
    return items


def _plan(opts: EvalOptions) -> _Plan:
    """The run size's values under the options, every name and number checked; the policies to run."""
    from tale_convert import rank_policy

    from . import frontier as frontier_mod
    from . import passkey, policies, retrieval

    specs = _kvpress_specs(opts)  # first: without kvpress nothing else is worth checking
    table = FRONTIER_RUN_SIZES if opts.frontier else RUN_SIZES
    if opts.preset not in table:
        raise UserError(f"unknown --preset {opts.preset!r}: use {' or '.join(table)}")
    p = table[opts.preset]
    names = _given("--policies", opts.policies) or p.policies
    ranks = p.rank_policies if opts.rank_policies is None else opts.rank_policies  # (): none
    if specs is not None:  # the presses' rows and the full cache's, no TALE rows
        names, ranks = (), ()
    lengths = p.lengths if opts.passkey_lengths is None else opts.passkey_lengths  # (): skip the task
    texts = _given("--text", opts.texts) or p.texts
    fams = _given("--families", opts.families) or FAMILIES
    rt_lengths = p.retrieval_lengths if opts.retrieval_lengths is None else opts.retrieval_lengths  # (): skip
    rt_tasks = _given("--retrieval-tasks", opts.retrieval_tasks) or retrieval.FAMILIES
    rt_samples = p.retrieval_samples if opts.retrieval_samples is None else opts.retrieval_samples
    if opts.frontier and (opts.retrieval_lengths or opts.retrieval_tasks or opts.retrieval_samples):
        raise UserError("--retrieval-lengths, --retrieval-tasks and --retrieval-samples do not apply to --frontier")
    depths = p.depths if opts.passkey_depths is None else tuple(opts.passkey_depths)
    for name, v in (
        ("--ctx", opts.ctx),
        ("--windows", opts.windows),
        ("--prefill", opts.prefill),
        ("--chunk", opts.chunk),
        ("--threads", opts.threads),
        ("--retrieval-samples", opts.retrieval_samples),
    ):
        if v is not None and v < 1:  # 0 would silently mean the run size's value
            raise UserError(f"{name} must be >= 1, got {v}")
    try:
        variants = None if opts.tale_variants is None else frontier_mod.parse_variants(opts.tale_variants)
    except ValueError as e:
        raise UserError(str(e)) from None
    ctx, windows = opts.ctx or p.ctx, opts.windows or p.windows
    prefill, chunk = opts.prefill or p.prefill, opts.chunk or p.chunk
    for name, v in (("--sinks", opts.overrides.sinks), ("--residual", opts.overrides.residual)):
        if v is not None and v >= ctx:  # every token would stay exact: a measured 1.00x that looks like a result
            raise UserError(f"{name} {v} covers the whole window of --ctx {ctx} tokens: nothing would be compressed")
    pols: list[policies.Policy] = []
    if opts.frontier:
        for f in fams:
            if f not in FAMILIES:
                raise UserError(f"unknown family {f!r}: use {', '.join(FAMILIES)}")
        pols = [policies.Full()] + frontier_mod.points(list(fams), opts.preset, ctx, variants)
    else:
        for n in names:
            try:
                pols.append(policies.named(n))
            except ValueError as e:
                raise UserError(str(e)) from None
    for pol in pols:
        if why := pol.missing():
            raise UserError(why)
    for n in texts:
        if n != "dev" and n not in TEST_FILES:
            raise UserError(f"unknown --text {n!r}: use dev, {', '.join(TEST_TEXTS)}")
    for n in ranks:
        if n not in rank_policy.POLICIES:
            raise UserError(f"unknown rank policy {n!r}: use {', '.join(rank_policy.POLICIES)}")
    for n in lengths:
        if n not in passkey.LENGTHS:
            raise UserError(f"unknown pass-key length {n!r}: use {', '.join(passkey.LENGTHS)}")
    try:
        rt_tokens = tuple(retrieval.parse_length(n) for n in rt_lengths)
    except ValueError as e:
        raise UserError(str(e)) from None
    for n in rt_tasks:
        if n not in retrieval.FAMILIES:
            raise UserError(f"unknown retrieval task {n!r}: use {', '.join(retrieval.FAMILIES)}")
    if opts.dtype not in ("bf16", "fp32"):
        raise UserError(f"--dtype must be bf16 or fp32, got {opts.dtype!r}")
    if not 0 < opts.energy <= 1:
        raise UserError(f"--energy must be a fraction in (0, 1], got {opts.energy}")
    samples = passkey.load_samples(lengths=lengths, depths=depths) if lengths else []
    if lengths and not samples:
        raise UserError(f"no pass-key samples at depths {depths} (shipped: {', '.join(map(str, passkey.DEPTHS))})")
    if prefill >= ctx:
        raise UserError(f"--prefill ({prefill}) must be smaller than --ctx ({ctx})")
    if specs is not None:
        from .kvpress_baselines import Spec, too_short

        if why := too_short(specs, prefill):
            raise UserError(why)
        specs = [Spec(None), *specs]  # the full cache's row
    device = str(console.device(opts.device))
    return _Plan(
        p, ctx, windows, prefill, chunk, texts, ranks, depths, samples, rt_tokens, rt_tasks, rt_samples, pols, device,
        specs=specs,
    )  # fmt: skip


def _kvpress_specs(opts: EvalOptions) -> list | None:
    """The presses of --kvpress, checked (kvpress importable, ratios, no option that only TALE's rows read), or None."""
    if opts.kvpress is None:
        return None
    from . import kvpress_baselines as kp

    if not kp.available():
        raise UserError(kp.MISSING)
    try:
        specs = kp.parse(",".join(opts.kvpress))
    except ValueError as e:
        raise UserError(str(e)) from None
    if not specs:
        raise UserError("--kvpress is empty: name at least one press, e.g. snapkv:0.75")
    tale_only = dict(
        policies=opts.policies,
        rank_policies=opts.rank_policies,
        frontier=opts.frontier or None,
        families=opts.families,
        tale_variants=opts.tale_variants,
        frontier_out=opts.frontier_out,
        **opts.overrides.given(),
    )
    for name, v in tale_only.items():
        if v is not None:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} does not apply to --kvpress (its rows are the presses and the full cache)")
    return specs


def _check_outputs(opts: EvalOptions, plan: _Plan) -> None:
    """The files to write, checked now, not after the whole evaluation ran."""
    plan.to_stdout = opts.json_out == "-"
    if opts.json_out is not None and not plan.to_stdout:
        json_out = Path(opts.json_out) if str(opts.json_out).strip() else Path("")
        console.writable_file(json_out, "--json", opts.overwrite)
        if console.replaceable(json_out):  # not for /dev/stdout and the like
            console.writable_file(partial_path(json_out), "--json (its FILE.partial)", overwrite=True)
        plan.json_path = json_out
    if opts.frontier:
        if opts.frontier_out is not None and not str(opts.frontier_out).strip():
            raise UserError("--frontier-out is empty: name the path to write (PATH.md and PATH.png)")
        frontier_out = Path(opts.frontier_out or DEFAULT_FRONTIER_OUT)
        if art := console.inside_artifact(frontier_out):
            raise UserError(f"--frontier-out {frontier_out}: inside the TALE artifact {art} (it would no longer load)")
        console.writable_dir(frontier_out.parent, "--frontier-out")
        for f in (frontier_out.with_suffix(".md"), frontier_out.with_suffix(".png")):
            if f.exists() and not opts.overwrite:
                raise UserError(f"--frontier-out: {f} exists (pass --overwrite to replace it)")
        plan.frontier_out = frontier_out


def partial_path(json_out: Path) -> Path:
    """Where the finished rows of a run with json_out go as they come (JSON lines)."""
    return json_out.with_name(json_out.name + ".partial")


def _load(artifact: str, opts: EvalOptions, plan: _Plan):
    """The model (through O^r on every device: the quality figures of docs/quality.md were measured on that path)
    with the schedule overrides, the held-out windows, the retrieval samples; the TALE variants resolved on it."""
    import torch

    from tale_runtime import ArtifactError
    from tale_runtime.load import load
    from tale_runtime.schedule import override_schedule

    from . import perplexity, policies, retrieval

    try:
        dt = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
        model, tok = load(artifact, device=plan.device, dtype=dt, output_path="fused")
        if tok is None:
            raise UserError(f"{artifact}: the artifact has no tokenizer")
        if knobs := opts.overrides.given():
            s = model.tale_spec.schedule
            model.tale_spec.schedule = override_schedule(s, model.tale_spec.arch.latent_rank, len(s.ranks), **knobs)
        ppl_pattern = perplexity.pattern(plan.ctx, plan.prefill, plan.chunk)
        ids = {t: perplexity.heldout_windows(tok, plan.ctx, plan.windows, t) for t in plan.texts}
        rt_samples = retrieval.make_samples(tok, plan.rt_tokens, plan.rt_tasks, plan.rt_samples)  # refuses too short
        for pol in plan.pols:  # invalid TALE variants fail here, before any run
            if isinstance(pol, policies.Tale):
                pol.resolve(model)
    except (ArtifactError, ValueError) as e:
        raise UserError(str(e)) from None
    plan.pols = [replace(p, match_pattern=ppl_pattern) if isinstance(p, policies.Palu) else p for p in plan.pols]
    return model, tok, ids, rt_samples


def _rows(model, tok, plan: _Plan, opts: EvalOptions, ids: dict, rt_samples: list, log) -> list[dict]:
    """One row per policy (perplexity, pass-key), then the retrieval task sample by sample. With a JSON file, each
    finished row (and retrieval sample) is appended to FILE.partial, so an interrupted run keeps it."""
    from . import measure as measure_mod
    from . import policies, retrieval
    from .report import log_row

    rows: list[dict] = []
    pols = plan.pols
    partial = partial_path(plan.json_path) if plan.json_path and console.replaceable(plan.json_path) else None
    if partial:
        partial.write_text("")
    try:
        for pol in pols:
            row = measure_mod.measure(model, tok, pol, ids, plan.prefill, plan.chunk, plan.samples)
            rows.append(row)
            if partial:  # a finished row survives an interrupt (or a crash) of the rows after it
                with open(partial, "a") as f:
                    f.write(json.dumps(row) + "\n")
            log_row(log, row, plan.samples)
        if rt_samples:  # sample by sample: one prefill per prompt for every policy whose prefill is exact
            rt_pols = [replace(pol, match_pattern=None) if isinstance(pol, policies.Palu) else pol for pol in pols]
            _add_retrieval(
                rows,
                partial,
                lambda keep: retrieval.run(model, tok, rt_samples, rt_pols, log, opts.shared_prefill, keep),
            )
    except KeyboardInterrupt:
        if rows and partial:
            log(f"interrupted: {len(rows)} finished row(s) of {len(pols)} kept in {partial} (JSON lines)")
        elif rows:
            log(f"interrupted: {len(rows)} finished row(s) of {len(pols)} were printed above (--json keeps them)")
        raise
    finally:
        if partial and not rows:
            partial.unlink(missing_ok=True)
    return rows


def _rewrite(partial: Path | None, rows: list[dict]) -> None:
    """FILE.partial as the finished rows, one JSON line each (no file: nothing)."""
    if partial:
        partial.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _add_retrieval(rows: list[dict], partial: Path | None, run, extra: tuple[str, ...] = ()) -> None:
    """The retrieval task's fields into each row: `run(keep)` returns one result per row and calls keep(sample,
    per_policy) as each sample finishes (appended to FILE.partial, so a run cut short keeps it); `extra`: result
    fields beyond score, tasks and ratio, stored as retrieval_<name>."""

    def keep(s, per_policy):
        if partial:
            with open(partial, "a") as f:
                f.write(json.dumps({"retrieval_sample": s["id"], "policies": per_policy}) + "\n")

    for row, res in zip(rows, run(keep)):
        row.update(retrieval=res["score"], retrieval_tasks=res["tasks"], retrieval_ratio=res["ratio"])
        row.update({f"retrieval_{k}": res[k] for k in extra}, retrieval_answers=res["answers"])
    _rewrite(partial, rows)


def _kvpress_rows(artifact: str, opts: EvalOptions, plan: _Plan, log):
    """The rows of --kvpress: the full cache and every press on the artifact's base model (kvpress_baselines), each
    with tale-eval's fields; finished parts go to FILE.partial as they come. Returns (rows, held-out windows,
    retrieval samples, the base model's id, the artifact's schedule)."""
    import torch

    from tale_runtime import ArtifactError
    from tale_runtime.artifact import read_manifest
    from tale_runtime.load import resolve

    from . import kvpress_baselines as kp
    from . import perplexity, retrieval
    from .report import log_row

    try:
        kp.import_kvpress()
        dt = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
        model, tok = kp.base_model(artifact, dt, plan.device)
        ids = {t: perplexity.heldout_windows(tok, plan.ctx, plan.windows, t) for t in plan.texts}
        rt_samples = retrieval.make_samples(tok, plan.rt_tokens, plan.rt_tasks, plan.rt_samples)  # refuses too short
    except (ArtifactError, ValueError, OSError) as e:
        raise UserError(str(e)) from None
    manifest = read_manifest(resolve(artifact))
    kp.quiet_warnings()
    partial = partial_path(plan.json_path) if plan.json_path and console.replaceable(plan.json_path) else None
    rows: list[dict] = []
    if partial:
        partial.write_text("")
    try:
        rows = kp.measure(model, tok, plan.specs, ids, plan.prefill, plan.chunk, plan.samples, opts.shared_prefill, log)
        _rewrite(partial, rows)
        for row in rows:
            log_row(log, row, plan.samples)
        if rt_samples:
            _add_retrieval(
                rows,
                partial,
                lambda keep: kp.retrieval_run(model, tok, rt_samples, plan.specs, log, opts.shared_prefill, keep),
                extra=("kept_ratio", "compression_ratio"),
            )
    except KeyboardInterrupt:
        if rows and partial:
            log(f"interrupted: the perplexity and pass-key rows and the finished retrieval samples are in {partial}")
        raise
    finally:
        if partial and not rows:
            partial.unlink(missing_ok=True)
    return rows, ids, rt_samples, manifest.get("base", {}).get("id"), manifest.get("schedule")


def _reference(model, rows: list[dict], ids: dict, prefill: int) -> tuple[str, dict]:
    """Each row's deltas against the full-cache row, or without one against the plain forward pass (which scores
    the same targets); returns what they are against and its perplexities."""
    from . import perplexity
    from .measure import add_deltas

    full = next((r for r in rows if r["policy"] == "full"), None)
    if full is not None:
        delta_vs, ref = "full", dict(full["ppl"])
    else:
        delta_vs, ref = "forward", {}
        for t, x in ids.items():
            nll, count = perplexity.forward_nll(model, x, prefill)
            ref[t] = math.exp(nll / count)
    add_deltas(rows, ref)
    return delta_vs, ref


def _publish(result: dict, opts: EvalOptions, plan: _Plan, log) -> None:
    """The tables (stdout), the JSON object (stdout with "-", else the file, replaced whole), the frontier's files."""
    from . import frontier as frontier_mod
    from .report import retrieval_table, table

    rows, config = result["results"], result["config"]
    table(console.rich_console(quiet=opts.quiet or plan.to_stdout), rows, config)
    if config["retrieval_samples"]:
        retrieval_table(console.rich_console(quiet=opts.quiet or plan.to_stdout), rows, config)
    if plan.to_stdout:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    if plan.frontier_out is not None:
        plan.frontier_out.parent.mkdir(parents=True, exist_ok=True)
        md, png = plan.frontier_out.with_suffix(".md"), plan.frontier_out.with_suffix(".png")
        md.write_text(frontier_mod.markdown(rows, config))
        frontier_mod.plot(rows, config, png)
        log(f"wrote {md} and {png}")
    json_out = plan.json_path
    if json_out:
        tmp = json_out.with_name(f".{json_out.name}.tmp-{os.getpid()}") if console.replaceable(json_out) else None
        target = tmp or json_out  # a regular file is replaced whole (rename); /dev/stdout and the like written to
        target.write_text(json.dumps(result, indent=2) + "\n")
        if tmp:
            os.replace(tmp, json_out)
        if console.replaceable(json_out):
            partial_path(json_out).unlink(missing_ok=True)
        log(f"wrote {json_out}")


def _rank_schedules(model, tok, sched, names, energy, log) -> dict:
    """TALE schedules from the rank policies, all with the artifact's levels and uniform budget."""
    from tale_convert import rank_policy

    a = model.tale_spec.arch
    r0 = _uniform_r0(sched)
    out = {}
    for name in names:
        kw = {}
        if name == "energy":
            kw["spectra"] = [rank_policy.singular_values(layer.self_attn.tale.tale.v_v) for layer in model.model.layers]
            kw["energy"] = energy
        elif name == "fisher":
            log("fisher: gradients of the calibration loss w.r.t. v_proj ...")
            kw["fisher"] = rank_policy.fisher_scores(model, _calib_batches(tok))
        out[name] = rank_policy.apply(
            sched, name, rank_policy.level0_ranks(name, a.latent_rank, a.num_layers, sched.value_group, r0, **kw)
        )
    return out


def _uniform_r0(sched) -> int:
    """The budget: the artifact's mean level-0 rank, rounded down to a quantization group."""
    from tale_runtime.schedule import round_rank

    mean = sum(rs[0] for rs in sched.ranks) / len(sched.ranks)
    R = max(rs[-1] for rs in sched.ranks)
    return round_rank(int(mean) / R, R, sched.value_group)


def _calib_batches(tok, count: int = 4, length: int = 256, batch: int = 2) -> list:
    """Fixed calibration windows (the bundled calibration corpus, never the held-out text)."""
    from tale_convert.stats import calibration_batches

    return calibration_batches(tok, count, length, batch)
