"""Tensor parallelism on the CPU: two gloo ranks (tests/tp_rank.py) against one process, float32.

A converted tiny Llama (4 KV heads in 2 latent groups of 2) gives the same greedy tokens over 2 ranks as in one
process, with the dynamic and the static cache and both output paths, each rank caching half the bytes; 2 ranks over
an artifact of one latent group are refused on both ranks, as is a bad path on one rank (no rank hangs).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_OPTS
from tale_helpers import invoke

from tale_convert.convert import Options, convert
from tale_runtime import cli, load, new_cache, set_output_path
from tale_runtime.model import cache_arg

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

# two processes per test under torchrun, each importing torch and transformers (make test-slow)
pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
NEW = 24  # past several flushes of the 8-token residual into the quantized levels
TIMEOUT = 300  # a rank that waits for the other one forever fails the test instead of hanging CI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world: int, port: int) -> dict:
    """What torchrun sets for each rank (the tests start the ranks themselves: no launcher process)."""
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", TALE_DEBUG="")
    return env


def run_ranks(args: list[str], world: int = 2) -> list[subprocess.CompletedProcess]:
    """Start `world` ranks of `python args...`; all must end within TIMEOUT."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env=torchrun_env(r, world, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


@pytest.fixture(scope="module")
def artifacts(tiny_model_dir, tmp_path_factory):
    """Tiny Llama (8 query, 4 KV heads) converted in float32 with groups of 2 (G = 2) and of 4 (G = 1), and with the
    lowrank preset (low-rank keys on its basis per latent group, a joint one and one per head); the tiny MHA model
    with tied embeddings (4 heads, groups of 2); tiny Qwen2 (value bias; groups of 1), Qwen3 (per-head q/k norms;
    groups of 2) and Gemma 3 (q/k norms,
    a sliding and a global layer with RoPE tables of their own; the lowrank preset, groups of 1) and Phi-3 (fused
    qkv_proj, partial rotary; the lowrank preset, groups of 1)."""
    root = tmp_path_factory.mktemp("tp")
    out = {}
    lowrank = dict(preset="lowrank")
    cases = [("good", "llama", 2, {}), ("odd", "llama", 4, {}), ("tied", "mha", 2, {})]
    cases += [("lowrank", "llama", 2, lowrank), ("lowrank_joint", "llama", 2, dict(lowrank, key_basis_blocks="joint"))]
    cases += [("lowrank_head", "llama", 2, dict(lowrank, key_basis_blocks="head"))]
    cases += [("qwen2", "qwen2", 1, {}), ("qwen3", "qwen3", 2, {}), ("gemma3", "gemma3", 1, lowrank)]  # 2 groups each
    cases += [("phi3", "phi3", 1, lowrank)]
    for name, arch, group, kw in cases:
        convert(str(tiny_model_dir(arch)), root / name, Options(group=group, **(TINY_OPTS | kw)))
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def prompt(tiny_tok) -> list[int]:
    text = "The printing press spread across Europe within decades, and books became cheaper to make and to buy."
    return tiny_tok(text)["input_ids"][:40]


