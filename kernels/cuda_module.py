"""CUDA C++ kernels for torch tensors without an extension build: source -> cubin (cached), the driver API via ctypes.

The kernels of kernels/cuda/ need no CuPy and no torch C++ extension: `Module(src, options)` compiles the source once
per set of options for the current GPU's architecture (`sm_90a` on Hopper) with NVRTC (the libnvrtc that CUDA builds
of torch install; no toolkit needed) or, without it, the nvcc on PATH, into a cache directory; loads the cubin with
`cuModuleLoadData`; and `Module.launch` calls `cuLaunchKernel(Ex)` on torch's current stream, so launches are
captured by `torch.cuda.graph` like any other. Arguments are torch tensors (passed as device pointers) or Python
ints (int32) and floats (float32), in the kernel's order. TALE_CUDA_COMPILER=nvcc|nvrtc picks the compiler.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache

import torch

CACHE = os.environ.get("TALE_CUDA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tale_cuda"))
_ATTR_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_LAUNCH_PDL = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        *[(n, ctypes.c_uint) for n in ("gx", "gy", "gz", "bx", "by", "bz", "smem")],
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttr)),
        ("num_attrs", ctypes.c_uint),
    ]


def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
    lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what}: CUDA driver error {rc} ({(msg.value or b'?').decode()})")


@lru_cache(maxsize=1)
def nvrtc() -> ctypes.CDLL | None:
    """libnvrtc: the one torch's CUDA wheels install (nvidia/*/lib), else the system's; None without either."""
    roots = [os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia")]
    names = sorted(glob.glob(os.path.join(roots[0], "**", "libnvrtc.so*"), recursive=True), key=len)
    for name in [n for n in names if "builtins" not in n] + ["libnvrtc.so"]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.nvrtcCreateProgram.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for f in ("nvrtcGetProgramLogSize", "nvrtcGetCUBINSize"):
            getattr(lib, f).argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        for f in ("nvrtcGetProgramLog", "nvrtcGetCUBIN"):
            getattr(lib, f).argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        return lib
    return None


def _nvrtc_compile(lib: ctypes.CDLL, src: str, code: bytes, arch: str, options: tuple[str, ...]) -> bytes:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), code, os.path.basename(src).encode(), 0, None, None):
        raise RuntimeError(f"NVRTC could not take {src}")
    try:
        opts = [f"--gpu-architecture={arch}", "-std=c++17", *(o for o in options if o != "-O3")]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if rc:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            lines = [x for x in log.value.decode(errors="replace").splitlines() if x.strip()]
            raise RuntimeError(f"NVRTC failed on {src}: {next((x for x in lines if 'error' in x), '?')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, out)
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvcc_compile(nvcc: str, src: str, arch: str, options: tuple[str, ...], tmp: str) -> None:
    gencode = f"-gencode=arch=compute_{arch[3:]},code={arch}"
    res = subprocess.run(
        [nvcc, "-cubin", gencode, "-O3", "-std=c++17", *options, "-o", tmp, src], capture_output=True, text=True
    )
    if res.returncode != 0:
        lines = res.stderr.strip().splitlines()
        raise RuntimeError(
            f"nvcc failed on {src}: {next((x for x in lines if 'error' in x), lines[-1] if lines else '?')}"
        )


def compiler() -> str | None:
    """The compiler builds use: TALE_CUDA_COMPILER, else NVRTC when found, else nvcc on PATH; None without any."""
    want = os.environ.get("TALE_CUDA_COMPILER")
    if want not in (None, "", "nvrtc", "nvcc"):
        raise RuntimeError(f"TALE_CUDA_COMPILER={want!r}: use nvrtc or nvcc")
    if want != "nvcc" and nvrtc() is not None:
        return "nvrtc"
    return "nvcc" if want != "nvrtc" and shutil.which("nvcc") else None


def _includes(code: bytes, here: str, seen: list[str] | None = None) -> list[str]:
    """The headers of `here` that `code` includes (#include "name"), and those they include, in order: part of the
    cache key."""
    seen = [] if seen is None else seen
    for n in re.findall(rb'^\s*#include\s+"([^"]+)"', code, re.M):
        name = n.decode()
        path = os.path.join(here, name)
        if name not in seen and os.path.exists(path):
            seen.append(name)
            _includes(open(path, "rb").read(), here, seen)
    return seen


def compile_cubin(src: str, options: tuple[str, ...], arch: str | None = None) -> bytes:
    """The cubin of `src` for `arch` (default: the current GPU's), from the cache or built (a one-line error
    without a compiler)."""
    if arch is None:
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}{'a' if major == 9 else ''}"
    code = open(src, "rb").read()
    how = compiler()
    if how is None:
        raise RuntimeError(f"neither NVRTC nor nvcc found: one is needed once to build {src} for {arch}")
    here = os.path.dirname(os.path.abspath(src))
    options = (*options, f"-I{here}")  # the folder's shared headers (ptx.cuh)
    headers = b"".join(open(os.path.join(here, h), "rb").read() for h in _includes(code, here))
    key = hashlib.sha256(code + headers + repr((arch, options, how)).encode()).hexdigest()[:20]
    path = os.path.join(CACHE, f"{os.path.basename(src)}.{key}.cubin")
    if not os.path.exists(path):
        os.makedirs(CACHE, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=CACHE, suffix=".cubin")
        os.close(fd)
        try:
            if how == "nvrtc":
                with open(tmp, "wb") as f:
                    f.write(_nvrtc_compile(nvrtc(), src, code, arch, options))
            else:
                _nvcc_compile(shutil.which("nvcc"), src, arch, options, tmp)
        except BaseException:
            os.unlink(tmp)
            raise
        os.replace(tmp, path)  # atomic: a concurrent build never sees half a file
    return open(path, "rb").read()


class Module:
    """The kernels of one CUDA source, compiled with `options` (e.g. ("-DSUBN=1", "--use_fast_math"))."""

    def __init__(self, src: str, options: tuple[str, ...] = ()):
        self.lib = _driver()
        torch.zeros(1, device="cuda")  # torch's primary context, current on this thread for the driver calls
        self._cubin = ctypes.create_string_buffer(compile_cubin(src, options))
        self.mod = ctypes.c_void_p()
        _check(self.lib, self.lib.cuModuleLoadData(ctypes.byref(self.mod), self._cubin), f"loading {src}")
        self.funcs: dict[str, ctypes.c_void_p] = {}
        self._smem: dict[str, int] = {}  # the dynamic shared memory each kernel was last allowed

    def function(self, name: str, max_dynamic_shared: int = 0) -> ctypes.c_void_p:
        """The kernel `name`, allowed `max_dynamic_shared` bytes of dynamic shared memory (set once per size)."""
        if name not in self.funcs:
            f = ctypes.c_void_p()
            _check(self.lib, self.lib.cuModuleGetFunction(ctypes.byref(f), self.mod, name.encode()), name)
            self.funcs[name] = f
        if max_dynamic_shared and self._smem.get(name) != max_dynamic_shared:
            rc = self.lib.cuFuncSetAttribute(self.funcs[name], _ATTR_MAX_DYNAMIC_SHARED, max_dynamic_shared)
            _check(self.lib, rc, f"{name}: {max_dynamic_shared} bytes of shared memory")
            self._smem[name] = max_dynamic_shared
        return self.funcs[name]

    def launch(self, name: str, grid, block, args, shared: int = 0, pdl: bool = False) -> None:
        """Launch `name` on torch's current stream. grid/block: int or up to 3 ints. pdl: programmatic dependent
        launch (the kernel may start before the previous one ends; it must `griddepcontrol.wait` before reading
        what that one wrote)."""
        g = (tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)) + (1, 1)
        b = (tuple(block) if isinstance(block, (tuple, list)) else (block,)) + (1, 1)
        vals = []
        for a in args:
            if isinstance(a, torch.Tensor):
                vals.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, bool) or not isinstance(a, (int, float)):
                raise TypeError(f"{name}: argument {a!r} is neither a tensor, an int nor a float")
            elif isinstance(a, int):
                if not -(2**31) <= a < 2**31:
                    raise ValueError(f"{name}: argument {a} does not fit the kernel's int32")
                vals.append(ctypes.c_int32(a))
            else:
                vals.append(ctypes.c_float(a))
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        pparams = ctypes.cast(params, ctypes.c_void_p)
        if pdl:
            attr = _LaunchAttr(id=_LAUNCH_PDL, value=(1).to_bytes(4, "little") + bytes(60))
            cfg = _LaunchConfig(*g[:3], *b[:3], shared, stream, ctypes.pointer(attr), 1)
            rc = self.lib.cuLaunchKernelEx(ctypes.byref(cfg), self.function(name), pparams, None)
        else:
            rc = self.lib.cuLaunchKernel(self.function(name), *g[:3], *b[:3], shared, stream, pparams, None)
        _check(self.lib, rc, f"launching {name}")


_LOADED: dict = {}


def loaded(src: str, options: tuple[str, ...], device: torch.device) -> Module:
    """The Module of `src` built with `options` on `device`, made once per process."""
    key = (src, options, device.index)
    if key not in _LOADED:
        with torch.cuda.device(device):
            _LOADED[key] = Module(src, options)
    return _LOADED[key]


def device_scalar(v, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A kernel's (pointer, value) pair for an int that is either a device scalar (read by the kernel: value -1) or a
    Python int (the pointer is `dummy`, never read)."""
    if isinstance(v, torch.Tensor):
        return (v if v.dtype == torch.int32 else v.to(torch.int32)), -1
    return dummy, int(v)


def dequant_bias(planes, dummy: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A kernel's (pointer, 1/value) pair for quantized planes' code bias: fp8 scales ("8/8") keep a bias that is a
    device tensor (value -1) or a float; other planes' bias is 1/shift."""
    if planes.meta != "8/8":
        return dummy, 1.0 / planes.shift
    b = planes.bias
    return (b, -1.0) if isinstance(b, torch.Tensor) else (dummy, 1.0 / float(b))
