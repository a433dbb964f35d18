"""`tale-eval`: quality lost by each cache policy, at what measured compression, side by side.

Every policy runs on the same model (attention.prepare), the same held-out windows and the same
pass-key samples: decode-mode perplexity (delta against the full 16-bit cache), the measured
compression (16-bit K+V bytes of the same tokens over the bytes the cache holds, at the end of
the run) and pass-key accuracy.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from tale_calib import TEST_FILES
from tale_runtime import console
from tale_runtime.console import fail

from .names import FAMILIES, NAMED, PASSKEY_DEPTHS, PASSKEY_LENGTHS, RETRIEVAL_FAMILIES

if TYPE_CHECKING:
    import torch

# torch, transformers and the policies are imported by run() itself: `tale-eval --help` starts without them

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Evaluate TALE against full, KIVI, quanto, HQQ, StreamingLLM, Palu, LESS and TailorKV caches on one artifact.",
)


@dataclass
class Preset:
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
PRESETS = {
    # about 10 minutes on a shared 2-core CPU with --threads 1 (docs/eval.md)
    "ci": Preset(
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
    "full": Preset(
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
FRONTIER_PRESETS = {
    "ci": Preset(256, 1, 32, 8, ("1k",), (0.5,), (), (), ("botchan",)),
    "full": Preset(1024, 1, 128, 8, ("1k",), (0.3, 0.5, 0.7), (), (), TEST_TEXTS),
}


def _csv(s: str | None) -> tuple[str, ...] | None:
    return None if s is None else tuple(x.strip() for x in s.split(",") if x.strip())


def _shares(s: str | None) -> list[float] | None:
    """--recent 0.05,0.1: one share per level above the middle, as tale-run and tale-convert take it."""
    try:
        return None if s is None else [float(x) for x in _csv(s)]
    except ValueError:
        fail(f"--recent takes comma-separated shares, e.g. 0.05,0.1; got {s!r}")


@app.command()
def run(
    artifact: str = typer.Argument(..., help="TALE artifact directory (tale-convert output) or Hub id"),
    preset: str = typer.Option("ci", help="ci (minutes on a laptop CPU) or full (the docs/quality.md numbers)"),
    policy_names: Optional[str] = typer.Option(None, "--policies", help=f"comma list of {', '.join(NAMED)}"),
    rank_policies: Optional[str] = typer.Option(
        None, help="extra TALE rows with these rank policies: uniform, energy, fisher, progressive ('' for none)"
    ),
    energy: float = typer.Option(0.9, help="energy policy: whitened spectral energy kept per layer at level 0"),
    text: Optional[str] = typer.Option(
        None, help=f"held-out texts, comma list of dev (tune on it), {', '.join(TEST_TEXTS)} (report on them)"
    ),
    frontier: bool = typer.Option(
        False,
        "--frontier",
        help="sweep every policy over its knob(s): a markdown table and a PNG plot of quality vs measured compression",
    ),
    families: Optional[str] = typer.Option(None, help=f"--frontier: comma list of {', '.join(FAMILIES)}"),
    tale_variants: Optional[str] = typer.Option(
        None,
        help="--frontier: TALE points, ';'-separated overrides, e.g. "
        "'-; key_bits=4/4; r0=0.25,key_group=64,value_group=64,residual=64'",
    ),
    frontier_out: Optional[str] = typer.Option(
        None,
        help=f"--frontier: writes PATH.md and PATH.png (default: {DEFAULT_FRONTIER_OUT}, under the current directory)",
    ),
    ctx: Optional[int] = typer.Option(None, help="tokens per held-out window"),
    windows: Optional[int] = typer.Option(None, help="held-out windows"),
    prefill: Optional[int] = typer.Option(None, help="exact prefix tokens per window"),
    chunk: Optional[int] = typer.Option(None, help="tokens per decode call (1 = token by token)"),
    passkey_lengths: Optional[str] = typer.Option(None, help="pass-key lengths: 1k,2k ('' to skip the task)"),
    passkey_depths: Optional[str] = typer.Option(None, help="pass-key needle depths, e.g. 0.1,0.5,0.9"),
    retrieval_lengths: Optional[str] = typer.Option(
        None,
        help="long-context retrieval (RULER's synthetic tasks) at these prompt lengths: 4k,8k or tokens "
        "('' to skip the task)",
    ),
    retrieval_tasks: Optional[str] = typer.Option(
        None, help=f"retrieval task families, comma list of {', '.join(RETRIEVAL_FAMILIES)} (default: all)"
    ),
    retrieval_samples: Optional[int] = typer.Option(None, help="retrieval samples per task family and length"),
    no_shared_prefill: bool = typer.Option(
        False, "--no-shared-prefill", help="retrieval: every policy prefills each prompt itself (slower, same result)"
    ),
    sinks: Optional[int] = typer.Option(None, help="TALE: override the artifact's sink tokens"),
    recent: Optional[str] = typer.Option(
        None, help="TALE: override the recent share p of each level above the middle, oldest first, e.g. 0.05,0.1"
    ),
    r0: Optional[float] = typer.Option(
        None, help="TALE: override the level-0 (middle) rank, a fraction of R, all layers; other levels keep theirs"
    ),
    bits: Optional[str] = typer.Option(None, help="TALE: override the bits per level, oldest first, e.g. 2,4"),
    key_bits: Optional[str] = typer.Option(None, help="TALE: override the key bits per level, e.g. 4,4"),
    key_axis: Optional[str] = typer.Option(
        None, help="TALE: keys per 'channel' (KIVI) or per 'token', per level, e.g. channel,token"
    ),
    key_meta: Optional[str] = typer.Option(None, help="TALE: key scale/zero storage: 16, 8/16 or 8/8"),
    value_meta: Optional[str] = typer.Option(None, help="TALE: latent scale/zero storage: 16, 8/16 or 8/8"),
    key_channel_group: Optional[int] = typer.Option(None, help="TALE: channels per key group at per-token levels"),
    rotate: Optional[str] = typer.Option(None, help="TALE: rotate q and k after RoPE: none or hadamard"),
    key_rope: Optional[str] = typer.Option(None, help="TALE: quantize keys after RoPE (post) or before it (pre)"),
    residual: Optional[int] = typer.Option(None, help="TALE: 16-bit residual tokens"),
    dtype: str = typer.Option("bf16", help="compute dtype: bf16 or fp32 (bytes are measured in it)"),
    device: Optional[str] = typer.Option(None, help="cpu, cuda, ... (default: cuda if available)"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    json_out: Optional[str] = typer.Option(
        None,
        "--json",
        help="also write the results to this JSON file (finished rows go to FILE.partial as they come); '-': the "
        "JSON object on stdout instead of the table, nothing else",
    ),
    kvpress_specs: Optional[str] = typer.Option(
        None,
        "--kvpress",
        help="kvpress's presses on the artifact's base model instead of the policy table, comma list of PRESS:RATIO "
        "(snapkv, expected_attention, kvzip, streaming_llm, knorm, tova, pyramidkv; RATIO the share of the prompt "
        "pruned, kvpress's compression_ratio, or Nx: N times fewer bytes than 16-bit), e.g. snapkv:0.75,kvzip:4x; "
        "in kvpress's venv (make kvpress-env, docs/eval.md)",
    ),
    lm_eval_tasks: Optional[str] = typer.Option(
        None,
        "--lm-eval",
        help="run these lm-evaluation-harness tasks (comma list of names, globs or YAML files) with the TALE cache "
        "instead of the policy table (docs/eval.md)",
    ),
    limit: Optional[float] = typer.Option(None, help="--lm-eval: examples per task (a fraction if < 1)"),
    num_fewshot: Optional[int] = typer.Option(None, help="--lm-eval: few-shot examples per prompt"),
    lm_eval_out: Optional[str] = typer.Option(
        None, help=f"--lm-eval: a new directory for lm_eval's result files (default: {DEFAULT_LM_EVAL_OUT})"
    ),
    include_path: Optional[str] = typer.Option(None, help="--lm-eval: a directory of your own task YAML files"),
    batch_size: Optional[int] = typer.Option(None, help="--lm-eval: requests per batch (default 1)"),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="replace existing --json / --frontier-out files (or an earlier --lm-eval-out run)"
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors (and --json -'s object)"),
) -> None:
    import torch

    from tale_convert import policy as rank_policy
    from tale_runtime import ArtifactError
    from tale_runtime.load import load
    from tale_runtime.schedule import override_schedule

    from . import frontier as frontier_mod
    from . import passkey, perplexity, policies, retrieval
    from .attention import prepare
    from .measure import add_deltas, measure

    specs = None
    if kvpress_specs is not None:  # first: without kvpress nothing else is worth checking
        from . import kvpress_baselines

        if not kvpress_baselines.available():
            fail(kvpress_baselines.MISSING)
        try:
            specs = kvpress_baselines.parse(kvpress_specs)
        except ValueError as e:
            fail(str(e))
        tale_only = dict(
            lm_eval=lm_eval_tasks,
            frontier=frontier or None,
            policies=policy_names,
            rank_policies=rank_policies,
            families=families,
            tale_variants=tale_variants,
            frontier_out=frontier_out,
            sinks=sinks,
            recent=recent,
            r0=r0,
            bits=bits,
            key_bits=key_bits,
            key_axis=key_axis,
            key_meta=key_meta,
            value_meta=value_meta,
            key_channel_group=key_channel_group,
            rotate=rotate,
            key_rope=key_rope,
            residual=residual,
        )
        for name, v in tale_only.items():
            if v is not None:
                fail(
                    f"--{name.replace('_', '-')} does not apply to --kvpress (its rows are the presses and the full cache)"
                )
    lm_only = dict(limit=limit, num_fewshot=num_fewshot, lm_eval_out=lm_eval_out, include_path=include_path)
    lm_only["batch_size"] = batch_size
    if lm_eval_tasks is None:
        for name, v in lm_only.items():
            if v is not None:
                fail(f"--{name.replace('_', '-')} applies to --lm-eval only")
    else:
        policy_only = dict(
            policies=policy_names,
            rank_policies=rank_policies,
            text=text,
            families=families,
            tale_variants=tale_variants,
            frontier_out=frontier_out,
            ctx=ctx,
            windows=windows,
            prefill=prefill,
            chunk=chunk,
            passkey_lengths=passkey_lengths,
            passkey_depths=passkey_depths,
            retrieval_lengths=retrieval_lengths,
            retrieval_tasks=retrieval_tasks,
            retrieval_samples=retrieval_samples,
            no_shared_prefill=no_shared_prefill or None,
        )
        for name, v in dict(policy_only, frontier=frontier or None).items():
            if v is not None:
                fail(f"--{name.replace('_', '-')} does not apply to --lm-eval")
        from .lmeval_run import run_lm_eval

        knobs = dict(
            sinks=sinks, recent=_shares(recent), r0=r0, residual=residual, key_meta=key_meta, value_meta=value_meta
        )
        knobs |= dict(key_channel_group=key_channel_group, rotate=rotate, key_rope=key_rope)
        try:
            knobs["bits"] = None if bits is None else [int(x) for x in _csv(bits)]
            knobs["key_bits"] = None if key_bits is None else [int(x) for x in _csv(key_bits)]
        except ValueError:
            fail("--bits and --key-bits take comma-separated numbers, e.g. 2,4")
        knobs["key_axis"] = _csv(key_axis) and list(_csv(key_axis))
        run_lm_eval(
            artifact,
            lm_eval_tasks,
            out=lm_eval_out if lm_eval_out is not None else DEFAULT_LM_EVAL_OUT,
            limit=limit,
            num_fewshot=num_fewshot,
            include_path=include_path,
            batch_size=batch_size or 1,
            knobs=knobs,
            dtype=dtype,
            device=device,
            threads=threads,
            json_out=json_out,
            overwrite=overwrite,
            quiet=quiet,
        )
        return
    table = FRONTIER_PRESETS if frontier else PRESETS
    if preset not in table:
        fail(f"unknown --preset {preset!r}: use {' or '.join(table)}")
    p = table[preset]
    names = _given("--policies", policy_names) or p.policies
    ranks = p.rank_policies if rank_policies is None else _csv(rank_policies)  # '': none (documented)
    lengths = p.lengths if passkey_lengths is None else _csv(passkey_lengths)  # '': skip the task (documented)
    texts = _given("--text", text) or p.texts
    fams = _given("--families", families) or FAMILIES
    rt_lengths = p.retrieval_lengths if retrieval_lengths is None else _csv(retrieval_lengths)  # '': skip
    rt_tasks = _given("--retrieval-tasks", retrieval_tasks) or retrieval.FAMILIES
    rt_samples = p.retrieval_samples if retrieval_samples is None else retrieval_samples
    if frontier and (retrieval_lengths or retrieval_tasks or retrieval_samples):
        fail("--retrieval-lengths, --retrieval-tasks and --retrieval-samples do not apply to --frontier")
    try:
        depths = p.depths if passkey_depths is None else tuple(float(x) for x in _csv(passkey_depths))
        bits_l = None if bits is None else [int(x) for x in _csv(bits)]
        key_bits_l = None if key_bits is None else [int(x) for x in _csv(key_bits)]
    except ValueError:
        fail("--passkey-depths, --bits and --key-bits take comma-separated numbers, e.g. 0.1,0.5 or 2,4")
    for name, v in (
        ("--ctx", ctx),
        ("--windows", windows),
        ("--prefill", prefill),
        ("--chunk", chunk),
        ("--threads", threads),
        ("--retrieval-samples", retrieval_samples),
    ):
        if v is not None and v < 1:  # 0 would silently mean the preset's value
            fail(f"{name} must be >= 1, got {v}")
    try:
        variants = None if tale_variants is None else frontier_mod.parse_variants(tale_variants)
    except ValueError as e:
        fail(str(e))
    ctx, windows, prefill, chunk = ctx or p.ctx, windows or p.windows, prefill or p.prefill, chunk or p.chunk
    for name, v in (("--sinks", sinks), ("--residual", residual)):
        if v is not None and v >= ctx:  # every token would stay exact: a measured 1.00x that looks like a result
            fail(f"{name} {v} covers the whole window of --ctx {ctx} tokens: nothing would be compressed")
    pols: list[policies.Policy] = []
    if specs is not None:
        pass  # kvpress's rows: the presses and the full cache, made below
    elif frontier:
        for f in fams:
            if f not in FAMILIES:
                fail(f"unknown family {f!r}: use {', '.join(FAMILIES)}")
        pols = [policies.Full()] + frontier_mod.points(list(fams), preset, ctx, variants)
    else:
        for n in names:
            try:
                pols.append(policies.named(n))
            except ValueError as e:
                fail(str(e))
    for pol in pols:
        if why := pol.missing():
            fail(why)
    for n in texts:
        if n != "dev" and n not in TEST_FILES:
            fail(f"unknown --text {n!r}: use dev, {', '.join(TEST_TEXTS)}")
    for n in ranks:
        if n not in rank_policy.POLICIES:
            fail(f"unknown rank policy {n!r}: use {', '.join(rank_policy.POLICIES)}")
    for n in lengths:
        if n not in passkey.LENGTHS:
            fail(f"unknown pass-key length {n!r}: use {', '.join(passkey.LENGTHS)}")
    try:
        rt_tokens = tuple(retrieval.parse_length(n) for n in rt_lengths)
    except ValueError as e:
        fail(str(e))
    for n in rt_tasks:
        if n not in retrieval.FAMILIES:
            fail(f"unknown retrieval task {n!r}: use {', '.join(retrieval.FAMILIES)}")
    if dtype not in ("bf16", "fp32"):
        fail(f"--dtype must be bf16 or fp32, got {dtype!r}")
    if not 0 < energy <= 1:
        fail(f"--energy must be a fraction in (0, 1], got {energy}")
    samples = passkey.load_samples(lengths=lengths, depths=depths) if lengths else []
    if lengths and not samples:
        fail(f"no pass-key samples at depths {depths} (shipped: {', '.join(map(str, passkey.DEPTHS))})")
    if prefill >= ctx:
        fail(f"--prefill ({prefill}) must be smaller than --ctx ({ctx})")
    if specs is not None and (why := kvpress_baselines.too_short(specs, prefill)):
        fail(why)
    device = str(console.device(device))
    to_stdout = json_out == "-"
    if to_stdout:
        json_out = None
    if json_out is not None:  # checked now, not after the whole evaluation ran
        json_out = Path(json_out) if json_out.strip() else Path("")
        console.writable_file(json_out, "--json", overwrite)
        if console.replaceable(json_out):  # not for /dev/stdout and the like
            console.writable_file(_partial(json_out), "--json (its FILE.partial)", overwrite=True)
    if frontier:
        if frontier_out is not None and not frontier_out.strip():
            fail("--frontier-out is empty: name the path to write (PATH.md and PATH.png)")
        frontier_out = Path(frontier_out or DEFAULT_FRONTIER_OUT)
        if art := console.inside_artifact(frontier_out):
            fail(f"--frontier-out {frontier_out}: inside the TALE artifact {art} (it would no longer load)")
        console.writable_dir(frontier_out.parent, "--frontier-out")
        for f in (frontier_out.with_suffix(".md"), frontier_out.with_suffix(".png")):
            if f.exists() and not overwrite:
                fail(f"--frontier-out: {f} exists (pass --overwrite to replace it)")
    if threads:
        torch.set_num_threads(threads)

    t0 = time.perf_counter()
    if specs is not None:
        rows, ids, rt_samples_l, model_id, sched_dict = _kvpress_rows(
            artifact,
            specs,
            dtype,
            device,
            texts,
            ctx,
            windows,
            prefill,
            chunk,
            samples,
            rt_tokens,
            rt_tasks,
            rt_samples,
            not no_shared_prefill,
            json_out,
            quiet,
        )
        model = None
        partial = _partial(json_out) if json_out and console.replaceable(json_out) else None
        log = console.rich_console(stderr=True, quiet=quiet).print
    else:
        try:
            # through O^r on every device: the quality figures of docs/quality.md were measured on that path
            dt = torch.bfloat16 if dtype == "bf16" else torch.float32
            model, tok = load(artifact, device=device, dtype=dt, output_path="fused")
            if tok is None:
                fail(f"{artifact}: the artifact has no tokenizer")
            formats = dict(
                key_axis=_csv(key_axis) and list(_csv(key_axis)),
                key_meta=key_meta,
                value_meta=value_meta,
                key_channel_group=key_channel_group,
                rotate=rotate,
                key_rope=key_rope,
                residual=residual,
            )
            formats = {k: v for k, v in formats.items() if v is not None}
            if formats or any(x is not None for x in (sinks, recent, r0, bits_l, key_bits_l)):
                s = model.tale_spec.schedule
                model.tale_spec.schedule = override_schedule(
                    s,
                    model.tale_spec.arch.latent_rank,
                    len(s.ranks),
                    sinks=sinks,
                    recent=_shares(recent),
                    r0=r0,
                    bits=bits_l,
                    key_bits=key_bits_l,
                    **formats,
                )
            ppl_pattern = perplexity.pattern(ctx, prefill, chunk)
            ids = {t: perplexity.heldout_windows(tok, ctx, windows, t) for t in texts}
            rt_samples_l = retrieval.make_samples(tok, rt_tokens, rt_tasks, rt_samples)  # refuses a length too short
            for pol in pols:  # invalid TALE variants fail here, before any run
                if isinstance(pol, policies.Tale):
                    pol.resolve(model)
        except (ArtifactError, ValueError) as e:
            fail(str(e))
        prepare(model)
        sched = model.tale_spec.schedule
        log = console.rich_console(stderr=True, quiet=quiet).print
        pols = [replace(pol, match_pattern=ppl_pattern) if isinstance(pol, policies.Palu) else pol for pol in pols]
        for name, rs in _rank_schedules(model, tok, sched, ranks, energy, log).items():
            pols.append(policies.Tale(schedule=rs, tag=name))
        for pol in pols:  # LESS's kernels, TailorKV's layer split: on the calibration text, before any run
            pol.prepare(model, tok, log)

        rows = []
        partial = _partial(json_out) if json_out and console.replaceable(json_out) else None
        if partial:
            partial.write_text("")
        try:
            for pol in pols:
                row = measure(model, tok, pol, ids, prefill, chunk, samples)
                rows.append(row)
                if partial:  # a finished row survives an interrupt (or a crash) of the rows after it
                    with open(partial, "a") as f:
                        f.write(json.dumps(row) + "\n")
                _log_row(log, row, samples)
            if rt_samples_l:  # sample by sample: one prefill per prompt for every policy whose prefill is exact
                rt_pols = [replace(pol, match_pattern=None) if isinstance(pol, policies.Palu) else pol for pol in pols]

                def keep(s, per_policy):  # a run cut short keeps its finished samples
                    if partial:
                        with open(partial, "a") as f:
                            f.write(json.dumps({"retrieval_sample": s["id"], "policies": per_policy}) + "\n")

                results = retrieval.run(model, tok, rt_samples_l, rt_pols, log, not no_shared_prefill, keep)
                for row, res in zip(rows, results):
                    row.update(
                        retrieval=res["score"],
                        retrieval_tasks=res["tasks"],
                        retrieval_ratio=res["ratio"],
                        retrieval_answers=res["answers"],
                    )
                if partial:
                    partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
        except KeyboardInterrupt:
            if rows and partial:
                log(f"interrupted: {len(rows)} finished row(s) of {len(pols)} kept in {partial} (JSON lines)")
            elif rows:
                log(f"interrupted: {len(rows)} finished row(s) of {len(pols)} were printed above (--json keeps them)")
            raise
        finally:
            if partial and not rows:
                partial.unlink(missing_ok=True)
        model_id = model.tale_spec.manifest.get("base", {}).get("id")
        sched_dict = sched.to_dict()
    full = next((r for r in rows if r["policy"] == "full"), None)
    delta_vs = "full"
    if full is not None:
        ref = dict(full["ppl"])
    else:  # no full-cache row: the plain forward pass scores the same targets
        ref = {}
        for t, x in ids.items():
            nll, count = perplexity.forward_nll(model, x, prefill)
            ref[t] = math.exp(nll / count)
        delta_vs = "forward"
    add_deltas(rows, ref)

    config = {
        "artifact": str(artifact),
        "model": model_id,
        "preset": preset,
        "frontier": frontier,
        "texts": list(texts),
        "ctx": ctx,
        "windows": windows,
        "prefill": prefill,
        "chunk": chunk,
        "dtype": dtype,
        "passkey_samples": len(samples),
        "retrieval_samples": len(rt_samples_l),
        "retrieval_lengths": list(rt_tokens),
        "retrieval_tasks": list(rt_tasks),
        "delta_vs": delta_vs,
        "ref_ppl": ref,
        "energy": energy,
        "schedule": sched_dict,
        "seconds": time.perf_counter() - t0,
    }
    if specs is not None:
        from .kvpress_baselines import versions

        config["kvpress"] = dict(versions(), presses=[s.name for s in specs if s.press], shared=not no_shared_prefill)
    _table(console.rich_console(quiet=quiet or to_stdout), rows, config)
    if rt_samples_l:
        _retrieval_table(console.rich_console(quiet=quiet or to_stdout), rows, config)
    if to_stdout:
        sys.stdout.write(json.dumps({"config": config, "results": rows}, indent=2) + "\n")
    if frontier:
        frontier_out.parent.mkdir(parents=True, exist_ok=True)
        md, png = frontier_out.with_suffix(".md"), frontier_out.with_suffix(".png")
        md.write_text(frontier_mod.markdown(rows, config))
        frontier_mod.plot(rows, config, png)
        log(f"wrote {md} and {png}")
    if json_out:
        tmp = json_out.with_name(f".{json_out.name}.tmp-{os.getpid()}") if console.replaceable(json_out) else None
        target = tmp or json_out  # a regular file is replaced whole (rename); /dev/stdout and the like written to
        target.write_text(json.dumps({"config": config, "results": rows}, indent=2) + "\n")
        if tmp:
            os.replace(tmp, json_out)
        if partial:
            partial.unlink(missing_ok=True)
        log(f"wrote {json_out}")


def _kvpress_rows(
    artifact,
    specs,
    dtype,
    device,
    texts,
    ctx,
    windows,
    prefill,
    chunk,
    samples,
    rt_tokens,
    rt_tasks,
    rt_samples,
    share,
    json_out,
    quiet,
):
    """The rows of `--kvpress`: the full cache and every press on the artifact's base model (kvpress_baselines), each
    with tale-eval's fields; finished parts go to FILE.partial as they come."""
    import torch

    from tale_runtime import ArtifactError

    from . import kvpress_baselines as kp
    from . import perplexity, retrieval

    try:
        kp.import_kvpress()
        dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        model, tok = kp.base_model(artifact, dt, device)
        ids = {t: perplexity.heldout_windows(tok, ctx, windows, t) for t in texts}
        rt_samples_l = retrieval.make_samples(tok, rt_tokens, rt_tasks, rt_samples)  # refuses a length too short
    except (ArtifactError, ValueError, OSError) as e:
        fail(str(e))
    from tale_runtime.artifact import read_manifest
    from tale_runtime.load import resolve

    manifest = read_manifest(resolve(artifact))
    kp.quiet_warnings()
    log = console.rich_console(stderr=True, quiet=quiet).print
    specs = [kp.Spec(None)] + list(specs)
    partial = _partial(json_out) if json_out and console.replaceable(json_out) else None
    rows = []
    if partial:
        partial.write_text("")
    try:
        rows = kp.measure(model, tok, specs, ids, prefill, chunk, samples, share, log)
        if partial:
            partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
        for row in rows:
            _log_row(log, row, samples)
        if rt_samples_l:

            def keep(s, per_policy):  # a run cut short keeps its finished samples
                if partial:
                    with open(partial, "a") as f:
                        f.write(json.dumps({"retrieval_sample": s["id"], "policies": per_policy}) + "\n")

            results = kp.retrieval_run(model, tok, rt_samples_l, specs, log, share, keep)
            for row, res in zip(rows, results):
                row.update(
                    retrieval=res["score"],
                    retrieval_tasks=res["tasks"],
                    retrieval_ratio=res["ratio"],
                    retrieval_kept_ratio=res["kept_ratio"],
                    retrieval_compression_ratio=res["compression_ratio"],
                    retrieval_answers=res["answers"],
                )
            if partial:
                partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
    except KeyboardInterrupt:
        if rows and partial:
            log(f"interrupted: the perplexity and pass-key rows and the finished retrieval samples are in {partial}")
        raise
    finally:
        if partial and not rows:
            partial.unlink(missing_ok=True)
    return rows, ids, rt_samples_l, manifest.get("base", {}).get("id"), manifest.get("schedule")


