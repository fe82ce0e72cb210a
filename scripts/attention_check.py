"""Quick numerical check of the attention kernels against the fp32 reference (a smoke test to run
before the full GPU suite): forward, lse and all gradients, poisoned outputs, a few odd shapes, and
the masking options (windows, segment ids, sequence lengths, soft cap) alone and combined.

    [CHECK_VARIANTS=auto,det] python scripts/attention_check.py [--small] [--masking-only]
"""
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import dispatch
from jax_tk.attention import reference
from jax_tk.attention.api import AttentionSpec
from jax_tk.attention.launch import Masks, bwd_kernel, bwd_workspace_shape, fwd_kernel

# the fastest kernels for this GPU, the same with the deterministic backward, and the mma.sync ones
# (the kernels as JAX_TK_KERNELS names them)
VARIANTS = {"auto": "auto", "det": "auto", "sm80": "sm80"}


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(b)  # lse of a row that sees no key is -inf: compared separately
    if not np.array_equal(finite, np.isfinite(a)) and not np.isnan(a).any():
        return float("inf")
    a, b = np.where(finite, a, 0.0), np.where(finite, b, 0.0)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def segments(rng, b, n, parts):
    cuts = [np.sort(rng.choice(np.arange(1, n), min(parts, n) - 1, replace=False)) for _ in range(b)]
    return jnp.asarray(np.stack([np.searchsorted(c, np.arange(n), side="right") for c in cuts]).astype(np.int32))


def check(b, t, s, n, kh, d, causal, dtype, variant="auto", seed=0, window=None, masks=None, softcap=None):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (b, t, n, d), dtype)
    k = jax.random.normal(ks[1], (b, s, kh, d), dtype)
    v = jax.random.normal(ks[2], (b, s, kh, d), dtype)
    do = jax.random.normal(ks[3], (b, t, n, d), dtype)
    dlse = jax.random.normal(ks[4], (b, n, t), jnp.float32)
    spec = AttentionSpec(1.0 / np.sqrt(d), causal, True, window, softcap, deterministic=variant == "det")
    variant = dispatch.kernel_variant(VARIANTS[variant])
    m = Masks() if masks is None else masks
    nan = lambda shape, dt: jnp.full(shape, jnp.nan, dt)

    @jax.jit
    def kernel(q, k, v, do, dlse):
        o, lse = fwd_kernel(q, k, v, spec, out_init=(nan(q.shape, q.dtype), nan((b, n, t), jnp.float32)),
                             variant=variant, masks=masks)
        grads = bwd_kernel(q, k, v, o, lse, do, dlse, spec,
                            out_init=(nan(q.shape, q.dtype), nan(k.shape, k.dtype), nan(v.shape, v.dtype),
                                      nan((b, n, t), jnp.float32), nan(bwd_workspace_shape(q).shape, jnp.float32)),
                            variant=variant, masks=masks)
        return (o, lse, *grads)

    @jax.jit
    def ref(q, k, v, do, dlse):
        f = lambda q, k, v: reference.attention_with_lse(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), scale=spec.scale, is_causal=causal,
            local_window_size=window, q_segment_ids=m.q_segment_ids, kv_segment_ids=m.kv_segment_ids,
            query_seq_lengths=m.q_lengths, key_value_seq_lengths=m.kv_lengths, logits_soft_cap=softcap)
        (o, lse), vjp = jax.vjp(f, q, k, v)
        return (o, lse, *vjp((do.astype(jnp.float32), jnp.where(jnp.isneginf(lse), 0.0, dlse))))

    got = kernel(q, k, v, do, dlse)
    want = ref(q, k, v, do, dlse)
    errs = [rel(g, w) for g, w in zip(got, want)]
    nans = [bool(np.isnan(np.asarray(g, np.float32)).any()) for g in got]
    return errs, nans


