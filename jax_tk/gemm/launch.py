"""The grouped GEMM kernel's operands and attributes, and how its calls are batched under ``vmap``.

One FFI target, ``jax_tk_gemm_ragged``, takes ``a``, ``b`` and ``group_sizes`` (int32 ``[g]``) and
three int attributes, ``variant`` (the kernels: ``dispatch.kernel_variant``) and:

- ``mode=MODE_RAGGED`` (0, rows grouped): a ``[m, k]``, b ``[g, k, n]`` (``b_transposed=0``) or ``[g, n, k]``
  (``b_transposed=1``); out ``[m, n]``: group i owns rows ``[off_i, off_i + size_i)`` (``off`` the
  exclusive cumulative sum); rows past the sum give 0.
- ``mode=MODE_CONTRACT`` (1, ragged contracting dimension): a ``[m, k]``, b ``[m, n]``; out ``[g, k, n]``,
  ``out_i = a[rows_i]^T b[rows_i]``; an empty group gives 0. With ``b_transposed=1`` (the sm_90a kernel
  only) both are K-major, a ``[k, m]`` and b ``[n, m]``: ``out_i = a[:, rows_i] b[:, rows_i]^T``.

a and b are both bfloat16 or both float16; out is that dtype or float32 (the kernel reads the result
buffer's dtype). The numbers the kernel and this file share (``MODE_RAGGED``, ``MODE_CONTRACT``,
``DIM_MULTIPLE``, and ``MAX_GROUPS`` where the kernel bounds the groups) come from ``cc/gemm/gemm.h``
through ``jax_tk._core.extension.contract``.

The api hands this layer group sizes that are >= 0 and sum to at most the rows (``api`` clips them),
which the batching rules below rely on.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import dispatch, extension, ffi
from jax_tk._core.ffi import broadcast_mapped, kernel_call, map_entries

TARGET = ffi.target("jax_tk_gemm_ragged")
FP8_TARGET = ffi.target("jax_tk_gemm_fp8")
FP8_CONTRACT_TARGET = ffi.target("jax_tk_gemm_fp8_contract")
QUANTIZE_TARGET = ffi.target("jax_tk_fp8_quantize")
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
MAX_ROWS = extension.MAX_INDEX  # row indices are int32 in the kernel


def contract() -> dict[str, int]:
    return extension.contract("gemm")


def max_groups() -> int | None:
    """The most groups one launch takes, None where the kernel sets no bound."""
    return contract().get("MAX_GROUPS")


def _fits(groups: int) -> bool:
    most = max_groups()
    return most is None or groups <= most


def kernel_unsupported_reason(dtype, k: int, n: int, groups: int, rows: int) -> str | None:
    """Why the kernel cannot take a call with inputs of ``dtype``, contracting size ``k``, output
    columns ``n`` (the same condition holds for the backward's calls), ``groups`` groups and ``rows``
    rows; None if it can."""
    if extension.has_cuda_kernels() and not extension.has_target(TARGET):
        return ("grouped GEMM: this build of jax_tk has no grouped GEMM kernel (it was built from a tree "
                "without cc/gemm; reinstall)")
    if not any(jnp.dtype(dtype) == d for d in KERNEL_DTYPES):
        return f"dtype {jnp.dtype(dtype)} (the kernel takes bfloat16 and float16)"
    c = contract()
    mult = c["DIM_MULTIPLE"]
    if k % mult or n % mult:
        return f"sizes k={k}, n={n} (the kernel takes multiples of {mult})"
    if not _fits(groups):
        return f"{groups} groups (the kernel takes at most {max_groups()})"
    if rows > MAX_ROWS:
        return f"{rows} rows (the kernel takes at most {MAX_ROWS})"
    return None


def _raw_call(mode: int, a, b, group_sizes, out_shape, out_dtype, b_transposed: bool, variant: int, out_init=None):
    """One launch of the kernel (``out_init``, tests only: a buffer aliased to the output)."""
    out_types = (jax.ShapeDtypeStruct(tuple(out_shape), jnp.dtype(out_dtype)),)
    attributes = dict(mode=np.int32(mode), b_transposed=np.int32(bool(b_transposed)), variant=np.int32(variant))
    (out,) = kernel_call(TARGET, out_types, (a, b, group_sizes.astype(jnp.int32)), attributes,
                         out_init=None if out_init is None else (out_init,))
    return out


def fp8_unsupported_reason(k: int, n: int, groups: int, rows: int) -> str | None:
    """Why the FP8 kernel cannot take a product with contracting size ``k``, ``n`` output columns,
    ``groups`` groups and ``rows`` rows on this machine; None if it can."""
    if extension.has_cuda_kernels() and not extension.has_target(FP8_TARGET):
        return "FP8 inputs: this build of jax_tk has no FP8 kernel (reinstall)"
    if k % 16 or n % contract()["DIM_MULTIPLE"]:
        return f"sizes k={k}, n={n} (the FP8 kernel takes k a multiple of 16 and n of {contract()['DIM_MULTIPLE']})"
    if not _fits(groups) or rows > MAX_ROWS:
        return f"{groups} groups of {rows} rows"
    if not extension.takes_sm90_kernels(extension.cuda_device_capability(), dispatch.kernel_variant()):
        return "this GPU (the FP8 kernel runs on H100/H200, sm_90a, only)"
    return None


def fp8_contract_unsupported_reason(n: int, groups: int, rows: int) -> str | None:
    """Why the FP8 kernel cannot take the weights' gradient (``[groups, k, n]``, contracting over
    ``rows`` rows) on this machine; None if it can."""
    if extension.has_cuda_kernels() and not extension.has_target(FP8_CONTRACT_TARGET):
        return "this build of jax_tk has no FP8 contraction kernel (reinstall)"
    if n % contract()["DIM_MULTIPLE"]:
        return f"n={n} (the FP8 contraction kernel takes n a multiple of {contract()['DIM_MULTIPLE']})"
    return fp8_unsupported_reason(16, n, groups, rows)  # (the rest as the forward's)


def fp8_contract_call(at, at_scales, bt, bt_scales, group_sizes, out_dtype=jnp.float32, out_init=None):
    """One launch of the FP8 kernel's contraction (Hopper): ``out[i] = deq(at)[:, rows_i] @
    deq(bt)[:, rows_i]^T``, ``[g, k, n]`` in ``out_dtype`` (float32 or bfloat16), the rows of group i
    along both operands' second axis (zeros for an empty group).

    at float8_e4m3fn ``[k, m]`` with scales float32 ``[k, ceil(m/128)]`` (1 x 128 blocks along m), bt
    ``[n, m]`` with scales ``[ceil(n/128), ceil(m/128)]`` (128 x 128 blocks): ``quantize_fp8`` of the
    transposed rows; m a multiple of 16 (pad with zero rows). Rows past the groups must be finite.
    Both scales go to the kernel m-block major, transposed here. ``out_init`` (tests): a buffer
    aliased to the output."""
    g, k, n = group_sizes.shape[0], at.shape[0], bt.shape[0]
    out_types = (jax.ShapeDtypeStruct((g, k, n), jnp.dtype(out_dtype)),)
    operands = (at, at_scales.T, bt, bt_scales.T, group_sizes.astype(jnp.int32))
    (out,) = kernel_call(FP8_CONTRACT_TARGET, out_types, operands, dict(variant=np.int32(dispatch.kernel_variant())),
                         out_init=None if out_init is None else (out_init,))
    return out


def quantize_unsupported_reason() -> str | None:
    """Why FP8 quantization cannot run on its kernel here; None if it can (CUDA kernels built with it)."""
    if not extension.has_cuda_kernels() or not extension.has_target(QUANTIZE_TARGET):
        return "this build of jax_tk has no FP8 quantization kernel"
    return None


def quantize_call(x, block_rows: int, *, x_scales=None, transposed=False, row_limit=None, out_shape=None,
                  out_init=None):
    """One launch of the FP8 quantization kernel (any CUDA GPU from sm_80): ``quantize_fp8(y,
    (block_rows, 128))`` in IEEE float32 (XLA's may differ by a float32 ulp before rounding), y being
    x (``[rows, cols]`` or ``[g, rows, cols]``; transposed: the last two dims swapped), its rows at or
    past ``row_limit`` (int32 ``[1]``, traced) zeroed, zero-padded to ``out_shape`` (the last two dims;
    default y's). An FP8 x (rank 2) comes with ``x_scales`` ``[rows, ceil(cols/128)]`` and is
    dequantized first. Returns (values float8_e4m3fn, scales float32). ``out_init`` (tests): two
    buffers aliased to the outputs."""
    shape = (*x.shape[:-2], x.shape[-1], x.shape[-2]) if transposed else tuple(x.shape)
    shape = shape if out_shape is None else (*shape[:-2], *out_shape)
    scale_shape = (*shape[:-2], -(-shape[-2] // block_rows), -(-shape[-1] // 128))
    out_types = (jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn), jax.ShapeDtypeStruct(scale_shape, jnp.float32))
    empty_f32, empty_i32 = jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32)
    operands = (x, empty_f32 if x_scales is None else x_scales,
                empty_i32 if row_limit is None else jnp.reshape(row_limit, (1,)).astype(jnp.int32))
    values, scales = kernel_call(QUANTIZE_TARGET, out_types, operands,
                                 dict(transposed=np.int32(bool(transposed)), block_rows=np.int32(block_rows)),
                                 out_init=out_init)
    return values, scales


def fp8_call(a, a_scales, b_nk, b_scales, group_sizes, out_dtype, out_init=None):
    """One launch of the FP8 kernel (Hopper): ``out[r] = deq(a)[r] @ deq(b)[i]`` for the rows r of group
    i, ``deq`` the operand times its block scales; rows past the groups give 0.

    a float8_e4m3fn ``[m, k]`` with scales float32 ``[m, ceil(k/128)]`` (1 x 128 blocks along k); b
    given K-major, as the kernel reads it (8-bit operands are read K-major): values float8_e4m3fn
    ``b_nk = [g, n, k]`` (b^T per group), scales ``[g, ceil(k/128), ceil(n/128)]`` (b's 128 x 128
    blocks); group_sizes ``[g]`` (>= 0, summing to at most m); out ``[m, n]`` in ``out_dtype``,
    bfloat16 or float32. (a's scales go to the kernel k-block major, transposed here.) ``out_init``
    (tests): a buffer aliased to the output."""
    m, n = a.shape[0], b_nk.shape[1]
    out_types = (jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype)),)
    operands = (a, a_scales.T, b_nk, b_scales, group_sizes.astype(jnp.int32))
    (out,) = kernel_call(FP8_TARGET, out_types, operands, dict(variant=np.int32(dispatch.kernel_variant())),
                         out_init=None if out_init is None else (out_init,))
    return out


def _rows_call(a, b, group_sizes, out_dtype, b_transposed, variant, out_init=None):
    n = b.shape[1] if b_transposed else b.shape[2]
    return _raw_call(contract()["MODE_RAGGED"], a, b, group_sizes, (a.shape[0], n), out_dtype, b_transposed, variant,
                     out_init)


def _contracting_call(a, b, group_sizes, out_dtype, variant, out_init=None, b_transposed=False):
    shape = (group_sizes.shape[0], *((a.shape[0], b.shape[0]) if b_transposed else (a.shape[1], b.shape[1])))
    return _raw_call(contract()["MODE_CONTRACT"], a, b, group_sizes, shape, out_dtype, b_transposed, variant, out_init)


# ----------------------------------------------------------------------------------------------
# Batching: a vmapped call becomes one launch with the batch folded into the groups
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _rows_fn(out_dtype: str, b_transposed: bool, variant: int):
    @jax.custom_batching.custom_vmap
    def fn(a, b, group_sizes):
        return _rows_call(a, b, group_sizes, out_dtype, b_transposed, variant)

    @fn.def_vmap
    def rule(axis_size, in_batched, a, b, group_sizes):
        a_batched, b_batched, s_batched = in_batched
        g = b.shape[1] if b_batched else b.shape[0]
        a = broadcast_mapped(a, a_batched, axis_size)
        sizes = broadcast_mapped(group_sizes, s_batched, axis_size).astype(jnp.int32)
        e, m, k = a.shape
        if not b_batched:
            # One b for every entry: the entries' rows sorted by group (stable: by entry within a
            # group) are one call with the summed sizes; the rows past each entry's groups go last,
            # past the sum, and give 0. The sort costs a gather of a and a scatter of the result.
            order = jnp.argsort(_row_groups(sizes, m).reshape(-1), stable=True)
            out = fn(a.reshape(e * m, k)[order], b, sizes.sum(axis=0))
            return jnp.zeros_like(out).at[order].set(out).reshape(e, m, -1), True
        if not _fits(axis_size * g):
            return map_entries(fn, (True, True, True), (a, b, sizes)), True
        # Entry i's rows become rows [i*m, (i+1)*m) and its groups groups [i*g, (i+1)*g) of one call:
        # its last group is stretched to the end of its rows so that the next entry starts at
        # (i+1)*m, and the rows past its own groups are zeroed afterwards.
        total = sizes.sum(axis=1)
        stretched = sizes.at[:, -1].add(m - total)
        out = fn(a.reshape(e * m, k), b.reshape(e * g, *b.shape[2:]), stretched.reshape(-1))
        out = out.reshape(e, m, -1)
        inside = jnp.arange(m, dtype=jnp.int32)[None, :] < total[:, None]
        return jnp.where(inside[..., None], out, jnp.zeros((), out.dtype)), True

    return fn


def _row_groups(sizes, m: int):
    """[e, m] int32: the group of each row of each entry (g past the entry's groups), from sizes
    [e, g] (>= 0, summing to at most m): a 1 where each group (and the rest after the last) starts,
    summed along the rows. O(e * (m + g))."""
    e, g = sizes.shape
    ends = jnp.cumsum(sizes, axis=1)
    starts = jnp.concatenate([ends - sizes, ends[:, -1:]], axis=1)  # g + 1 starts, the rest's last
    marks = jnp.zeros((e, m + 1), jnp.int32).at[jnp.arange(e)[:, None], starts].add(1)
    return jnp.cumsum(marks[:, :m], axis=1) - 1


@functools.lru_cache(maxsize=None)
def _contracting_fn(out_dtype: str, variant: int, b_transposed: bool = False):
    @jax.custom_batching.custom_vmap
    def fn(a, b, group_sizes):
        return _contracting_call(a, b, group_sizes, out_dtype, variant, b_transposed=b_transposed)

    @fn.def_vmap
    def rule(axis_size, in_batched, a, b, group_sizes):
        if b_transposed:  # (a launch per entry: the entries' rows are columns here)
            return map_entries(fn, in_batched, (a, b, group_sizes)), True
        # Entry i's rows become rows [i*m, (i+1)*m) of one call, its groups g of its g + 1: one more
        # group takes the rows past its own groups (so that the next entry starts at (i+1)*m), and its
        # result is dropped.
        a_batched, b_batched, s_batched = in_batched
        g = group_sizes.shape[-1]
        if not _fits(axis_size * (g + 1)):
            return map_entries(fn, in_batched, (a, b, group_sizes)), True
        a = broadcast_mapped(a, a_batched, axis_size)
        b = broadcast_mapped(b, b_batched, axis_size)
        sizes = broadcast_mapped(group_sizes, s_batched, axis_size).astype(jnp.int32)
        e, m, k = a.shape
        rest = m - sizes.sum(axis=1, keepdims=True)
        folded = jnp.concatenate([sizes, rest], axis=1).reshape(-1)
        out = fn(a.reshape(e * m, k), b.reshape(e * m, b.shape[-1]), folded)
        return out.reshape(e, g + 1, *out.shape[1:])[:, :g], True

    return fn


# ----------------------------------------------------------------------------------------------
# The kernel calls the api makes
# ----------------------------------------------------------------------------------------------


def ragged_dot(a, b, group_sizes, *, out_dtype, b_transposed=False, out_init=None, variant=None):
    """Mode 0: ``out[r] = a[r] @ b[group(r)]`` (``b[group(r)]^T`` with ``b_transposed``), [m, n].
    ``variant``: the kernels (``dispatch.kernel_variant``; None: from ``JAX_TK_KERNELS``)."""
    variant = dispatch.kernel_variant() if variant is None else variant
    if out_init is not None:  # (tests: no vmap)
        return _rows_call(a, b, group_sizes, out_dtype, b_transposed, variant, out_init)
    return _rows_fn(jnp.dtype(out_dtype).name, bool(b_transposed), variant)(a, b, group_sizes)


# Split-k of a dense product whose output tiles would leave most of the GPU idle (e.g. 128 rows of a
# against a large b): its k is cut into parts, each a group of the contracting kernel (mode 1), whose
# float32 partial products are then summed, so that about a wave of tiles (the core contract's
# WAVE_BLOCKS) runs. SPLIT_K_MIN: the fewest positions of k per part (the partial sums' traffic must
# stay small beside the operands').
SPLIT_K_MIN = 1024


def split_k_parts(m: int, k: int, n: int, tile_n: int | None = None) -> int:
    """How many parts of k the product of a ``[m, k]`` and b ``[k, n]`` is split into: 1 where its output
    tiles (``tile_n`` wide, by default SM90_TILE_N) fill half a wave or more, or where m is not a multiple
    of DIM_MULTIPLE (the contracting kernel's output rows); else enough to fill about one wave, each at
    least SPLIT_K_MIN of k."""
    c, wave = contract(), extension.WAVE_BLOCKS
    tiles = -(-m // c["SM90_TILE_M"]) * -(-n // (tile_n or c["SM90_TILE_N"]))
    if 2 * tiles >= wave or m % c["DIM_MULTIPLE"]:
        return 1
    return max(1, min(wave // tiles, k // SPLIT_K_MIN))


def split_k_launch_parts(m: int, k: int, n: int) -> int:
    """The parts split_k_dot runs a product of ``[m, k]`` and ``[k, n]`` in (split_k_parts). Where they
    run as mode 2, whose tiles are SM90_SPLIT_TILE_N wide, they are counted in those tiles: as many
    blocks over fewer, longer ranges of k, with fewer partial products to sum."""
    if split_k_on_sm90():
        parts = split_k_parts(m, k, n, contract()["SM90_SPLIT_TILE_N"])
        if parts > 1 and split_k_in_place(k, parts):
            return parts
    return split_k_parts(m, k, n)


def split_k_in_place(k: int, parts: int) -> bool:
    """Whether split_k_dot runs ``parts`` parts of k as the groups of the row kernel (mode 2): on the
    sm_90a kernel, where k cuts into equal parts of whole steps."""
    return k % (parts * contract()["SM90_TILE_K"]) == 0 and split_k_on_sm90()


def split_k_on_sm90() -> bool:
    """Whether split_k_dot's launches of the sm_90a kernel alone (mode 2, and mode 1 with both operands
    K-major: ``b_transposed``) run here."""
    return extension.takes_sm90_kernels(extension.cuda_device_capability(), dispatch.kernel_variant())


def split_k_dot(a, b, parts: int, *, out_dtype, b_transposed=False):
    """``a [m, k] @ b [k, n]`` (``b [n, k]`` transposed with ``b_transposed``) as the sum of ``parts``
    products over consecutive ranges of k (multiples of the kernel's steps but the last), in float32,
    then XLA's sum of the partial products. One launch: on the sm_90a kernel (split_k_on_sm90),
    of mode 2 where the parts are equal (a and b read as they are: ``b [parts, k / parts, n]`` is a
    view, and b transposed is read in place), else of the contracting kernel (mode 1), whose group i
    is range i, on a and b as they are with ``b_transposed``, on ``a^T`` and b otherwise."""
    k = a.shape[1]
    step = contract()["SM90_TILE_K"]
    if split_k_in_place(k, parts):
        m, n = a.shape[0], b.shape[0 if b_transposed else 1]
        b = b if b_transposed else b.reshape(parts, k // parts, n)
        partial = _raw_call(contract()["MODE_SPLIT_K"], a, b, jnp.full((parts,), m, jnp.int32), (parts * m, n),
                            jnp.float32, b_transposed, dispatch.kernel_variant())
        return jnp.sum(partial.reshape(parts, m, n), axis=0).astype(out_dtype)
    part = -(-k // (parts * step)) * step
    ends = np.minimum(np.arange(1, parts + 1) * part, k)
    sizes = jnp.asarray(np.diff(ends, prepend=0).astype(np.int32))
    if b_transposed:
        partial = ragged_contracting(a, b, sizes, out_dtype=jnp.float32, b_transposed=True)
    else:
        partial = ragged_contracting(a.T, b, sizes, out_dtype=jnp.float32)
    return jnp.sum(partial, axis=0).astype(out_dtype)


def ragged_contracting(a, b, group_sizes, *, out_dtype, out_init=None, variant=None, b_transposed=False):
    """Mode 1: ``out[i] = a[rows_i]^T @ b[rows_i]``, [g, k, n]; with ``b_transposed`` (sm_90a only)
    ``out[i] = a[:, rows_i] @ b[:, rows_i]^T`` of a [k, m] and b [n, m]. ``variant``: as in
    :func:`ragged_dot`."""
    variant = dispatch.kernel_variant() if variant is None else variant
    if out_init is not None:
        return _contracting_call(a, b, group_sizes, out_dtype, variant, out_init, b_transposed)
    return _contracting_fn(jnp.dtype(out_dtype).name, variant, bool(b_transposed))(a, b, group_sizes)
