"""Training LESS's kernels, one layer at a time, on the bundled calibration text; cached per model and schedule.

For every query t of a calibration window the Λ cache holds the sinks and the `window` + 1 newest tokens (t
included: a decode step's own token); the rest, sinks <= j < t - window, lives in the state. All queries are trained
at once: the state a query reads is a prefix sum over the keys, H_t = sum_{sinks <= j < t - window} psi(k_j)^T v_j.
Loss: squared error of the attention output against full attention, over the queries that have evicted tokens.

    python -m tale_eval.less_train ARTIFACT --window 170      # trains (or finds) the kernels, prints the errors
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import typer
from safetensors.torch import load_file, save_file
from torch import nn

from tale_convert.bundled import cache_root
from tale_convert.stats import calibration_batches

from . import capture
from .less import LessKernels, read_state
from .sparse import partial_attention


@dataclass(frozen=True)
class Recipe:
    """Everything the trained kernels depend on besides the model's weights."""

    sinks: int = 4
    window: int = 128
    rank: int = 8
    hidden: int = 32
    steps: int = 100
    stride: int = 8  # a training step reads every stride-th query
    lr: float = 1e-2
    seed: int = 0
    windows: int = 2  # calibration windows
    length: int = 1024  # tokens per calibration window


def targets(q, k, v, scaling: float, sinks: int, window: int):
    """Full-attention outputs and the Λ cache's unnormalized sums for every query of the windows (float32):
    (full [N, H, T, n], num [N, H, T, n], den [N, H, T], m [N, H, T])."""
    T = q.shape[2]
    t = torch.arange(T)
    causal = t[:, None] >= t[None, :]
    kept = causal & ((t[None, :] < sinks) | (t[:, None] - t[None, :] <= window))
    full = partial_attention(q, k, v, None, None, scaling)
    sparse = partial_attention(q, k, v, None, None, scaling, new_mask=kept)
    return full[0] / full[1][..., None], *sparse


def less_outputs(
    kern: LessKernels,
    q,
    k,
    v,
    scaling: float,
    sinks: int,
    window: int,
    num,
    den,
    m,
    first: int,
    stride: int = 1,
    offset: int = 0,
):
    """LESS's outputs for the queries t = first + offset + i * stride (those with evicted tokens):
    [N, H, Tq, n]. Query t reads the state of the tokens sinks .. t - window - 1; those states are prefix sums over
    segments of `stride` keys (segment 0: sinks .. sinks + offset)."""
    N, K, T, n = v.shape
    ts = torch.arange(first + offset, T, stride)
    e = torch.exp(kern.log_psi(k[:, :, sinks:], scaling))  # [N, K, T - sinks, R]; the sinks are held, never absorbed
    vv = v[:, :, sinks:]
    pad = stride - 1 - offset  # segment c holds tokens u = j - sinks with (u + pad) // stride == c
    used = len(ts) * stride
    e = nn.functional.pad(e, (0, 0, pad, 0))[:, :, :used]
    vv = nn.functional.pad(vv, (0, 0, pad, 0))[:, :, :used]
    R = e.shape[-1]
    seg_h = torch.einsum("bkcsr,bkcsn->bkcrn", e.view(N, K, -1, stride, R), vv.view(N, K, -1, stride, n))
    seg_z = e.view(N, K, -1, stride, R).sum(3)
    en, ed = read_state(kern.log_phi(q[:, :, ts], scaling), m[:, :, ts], seg_h.cumsum(2), seg_z.cumsum(2))
    return (num[:, :, ts] + en) / (den[:, :, ts] + ed)[..., None]


