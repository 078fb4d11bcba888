"""Argument checks at the API edge: array coercion, dtypes, shapes, devices, ``out=``.

Every public function calls into here once; the stages behind it trust what they get.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from . import fp8
from ._contract import ACTIVATIONS, K_TILE
from ._types import ExpertOptions, Shape, WeightScales

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT16 = np.dtype(np.float16)
FLOAT32 = np.dtype(np.float32)
ACTIVATION_DTYPES = (BFLOAT16, FLOAT16)
CUDA_TYPES = {FLOAT32: "float", BFLOAT16: "bf16", FLOAT16: "f16"}  # dtype -> its type in kernels_cu/common.cuh
ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
SIZE_MULTIPLE = K_TILE  # H and I must be multiples of the kernels' K tile
GPU_ALIGNMENT = 16  # bytes: where x, the weights and out must start on the GPU


def _cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def _dtype_name(dtype) -> str:
    return "bfloat16" if dtype == BFLOAT16 else str(dtype)


def _names(dtypes) -> str:
    return " or ".join(_dtype_name(d) for d in dtypes)


def as_array(obj, name: str):
    """Return ``obj`` as a numpy.ndarray or cupy.ndarray without copying.

    NumPy and CuPy arrays pass through; CUDA arrays from other libraries (torch, JAX, ...)
    are wrapped zero-copy through ``__cuda_array_interface__`` or DLPack; a torch
    ``float8_e4m3fn`` tensor comes as a uint8 view of its bits (DLPack carries no float8 to CuPy).
    """
    obj = _torch_float8_as_bits(obj)
    if isinstance(obj, np.ndarray):
        return obj
    cupy = _cupy()
    if cupy is not None and isinstance(obj, cupy.ndarray):
        return obj
    if hasattr(obj, "__dlpack_device__"):
        device_type = int(obj.__dlpack_device__()[0])
        if device_type == 1:  # kDLCPU
            return np.from_dlpack(obj)
        if cupy is None:
            raise TypeError(f"{name}: a CUDA array needs CuPy (pip install 'cupymoe[cuda12]')")
        return cupy.from_dlpack(obj)
    if hasattr(obj, "__cuda_array_interface__"):
        if cupy is None:
            raise TypeError(f"{name}: a CUDA array needs CuPy (pip install 'cupymoe[cuda12]')")
        a = cupy.asarray(obj)
        return a.view(BFLOAT16) if a.dtype == np.dtype("V2") else a  # bfloat16's typestr is "<V2"
    raise TypeError(
        f"{name}: expected a NumPy, CuPy or DLPack-capable array, got {type(obj).__name__}"
    )


def _torch_float8_as_bits(obj):
    """A torch float8_e4m3fn tensor as its uint8 view (the e4m3 bits that FP8 weights take); anything
    else as it is."""
    if type(obj).__module__.split(".")[0] == "torch" and str(getattr(obj, "dtype", "")) == "torch.float8_e4m3fn":
        import torch  # the tensor is torch's, so torch is imported already

        return obj.view(torch.uint8)
    return obj


def array_module(arrays: dict):
    """Return numpy or cupy, the module every array in ``arrays`` (name -> array) belongs to.

    Raises TypeError when host and device arrays are mixed and ValueError when device
    arrays live on different GPUs.
    """
    on_host = [n for n, a in arrays.items() if isinstance(a, np.ndarray)]
    on_device = [n for n in arrays if n not in on_host]
    if on_host and on_device:
        raise TypeError(
            f"all arrays must be on the same side: {', '.join(on_host)} on the host (NumPy) "
            f"but {', '.join(on_device)} on the GPU"
        )
    if on_host:
        return np
    cupy = _cupy()
    devices = {n: arrays[n].device.id for n in on_device}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        where = ", ".join(f"{n} on GPU {d}" for n, d in devices.items())
        raise ValueError(f"all arrays must be on one GPU, got {where}")
    return cupy


def check_array(a, name: str, ndim: int, dtypes) -> None:
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array, got shape {tuple(a.shape)}")
    if a.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_names(dtypes)}, got {_dtype_name(a.dtype)}")


def require_contiguous(a, name: str) -> None:
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (strides {a.strides})")


def require_aligned(a, name: str) -> None:
    """A GPU array whose data starts on the 16-byte grid that the kernels' loads and stores need."""
    address = a.data.ptr
    if address % GPU_ALIGNMENT:
        raise ValueError(
            f"{name}: expected data aligned to {GPU_ALIGNMENT} bytes (the kernels move 16 bytes at a "
            f"time), got address 0x{address:x}, a view off that grid; pass a copy"
        )


