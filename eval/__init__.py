"""tale-eval: decode-mode quality of TALE against full, KIVI, StreamingLLM and Palu-style caches.

One call per task, as the command line makes it: `evaluate(artifact, EvalOptions(...))` (the policy table, the
frontier) and `run_lm_eval(artifact, LmEvalOptions(tasks=...))` (lm-evaluation-harness tasks). Importing the package
imports neither torch nor transformers; the calls do.
"""

from .evaluation import EvalOptions, Overrides, evaluate
from .lmeval_run import LmEvalOptions, run_lm_eval

__all__ = ["EvalOptions", "LmEvalOptions", "Overrides", "evaluate", "run_lm_eval"]
