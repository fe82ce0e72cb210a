"""Every kernel inside CUDA graphs: XLA's command buffers, with custom calls in them and no minimum size.

The handlers declare themselves command-buffer compatible (cc/ffi/common.h): they allocate nothing and
never wait on the host, so XLA may record their launches into a CUDA graph and replay it. Here each
op's compiled program must run every one of its custom calls inside a command buffer (read from the
thunk sequence that XLA dumps), and its results must match the float32 reference on two sets of
inputs in turn (new buffers: the graph has to follow them; nothing of the first call's may be baked
in). A decoding loop (``lax.scan`` of cache update + decode attention, contiguous and paged) runs the
same way: there XLA wraps the decode call in a dynamic-slice fusion (it writes the step's slice of the
stacked output), which command buffers take when DYNAMIC_SLICE_FUSION is enabled. So does MLA's
(one latent cache, 16 query heads of 576 dims, two new tokens a step), contiguous and in pages of 64.
matmul runs its clustered and its split-k kernels there too, and append_attention's loop its fused call.

XLA reads its flags when its backend starts, so ``test_in_subprocess`` reruns this file in a fresh
Python with them.
"""
import glob
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import randn, rel_err, run_file_in_child, scan_step
from jax_tk._core import extension

pytestmark = pytest.mark.gpu
BF16, F32 = jnp.bfloat16, jnp.float32
DUMP = os.environ.get("JAX_TK_GRAPH_DUMP")  # set in the child: where XLA dumps the graphed programs
PREFIX = "graphed_"  # the programs checked here: jit_graphed_*
in_child = pytest.mark.skipif(not DUMP, reason="runs in the subprocess with command buffers on")


