"""Quick numerical check of the attention kernels against the fp32 reference (a smoke test to run
before the full GPU suite): forward, lse and all gradients, poisoned outputs, a few odd shapes.

    python scripts/attention_check.py [--small]
"""
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk import reference
from jax_tk.attention import AttentionSpec, _bwd_kernel, _bwd_workspace_shape, _fwd_kernel


# the fastest kernels for this GPU, the same with the deterministic backward, and the mma.sync ones
VARIANTS = {"auto": 0, "det": 0, "sm80": 1}


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(b, t, s, n, kh, d, causal, dtype, variant="auto", seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (b, t, n, d), dtype)
    k = jax.random.normal(ks[1], (b, s, kh, d), dtype)
    v = jax.random.normal(ks[2], (b, s, kh, d), dtype)
    do = jax.random.normal(ks[3], (b, t, n, d), dtype)
    dlse = jax.random.normal(ks[4], (b, n, t), jnp.float32)
    spec = AttentionSpec(1.0 / np.sqrt(d), causal, True, deterministic=variant == "det")
    variant = VARIANTS[variant]
    nan = lambda shape, dt: jnp.full(shape, jnp.nan, dt)

    @jax.jit
    def kernel(q, k, v, do, dlse):
        o, lse = _fwd_kernel(q, k, v, spec, out_init=(nan(q.shape, q.dtype), nan((b, n, t), jnp.float32)),
                             variant=variant)
        grads = _bwd_kernel(q, k, v, o, lse, do, dlse, spec,
                            out_init=(nan(q.shape, q.dtype), nan(k.shape, k.dtype), nan(v.shape, v.dtype),
                                      nan((b, n, t), jnp.float32), nan(_bwd_workspace_shape(q).shape, jnp.float32)),
                            variant=variant)
        return (o, lse, *grads)

    @jax.jit
    def ref(q, k, v, do, dlse):
        f = lambda q, k, v: reference.attention_with_lse(q.astype(jnp.float32), k.astype(jnp.float32),
                                                         v.astype(jnp.float32), scale=spec.scale, is_causal=causal)
        (o, lse), vjp = jax.vjp(f, q, k, v)
        return (o, lse, *vjp((do.astype(jnp.float32), dlse)))

    got = kernel(q, k, v, do, dlse)
    want = ref(q, k, v, do, dlse)
    errs = [rel(g, w) for g, w in zip(got, want)]
    nans = [bool(np.isnan(np.asarray(g, np.float32)).any()) for g in got]
    return errs, nans


def main():
    worst = np.zeros(5)
    ok = True
    small = "--small" in sys.argv  # a couple of tiny cases, e.g. under compute-sanitizer
    cases = [(1, 70, 50, 2, 1, 64), (1, 33, 65, 2, 2, 128)] if small else [
        (1, 128, 128, 2, 2, 64), (2, 17, 33, 4, 2, 64), (1, 65, 64, 2, 1, 128), (2, 200, 130, 4, 4, 128),
        (1, 130, 200, 8, 2, 64), (1, 1, 1, 1, 1, 128), (1, 1024, 1024, 4, 4, 128), (1, 333, 1000, 2, 2, 64),
    ]
    variants = list(VARIANTS)
    runs = [(c, causal, jnp.bfloat16, v) for c, causal, v in itertools.product(cases, [False, True], variants)]
    runs += [(c, causal, jnp.float16, v) for c, causal, v in itertools.product(cases[:2], [False, True], variants)]
    for (b, t, s, n, kh, d), causal, dtype, variant in runs:
        errs, nans = check(b, t, s, n, kh, d, causal, dtype, variant)
        worst = np.maximum(worst, errs)
        bad = any(nans) or max(errs[0], *errs[2:]) > 1e-2 or errs[1] > 1e-3
        ok &= not bad
        print(f"{'FAIL' if bad else 'ok  '} {variant:4} b={b} t={t} s={s} n={n} kh={kh} d={d} causal={causal} "
              f"{jnp.dtype(dtype).name}: out {errs[0]:.2e} lse {errs[1]:.2e} dq {errs[2]:.2e} "
              f"dk {errs[3]:.2e} dv {errs[4]:.2e} nan={nans}")
    print("worst relative errors: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e" % tuple(worst))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