def _partial(json_out: Path) -> Path:
    return json_out.with_name(json_out.name + ".partial")


def _given(flag: str, s: str | None) -> tuple[str, ...] | None:
    """A comma list option; given but empty is refused (it would silently mean the preset's default)."""
    items = _csv(s)
    if items is not None and not items:
        fail(f"{flag} is empty: leave it out for the preset's, or name at least one")
    return items


def _log_row(log, row: dict, samples) -> None:
    log(
        f"{row['policy']} ({row['setting']}): ppl "
        + ", ".join(f"{v:.3f}" for v in row["ppl"].values())
        + f", {row['ratio']:.2f}x"
        + (f", pass-key {row['passkey']:.0%}" if samples else "")
        + f" ({row['seconds']:.0f} s)"
    )


def _rank_schedules(model, tok, sched, names, energy, log) -> dict:
    """TALE schedules from the rank policies, all with the artifact's levels and uniform budget."""
    from tale_convert import policy as rank_policy

    from . import policies

    d = policies.Dims.of(model)
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
            sched, name, rank_policy.level0_ranks(name, d.R, d.layers, sched.value_group, r0, **kw)
        )
    return out


def _uniform_r0(sched) -> int:
    """The budget: the artifact's mean level-0 rank, rounded down to a quantization group."""
    from tale_runtime.schedule import round_rank

    mean = sum(rs[0] for rs in sched.ranks) / len(sched.ranks)
    R = max(rs[-1] for rs in sched.ranks)
    return round_rank(int(mean) / R, R, sched.value_group)


