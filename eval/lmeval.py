"""lm-evaluation-harness with the TALE cache: the `tale` model of lm_eval and one run of it.

TaleLM is lm_eval's HFLM over a TALE artifact. Its generate_until requests (GSM8K, RULER, LongBench, ...) call
model.generate with a fresh TALE cache each (tale_runtime.new_cache): the prompt is prefilled exactly, and every
generated token reads the compressed past. Its loglikelihood requests (multiple choice, perplexity) are one plain
forward pass, which is exact in TALE (the base model's attention with the original v_proj): they score the same as
the base model and do not exercise the cache at all.

lm_eval has no plugin entry point for models: importing this module registers "tale", and
`python -m tale_eval.lmeval` is lm_eval's own command line with it registered (`--model tale --model_args
pretrained=ARTIFACT`). `tale-eval ARTIFACT --lm-eval TASKS` runs the same through tale-eval's conventions.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from tale_runtime import cache_arg, load, new_cache
from tale_runtime.schedule import override_schedule

CACHE_FILE = "tale_cache.json"  # the measured compression of the caches used, beside lm_eval's files
# schedule knobs a run may override (tale-eval's flags of the same names; in --model_args lists take '/': bits=2/4)
KNOBS = ("sinks", "recent", "r0", "bits", "key_bits", "residual")
DTYPES = {"auto": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32}
DTYPES |= {"float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}


def schedule_overrides(model, **knobs) -> None:
    """Change single knobs of the model's schedule (None: the artifact's), as tale-eval's --sinks/--r0/... do."""
    knobs = {k: v for k, v in knobs.items() if v is not None}
    if not knobs:
        return
    s = model.tale_spec.schedule
    r0 = knobs.pop("r0", None)
    model.tale_spec.schedule = override_schedule(
        s,
        model.tale_spec.arch.latent_rank,
        len(s.ranks),
        r0=r0,
        **knobs,
    )


def _parse_knob(name: str, v):
    """A knob from --model_args (lm_eval has made numbers of what it could): lists of bits as '2/4', of recent
    shares as '0.05/0.1'."""
    if v is None or name not in ("bits", "key_bits", "recent"):
        return v
    kind = float if name == "recent" else int
    if isinstance(v, (list, tuple)):
        return [kind(x) for x in v]
    return [kind(x) for x in str(v).split("/")]


@register_model("tale")
class TaleLM(HFLM):
    """lm_eval's HF model over a TALE artifact (a directory or a Hub id).

    model_args: pretrained (the artifact), dtype (auto = bf16, or float32/bfloat16/float16), device, attention (the
    decode-attention backend, tale_runtime.backends: auto, torch, triton, cuda), the schedule knobs sinks, recent, r0,
    bits, key_bits, residual (lists with '/': bits=2/4), and HFLM's own (batch_size, max_length, ...)."""

    def __init__(
        self,
        pretrained,
        device: str | None = None,
        dtype: str | torch.dtype | None = "auto",
        attention: str = "auto",
        schedule=None,
        sinks: int | None = None,
        recent: float | None = None,
        r0: float | None = None,
        bits=None,
        key_bits=None,
        residual: int | None = None,
        **kwargs,
    ) -> None:
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
            dtype = DTYPES[dtype]
        model, tok = load(pretrained, device=device, dtype=dtype, schedule=schedule, backend=attention)
        if tok is None:
            raise ValueError(f"{pretrained}: the artifact has no tokenizer")
        knobs = dict(sinks=sinks, recent=recent, r0=r0, bits=bits, key_bits=key_bits, residual=residual)
        schedule_overrides(model, **{k: _parse_knob(k, v) for k, v in knobs.items()})
        kwargs.pop("backend", None)  # HFLM's backend is causal/seq2seq: a TALE model is causal
        super().__init__(pretrained=model, tokenizer=tok, backend="causal", **kwargs)
        self.pretrained = str(pretrained)  # lm_eval's results name the model by it
        self.cache_bytes: list[tuple[int, int]] = []  # per generate call: (bytes held, 16-bit K+V bytes)

    def _model_call(self, inps, attn_mask=None, labels=None):
        # loglikelihood: one forward pass without a cache, i.e. the exact prefill path (the base model's attention)
        with torch.no_grad():
            return self.model(inps, use_cache=False).logits

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        cache = new_cache(self.model)
        out = super()._model_generate(context, max_length, stop, **cache_arg(cache), **generation_kwargs)
        self.cache_bytes.append((cache.nbytes(), cache.baseline_nbytes()))
        return out

    def cache_report(self) -> dict:
        """The measured compression of the caches the generate_until requests used: 16-bit K+V bytes of the same
        tokens over the bytes each cache held at the end of its generate call (packed codes, scales, zero points,
        sinks, residual), summed over calls."""
        sched = self.model.tale_spec.schedule
        held = sum(h for h, _ in self.cache_bytes)
        base = sum(b for _, b in self.cache_bytes)
        ratios = [b / h for h, b in self.cache_bytes if h]
        return {
            "generate_calls": len(self.cache_bytes),
            "cache_bytes": held,
            "baseline_bytes": base,
            "ratio": base / held if held else None,
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
            "nominal": self.model.tale_spec.nominal_ratio(),
            "schedule": sched.to_dict(),
            "note": "ratio: 16-bit K+V bytes / bytes held by the TALE cache at the end of each generate_until call, "
            "summed over calls; loglikelihood requests run the exact forward pass and use no cache"
            + ("" if self.cache_bytes else " (this run made no generate_until request: the cache was not used)"),
        }

    def get_model_info(self) -> dict:
        info = {
            "model_num_parameters": self._model.num_parameters(),
            "model_dtype": str(self._model.dtype),
            "model_revision": None,
            "model_sha": "",
        }
        path = self.model.tale_spec.path
        info["tale_artifact"] = str(path) if path is not None else self.pretrained
        info["tale_base"] = self.model.tale_spec.manifest.get("base", {}).get("id")
        return info