@pytest.mark.skipif(bool(DUMP), reason="this is the subprocess")
def test_in_subprocess(tmp_path):
    flags = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,DYNAMIC_SLICE_FUSION "
             f"--xla_gpu_graph_min_graph_size=1 --xla_dump_to={tmp_path} --xla_dump_hlo_module_re=jit_{PREFIX}.*")
    # (The child takes GPU memory as it needs it: this process may hold most of it already.)
    summary = run_file_in_child(__file__, flags, JAX_TK_GRAPH_DUMP=str(tmp_path), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    # (the child ran every test below: on a GPU other than H100/H200 the MLA loops skip)
    want = 8 if extension.cuda_device_capability() == (9, 0) else 6
    assert re.search(rf"\b{want} passed", summary), summary


def custom_calls_in_graphs(thunks: str) -> list[bool]:
    """For each custom-call thunk of a thunk-sequence dump (one thunk a line, "NNN: kKind ...", a thunk's
    parts indented under it): whether it runs inside a command buffer."""
    stack, found = [], []
    for line in thunks.splitlines():
        m = re.match(r"( *)\d+: (k\w+)", line)
        if not m:
            continue
        indent, kind = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if kind == "kCustomCall":
            found.append(any(k == "kCommandBuffer" for _, k in stack))
        stack.append((indent, kind))
    return found


def check(name, f, reference, input_sets, tol=1.2e-2):
    """Compiles f (as program jit_graphed_NAME), checks that each of its jax_tk custom calls runs in a
    command buffer, and compares f with the float32 ``reference`` on each input set."""
    f.__name__ = PREFIX + name
    compiled = jax.jit(f).lower(*input_sets[0]).compile()
    calls = compiled.as_text().count('custom_call_target="jax_tk_')
    dumps = glob.glob(os.path.join(DUMP, f"*.jit_{PREFIX}{name}.thunk_sequence_after_thunk_passes.txt"))
    assert dumps, f"XLA dumped no thunk sequence of jit_{PREFIX}{name} in {DUMP}"
    with open(max(dumps, key=os.path.getmtime)) as file:
        graphed = custom_calls_in_graphs(file.read())
    assert calls >= 1 and len(graphed) == calls, (calls, graphed)
    assert all(graphed), f"custom calls outside command buffers: {graphed}"
    for args in input_sets:
        got = jax.tree.leaves(compiled(*args))
        want = jax.tree.leaves(jax.jit(reference)(*args))
        for g, w in zip(got, want, strict=True):
            assert rel_err(g, w) < tol


def to_f32(*xs):
    return [x.astype(F32) for x in xs]


@in_child
def test_attention_forward_and_backward():
    def loss(impl):
        def f(q, k, v, dout):
            fn = lambda q, k, v: jax_tk.attention(q, k, v, is_causal=True, implementation=impl)
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(dout)
        return f

    rng = np.random.default_rng(0)
    sets = [tuple(randn(rng, s, BF16) for s in [(2, 320, 4, 128), (2, 320, 2, 128), (2, 320, 2, 128),
                                                (2, 320, 4, 128)]) for _ in range(2)]
    check("attention", loss("tk"), lambda *a: loss("xla")(*to_f32(*a)), sets)


@in_child
def test_ragged_dot_forward_and_backward():
    def f(lhs, rhs, sizes, dout, impl="tk"):
        out, vjp = jax.vjp(lambda a, b: jax_tk.ragged_dot(a, b, sizes, implementation=impl), lhs, rhs)
        return out, vjp(dout)

    rng = np.random.default_rng(1)
    sets = []
    for sizes in [(100, 0, 37, 200), (3, 250, 0, 60)]:  # sums under m: the rows past them give 0
        sets.append((randn(rng, (400, 136), BF16), randn(rng, (4, 136, 200), BF16),
                     jnp.asarray(sizes, jnp.int32), randn(rng, (400, 200), BF16)))
    check("ragged_dot", f, lambda lhs, rhs, sizes, dout: f(*to_f32(lhs, rhs), sizes, dout.astype(F32), impl="xla"),
          sets)


@in_child
def test_append_decoding_loop():
    """The same loop with each step's cache update and attention in one call (append_attention: the
    caches aliased to its results)."""
    b, s, n, kh, h, steps = 2, 1024, 8, 2, 128, 4

    def loop(impl, f32=False):
        def f(k_cache, v_cache, lengths, q, new):
            if f32:
                k_cache, v_cache, q, new = to_f32(k_cache, v_cache, q, new)

            def step(carry, x):
                kc, vc, lens = carry
                out, kc, vc = jax_tk.decode.append_attention(x[0], x[1], x[1], kc, vc, lens, implementation=impl)
                return (kc, vc, lens + 1), out
            return jax.lax.scan(step, (k_cache, v_cache, lengths), (q, new))[1]
        return f

    rng = np.random.default_rng(3)
    sets = [(randn(rng, (b, s, kh, h), BF16), randn(rng, (b, s, kh, h), BF16), jnp.asarray(lengths, jnp.int32),
             randn(rng, (steps, b, 1, n, h), BF16), randn(rng, (steps, b, 1, kh, h), BF16))
            for lengths in [(700, 3), (0, 1000)]]
    check("append", loop("tk"), loop("xla", f32=True), sets)


@in_child
def test_matmul_forward_and_backward():
    # On H100/H200 a dense product of 1024 rows or more runs in clusters of two blocks (launched with
    # the cluster's dimension; the count of clusters that fit is asked once, maybe while XLA records);
    # one of few output tiles splits k, forward and (there) its input gradient.
    def f(a, b, dout, impl="tk"):
        out, vjp = jax.vjp(lambda a, b: jax_tk.matmul(a, b, implementation=impl), a, b)
        return out, vjp(dout)

    rng = np.random.default_rng(2)
    for m, k, n in [(1100, 200, 392), (128, 4096, 2048)]:
        sets = [(randn(rng, (m, k), BF16), randn(rng, (k, n), BF16), randn(rng, (m, n), BF16)) for _ in range(2)]
        check(f"matmul_{m}", f, lambda a, b, dout: f(*to_f32(a, b), dout.astype(F32), impl="xla"), sets)


@in_child
@pytest.mark.parametrize("page_size", [None, 64])
def test_decoding_loop(page_size):
    """Four steps of a jitted lax.scan over a contiguous or paged cache (2 sequences x 2 KV heads with
    long caches: the keys are split over several blocks, so the merge kernel runs too)."""
    b, s, n, kh, h, steps = 2, 1024, 8, 2, 128, 4

    def loop(impl, f32=False):
        def f(k_cache, v_cache, table, lengths, q, new):
            if f32:
                k_cache, v_cache, q, new = to_f32(k_cache, v_cache, q, new)
            carry = (k_cache, v_cache, lengths)
            return jax.lax.scan(scan_step(impl, table), carry, (q, new))[1]
        return f

    rng = np.random.default_rng(2)
    sets = []
    for lengths in [(700, 3), (0, 1000)]:
        k, v, table = randn(rng, (b, s, kh, h), BF16), randn(rng, (b, s, kh, h), BF16), None
        if page_size is not None:  # the same caches in pages, shuffled
            order = rng.permutation(b * s // page_size)
            k, v = (x.reshape(-1, page_size, kh, h)[np.argsort(order)] for x in (k, v))
            table = jnp.asarray(order.reshape(b, -1), jnp.int32)
        sets.append((k, v, table, jnp.asarray(lengths, jnp.int32), randn(rng, (steps, b, 1, n, h), BF16),
                     randn(rng, (steps, b, 1, kh, h), BF16)))
    check(f"decode_{page_size}", loop("tk"), loop("xla", f32=True), sets)


@in_child
@pytest.mark.skipif(extension.cuda_device_capability() != (9, 0), reason="the MLA kernel runs on sm_90a")
@pytest.mark.parametrize("page_size", [None, 64])
def test_mla_decoding_loop(page_size):
    """Three steps of a jitted lax.scan of MLA decoding (update_kv_cache into the latent cache, then
    mla_attention) over 2 sequences with long caches (the MLA kernel's parts are merged too), two new
    tokens a step, contiguous or in pages of 64."""
    b, s, heads, d, t_new, steps = 2, 1536, 16, 576, 2, 3

    def loop(impl, f32=False):
        def f(cache, table, lengths, q, new):
            if f32:
                cache, q, new = to_f32(cache, q, new)

            def step(carry, x):
                c, lens = carry
                q, new = x
                c = jax_tk.decode.update_kv_cache(c, new, lens, page_table=table)
                lens = lens + t_new
                return (c, lens), jax_tk.decode.mla_attention(q, c, lens, page_table=table, implementation=impl)

            return jax.lax.scan(step, (cache, lengths), (q, new))[1]
        return f

    rng = np.random.default_rng(3)
    sets = []
    for lengths in [(900, 5), (0, 1400)]:
        cache, table = randn(rng, (b, s, 1, d), BF16), None
        if page_size is not None:  # the same cache in pages, shuffled
            order = rng.permutation(b * s // page_size)
            cache = cache.reshape(-1, page_size, 1, d)[np.argsort(order)]
            table = jnp.asarray(order.reshape(b, -1), jnp.int32)
        sets.append((cache, table, jnp.asarray(lengths, jnp.int32), randn(rng, (steps, b, t_new, heads, d), BF16),
                     randn(rng, (steps, b, t_new, 1, d), BF16)))
    check(f"mla_{page_size}", loop("tk"), loop("xla", f32=True), sets)
