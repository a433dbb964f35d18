"""CUDA C++ kernels for torch tensors without an extension build: nvcc -> cubin (cached), the driver API via ctypes.

The prototype kernels of benchmarks/cuda_decode/ need no CuPy and no torch C++ extension: `Module(src, defines)`
compiles the source once per set of options with the nvcc on PATH (for the current GPU's architecture, `sm_90a`
on Hopper) into a cache directory, loads the cubin with `cuModuleLoadData`, and `Module.launch` calls
`cuLaunchKernel` on torch's current stream, so launches are captured by `torch.cuda.graph` like any other. Arguments
are torch tensors (passed as device pointers) or Python ints (int32) and floats (float32), in the kernel's order.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

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


def compile_cubin(src: str, options: tuple[str, ...], arch: str | None = None) -> bytes:
    """The cubin of `src` for `arch` (default: the current GPU's), from the cache or built with nvcc (a one-line
    error without it)."""
    if arch is None:
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}{'a' if major == 9 else ''}"
    code = open(src, "rb").read()
    key = hashlib.sha256(code + repr((arch, options)).encode()).hexdigest()[:20]
    path = os.path.join(CACHE, f"{os.path.basename(src)}.{key}.cubin")
    if not os.path.exists(path):
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            raise RuntimeError(f"nvcc not found on PATH: needed once to build {src} for {arch}")
        os.makedirs(CACHE, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=CACHE, suffix=".cubin")
        os.close(fd)
        gencode = f"-gencode=arch=compute_{arch[3:]},code={arch}"
        cmd = [nvcc, "-cubin", gencode, "-O3", "-std=c++17", *options, "-o", tmp, src]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"nvcc failed on {src}: {res.stderr.strip().splitlines()[-1:]}")
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

    def function(self, name: str, max_dynamic_shared: int = 0) -> ctypes.c_void_p:
        if name not in self.funcs:
            f = ctypes.c_void_p()
            _check(self.lib, self.lib.cuModuleGetFunction(ctypes.byref(f), self.mod, name.encode()), name)
            self.funcs[name] = f
        if max_dynamic_shared:
            rc = self.lib.cuFuncSetAttribute(self.funcs[name], _ATTR_MAX_DYNAMIC_SHARED, max_dynamic_shared)
            _check(self.lib, rc, f"{name}: {max_dynamic_shared} bytes of shared memory")
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