def evaluate(
    lm: HFLM,
    tasks: list,
    task_manager,
    out: Path,
    model_args: str,
    limit: float | None = None,
    num_fewshot: int | None = None,
    model_source: str = "tale",
) -> dict:
    """Run `tasks` on `lm` and write lm_eval's own files (results_DATE.json, samples_TASK_DATE.jsonl) into `out`,
    which must be a new, empty directory; a TaleLM's measured compression goes beside them (tale_cache.json).
    Returns lm_eval's results (without the samples), with "tale_cache" added for a TaleLM."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import handle_non_serializable

    tracker = EvaluationTracker(output_path=str(out / "results.json"))  # a .json path: files go flat into `out`
    results = simple_evaluate(
        model=lm,
        model_args=model_args,
        tasks=tasks,
        num_fewshot=num_fewshot,
        limit=limit,
        log_samples=True,
        evaluation_tracker=tracker,
        task_manager=task_manager,
    )
    if results is None:  # a non-zero rank of a distributed run
        return {}
    tracker.general_config_tracker.model_source = model_source  # lm_eval says CUSTOM for a model object
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for name in results["configs"]:
        tracker.save_results_samples(task_name=name, samples=samples[name])
    if not list(out.glob("results_*.json")):  # the tracker logs a failed write and goes on
        raise OSError(f"lm_eval wrote no results file into {out}")
    if isinstance(lm, TaleLM):
        results["tale_cache"] = lm.cache_report()
        (out / CACHE_FILE).write_text(json.dumps(results["tale_cache"], indent=2) + "\n")
    return json.loads(json.dumps(results, default=handle_non_serializable))


def replaceable(out: Path) -> str | None:
    """Why `out` may not be replaced by a new run's files (None: it may): only an empty directory or one that holds
    nothing but an earlier run's files (results_*.json, samples_*.jsonl, tale_cache.json), never a user's."""
    if out.is_symlink() or not out.is_dir():
        return "it is not a directory"
    names = [p for p in out.rglob("*")]
    other = [
        p.relative_to(out).as_posix()
        for p in names
        if p.is_dir()
        or not (
            (p.name.startswith("results_") and p.suffix == ".json")
            or (p.name.startswith("samples_") and p.suffix == ".jsonl")
            or p.name == CACHE_FILE
        )
    ]
    if other:
        return f"it holds files that are not an lm-eval run's ({', '.join(sorted(other)[:3])}): move them away first"
    return None


def publish(tmp: Path, out: Path) -> None:
    """Move the finished run's directory into place, replacing an earlier run's (checked by the caller)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main() -> None:
    """`python -m tale_eval.lmeval ...`: lm_eval's command line with the `tale` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    sys.exit(main())
