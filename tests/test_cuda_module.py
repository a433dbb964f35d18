"""tale_kernels.cuda_module's build step without a GPU: the compiler choice and its one-line errors."""

import os
import re
import shutil

import pytest

from tale_kernels import cuda_module, mma_attention


def test_compiler_choice_is_checked(monkeypatch):
    monkeypatch.setenv("TALE_CUDA_COMPILER", "clang")
    with pytest.raises(RuntimeError, match="TALE_CUDA_COMPILER='clang': use nvrtc or nvcc"):
        cuda_module.compiler()


def test_no_compiler_is_one_line(monkeypatch, tmp_path):
    """Neither NVRTC nor nvcc: a one-line error, and no half-written cubin left in the cache."""
    monkeypatch.setattr(cuda_module, "nvrtc", lambda: None)
    monkeypatch.setattr(cuda_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(cuda_module, "CACHE", str(tmp_path))
    monkeypatch.delenv("TALE_CUDA_COMPILER", raising=False)
    assert cuda_module.compiler() is None
    with pytest.raises(RuntimeError, match="neither NVRTC nor nvcc found"):
        cuda_module.compile_cubin(mma_attention.SRC, mma_attention.OPTIONS, arch="sm_90a")
    assert list(tmp_path.iterdir()) == []


def test_failed_build_leaves_nothing(monkeypatch, tmp_path):
    """A compiler that fails: its error, and the cache directory holds no file."""
    monkeypatch.setattr(cuda_module, "CACHE", str(tmp_path))
    monkeypatch.setenv("TALE_CUDA_COMPILER", "nvcc")
    monkeypatch.setattr(cuda_module.shutil, "which", lambda name: "/bin/false")
    with pytest.raises(RuntimeError, match="nvcc failed on"):
        cuda_module.compile_cubin(mma_attention.SRC, mma_attention.OPTIONS, arch="sm_90a")
    assert list(tmp_path.iterdir()) == []


def test_kernel_source_ships_with_the_package():
    assert os.path.isfile(mma_attention.SRC) and open(mma_attention.SRC).read().count('extern "C" __global__') >= 5


def test_a_header_edit_rebuilds(monkeypatch, tmp_path):
    """The cache key holds the headers a source includes: an edited ptx.cuh is a new build, not a stale cubin."""
    src = tmp_path / "src"
    shutil.copytree(os.path.dirname(mma_attention.SRC), src)
    builds = []

    def fake_nvcc(nvcc, path, arch, options, tmp):
        builds.append(options)
        open(tmp, "wb").write(b"cubin")

    monkeypatch.setattr(cuda_module, "CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TALE_CUDA_COMPILER", "nvcc")
    monkeypatch.setattr(cuda_module.shutil, "which", lambda name: "/usr/bin/nvcc")
    monkeypatch.setattr(cuda_module, "_nvcc_compile", fake_nvcc)
    cu = str(src / "latent_level.cu")
    for _ in range(2):
        assert cuda_module.compile_cubin(cu, mma_attention.OPTIONS, arch="sm_90a") == b"cubin"
    assert len(builds) == 1 and f"-I{src}" in builds[0]  # the second call read the cache
    with open(src / "ptx.cuh", "a") as f:
        f.write("\n// edited\n")
    cuda_module.compile_cubin(cu, mma_attention.OPTIONS, arch="sm_90a")
    assert len(builds) == 2
    # a header included through another one (lowrank_score_wg.cu -> wgmma.cuh -> ptx.cuh) is in the key too
    wg = str(src / "lowrank_score_wg.cu")
    cuda_module.compile_cubin(wg, ("-DKC=152",), arch="sm_90a")
    with open(src / "ptx.cuh", "a") as f:
        f.write("\n// edited again\n")
    cuda_module.compile_cubin(wg, ("-DKC=152",), arch="sm_90a")
    assert len(builds) == 4


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("name", ["latent_level.cu", "lowrank_score.cu"])
def test_sources_build_with_their_header(monkeypatch, tmp_path, name):
    """Each .cu compiles offline for sm_90a with nvcc (no GPU needed): the shared header resolves."""
    from tale_kernels import lowrank_score

    monkeypatch.setattr(cuda_module, "CACHE", str(tmp_path))
    monkeypatch.setenv("TALE_CUDA_COMPILER", "nvcc")
    src = os.path.join(os.path.dirname(mma_attention.SRC), name)
    tiling = lowrank_score.Tiling(4)
    opts = (
        mma_attention.OPTIONS if name == "latent_level.cu" else lowrank_score.build_options(152, 4, 32, True, 4, tiling)
    )
    assert len(cuda_module.compile_cubin(src, opts, arch="sm_90a")) > 10000


SCORE_BUILDS = [
    # (KC, bits, token group, fp8 scales, query heads per KV head, KV heads per CTA or "wg", RoPE tables)
    (152, 4, 64, True, 4, 4, False),  # the lowrank preset's at 8B shapes on mma.sync: one CTA per SM
    (144, 2, 16, False, 8, 2, True),  # no padding coefficient, 16-bit scales, GQA 8, tables
    (96, 8, 32, False, 3, 1, False),
    (152, 4, 64, True, 4, "wg", False),  # the rebuild on wgmma, one warpgroup of 2 KV heads, two CTAs per SM
    (144, 2, 16, False, 8, "wg", True),
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("case", SCORE_BUILDS)
def test_score_pass_builds_fit_their_launch(tmp_path, case):
    """Each cut of the CUDA score pass builds offline for sm_90a with the shared memory its launch gives (the build
    asserts the two layouts agree), spills nothing, and its registers let as many CTAs share an SM as their shared
    memory does; a launch that gives other bytes does not build."""
    import subprocess

    from tale_kernels import lowrank_score

    kc, bits, ktg, meta8, rep, cut, tables = case
    t = lowrank_score.WG if cut == "wg" else lowrank_score.Tiling(cut)
    opts = lowrank_score.build_options(kc, bits, ktg, meta8, rep, t, tables=tables)
    inc = f"-I{os.path.dirname(lowrank_score.SRC)}"

    def nvcc(*o):
        cmd = ["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", inc, *o]
        return subprocess.run([*cmd, "-o", str(tmp_path / "k.cubin"), t.src], capture_output=True, text=True)

    r = nvcc(*opts)
    assert r.returncode == 0, r.stderr[-2000:]
    used = re.search(r"Used (\d+) registers", r.stderr)
    assert used and "0 bytes spill stores" in r.stderr, r.stderr[-2000:]
    smem = lowrank_score.smem_bytes(kc, bits, ktg, meta8, rep, t)
    per_sm = 233472 // (smem + 1024)  # Hopper: 228 KB per SM, 1 KB of it reserved per CTA
    assert per_sm >= 1 and int(used[1]) * t.threads * per_sm <= 65536, (used[1], per_sm)
    wrong = [o if not o.startswith("-DSMEM_LAUNCH=") else f"-DSMEM_LAUNCH={smem + 16}" for o in opts]
    r = nvcc(*wrong)
    assert r.returncode != 0 and "shared memory differs" in r.stderr


def test_score_pass_cut_choice(monkeypatch):
    """The score pass' cut: the wgmma build on Hopper for basis blocks of an even number of KV heads, the mma.sync
    build with the most heads that fit elsewhere; TALE_LR_SCORE_TILE overrides it; nothing where no basis fits."""
    from tale_kernels import lowrank_score as ls

    monkeypatch.delenv("TALE_LR_SCORE_TILE", raising=False)
    fmt = (152, 4, 64, True, 4)  # the lowrank preset's coefficients at 8B shapes, GQA 4
    kw = dict(limit=232448)  # an H100's shared memory per block
    assert ls.tiling(4, 8, *fmt, **kw, hopper=True) == ls.WG
    assert ls.tiling(4, 8, *fmt, **kw, hopper=False) == ls.Tiling(4)
    assert ls.tiling(3, 3, *fmt, **kw, hopper=True) == ls.Tiling(1)  # odd blocks: no pair of heads
    assert ls.tiling(4, 8, *fmt, limit=100_000, hopper=True) == ls.Tiling(1)  # only one head's columns fit
    assert ls.tiling(4, 8, *fmt, limit=40_000, hopper=True) is None
    monkeypatch.setenv("TALE_LR_SCORE_TILE", "2")
    assert ls.tiling(4, 8, *fmt, **kw, hopper=True) == ls.Tiling(2)