def on_gpu_grid(x):
    """The GPU array ``x`` contiguous and starting on the 16-byte grid: itself, or a copy."""
    import cupy

    x = cupy.ascontiguousarray(x)
    return x.copy() if x.data.ptr % GPU_ALIGNMENT else x


def check_weights(w13, w2, w13_scale=None, w2_scale=None, fp8_compute=None) -> tuple:
    """Validate the expert weights (and the scales and ``fp8_compute`` of FP8 ones); return (E, I,
    H, dtype, scales): dtype the weights' (None for FP8 weights), scales a WeightScales for FP8
    weights, else None."""
    fp8_weights = w13.dtype in fp8.FP8_DTYPES or w2.dtype in fp8.FP8_DTYPES
    if fp8_compute is not None:
        if not isinstance(fp8_compute, str):
            raise TypeError(f"fp8_compute: expected one of {fp8.COMPUTE_MODES} or None, got "
                            f"{type(fp8_compute).__name__}")
        if fp8_compute not in fp8.COMPUTE_MODES:
            raise ValueError(f"fp8_compute: expected one of {fp8.COMPUTE_MODES} or None, got {fp8_compute!r}")
        if not fp8_weights:
            raise ValueError(f"fp8_compute: applies to FP8 weights only, got w13 of dtype {_dtype_name(w13.dtype)}")
    if fp8_weights or w13_scale is not None or w2_scale is not None:
        dtypes = fp8.FP8_DTYPES
        for name, scale, weight in (("w13_scale", w13_scale, w13), ("w2_scale", w2_scale, w2)):
            if scale is None:
                raise TypeError(f"{name}: FP8 weights need their float32 scales, got None")
            if weight.dtype not in dtypes:
                raise TypeError(f"{name}: scales go with float8_e4m3fn (or uint8) weights, got "
                                f"{name[:-6]} of dtype {_dtype_name(weight.dtype)}")
    else:
        dtypes = ACTIVATION_DTYPES
    check_array(w13, "w13", 3, dtypes)
    check_array(w2, "w2", 3, dtypes)
    if not fp8_weights and w2.dtype != w13.dtype:
        raise TypeError(
            f"w2: expected dtype {_dtype_name(w13.dtype)} like w13, got {_dtype_name(w2.dtype)}"
        )
    experts, two_i, hidden = w13.shape
    if experts < 1:
        raise ValueError(f"w13: expected at least one expert, got shape {tuple(w13.shape)}")
    if two_i % 2:
        raise ValueError(f"w13: expected an even dimension 1 (gate rows then up rows), got {two_i}")
    inter = two_i // 2
    if hidden % SIZE_MULTIPLE or hidden == 0:
        raise ValueError(f"w13: hidden size must be a positive multiple of {SIZE_MULTIPLE}, got {hidden}")
    if inter % SIZE_MULTIPLE or inter == 0:
        raise ValueError(
            f"w13: intermediate size must be a positive multiple of {SIZE_MULTIPLE}, got {inter}"
        )
    if tuple(w2.shape) != (experts, hidden, inter):
        raise ValueError(f"w2: expected shape {(experts, hidden, inter)}, got {tuple(w2.shape)}")
    require_contiguous(w13, "w13")
    require_contiguous(w2, "w2")
    if not fp8_weights:
        return experts, inter, hidden, w13.dtype, None
    _check_scale(w13_scale, "w13_scale", w13)
    _check_scale(w2_scale, "w2_scale", w2)
    return experts, inter, hidden, None, WeightScales(w13_scale, w2_scale, fp8_compute == "w8a16")


def _check_scale(scale, name: str, weight) -> None:
    """An FP8 weight's scales: float32 of a layout's shape (cupymoe.fp8), contiguous, beside it."""
    array_module({name: scale, name[:-6]: weight})
    experts, rows, cols = weight.shape
    shapes = [fp8.scale_shape(layout, experts, rows, cols) for layout in fp8.ScaleLayout]
    if tuple(scale.shape) not in shapes:
        raise ValueError(f"{name}: expected a shape of {' (block), '.join(map(str, shapes[:2]))} (channel) "
                         f"or {shapes[2]} (expert) for {name[:-6]} of shape {tuple(weight.shape)}, "
                         f"got {tuple(scale.shape)}")
    if scale.dtype != FLOAT32:
        raise TypeError(f"{name}: expected dtype float32, got {_dtype_name(scale.dtype)}")
    require_contiguous(scale, name)


def activation_dtype(weights_dtype, options: ExpertOptions):
    """The dtype of x and out: the weights' (bf16/fp16 weights), else that of the biases (FP8
    weights), else None (FP8 weights without biases take either)."""
    if weights_dtype is not None:
        return weights_dtype
    bias = options.w13_bias if options.w13_bias is not None else options.w2_bias
    return None if bias is None else bias.dtype


