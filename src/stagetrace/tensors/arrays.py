"""What is an array, and its canonical dtype name, shape and bytes: NumPy arrays, torch tensors on any device, DLPack
and CUDA array interface producers. What cannot be digested is a TypeError or ValueError in one line."""

from __future__ import annotations

import sys

import numpy as np

from stagetrace.errors import first_line


def _torch():
    return sys.modules.get("torch")


def is_array(value) -> bool:
    """Whether ``digest`` treats ``value`` as an array: NumPy, torch, DLPack, CUDA array interface, or NumPy-like."""
    if isinstance(value, (np.ndarray, np.generic)):
        return True
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return True
    if isinstance(value, type):
        return False
    return (
        hasattr(value, "__dlpack__")
        or hasattr(value, "__cuda_array_interface__")
        or (hasattr(value, "dtype") and hasattr(value, "tobytes") and hasattr(value, "shape"))
    )


def numpy_dtype_name(dtype: np.dtype) -> str:
    if dtype.kind == "O":
        raise TypeError("cannot digest an array of Python objects: digest its elements (a list) instead")
    if dtype.kind in "USV" and not dtype.type.__module__.startswith("ml_dtypes"):
        return dtype.str.lstrip("<>|=")  # strings, bytes and records: the name alone does not say the item size
    return dtype.name  # bfloat16, float8_e4m3fn, ... from ml_dtypes as torch names them


def torch_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _host_array(value) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return array


def as_tensor_or_array(value):
    """``value`` as a torch tensor (any device) or a NumPy array; TypeError, in one line, for what has no bytes."""
    if isinstance(value, (np.ndarray, np.generic)):
        return _host_array(value)
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return _checked(value)
    if hasattr(value, "__dlpack__") and hasattr(value, "__dlpack_device__"):
        on_host = int(value.__dlpack_device__()[0]) in (1, 3)  # kDLCPU, kDLCUDAHost
        torch = _import_torch(None if on_host else "a device array (DLPack)")
        if torch is not None:
            return _checked(torch.from_dlpack(value))
        try:
            return _host_array(np.from_dlpack(value))
        except (RuntimeError, TypeError, BufferError):
            return _host_array(value)  # bfloat16 and the float8 types: through the producer's own __array__
    if hasattr(value, "__cuda_array_interface__"):
        torch = _import_torch("a CUDA array (__cuda_array_interface__)")
        return _checked(torch.as_tensor(value, device="cuda"))
    return _host_array(value)


def _import_torch(needed_for: str | None):
    try:
        import torch
    except ImportError:
        if needed_for is None:
            return None
        raise TypeError(f"cannot digest {needed_for} without PyTorch: pip install torch") from None
    return torch


def _checked(tensor):
    """The tensor if its bytes can be read; TypeError or ValueError in one line if not."""
    import torch

    if tensor.is_meta or tensor.device.type == "meta":
        raise ValueError("cannot digest a tensor on the meta device: it has shape and dtype but no data")
    if tensor.layout != torch.strided:
        layout = str(tensor.layout).removeprefix("torch.")
        raise TypeError(f"cannot digest a {layout} tensor: pass a dense one (tensor.to_dense())")
    if getattr(tensor, "is_nested", False):
        raise TypeError("cannot digest a nested tensor: digest its components (tensor.unbind()) instead")
    if tensor.is_quantized:
        raise TypeError("cannot digest a quantized tensor: pass tensor.int_repr() and its scale and zero point")
    return tensor.detach()


def storage_problem(tensor) -> str | None:
    """Why the tensor's bytes cannot be read now (its storage was freed or shrunk), or None."""
    if tensor.numel() == 0:
        return None
    try:
        have = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError) as exc:  # fake and functional tensors have no real storage
        return f"its storage cannot be read ({described(exc)})"
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    need = (tensor.storage_offset() + extent) * tensor.element_size()
    if have < need:
        return f"its storage was freed or shrunk before it was digested ({have} of {need} bytes left)"
    return None


def host_bytes(array) -> tuple[str, tuple, np.ndarray]:
    """A NumPy array's or a CPU tensor's dtype name, shape and bytes in C order (uint8, a view where it can be)."""
    if isinstance(array, np.ndarray):
        return numpy_dtype_name(array.dtype), array.shape, np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    import torch

    name, shape = torch_dtype_name(array.dtype), array.shape
    if array.numel() == 0:
        return name, shape, np.empty(0, np.uint8)
    return name, shape, flat(array).view(torch.uint8).numpy()


def flat(tensor):
    """The tensor's values as a contiguous 1-d tensor of its dtype (a view when it already is one)."""
    try:
        return tensor.resolve_conj().resolve_neg().contiguous().reshape(-1)
    except RuntimeError as exc:
        raise TypeError(f"cannot digest a {torch_dtype_name(tensor.dtype)} tensor: {described(exc)}") from None


def described(exc: BaseException) -> str:
    """An exception for a span's or an error's one line: its type and the first line of its message."""
    return f"{type(exc).__name__}: {first_line(exc)}"
