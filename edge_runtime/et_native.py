"""The ExecuTorch runtime without torch: a small C ABI (``native/orchard_et.cpp``) over
the runtime libraries the ``executorch`` wheel ships, loaded with ctypes.

Why not ``executorch.runtime`` or ``executorch.extension.training``: their Python
bindings link ``libtorch`` and ``import torch`` first, so a process that uses them
carries all of torch. The wheel also ships the runtime itself (``lib/libexecutorch.so``,
the CPU kernels in ``lib/libexecutorch_kernels_optimized.so``, headers and a CMake
package for applications), and neither needs torch; that is what a phone app links,
and what this module builds against, once per installation, with the host's C++
compiler (about a second). The compiled library is cached under
``$ORCHARD_NATIVE_DIR`` (default ``~/.cache/orchard/native``), keyed by the source
and the runtime library it links, so an upgraded executorch gets a fresh build.

Finding the wheel uses ``importlib.util.find_spec``, which locates the package without
importing it.

Memory: a :class:`NativeMethod`'s inputs and outputs are numpy arrays that *view* the
runtime's planned memory: writing an input array sets the input, and an output array
changes when the method runs again. They are valid while the method object lives.
"""

from __future__ import annotations

import ctypes as C
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from orchard.errors import OrchardError

SOURCE = Path(__file__).parent / "native" / "orchard_et.cpp"
# What SOURCE includes from its own directory (shared with device/src/et_program.cpp).
HEADERS = (Path(__file__).parent / "native" / "et_loader.h",)
CACHE_ENV = "ORCHARD_NATIVE_DIR"
# ExecuTorch ScalarType codes (runtime/core/portable_type/scalar_type.h).
_DTYPES: dict[int, np.dtype] = {
    0: np.dtype(np.uint8), 1: np.dtype(np.int8), 2: np.dtype(np.int16), 3: np.dtype(np.int32),
    4: np.dtype(np.int64), 6: np.dtype(np.float32), 7: np.dtype(np.float64), 11: np.dtype(np.bool_),
}
_ERR_LEN = 512


class NativeRuntimeError(OrchardError):
    """The ExecuTorch runtime could not be found, built, loaded or run."""


def executorch_root() -> Path:
    """The installed ``executorch`` package directory (found, not imported)."""
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise NativeRuntimeError(
            "the executorch package is not installed: pip install 'orchard-fl[executorch]' "
            "(it ships the ExecuTorch runtime libraries this client links)"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    missing = [p for p in ("include/executorch", "lib/libexecutorch.so") if not (root / p).exists()]
    if missing:
        raise NativeRuntimeError(
            f"{root} lacks {missing}: this executorch wheel does not ship its C++ runtime; "
            "install executorch >= 1.5.1 from PyPI"
        )
    return root


def _cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "orchard" / "native")