def evicted_log_mean_exp(q, k, scaling: float, sinks: int, window: int, every: int = 16) -> float:
    """log mean_j exp(l_tj) over each query's evicted keys, averaged over every `every`-th query that has some."""
    N, H, T, n = q.shape
    K = k.shape[1]
    ts = torch.arange(sinks + window + 1, T, every)
    logits = torch.einsum("bkitn,bkjn->bkitj", q[:, :, ts].view(N, K, H // K, len(ts), n), k) * scaling
    j = torch.arange(T)
    ev = (j[None, :] >= sinks) & (j[None, :] < ts[:, None] - window)  # [Tq, T]
    lme = logits.masked_fill(~ev, float("-inf")).logsumexp(-1) - ev.sum(-1).log()
    return float(lme.mean())


def train_layer(q, k, v, scaling: float, recipe: Recipe) -> tuple[LessKernels, float, float]:
    """One layer's kernels; returns them and the mean squared output error of the sparse policy alone and of LESS
    (calibration windows, queries with evicted tokens)."""
    torch.manual_seed(recipe.seed)
    s, w = recipe.sinks, recipe.window
    first = s + w + 1
    if first >= q.shape[2]:
        raise ValueError(f"LESS: calibration windows of {q.shape[2]} tokens evict nothing at window {w}")
    kern = LessKernels(q.shape[1], k.shape[1], q.shape[3], recipe.rank, recipe.hidden)
    with torch.no_grad():
        full, num, den, m = targets(q, k, v, scaling, s, w)
        full = full[:, :, first:]
        sparse_err = (num[:, :, first:] / den[:, :, first:, None] - full).pow(2).mean().item()
        # start where every evicted token weighs exp(the log-mean-exp of the evicted logits): phi(q) psi(k) =
        # sum_r exp(b_phi + b_psi) at zero hidden output
        b = (evicted_log_mean_exp(q, k, scaling, s, w) - math.log(recipe.rank)) / 2
        kern.phi_mlp["b2"].fill_(b)
        kern.psi_mlp["b2"].fill_(b)
    opt = torch.optim.Adam(kern.parameters(), lr=recipe.lr)
    gen = torch.Generator().manual_seed(recipe.seed)
    st = recipe.stride
    for _ in range(recipe.steps):  # each step a different 1/stride of the queries
        o = int(torch.randint(st, (), generator=gen))
        opt.zero_grad()
        out = less_outputs(kern, q, k, v, scaling, s, w, num, den, m, first, st, o)
        loss = (out - full[:, :, o::st]).pow(2).mean()
        loss.backward()
        opt.step()
    with torch.no_grad():
        err = (less_outputs(kern, q, k, v, scaling, s, w, num, den, m, first) - full).pow(2).mean().item()
    return kern.requires_grad_(False), sparse_err, err


def fingerprint(model) -> str:
    """The attention weights that produce q, k, v (what the kernels are trained on)."""
    h = hashlib.sha256()
    for layer in model.model.layers:
        t = layer.self_attn.tale
        for p in (t.q_proj, t.k_proj, t.v_proj):
            h.update(p.weight.detach().float().cpu().numpy().tobytes())
            if p.bias is not None:
                h.update(p.bias.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def cache_path(model, recipe: Recipe) -> Path:
    """One file per model, compute dtype (the activations trained on) and recipe."""
    what = dict(asdict(recipe), dtype=str(model.dtype))
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / "less" / f"{fingerprint(model)}-s{recipe.sinks}-w{recipe.window}-{key}.safetensors"


def train(model, tok, recipe: Recipe, log=print) -> tuple[list[LessKernels], list[tuple[float, float]]]:
    """Every layer's kernels, trained on the calibration text (float32, on the model's device)."""
    batches = calibration_batches(tok, count=1, length=recipe.length, batch=recipe.windows)
    data = capture.qkv(model, batches)
    scaling = model.model.layers[0].self_attn.tale.scaling
    kernels, errors = [], []
    for i in range(len(data)):
        q, k, v = data[i]
        with torch.enable_grad():
            kern, sparse_err, err = train_layer(q, k, v, scaling, recipe)
        data[i] = None  # frees the layer's activations
        kernels.append(kern)
        errors.append((sparse_err, err))
        log(f"LESS layer {i}: attention-output MSE {sparse_err:.3e} (sparse alone) -> {err:.3e}")
    return kernels, errors


def save(path: Path, kernels: list[LessKernels], recipe: Recipe) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{i}.{name}": p.detach().contiguous() for i, k in enumerate(kernels) for name, p in k.named_parameters()
    }
    meta = {"recipe": json.dumps(asdict(recipe)), "config": json.dumps(kernels[0].config())}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)  # a reader never sees half a file


def load(path: Path, layers: int) -> list[LessKernels]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        cfg = json.loads(f.metadata()["config"])
    tensors = load_file(str(path))
    out = []
    for i in range(layers):
        k = LessKernels(**cfg)
        k.load_state_dict({name[len(f"{i}.") :]: t for name, t in tensors.items() if name.startswith(f"{i}.")})
        out.append(k.requires_grad_(False))
    return out


def kernels_for(model, tok, recipe: Recipe, log=print) -> list[LessKernels]:
    """The cached kernels of this model and recipe, trained first if there are none."""
    path = cache_path(model, recipe)
    if not path.is_file():
        log(f"LESS: training kernels (window {recipe.window}, sinks {recipe.sinks}) -> {path}")
        kernels, _ = train(model, tok, recipe, log)
        save(path, kernels, recipe)
    device = model.model.layers[0].self_attn.tale.q_proj.weight.device
    return [k.to(device) for k in load(path, model.config.num_hidden_layers)]


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__.split("\n")[0])


@app.command()
def main(
    artifact: str = typer.Argument(..., help="TALE artifact directory (tale-convert output) or Hub id"),
    window: int = typer.Option(128, help="recent tokens the cache holds"),
    sinks: int = typer.Option(4, help="first tokens the cache holds"),
    rank: int = typer.Option(8, help="R: the state's rank"),
    hidden: int = typer.Option(32, help="hidden width of the kernels' MLPs"),
    steps: int = typer.Option(100, help="Adam steps per layer"),
    seed: int = typer.Option(0),
    dtype: str = typer.Option("bf16", help="compute dtype of the model the kernels serve (tale-eval --dtype)"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    retrain: bool = typer.Option(False, help="train even if cached kernels exist"),
) -> None:
    from tale_runtime import load as load_artifact
    from tale_runtime.console import fail

    from .attention import prepare

    for name, val in (("--window", window), ("--rank", rank), ("--hidden", hidden), ("--steps", steps)):
        if val < 1:
            fail(f"{name} must be >= 1, got {val}")
    if sinks < 0:
        fail(f"--sinks must be >= 0, got {sinks}")
    if dtype not in ("bf16", "fp32"):
        fail(f"--dtype must be bf16 or fp32, got {dtype!r}")
    if threads:
        torch.set_num_threads(threads)
    recipe = Recipe(sinks=sinks, window=window, rank=rank, hidden=hidden, steps=steps, seed=seed)
    if sinks + window + 1 >= recipe.length:
        fail(f"--window {window}: the calibration windows of {recipe.length} tokens would evict nothing")
    model, tok = load_artifact(artifact, device="cpu", dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    prepare(model)
    path = cache_path(model, recipe)
    if path.is_file() and not retrain:
        print(f"cached: {path}")
        return
    kernels, errors = train(model, tok, recipe)
    save(path, kernels, recipe)
    sparse = sum(e[0] for e in errors) / len(errors)
    less = sum(e[1] for e in errors) / len(errors)
    print(f"wrote {path}: mean attention-output MSE over layers {sparse:.3e} (sparse alone) -> {less:.3e} (LESS)")


if __name__ == "__main__":
    from tale_runtime.console import run_app

    run_app(app)
