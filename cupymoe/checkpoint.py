"""Reading (and writing) ``.safetensors`` files without torch: each tensor a read-only NumPy view of
the memory-mapped file, so loading a layer onto the GPU copies each tensor once, host to device,
and never holds a second host copy of the layer.

The format: an 8-byte little-endian header length, a JSON header mapping each name to its dtype,
shape and byte range (after the header), then the bytes.
"""
from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsFile:
    """One ``.safetensors`` file: ``names()``, ``f[name]`` (a read-only array view of the file)."""

    def __init__(self, path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ValueError(f"path: {self.path} is too short for a safetensors file ({size} bytes)")
            header_len = int.from_bytes(f.read(8), "little")
            if header_len > size - 8:
                raise ValueError(f"path: {self.path}: header of {header_len} bytes in a file of {size}")
            header = json.loads(f.read(header_len))
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + header_len else b""
        header.pop("__metadata__", None)
        self._start = 8 + header_len
        self._entries = header

    def names(self) -> list:
        return list(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __getitem__(self, name) -> np.ndarray:
        entry = self._entries[name]
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise TypeError(f"{name}: dtype {entry['dtype']} of {self.path} is not supported "
                            f"(expected one of {', '.join(DTYPES)})")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize:
            raise ValueError(f"{name}: {end - begin} bytes in {self.path} for shape {shape} of {entry['dtype']}")
        return np.frombuffer(self._map, dtype, count, self._start + begin).reshape(shape)


class Checkpoint:
    """The tensors of one or more ``.safetensors`` files (a sharded checkpoint) by name."""

    def __init__(self, paths):
        paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        if not paths:
            raise ValueError("paths: expected at least one .safetensors file, got none")
        self._where = {}
        for path in paths:
            shard = SafetensorsFile(path)
            for name in shard.names():
                self._where[name] = shard

    def names(self) -> list:
        return list(self._where)

    def __contains__(self, name) -> bool:
        return name in self._where

    def __getitem__(self, name) -> np.ndarray:
        shard = self._where.get(name)
        if shard is None:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        return shard[name]

    def layer(self, prefix: str) -> dict:
        """The tensors whose names start with ``prefix``, by the rest of their names (views)."""
        return {name[len(prefix):]: shard[name] for name, shard in self._where.items() if name.startswith(prefix)}


def save(path, tensors: dict) -> None:
    """Write NumPy arrays (those dtypes of :data:`DTYPES`) by name to a ``.safetensors`` file."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype not in _NAMES:
            raise TypeError(f"{name}: dtype {array.dtype} cannot be written (expected one of {', '.join(DTYPES)})")
        blobs.append(array.tobytes())
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blobs[-1])]}
        offset += len(blobs[-1])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)