def build_native_library(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The compiled C ABI library, built on first use (atomically, so concurrent
    clients never load a half-written file)."""
    root = executorch_root()
    lib_dir, include = root / "lib", root / "include"
    runtime = lib_dir / "libexecutorch.so"
    flags = [
        "-O2", "-std=c++17", "-shared", "-fPIC",
        # The definitions executorch's CMake package puts on its runtime target.
        "-DC10_USING_CUSTOM_GENERATED_MACROS", "-DET_EVENT_TRACER_ENABLED",
        f"-I{include}", f"-I{include / 'executorch/runtime/core/portable_type/c10'}", f"-L{lib_dir}",
        # The kernel and backend libraries only register themselves (nothing references
        # their symbols), so keep them on the link line explicitly.
        "-Wl,--no-as-needed", "-lexecutorch", "-lexecutorch_kernels_optimized",
        "-lexecutorch_backend_xnnpack", "-lexecutorch_threadpool", "-Wl,--as-needed",
        f"-Wl,--enable-new-dtags,-rpath,{lib_dir}",
    ]
    st = runtime.stat()
    key = hashlib.sha256(
        SOURCE.read_bytes() + b"".join(h.read_bytes() for h in HEADERS) + f"{runtime.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
        + " ".join(flags).encode()
    ).hexdigest()[:16]
    out_dir = Path(cache_dir) if cache_dir is not None else _cache_dir()
    target = out_dir / f"liborchard_et-{key}.so"
    if target.is_file():
        return target
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise NativeRuntimeError(
            "no C++ compiler (c++ or g++, or $CXX) to build the ExecuTorch bridge; install one "
            f"(e.g. apt-get install g++) or set {CACHE_ENV} to a directory holding a built {target.name}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        tmp_lib = Path(tmp) / target.name
        cmd = [compiler, *flags[:4], str(SOURCE), "-o", str(tmp_lib), *flags[4:]]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise NativeRuntimeError(
                f"building the ExecuTorch bridge failed ({' '.join(cmd[:2])} ... exit {res.returncode}):\n"
                + res.stderr[-2000:]
            )
        os.replace(tmp_lib, target)
    return target


_LIB: C.CDLL | None = None


def _lib() -> C.CDLL:
    global _LIB
    if _LIB is None:
        lib = C.CDLL(str(build_native_library()))
        vp, sz = C.c_void_p, C.c_size_t
        lib.oet_program_load.restype, lib.oet_program_load.argtypes = vp, [C.c_char_p, C.c_char_p, sz]
        lib.oet_program_free.restype, lib.oet_program_free.argtypes = None, [vp]
        lib.oet_num_methods.restype, lib.oet_num_methods.argtypes = sz, [vp]
        lib.oet_method_name.restype, lib.oet_method_name.argtypes = C.c_char_p, [vp, sz]
        lib.oet_method_load.restype, lib.oet_method_load.argtypes = vp, [vp, C.c_char_p, C.c_char_p, sz]
        lib.oet_method_free.restype, lib.oet_method_free.argtypes = None, [vp]
        lib.oet_planned_bytes.restype, lib.oet_planned_bytes.argtypes = C.c_uint64, [vp]
        lib.oet_num_inputs.restype, lib.oet_num_inputs.argtypes = sz, [vp]
        lib.oet_num_outputs.restype, lib.oet_num_outputs.argtypes = sz, [vp]
        lib.oet_execute.restype, lib.oet_execute.argtypes = C.c_int, [vp]
        lib.oet_value.restype = C.c_int
        lib.oet_value.argtypes = [vp, C.c_int, sz, C.POINTER(C.c_int32), C.POINTER(C.c_int32),
                                  C.POINTER(C.c_int64), C.POINTER(C.c_void_p), C.POINTER(C.c_int64)]
        _LIB = lib
    return _LIB


class NativeProgram:
    """A ``.pte`` program loaded by the ExecuTorch runtime."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lib = _lib()
        err = C.create_string_buffer(_ERR_LEN)
        handle = self._lib.oet_program_load(str(self.path).encode(), err, _ERR_LEN)
        if not handle:
            raise NativeRuntimeError(f"{self.path}: {err.value.decode()}")
        self._h: int | None = handle

    @property
    def method_names(self) -> list[str]:
        assert self._h is not None
        names = (self._lib.oet_method_name(self._h, i) for i in range(self._lib.oet_num_methods(self._h)))
        return [n.decode() for n in names if n is not None]

    def method(self, name: str) -> NativeMethod:
        if self._h is None:
            raise NativeRuntimeError(f"{self.path}: the program is closed")
        err = C.create_string_buffer(_ERR_LEN)
        handle = self._lib.oet_method_load(self._h, name.encode(), err, _ERR_LEN)
        if not handle:
            raise NativeRuntimeError(f"{self.path}: {err.value.decode()}")
        return NativeMethod(self, handle, name)

    def close(self) -> None:
        if self._h is not None:
            self._lib.oet_program_free(self._h)
            self._h = None

    def __del__(self) -> None:  # methods hold a reference, so they go first
        self.close()


class NativeMethod:
    """One loaded method: planned memory, inputs and outputs as in-place numpy views."""

    def __init__(self, program: NativeProgram, handle: int, name: str) -> None:
        self.program = program  # keeps the program alive while the method is
        self.name = name
        self._lib = program._lib
        self._h: int | None = handle
        self.planned_bytes = int(self._lib.oet_planned_bytes(handle))
        self.inputs = [self._value(0, i) for i in range(self._lib.oet_num_inputs(handle))]
        self._outputs: list[np.ndarray | int] | None = None

    def _value(self, which: int, i: int) -> np.ndarray | int:
        dtype, ndim, ival = C.c_int32(), C.c_int32(), C.c_int64()
        sizes, data = (C.c_int64 * 8)(), C.c_void_p()
        kind = self._lib.oet_value(self._h, which, i, dtype, ndim, sizes, data, ival)
        if kind == 1:
            return int(ival.value)
        where = "input" if which == 0 else "output"
        if kind != 0:
            raise NativeRuntimeError(f"{self.program.path}: {self.name} {where} {i} is neither a tensor nor an int")
        if dtype.value not in _DTYPES:
            raise NativeRuntimeError(f"{self.program.path}: {self.name} {where} {i} has unsupported dtype code {dtype.value}")
        if ndim.value > 8:
            raise NativeRuntimeError(f"{self.program.path}: {self.name} {where} {i} has rank {ndim.value} > 8")
        dt = _DTYPES[dtype.value]
        shape = tuple(int(s) for s in sizes[: ndim.value])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if nbytes == 0:
            return np.empty(shape, dt)
        buf = (C.c_uint8 * nbytes).from_address(int(data.value or 0))
        return np.frombuffer(memoryview(buf), dtype=dt).reshape(shape)

    @property
    def outputs(self) -> list[np.ndarray | int]:
        """The outputs, as views (refreshed after each :meth:`execute`)."""
        if self._outputs is None:
            self._outputs = [self._value(1, i) for i in range(self._lib.oet_num_outputs(self._h))]
        return self._outputs

    def execute(self) -> list[np.ndarray | int]:
        if self._h is None:
            raise NativeRuntimeError(f"{self.program.path}: method {self.name} is closed")
        code = self._lib.oet_execute(self._h)
        if code != 0:
            raise NativeRuntimeError(f"{self.program.path}: {self.name} failed to run (ExecuTorch error {code})")
        self._outputs = None
        return self.outputs

    def close(self) -> None:
        if self._h is not None:
            self._lib.oet_method_free(self._h)
            self._h = None

    def __del__(self) -> None:
        self.close()
