"""`tale-eval`: quality lost by each cache policy, at what measured compression, side by side.

The command line around tale_eval.evaluate (the policy table, --frontier) and tale_eval.run_lm_eval (--lm-eval):
it parses the options into EvalOptions or LmEvalOptions and makes that one call.
"""

from __future__ import annotations

from typing import Optional

import typer

from tale_runtime import console
from tale_runtime.console import UserError

from .evaluation import DEFAULT_FRONTIER_OUT, DEFAULT_LM_EVAL_OUT, TEST_TEXTS, EvalOptions, Overrides, evaluate
from .lmeval_run import LmEvalOptions, run_lm_eval
from .names import FAMILIES, NAMED, RETRIEVAL_FAMILIES

# torch, transformers and the policies are imported by evaluate() and run_lm_eval(): `tale-eval --help` starts
# without them

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Evaluate TALE against full, KIVI, quanto, HQQ, StreamingLLM, Palu, LESS and TailorKV caches on one artifact.",
)


class Opt:
    """tale-eval's arguments and options, declared once: run() reads as the list of its parameters."""

    artifact = typer.Argument(..., help="TALE artifact directory (tale-convert output) or Hub id")
    preset = typer.Option("ci", help="ci (minutes on a laptop CPU) or full (the docs/quality.md numbers)")
    policies = typer.Option(None, "--policies", help=f"comma list of {', '.join(NAMED)}")
    rank_policies = typer.Option(
        None, help="extra TALE rows with these rank policies: uniform, energy, fisher, progressive ('' for none)"
    )
    energy = typer.Option(0.9, help="energy policy: whitened spectral energy kept per layer at level 0")
    text = typer.Option(
        None, help=f"held-out texts, comma list of dev (tune on it), {', '.join(TEST_TEXTS)} (report on them)"
    )
    frontier = typer.Option(
        False,
        "--frontier",
        help="sweep every policy over its knob(s): a markdown table and a PNG plot of quality vs measured compression",
    )
    families = typer.Option(None, help=f"--frontier: comma list of {', '.join(FAMILIES)}")
    tale_variants = typer.Option(
        None,
        help="--frontier: TALE points, ';'-separated overrides, e.g. "
        "'-; key_bits=4/4; r0=0.25,key_group=64,value_group=64,residual=64'",
    )
    frontier_out = typer.Option(
        None,
        help=f"--frontier: writes PATH.md and PATH.png (default: {DEFAULT_FRONTIER_OUT}, under the current directory)",
    )
    ctx = typer.Option(None, help="tokens per held-out window")
    windows = typer.Option(None, help="held-out windows")
    prefill = typer.Option(None, help="exact prefix tokens per window")
    chunk = typer.Option(None, help="tokens per decode call (1 = token by token)")
    passkey_lengths = typer.Option(None, help="pass-key lengths: 1k,2k ('' to skip the task)")
    passkey_depths = typer.Option(None, help="pass-key needle depths, e.g. 0.1,0.5,0.9")
    retrieval_lengths = typer.Option(
        None,
        help="long-context retrieval (RULER's synthetic tasks) at these prompt lengths: 4k,8k or tokens "
        "('' to skip the task)",
    )
    retrieval_tasks = typer.Option(
        None, help=f"retrieval task families, comma list of {', '.join(RETRIEVAL_FAMILIES)} (default: all)"
    )
    retrieval_samples = typer.Option(None, help="retrieval samples per task family and length")
    no_shared_prefill = typer.Option(
        False, "--no-shared-prefill", help="retrieval: every policy prefills each prompt itself (slower, same result)"
    )
    sinks = typer.Option(None, help="TALE: override the artifact's sink tokens")
    recent = typer.Option(
        None, help="TALE: override the recent share p of each level above the middle, oldest first, e.g. 0.05,0.1"
    )
    r0 = typer.Option(
        None, help="TALE: override the level-0 (middle) rank, a fraction of R, all layers; other levels keep theirs"
    )
    bits = typer.Option(None, help="TALE: override the bits per level, oldest first, e.g. 2,4")
    key_bits = typer.Option(None, help="TALE: override the key bits per level, e.g. 4,4")
    key_axis = typer.Option(None, help="TALE: keys per 'channel' (KIVI) or per 'token', per level, e.g. channel,token")
    key_meta = typer.Option(None, help="TALE: key scale/zero storage: 16, 8/16 or 8/8")
    value_meta = typer.Option(None, help="TALE: latent scale/zero storage: 16, 8/16 or 8/8")
    key_channel_group = typer.Option(None, help="TALE: channels per key group at per-token levels")
    rotate = typer.Option(None, help="TALE: rotate q and k after RoPE: none or hadamard")
    key_rope = typer.Option(None, help="TALE: quantize keys after RoPE (post) or before it (pre)")
    residual = typer.Option(None, help="TALE: 16-bit residual tokens")
    dtype = typer.Option("bf16", help="compute dtype: bf16 or fp32 (bytes are measured in it)")
    device = typer.Option(None, help="cpu, cuda, ... (default: cuda if available)")
    threads = typer.Option(None, help="torch CPU threads")
    json = typer.Option(
        None,
        "--json",
        help="also write the results to this JSON file (finished rows go to FILE.partial as they come); '-': the "
        "JSON object on stdout instead of the table, nothing else",
    )
    lm_eval = typer.Option(
        None,
        "--lm-eval",
        help="run these lm-evaluation-harness tasks (comma list of names, globs or YAML files) with the TALE cache "
        "instead of the policy table (docs/eval.md)",
    )
    limit = typer.Option(None, help="--lm-eval: examples per task (a fraction if < 1)")
    num_fewshot = typer.Option(None, help="--lm-eval: few-shot examples per prompt")
    lm_eval_out = typer.Option(
        None, help=f"--lm-eval: a new directory for lm_eval's result files (default: {DEFAULT_LM_EVAL_OUT})"
    )
    include_path = typer.Option(None, help="--lm-eval: a directory of your own task YAML files")
    batch_size = typer.Option(None, help="--lm-eval: requests per batch (default 1)")
    overwrite = typer.Option(
        False, "--overwrite", help="replace existing --json / --frontier-out files (or an earlier --lm-eval-out run)"
    )
    quiet = typer.Option(False, "--quiet", "-q", help="print nothing but errors (and --json -'s object)")