def _calib_batches(tok, count: int = 4, length: int = 256, batch: int = 2) -> list[torch.Tensor]:
    """Fixed calibration windows (the bundled calibration corpus, never the held-out text)."""
    from tale_convert.stats import calibration_batches

    return calibration_batches(tok, count, length, batch)


def _table(to, rows: list[dict], config: dict) -> None:
    from rich.table import Table

    texts = config["texts"]
    t = Table(
        title=f"{config['model'] or config['artifact']}: decode-mode ppl, {config['windows']} x {config['ctx']} "
        f"tokens of {', '.join(texts)} (prefill {config['prefill']}, chunk {config['chunk']}), {config['dtype']}"
    )
    kv = "kvpress" in config
    cols = [
        "policy",
        *[c for tx in texts for c in (f"ppl {tx}", "delta")],
        "compr.",
        *(["kept", "kvpress"] if kv else ["nominal"]),
        "pass-key",
        "pk compr.",
    ]
    for col in cols:
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in rows:
        task = "passkey" in r
        name = r["policy"] if not config["frontier"] or r["family"] == "full" else f"{r['family']}: {r['setting']}"
        t.add_row(
            name,
            *[c for tx in texts for c in (f"{r['ppl'][tx]:.3f}", f"{r['delta_pct'][tx]:+.2f}%")],
            f"{r['ratio']:.2f}x",
            *([f"{r['kept_ratio']:.2f}x"] if kv else []),
            f"{r['nominal']:.2f}x" if r["nominal"] else "",
            f"{r['passkey']:.0%}" if task else "",
            f"{r['passkey_ratio']:.2f}x" if task else "",
        )
    to.print(t)
    for r in rows:
        to.print(f"  {r['policy']}: {r['detail']}", markup=False)
    to.print(
        f"compr.: 16-bit K+V bytes of the same tokens / bytes held by the cache (codes, scales, zero points, "
        f"sinks, residual), measured at the end of the run; pass-key: {config['passkey_samples']} samples, "
        f"exact match; {config['seconds']:.0f} s"
    )
    if kv:
        to.print(_KVPRESS_NOTE.format(**config["kvpress"]))