def masking_runs(small):
    """(label, check kwargs) for the masking options: one-sided and two-sided windows, packed and
    unsorted segment ids (some query segments with no key), lengths with 0, soft cap, combinations."""
    rng = np.random.default_rng(0)
    b, t, s = 2, 200, 130
    packed = Masks(segments(rng, b, t, 4), segments(rng, b, s, 3))
    rand = Masks(jnp.asarray(rng.integers(0, 3, (1, 333)).astype(np.int32)),
                 jnp.asarray(rng.integers(0, 3, (1, 1000)).astype(np.int32)))
    lens = Masks(q_lengths=jnp.array([200, 0], jnp.int32), kv_lengths=jnp.array([0, 77], jnp.int32))
    both = Masks(packed.q_segment_ids, packed.kv_segment_ids, jnp.array([150, 200], jnp.int32),
                 jnp.array([130, 90], jnp.int32))
    runs = [
        ("window(16,8)", (b, t, s, 8, 2, 64), False, dict(window=(16, 8))),
        ("window(64,0)+causal+gqa", (1, 333, 1000, 8, 2, 128), True, dict(window=(64, 0))),
        ("window(0,40)", (1, 130, 200, 4, 4, 64), False, dict(window=(0, 40))),
        ("segments", (b, t, s, 4, 2, 128), False, dict(masks=packed)),
        ("segments(random)+causal", (1, 333, 1000, 4, 4, 64), True, dict(masks=rand)),
        ("lengths(0 rows)", (b, t, s, 4, 2, 64), False, dict(masks=lens)),
        ("segments+lengths", (b, t, s, 8, 2, 128), False, dict(masks=both)),
        ("softcap+causal", (b, t, s, 8, 2, 128), True, dict(softcap=5.0)),
        ("everything", (b, t, s, 8, 2, 64), True, dict(window=(100, 3), masks=both, softcap=8.0)),
    ]
    return runs[:2] if small else runs


def main():
    worst = np.zeros(5)
    ok = True
    small = "--small" in sys.argv  # a couple of tiny cases, e.g. under compute-sanitizer
    cases = [(1, 70, 50, 2, 1, 64), (1, 33, 65, 2, 2, 128)] if small else [
        (1, 128, 128, 2, 2, 64), (2, 17, 33, 4, 2, 64), (1, 65, 64, 2, 1, 128), (2, 200, 130, 4, 4, 128),
        (1, 130, 200, 8, 2, 64), (1, 1, 1, 1, 1, 128), (1, 1024, 1024, 4, 4, 128), (1, 333, 1000, 2, 2, 64),
    ]
    variants = os.environ.get("CHECK_VARIANTS", ",".join(VARIANTS)).split(",")  # e.g. a build without sm80
    runs = [(c, causal, jnp.bfloat16, v) for c, causal, v in itertools.product(cases, [False, True], variants)]
    runs += [(c, causal, jnp.float16, v) for c, causal, v in itertools.product(cases[:2], [False, True], variants)]
    runs = [(c, causal, dtype, v, "", {}) for c, causal, dtype, v in runs]
    if "--masking-only" in sys.argv:
        runs = []
    runs += [(c, causal, jnp.bfloat16, v, label + " ", kw)
             for (label, c, causal, kw), v in itertools.product(masking_runs(small), variants)]
    for (b, t, s, n, kh, d), causal, dtype, variant, label, kw in runs:
        errs, nans = check(b, t, s, n, kh, d, causal, dtype, variant, **kw)
        worst = np.maximum(worst, errs)
        bad = any(nans) or max(errs[0], *errs[2:]) > 1e-2 or errs[1] > 1e-3
        ok &= not bad
        print(f"{'FAIL' if bad else 'ok  '} {label}{variant:4} b={b} t={t} s={s} n={n} kh={kh} d={d} causal={causal} "
              f"{jnp.dtype(dtype).name}: out {errs[0]:.2e} lse {errs[1]:.2e} dq {errs[2]:.2e} "
              f"dk {errs[3]:.2e} dv {errs[4]:.2e} nan={nans}")
    print("worst relative errors: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e" % tuple(worst))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