def check_routing(topk_ids, topk_weights, tokens: int, experts: int) -> int:
    """Validate the routing arrays against T and E; return k."""
    check_array(topk_ids, "topk_ids", 2, ID_DTYPES)
    if topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids: expected {tokens} rows like x, got shape {tuple(topk_ids.shape)}")
    top_k = topk_ids.shape[1]
    if not 1 <= top_k <= experts:
        raise ValueError(f"topk_ids: expected 1 <= k <= {experts} (the experts), got k = {top_k}")
    if topk_weights is not None:
        check_array(topk_weights, "topk_weights", 2, (FLOAT32,))
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"topk_weights: expected shape {tuple(topk_ids.shape)} like topk_ids, "
                f"got {tuple(topk_weights.shape)}"
            )
    return top_k


def check_out(out, xp, shape: tuple, dtype, device_id=None) -> None:
    """Validate a caller-supplied output buffer."""
    if not isinstance(out, xp.ndarray):
        side = "a NumPy" if xp is np else "a CuPy"
        raise TypeError(f"out: expected {side} array like the inputs, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out: expected dtype {_dtype_name(dtype)}, got {_dtype_name(out.dtype)}")
    require_contiguous(out, "out")
    if device_id is not None and out.device.id != device_id:
        raise ValueError(f"out: expected an array on GPU {device_id}, got one on GPU {out.device.id}")


def check_forward(x, sizes: tuple, dtype, topk_ids, topk_weights) -> Shape:
    """Validate x and the routing of one forward (already coerced, one module) against the checked
    weights' sizes (E, I, H) and x's dtype (None: either activation dtype); return its Shape."""
    experts, inter, hidden = sizes
    check_array(x, "x", 2, ACTIVATION_DTYPES)
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"x: expected dtype {_dtype_name(dtype)} like the weights (FP8 weights: like their "
                        f"biases), got {_dtype_name(x.dtype)}")
    if x.shape[1] != hidden:
        raise ValueError(f"x: expected {hidden} columns (w13's hidden size), got shape {tuple(x.shape)}")
    top_k = check_routing(topk_ids, topk_weights, x.shape[0], experts)
    return Shape(x.shape[0], hidden, experts, inter, top_k, x.dtype)


def check_activation(activation) -> str:
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    return activation


def check_options(activation, w13_bias, w2_bias, apply_router_weight_on_input, w13, dtype) -> ExpertOptions:
    """Validate the expert options against the (coerced, checked) w13 and its dtype (None for FP8
    weights, whose biases take either activation dtype, both the same); return them with the biases
    coerced to arrays on the weights' side and device."""
    check_activation(activation)
    if not isinstance(apply_router_weight_on_input, (bool, np.bool_)):
        raise TypeError(f"apply_router_weight_on_input: expected a bool, got "
                        f"{type(apply_router_weight_on_input).__name__}")
    experts, two_i, hidden = w13.shape
    biases = []
    for name, bias, shape in (("w13_bias", w13_bias, (experts, two_i)), ("w2_bias", w2_bias, (experts, hidden))):
        if bias is not None:
            bias = as_array(bias, name)
            array_module({name: bias, "w13": w13})  # the same side and GPU as the weights
            check_array(bias, name, 2, ACTIVATION_DTYPES if dtype is None else (dtype,))
            if biases and biases[0] is not None and bias.dtype != biases[0].dtype:
                raise TypeError(f"{name}: expected dtype {_dtype_name(biases[0].dtype)} like w13_bias, "
                                f"got {_dtype_name(bias.dtype)}")
            if tuple(bias.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {tuple(bias.shape)}")
            require_contiguous(bias, name)
        biases.append(bias)
    return ExpertOptions(activation, biases[0], biases[1], bool(apply_router_weight_on_input))


def check_ids_in_range(topk_ids, experts: int) -> None:
    """Raise ValueError if an id lies outside [-1, experts). Synchronises on the GPU."""
    if topk_ids.size == 0:
        return
    bad = (topk_ids < -1) | (topk_ids >= experts)
    if bool(bad.any()):
        first = tuple(int(i) for i in np.argwhere(_to_host(bad))[0])
        raise ValueError(
            f"topk_ids: expected ids in [-1, {experts}), got {int(topk_ids[first])} at {first} "
            "(pass check_ids=False to treat out-of-range ids as -1 without this check)"
        )


def _to_host(a):
    return a if isinstance(a, np.ndarray) else a.get()
