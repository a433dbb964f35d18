"""tale_kernels.cuda_module's build step without a GPU: the compiler choice and its one-line errors."""

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
    import os

    assert os.path.isfile(mma_attention.SRC) and open(mma_attention.SRC).read().count('extern "C" __global__') >= 5
