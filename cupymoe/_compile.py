"""The only module that knows about NVRTC: kernel sources, architecture options, memoized modules.

Sources live in ``kernels_cu/`` (shipped inside the wheel as ``cupymoe/kernels_cu``). Project
headers are inlined into the source text, so CuPy's disk cache, which keys on the text,
recompiles whenever any header changes.
"""
from __future__ import annotations

import functools
import re
import threading
from pathlib import Path

from . import _contract

_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)
BASE_OPTIONS = ("-std=c++17",) + _contract.compile_options()
MIN_COMPUTE_CAPABILITY = 80


def kernel_dir() -> Path:
    """The folder holding the .cu/.cuh files: inside the package when installed, else the checkout's."""
    packaged = Path(__file__).with_name("kernels_cu")
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "kernels_cu"


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text of ``kernels_cu/name`` with its project ``#include "..."`` lines inlined once each."""
    seen = set()

    def expand(filename: str) -> str:
        if filename in seen:
            return ""
        seen.add(filename)
        text = (kernel_dir() / filename).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


def arch_option(compute_capability: int) -> str:
    """``-arch`` for a compute capability such as 90; 9.0 gets sm_90a so wgmma is available."""
    if compute_capability < MIN_COMPUTE_CAPABILITY:
        raise NotImplementedError(
            f"cupymoe needs compute capability 8.0 or newer (bf16 tensor cores); got {compute_capability / 10:.1f}"
        )
    return "-arch=sm_90a" if compute_capability == 90 else f"-arch=sm_{compute_capability}"


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def compute_capability(device_id: int) -> int:
    """The device's compute capability as an int (90 for sm_90); NotImplementedError below 8.0."""
    import cupy

    cc = int(cupy.cuda.Device(device_id).compute_capability)
    if cc < MIN_COMPUTE_CAPABILITY:
        name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"].decode()
        raise NotImplementedError(
            f"cupymoe needs a GPU of compute capability 8.0 or newer (bf16 tensor cores); "
            f"GPU {device_id} ({name}) is {cc / 10:.1f}"
        )
    return cc


@functools.lru_cache(maxsize=None)
def device_attribute(device_id: int, name: str) -> int:
    """A CUDA device attribute by its name without "cudaDevAttr", e.g. "MultiProcessorCount"."""
    import cupy

    return cupy.cuda.Device(device_id).attributes[name]


def multiprocessors(device_id: int) -> int:
    """The device's streaming multiprocessors."""
    return device_attribute(device_id, "MultiProcessorCount")


def resident_blocks(kernel, threads: int, shared_bytes: int) -> int:
    """How many blocks of ``kernel`` (a ``cupy.RawKernel``) one multiprocessor holds at once."""
    from cupy_backends.cuda.api import driver

    return driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, threads, shared_bytes)


def shared_memory_limit(device_id: int) -> int:
    """The most dynamic shared memory one block may opt in to, in bytes."""
    return device_attribute(device_id, "MaxSharedMemoryPerBlockOptin")


_lock = threading.Lock()
_modules = {}


def module(source_name: str, name_expressions: tuple, device_id: int):
    """The compiled ``cupy.RawModule`` for a source and its template instantiations on one device."""
    key = (source_name, name_expressions, device_id)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    import cupy

    with _lock:
        mod = _modules.get(key)
        if mod is None:
            options = BASE_OPTIONS + (arch_option(compute_capability(device_id)),)
            with cupy.cuda.Device(device_id):
                mod = cupy.RawModule(code=source(source_name), options=options,
                                     name_expressions=list(name_expressions))
                mod.compile()
                _modules[key] = mod
    return mod


_kernels = {}


def kernel(source_name: str, name_expression: str, name_expressions: tuple, device_id: int):
    """One kernel (``cupy.RawKernel``) of a module; ``name_expressions`` lists the module's instantiations."""
    key = (source_name, name_expression, name_expressions, device_id)
    found = _kernels.get(key)
    if found is None:
        found = module(source_name, name_expressions, device_id).get_function(name_expression)
        _kernels[key] = found
    return found


def ptxas_report(source_name: str, name_expressions: tuple, arch: str) -> str:
    """Compile with NVRTC for ``arch`` (e.g. "sm_90a"), no GPU needed; return the ptxas -v log.

    Raises RuntimeError with the compiler log if compilation fails.
    """
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source(source_name), source_name, [], [])
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, list(BASE_OPTIONS) + [f"-arch={arch}", "-Xptxas=-v"])
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"{source_name} for {arch} failed:\n{nvrtc.getProgramLog(prog)}") from err
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
