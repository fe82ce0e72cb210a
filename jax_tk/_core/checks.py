"""Trace-time checks of options that several ops share, with errors that name the op and the argument."""
from __future__ import annotations

import math

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
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"jax_tk.{op}: {name} must be a positive finite float, got {value}")
    return value


def _is_int(w) -> bool:
    return isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_))


def window(op: str, local_window_size, left_limit: int, right_limit: int):
    """None, or ``local_window_size`` (one int >= 0 for both sides, or a pair ``(left, right)``; numpy
    integers too) as a pair of Python ints, each side clamped to its limit: a side longer than the
    sequence it reaches over bounds nothing (the same meaning), and the values stay small enough for
    int32 index arithmetic in the references and the kernels."""
    if local_window_size is None:
        return None
    pair = (local_window_size,) * 2 if _is_int(local_window_size) else local_window_size
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(_is_int(w) and w >= 0 for w in pair):
        raise ValueError(f"jax_tk.{op}: local_window_size must be None, an int >= 0 or a pair (left, right) of "
                         f"ints >= 0, got {local_window_size!r}")
    return min(int(pair[0]), left_limit), min(int(pair[1]), right_limit)