@app.command()
def run(
    context: typer.Context,
    artifact: str = Opt.artifact,
    preset: str = Opt.preset,
    policy_names: Optional[str] = Opt.policies,
    rank_policies: Optional[str] = Opt.rank_policies,
    energy: float = Opt.energy,
    text: Optional[str] = Opt.text,
    frontier: bool = Opt.frontier,
    families: Optional[str] = Opt.families,
    tale_variants: Optional[str] = Opt.tale_variants,
    frontier_out: Optional[str] = Opt.frontier_out,
    ctx: Optional[int] = Opt.ctx,
    windows: Optional[int] = Opt.windows,
    prefill: Optional[int] = Opt.prefill,
    chunk: Optional[int] = Opt.chunk,
    passkey_lengths: Optional[str] = Opt.passkey_lengths,
    passkey_depths: Optional[str] = Opt.passkey_depths,
    retrieval_lengths: Optional[str] = Opt.retrieval_lengths,
    retrieval_tasks: Optional[str] = Opt.retrieval_tasks,
    retrieval_samples: Optional[int] = Opt.retrieval_samples,
    no_shared_prefill: bool = Opt.no_shared_prefill,
    sinks: Optional[int] = Opt.sinks,
    recent: Optional[str] = Opt.recent,
    r0: Optional[float] = Opt.r0,
    bits: Optional[str] = Opt.bits,
    key_bits: Optional[str] = Opt.key_bits,
    key_axis: Optional[str] = Opt.key_axis,
    key_meta: Optional[str] = Opt.key_meta,
    value_meta: Optional[str] = Opt.value_meta,
    key_channel_group: Optional[int] = Opt.key_channel_group,
    rotate: Optional[str] = Opt.rotate,
    key_rope: Optional[str] = Opt.key_rope,
    residual: Optional[int] = Opt.residual,
    dtype: str = Opt.dtype,
    device: Optional[str] = Opt.device,
    threads: Optional[int] = Opt.threads,
    json_out: Optional[str] = Opt.json,
    lm_eval_tasks: Optional[str] = Opt.lm_eval,
    limit: Optional[float] = Opt.limit,
    num_fewshot: Optional[int] = Opt.num_fewshot,
    lm_eval_out: Optional[str] = Opt.lm_eval_out,
    include_path: Optional[str] = Opt.include_path,
    batch_size: Optional[int] = Opt.batch_size,
    overwrite: bool = Opt.overwrite,
    quiet: bool = Opt.quiet,
) -> None:
    if lm_eval_tasks is None:
        evaluate(artifact, _eval_options(context.params))
    else:
        run_lm_eval(artifact, _lm_eval_options(context.params))