@pytest.fixture(scope="module")
def ranks(artifacts, prompt, tmp_path_factory):
    """The JSON each of the two ranks wrote (tests/tp_rank.py)."""
    out = tmp_path_factory.mktemp("tp-out") / "res"
    arts = {name: str(path) for name, path in artifacts.items()}
    args = [str(HERE / "tp_rank.py"), str(out), json.dumps(arts), json.dumps(prompt)]
    done = run_ranks([*args, str(NEW)])
    for p in done:
        assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def one_process(path, prompt, **cache_kw) -> tuple[list[int], int, list[float]]:
    factored = cache_kw.pop("factored", False)
    model, _ = load(path, device="cpu", dtype=torch.float32, output_path="factored" if factored else "fused")
    if factored:  # O^r was not read
        assert model.model.layers[0].self_attn.tale.o_fused.numel() == 0
        with pytest.raises(ValueError, match="loaded without O"):
            set_output_path(model, "fused")
    cache = new_cache(model, **cache_kw)
    out = model.generate(
        torch.tensor([prompt]),
        **cache_arg(cache),
        max_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logits = out.logits[0][0, :8].tolist() + out.logits[-1][0, :8].tolist()  # as tests/tp_rank.py takes them
    return out.sequences[0, len(prompt) :].tolist(), cache.nbytes(), logits


@pytest.mark.parametrize("case", ["dynamic", "static", "factored", "pieces", "pieces_static"])
def test_two_ranks_give_the_tokens_of_one_process_with_half_the_cache(ranks, artifacts, prompt, case):
    """pieces: the ranks prefill the 40-token prompt in pieces of 16 (each piece's all-reduces in step), the one
    process in one piece."""
    kw = {"static": dict(static=True), "pieces_static": dict(static=True), "factored": dict(factored=True)}.get(
        case, {}
    )
    if case.startswith("pieces"):
        assert [r["piece_rows"] for r in ranks] == [[16, 16, len(prompt) - 32, 1]] * 2  # three pieces, then a step
    tokens, nbytes, logits = one_process(artifacts["good"], prompt, **kw)
    assert [r["tp"] for r in ranks] == [[2, 0], [2, 1]]
    assert all(r["local_groups"] == [1, 1, 1] for r in ranks)  # 2 groups per layer, one per rank
    for r in ranks:
        tp_tokens, tp_bytes, tp_logits = r[case]
        assert tp_tokens == tokens
        assert 2 * tp_bytes == nbytes  # each rank caches its own KV heads and latent groups
        assert_logits_close(tp_logits, logits)
    assert len(set(tokens)) > 1  # a real sequence, not one token repeated


def assert_logits_close(tp: list[float], one: list[float]) -> None:
    """The logits tests/tp_rank.py keeps (8 of the prefill's, 8 of the last step's) against one process's: the prefill
    to float32 rounding; the last step read from quantized levels, where the ranks' other summation order can move a
    value across a rounding step of its code (about 3e-4 seen on Gemma 3's lowrank schedule)."""
    tp, one = torch.tensor(tp), torch.tensor(one)
    assert torch.allclose(tp[:8], one[:8], rtol=1e-4, atol=1e-5)
    assert torch.allclose(tp[8:], one[8:], rtol=1e-3, atol=2e-3)


def same_tokens_as_one_process(ranks, artifacts, prompt, art, static) -> tuple[list[int], int, list[int]]:
    """Assert both ranks generated one process's tokens and logits on `art`; (tokens, one process's cache bytes, each
    rank's cache bytes)."""
    tokens, nbytes, logits = one_process(artifacts[art], prompt, **(dict(static=True) if static else {}))
    rank_bytes = []
    for r in ranks:
        tp_tokens, tp_bytes, tp_logits = r[art + ("_static" if static else "")]
        assert tp_tokens == tokens
        assert_logits_close(tp_logits, logits)
        rank_bytes.append(tp_bytes)
    # a real sequence, not one token repeated (the tiny Qwen2 repeats one token whatever its seed: its last step's
    # logits, compared above, carry the check past the flushes)
    assert len(set(tokens)) > 1 or art == "qwen2"
    return tokens, nbytes, rank_bytes


def fp8_biases(path) -> int:
    """The bytes each rank keeps beyond half of one process's cache on a low-rank schedule: a 4-byte fp8 bias per
    quantized tensor (two per level, three levels, each layer)."""
    return 4 * 2 * 3 * json.loads((path / "config.json").read_text())["num_hidden_layers"]


@pytest.mark.parametrize("art", ["lowrank", "lowrank_joint", "lowrank_head"])
@pytest.mark.parametrize("static", [False, True])
def test_low_rank_keys_under_two_ranks(ranks, artifacts, prompt, art, static):
    """Low-rank keys split over the ranks: a basis per latent group (the preset's) or per head by its blocks; a joint
    one by each head's rows and columns, every rank encoding its heads' share of each coefficient and the shares summed
    across ranks, so both ranks hold all the coefficients and rebuild only their own heads. The tokens of one process,
    through the dynamic and the static cache (demotions into the low-rank level included)."""
    tokens, nbytes, rank_bytes = same_tokens_as_one_process(ranks, artifacts, prompt, art, static)
    biases = fp8_biases(artifacts[art])  # a joint basis' coefficients are held whole by each rank
    for tp_bytes in rank_bytes:
        if art != "lowrank_joint":
            assert 0 < 2 * tp_bytes - nbytes <= biases, (tp_bytes, nbytes)
        else:
            assert nbytes / 2 + biases < tp_bytes < nbytes, (tp_bytes, nbytes)
    if not static:  # the coefficients the ranks cache are the one process's (a joint basis: summed across ranks)
        import tp_rank

        model, _ = load(artifacts[art], device="cpu", dtype=torch.float32)
        whole = torch.tensor(tp_rank.coefficients(model, prompt))
        for r in ranks:
            mine = torch.tensor(r[art + "_coefficients"])
            if art != "lowrank_joint":  # each rank its own heads' blocks (the first half of them, or the second)
                whole_r = whole.view(1, 2, -1)[:, r["tp"][1]].flatten()
                assert torch.equal(mine, whole_r)
            else:
                assert mine.shape == whole.shape and (mine == whole).float().mean() > 0.95


@pytest.mark.parametrize("art", ["qwen2", "qwen3", "gemma3", "phi3"])
@pytest.mark.parametrize("static", [False, True])
def test_other_families_under_two_ranks(ranks, artifacts, prompt, art, static):
    """Qwen2's value bias (each rank adds its heads' part through its slice of W_O); Qwen3's and Gemma 3's per-head q/k
    norms replicated on both ranks (transformers' plan), Gemma 3's sliding layer held as a ring of its window per rank
    and its keys before RoPE re-rotated by each layer type's own tables; Phi-3's fused qkv_proj gathered whole by its
    plan and cut to each rank's heads, its partial rotary on keys held before RoPE: the tokens of one process, each rank
    caching half the bytes (the lowrank schedules of Gemma 3 and Phi-3: but for the fp8 biases)."""
    _, nbytes, rank_bytes = same_tokens_as_one_process(ranks, artifacts, prompt, art, static)
    biases = fp8_biases(artifacts[art]) if art in ("gemma3", "phi3") else 0
    assert all(0 <= 2 * tp_bytes - nbytes <= biases for tp_bytes in rank_bytes), (rank_bytes, nbytes)


def test_tied_embeddings_under_two_ranks(ranks, artifacts, prompt):
    """Tied embeddings: transformers' plan splits lm_head and the embedding by vocabulary, tied again after loading."""
    tokens, nbytes, logits = one_process(artifacts["tied"], prompt)
    for r in ranks:
        tp_tokens, tp_bytes, tp_logits = r["tied"]
        assert tp_tokens == tokens and 2 * tp_bytes == nbytes
        assert_logits_close(tp_logits, logits)


def test_compiled_decode_step_under_two_ranks(ranks):
    """DecodeStep, what a GPU decode step compiles and captures, traced through transformers' TP hooks: the forward's
    logits bit for bit (tests/tp_rank.py decode_step)."""
    assert [r["decode_step"] for r in ranks] == [True, True]


def test_groups_that_do_not_split_are_refused_on_every_rank(ranks):
    for r in ranks:
        assert r["odd"]["type"] == "ValueError"
        assert r["odd"]["message"].endswith(
            "tp_size 2 does not divide the 1 latent groups of 4 KV heads (each rank holds "
            "whole groups): use a tp size that divides 1, or convert with a smaller --group"
        )


def test_a_bad_path_on_one_rank_ends_every_rank(ranks):
    for r in ranks:
        err = r["bad_path"]
        assert err["type"] == "ArtifactError"
        assert err["message"].startswith("rank 1 of 2: ") and "good-missing" in err["message"]


def test_load_without_torchrun_is_refused_in_one_line(artifacts, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        load(artifacts["good"], device="cpu", tp_size=2)
    with pytest.raises(ValueError, match="whole number"):
        load(artifacts["good"], device="cpu", tp_size=0)


def test_tale_run_under_two_ranks(ranks):
    """tale-run --tp 2 on every rank: rank 0 prints the answer and the stats line, rank 1 nothing."""
    zero, one = (r["cli"] for r in ranks)
    assert zero["exit_code"] == one["exit_code"] == 0, zero["stderr"] + one["stderr"]
    assert zero["stdout"].strip() and "tensor parallel: 2 ranks, cache bytes per rank" in zero["stderr"]
    assert one["stdout"] == one["stderr"] == ""


def test_tale_run_bad_path_on_one_rank_is_one_line_on_every_rank(ranks):
    for r in ranks:
        res = r["cli_bad_path"]
        assert res["exit_code"] == 2 and res["stdout"] == ""
        assert res["stderr"].count("\n") == 1 and res["stderr"].startswith("error: rank 1 of 2: ")
        assert "good-missing: no such artifact directory" in res["stderr"]


def test_bench_tp_cpu_path(ranks):
    """benchmarks/bench_tp.py --device cpu --tiny under 2 ranks: the check passes and the table comes out (rank 0)."""
    text = ranks[0]["bench"]
    check = [ln for ln in text.splitlines() if ln.startswith("| TALE, ")]
    assert len(check) == 2 and all(ln.endswith("| 8/8 |") for ln in check)
    row = next(ln for ln in text.splitlines() if ln.startswith("| tiny (2 layers, g=2, fused) | 2 | 64 |"))
    cols = row.split("|")
    assert float(cols[4]) > 0 and cols[7].strip() == "torch reference" and float(cols[8]) > 0  # ms/token, attention
    assert ranks[1]["bench"] == ""
    # --throughput: each runtime at the batch (3 rows on the CPU), tokens/s = batch x 1000 / ms per token
    batch = {
        tuple(c.strip() for c in ln.split("|")[1:3]): [c.strip() for c in ln.split("|")[3:]]
        for ln in text.split("## Throughput")[1].splitlines()
        if ln.startswith(("| TALE |", "| transformers |"))
    }
    assert set(batch) == {
        ("TALE", "static"),
        ("transformers", "DynamicCache, eager"),
        ("transformers", "static cache + torch.compile (off on the CPU)"),
    }
    for b, ms, tps, *_ in batch.values():
        assert b == "3" and float(ms) > 0 and abs(float(tps) - 3000 / float(ms)) <= 0.06 + 1e-3 * float(tps)
    assert "TALE / best transformers: **" in text


def test_bench_tp_memory_model():
    """--throughput's byte model: the largest batch and the largest context from a batch-1 run's memory, and the sizes
    it reads at Llama-3.1-70B shapes over 4 GPUs (docs/runtime.md's memory table: 131.4 GiB of base weights)."""
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    import bench_tp

    G = bench_tp.GiB
    assert bench_tp.fit_batch(80 * G, 40 * G, 2 * G, 2.5 * G) == 15  # 38 GiB over 2.5 per row
    assert bench_tp.fit_batch(41 * G, 40 * G, 2 * G, 2.5 * G) == 0  # not even the workspace
    run = dict(ceiling=76.0, base=34.0, prefill_peak=38.0, ctx=32768)  # 4 GiB over 32K tokens: 128 KiB per token
    T, line = bench_tp.largest_context(run)
    assert (
        T == 42 * G // (128 * 1024) == 344064 and "about 336K tokens" in line and "128.0 KiB per prompt token" in line
    )
    assert bench_tp.largest_context(dict(run, ceiling=float("nan"))) is None  # the CPU: no device memory
    assert bench_tp.largest_context(None) is None
    assert bench_tp.workspace(dict(run, ws=1.5), torch.device("cpu")) == (1.5 * G, "")
    from transformers import AutoConfig

    c = AutoConfig.for_model("llama", **bench_tp.SHAPES["70b"])
    assert round(bench_tp.base_bytes(c, torch.bfloat16) / G, 1) == 131.4
    assert bench_tp.kv_bytes(c, 32768, torch.bfloat16) / 4 == 2.5 * G  # per GPU, a 32K row of the 16-bit cache


def test_tale_run_tp_without_torchrun_is_one_line(artifacts, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    r = invoke(cli.main, [artifacts["good"], "-p", "hi", "--tp", "2", "--device", "cpu"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr == "error: tp_size 2 needs one process per rank: start it with torchrun --nproc-per-node 2 ...\n"


def test_tale_run_tp_with_an_old_transformers_is_one_line(artifacts, monkeypatch):
    """transformers before 5.22 has no transformers.distributed: one line that says which version to install."""
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    r = invoke(cli.main, [artifacts["good"], "-p", "hi", "--tp", "2", "--device", "cpu"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr == (
        "error: tensor parallelism needs transformers >= 5.22 (installed: 5.17.0): "
        "pip install -U 'transformers>=5.22,<5.25'\n"
    )