_KVPRESS_NOTE = (
    "kvpress {kvpress} (transformers {transformers}, torch {torch}): the presses compress the prompt at the prefill "
    "(the perplexity run: its --prefill tokens), later tokens are appended uncompressed; kept: 16-bit K+V bytes / "
    "bytes of the entries the attention still reads (KVzip masks entries and holds them: kept > compr.); kvpress: "
    "its own accounting, 1 / (1 - compression_ratio) on the prompt (cr: the share of the prompt's KV pairs pruned)"
)


def _retrieval_table(to, rows: list[dict], config: dict) -> None:
    """Per task family and length, the mean score (RULER's string_match_all, %); the full cache's mean beside each
    row, so that `retention` (the row's mean over the full cache's) reads as what the compression kept."""
    from rich.table import Table

    tasks = list(rows[0]["retrieval_tasks"])
    full = next((r for r in rows if r["policy"] == "full"), None)
    per = config["retrieval_samples"] // max(1, len(tasks))
    t = Table(title=f"long-context retrieval: {per} sample(s) per task, {config['dtype']}")
    kv = "kvpress" in config
    cols = ["policy", *[c.replace("niah_", "") for c in tasks], "score", "full", "retention", "rt compr."]
    cols += ["kept", "kvpress cr"] if kv else []
    for col in cols:
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in rows:
        ref = full["retrieval"] if full else None
        t.add_row(
            r["policy"],
            *[f"{100 * r['retrieval_tasks'][k]:.0f}" for k in tasks],
            f"{100 * r['retrieval']:.1f}",
            f"{100 * ref:.1f}" if ref is not None else "",
            f"{100 * r['retrieval'] / ref:.0f}%" if ref else "",
            f"{r['retrieval_ratio']:.2f}x",
            *([f"{r['retrieval_kept_ratio']:.2f}x", f"{r['retrieval_compression_ratio']:.3f}"] if kv else []),
        )
    to.print(t)
    to.print(
        "retrieval: RULER's string_match_all (share of the expected answers in the greedy output), mean over samples "
        "per task, then over tasks; rt compr.: measured on those runs"
    )


def main(argv: list[str] | None = None) -> None:
    """Console script entry: one-line errors (TALE_DEBUG=1 for tracebacks)."""
    console.run_app(app, argv)
