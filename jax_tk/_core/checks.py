"""Trace-time checks of options that several ops share, with errors that name the op and the argument."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def positive_float(op: str, name: str, value):
    """None, or ``value`` as a positive finite float (TypeError for strings, bools and non-numbers)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, bool, np.bool_)):
        raise TypeError(f"jax_tk.{op}: {name} must be a Python float or None, got {value!r}")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"jax_tk.{op}: {name} must be a Python float or None, got {value!r}") from None
    # The kernels and the references compute in float32: the value must stay positive and finite there.
    with np.errstate(over="ignore", under="ignore"):
        as_float32 = np.float32(value)
    if not math.isfinite(value) or value <= 0 or not 0 < as_float32 < np.inf:
        raise ValueError(f"jax_tk.{op}: {name} must be a positive float, finite and nonzero in float32, got {value}")
    return value


def to_int32(x, lo: int, hi: int):
    """Integers of any dtype (numpy or JAX, maybe traced) as int32, for arguments in which values below
    ``lo`` mean the same as ``lo`` and values above ``hi`` the same as ``hi`` (lengths, sizes): a dtype
    whose values int32 cannot all hold (64-bit, uint32) is clamped to ``[lo, hi]`` first, so that large
    values saturate instead of wrapping; narrower ones are only cast. numpy arrays stay on the host (jnp
    would narrow int64 to int32 before clamping when x64 is off)."""
    dtype = np.dtype(x.dtype)
    xp = np if isinstance(x, np.ndarray) else jnp
    if dtype == np.int32:
        return x
    if dtype.itemsize < 4 or (dtype.itemsize == 4 and dtype.kind == "i"):
        return x.astype(xp.int32)
    info = np.iinfo(dtype)
    lo, hi = max(lo, int(info.min)), min(hi, int(info.max))
    return xp.clip(x, xp.asarray(lo, dtype), xp.asarray(hi, dtype)).astype(xp.int32)


def array(op: str, name: str, x, ndim: int, what: str):
    """``x`` must be an array (TypeError) of rank ``ndim`` (ValueError; ``what`` describes its dims)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"jax_tk.{op}: {name} must be an array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"jax_tk.{op}: {name} must have rank {ndim} {what}, got shape {tuple(x.shape)}")


def float_array(op: str, name: str, x, ndim: int, what: str, dtypes, empty_ok=()):
    """``array``, of one of ``dtypes`` (bfloat16, float16, float32), with no empty dimension but those
    listed in ``empty_ok`` (e.g. a batch of 0, which leaves the op nothing to compute)."""
    array(op, name, x, ndim, what)
    if not any(x.dtype == d for d in dtypes):
        raise TypeError(f"jax_tk.{op}: {name} must be bfloat16, float16 or float32, got {x.dtype}")
    if any(dim == 0 and i not in empty_ok for i, dim in enumerate(x.shape)):
        raise ValueError(f"jax_tk.{op}: {name} has an empty dimension: {tuple(x.shape)}")


def is_int(w) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_))


def window(op: str, local_window_size, left_limit: int, right_limit: int):
    """None, or ``local_window_size`` (one int >= 0 for both sides, or a pair ``(left, right)``; numpy
    integers too) as a pair of Python ints, each side clamped to its limit: a side longer than the
    sequence it reaches over bounds nothing (the same meaning), and the values stay small enough for
    int32 index arithmetic in the references and the kernels."""
    if local_window_size is None:
        return None
    pair = (local_window_size,) * 2 if is_int(local_window_size) else local_window_size
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(is_int(w) and w >= 0 for w in pair):
        raise ValueError(f"jax_tk.{op}: local_window_size must be None, an int >= 0 or a pair (left, right) of "
                         f"ints >= 0, got {local_window_size!r}")
    return min(int(pair[0]), left_limit), min(int(pair[1]), right_limit)
