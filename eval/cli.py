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
    """tale-eval's arguments and options, declared once: run() takes them as its parameters."""

    artifact: str = typer.Argument(..., help="TALE artifact directory (tale-convert output) or Hub id")
    preset: str = typer.Option("ci", help="ci (minutes on a laptop CPU) or full (the docs/quality.md numbers)")
    policy_names: Optional[str] = typer.Option(None, "--policies", help=f"comma list of {', '.join(NAMED)}")
    rank_policies: Optional[str] = typer.Option(
        None, help="extra TALE rows with these rank policies: uniform, energy, fisher, progressive ('' for none)"
    )
    energy: float = typer.Option(0.9, help="energy policy: whitened spectral energy kept per layer at level 0")
    text: Optional[str] = typer.Option(
        None, help=f"held-out texts, comma list of dev (tune on it), {', '.join(TEST_TEXTS)} (report on them)"
    )
    frontier: bool = typer.Option(
        False,
        "--frontier",
        help="sweep every policy over its knob(s): a markdown table and a PNG plot of quality vs measured compression",
    )
    families: Optional[str] = typer.Option(None, help=f"--frontier: comma list of {', '.join(FAMILIES)}")
    tale_variants: Optional[str] = typer.Option(
        None,
        help="--frontier: TALE points, ';'-separated overrides, e.g. "
        "'-; key_bits=4/4; r0=0.25,key_group=64,value_group=64,residual=64'",
    )
    frontier_out: Optional[str] = typer.Option(
        None,
        help=f"--frontier: writes PATH.md and PATH.png (default: {DEFAULT_FRONTIER_OUT}, under the current directory)",
    )
    ctx: Optional[int] = typer.Option(None, help="tokens per held-out window")
    windows: Optional[int] = typer.Option(None, help="held-out windows")
    prefill: Optional[int] = typer.Option(None, help="exact prefix tokens per window")
    chunk: Optional[int] = typer.Option(None, help="tokens per decode call (1 = token by token)")
    passkey_lengths: Optional[str] = typer.Option(None, help="pass-key lengths: 1k,2k ('' to skip the task)")
    passkey_depths: Optional[str] = typer.Option(None, help="pass-key needle depths, e.g. 0.1,0.5,0.9")
    retrieval_lengths: Optional[str] = typer.Option(
        None,
        help="long-context retrieval (RULER's synthetic tasks) at these prompt lengths: 4k,8k or tokens "
        "('' to skip the task)",
    )
    retrieval_tasks: Optional[str] = typer.Option(
        None, help=f"retrieval task families, comma list of {', '.join(RETRIEVAL_FAMILIES)} (default: all)"
    )
    retrieval_samples: Optional[int] = typer.Option(None, help="retrieval samples per task family and length")
    no_shared_prefill: bool = typer.Option(
        False, "--no-shared-prefill", help="retrieval: every policy prefills each prompt itself (slower, same result)"
    )
    sinks: Optional[int] = typer.Option(None, help="TALE: override the artifact's sink tokens")
    recent: Optional[str] = typer.Option(
        None, help="TALE: override the recent share p of each level above the middle, oldest first, e.g. 0.05,0.1"
    )
    r0: Optional[float] = typer.Option(
        None, help="TALE: override the level-0 (middle) rank, a fraction of R, all layers; other levels keep theirs"
    )
    bits: Optional[str] = typer.Option(None, help="TALE: override the bits per level, oldest first, e.g. 2,4")
    key_bits: Optional[str] = typer.Option(None, help="TALE: override the key bits per level, e.g. 4,4")
    key_axis: Optional[str] = typer.Option(
        None, help="TALE: keys per 'channel' (KIVI) or per 'token', per level, e.g. channel,token"
    )
    key_meta: Optional[str] = typer.Option(None, help="TALE: key scale/zero storage: 16, 8/16 or 8/8")
    value_meta: Optional[str] = typer.Option(None, help="TALE: latent scale/zero storage: 16, 8/16 or 8/8")
    key_channel_group: Optional[int] = typer.Option(None, help="TALE: channels per key group at per-token levels")
    rotate: Optional[str] = typer.Option(None, help="TALE: rotate q and k after RoPE: none or hadamard")
    key_rope: Optional[str] = typer.Option(None, help="TALE: quantize keys after RoPE (post) or before it (pre)")
    residual: Optional[int] = typer.Option(None, help="TALE: 16-bit residual tokens")
    dtype: str = typer.Option("bf16", help="compute dtype: bf16 or fp32 (bytes are measured in it)")
    device: Optional[str] = typer.Option(None, help="cpu, cuda, ... (default: cuda if available)")
    threads: Optional[int] = typer.Option(None, help="torch CPU threads")
    json_out: Optional[str] = typer.Option(
        None,
        "--json",
        help="also write the results to this JSON file (finished rows go to FILE.partial as they come); '-': the "
        "JSON object on stdout instead of the table, nothing else",
    )
    kvpress_specs: Optional[str] = typer.Option(
        None,
        "--kvpress",
        help="kvpress's presses on the artifact's base model instead of the policy table, comma list of PRESS:RATIO "
        "(snapkv, expected_attention, kvzip, streaming_llm, knorm, tova, pyramidkv; RATIO the share of the prompt "
        "pruned, kvpress's compression_ratio, or Nx: N times fewer bytes than 16-bit), e.g. snapkv:0.75,kvzip:4x; "
        "in kvpress's venv (make kvpress-env, docs/eval.md)",
    )
    lm_eval_tasks: Optional[str] = typer.Option(
        None,
        "--lm-eval",
        help="run these lm-evaluation-harness tasks (comma list of names, globs or YAML files) with the TALE cache "
        "instead of the policy table (docs/eval.md)",
    )
    limit: Optional[float] = typer.Option(None, help="--lm-eval: examples per task (a fraction if < 1)")
    num_fewshot: Optional[int] = typer.Option(None, help="--lm-eval: few-shot examples per prompt")
    lm_eval_out: Optional[str] = typer.Option(
        None, help=f"--lm-eval: a new directory for lm_eval's result files (default: {DEFAULT_LM_EVAL_OUT})"
    )
    include_path: Optional[str] = typer.Option(None, help="--lm-eval: a directory of your own task YAML files")
    batch_size: Optional[int] = typer.Option(None, help="--lm-eval: requests per batch (default 1)")
    overwrite: bool = typer.Option(
        False, "--overwrite", help="replace existing --json / --frontier-out files (or an earlier --lm-eval-out run)"
    )
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors (and --json -'s object)")


@app.command()
@console.options_from(Opt)
def run(context: typer.Context, **params) -> None:
    if params["lm_eval_tasks"] is None:
        evaluate(params["artifact"], _eval_options(context.params))
    else:
        run_lm_eval(params["artifact"], _lm_eval_options(context.params))


# the options of one mode only: given in the other, each is refused by name
LM_EVAL_ONLY = ("limit", "num_fewshot", "lm_eval_out", "include_path", "batch_size")
TABLE_ONLY = ("policy_names", "rank_policies", "text", "families", "tale_variants", "frontier_out", "ctx", "windows")
TABLE_ONLY += ("prefill", "chunk", "passkey_lengths", "passkey_depths", "retrieval_lengths", "retrieval_tasks")
TABLE_ONLY += ("retrieval_samples", "no_shared_prefill", "frontier", "kvpress_specs")
# the options of both modes that go to EvalOptions and LmEvalOptions as they are
BOTH = ("dtype", "device", "threads", "json_out", "overwrite", "quiet")
FLAG = {"policy_names": "policies", "kvpress_specs": "kvpress"}  # parameters named otherwise than their flags


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
    same = ("preset", "energy", "frontier", "tale_variants", "frontier_out", "ctx", "windows", "prefill", "chunk")
    csv = ("rank_policies", "families", "passkey_lengths", "retrieval_lengths", "retrieval_tasks")
    return EvalOptions(
        policies=_csv(p["policy_names"]),
        texts=_csv(p["text"]),
        passkey_depths=depths,
        retrieval_samples=p["retrieval_samples"],
        shared_prefill=not p["no_shared_prefill"],
        kvpress=_csv(p["kvpress_specs"]),
        overrides=_overrides(p, numbers),
        **{k: p[k] for k in same + BOTH},
        **{k: _csv(p[k]) for k in csv},
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
        **{k: p[k] for k in BOTH},
    )


def main(argv: list[str] | None = None) -> None:
    """Console script entry: one-line errors (TALE_DEBUG=1 for tracebacks)."""
    console.run_app(app, argv)
