"""What the kernel test modules share: importing tale_kernels so that, without a GPU, the kernels run in Triton's CPU
interpreter. TRITON_INTERPRET=1 must be set when triton and the kernels are first imported; it is restored after,
so other modules' tests keep the torch paths on the CPU. Imports only torch and pytest (not transformers, which may
import triton)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def kernels(*names: str, kernel: str) -> list:
    """The modules tale_kernels.<name>; skips the calling test module where triton is missing, or was imported
    before without the interpreter (its own library functions are then built for a GPU): `kernel` names a
    triton.jit function of the first module, which must be interpreted."""
    prev = os.environ.get("TRITON_INTERPRET")
    if not CUDA and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    mods = [importlib.import_module(f"tale_kernels.{n}") for n in names]
    if prev is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = prev
    if not CUDA:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(getattr(mods[0], kernel), InterpretedFunction):
            pytest.skip(
                "triton was imported without TRITON_INTERPRET=1 before this module; run it alone or with "
                "TRITON_INTERPRET=1",
                allow_module_level=True,
            )
    return mods


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    """Imported by a kernel test module: its tests run the kernels in the interpreter on the CPU."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