# the options of one mode only: given in the other, each is refused by name
LM_EVAL_ONLY = ("limit", "num_fewshot", "lm_eval_out", "include_path", "batch_size")
TABLE_ONLY = (
    "policy_names",
    "rank_policies",
    "text",
    "families",
    "tale_variants",
    "frontier_out",
    "ctx",
    "windows",
    "prefill",
    "chunk",
    "passkey_lengths",
    "passkey_depths",
    "retrieval_lengths",
    "retrieval_tasks",
    "retrieval_samples",
    "no_shared_prefill",
    "frontier",
)
FLAG = {"policy_names": "policies"}  # a parameter named otherwise than its flag


def _flag(name: str) -> str:
    return "--" + FLAG.get(name, name).replace("_", "-")


def _csv(s: str | None) -> tuple[str, ...] | None:
    return None if s is None else tuple(x.strip() for x in s.split(",") if x.strip())


def _overrides(p: dict, numbers: str) -> Overrides:
    """The TALE schedule flags; `numbers`: the refusal of --bits or --key-bits that are not numbers."""
    try:
        recent = None if p["recent"] is None else tuple(float(x) for x in _csv(p["recent"]))
    except ValueError:
        raise UserError(f"--recent takes comma-separated shares, e.g. 0.05,0.1; got {p['recent']!r}") from None
    try:
        bits, key_bits = (None if p[k] is None else tuple(int(x) for x in _csv(p[k])) for k in ("bits", "key_bits"))
    except ValueError:
        raise UserError(numbers) from None
    same = ("sinks", "r0", "residual", "key_meta", "value_meta", "key_channel_group", "rotate", "key_rope")
    return Overrides(
        recent=recent, bits=bits, key_bits=key_bits, key_axis=_csv(p["key_axis"]), **{k: p[k] for k in same}
    )


def _eval_options(p: dict) -> EvalOptions:
    for name in LM_EVAL_ONLY:
        if p[name] is not None:
            raise UserError(f"{_flag(name)} applies to --lm-eval only")
    numbers = "--passkey-depths, --bits and --key-bits take comma-separated numbers, e.g. 0.1,0.5 or 2,4"
    try:
        depths = None if p["passkey_depths"] is None else tuple(float(x) for x in _csv(p["passkey_depths"]))
    except ValueError:
        raise UserError(numbers) from None
    return EvalOptions(
        preset=p["preset"],
        policies=_csv(p["policy_names"]),
        rank_policies=_csv(p["rank_policies"]),
        energy=p["energy"],
        texts=_csv(p["text"]),
        frontier=p["frontier"],
        families=_csv(p["families"]),
        tale_variants=p["tale_variants"],
        frontier_out=p["frontier_out"],
        ctx=p["ctx"],
        windows=p["windows"],
        prefill=p["prefill"],
        chunk=p["chunk"],
        passkey_lengths=_csv(p["passkey_lengths"]),
        passkey_depths=depths,
        retrieval_lengths=_csv(p["retrieval_lengths"]),
        retrieval_tasks=_csv(p["retrieval_tasks"]),
        retrieval_samples=p["retrieval_samples"],
        shared_prefill=not p["no_shared_prefill"],
        overrides=_overrides(p, numbers),
        dtype=p["dtype"],
        device=p["device"],
        threads=p["threads"],
        json_out=p["json_out"],
        overwrite=p["overwrite"],
        quiet=p["quiet"],
    )


def _lm_eval_options(p: dict) -> LmEvalOptions:
    for name in TABLE_ONLY:
        if p[name] is not None and p[name] is not False:  # --frontier and --no-shared-prefill: flags
            raise UserError(f"{_flag(name)} does not apply to --lm-eval")
    return LmEvalOptions(
        tasks=tuple(p["lm_eval_tasks"].split(",")),
        out=p["lm_eval_out"] if p["lm_eval_out"] is not None else DEFAULT_LM_EVAL_OUT,
        limit=p["limit"],
        num_fewshot=p["num_fewshot"],
        include_path=p["include_path"],
        batch_size=p["batch_size"] or 1,
        overrides=_overrides(p, "--bits and --key-bits take comma-separated numbers, e.g. 2,4"),
        dtype=p["dtype"],
        device=p["device"],
        threads=p["threads"],
        json_out=p["json_out"],
        overwrite=p["overwrite"],
        quiet=p["quiet"],
    )


def main(argv: list[str] | None = None) -> None:
    """Console script entry: one-line errors (TALE_DEBUG=1 for tracebacks)."""
    console.run_app(app, argv)
