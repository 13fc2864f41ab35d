"""The document-skipping Pallas flash attention kernel against a dense float64 reference.

`pallas_kernels.flash_attention` visits only the key blocks of each query's own document; these
tests check its values and gradients (dq, dk, dv) against the plain float64 formula: scores
q.k * scale, mask = causal AND same segment id, softmax, times v. On the CPU the kernels run in
Pallas interpret mode, so the sizes are small; blocks of 16/32/64 still give several blocks per row
and ragged tails. On a GPU the same tests run the compiled (Triton) kernels (flash_attention's
default), and one more, at a moderate size, runs only there.

The reference assumes every document has its own id (the contract: documents are contiguous runs,
and the packer numbers them 1, 2, ... per row), so "same id" and "same run" agree.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3.mla.layer import ATTENTION
from pallas_kernels.common import default_interpret
from pallas_kernels.flash_attention import document_bounds, flash_attention

# Whether flash_attention's default (interpret=None) runs the compiled Triton kernels here: on a GPU,
# unless K3_PALLAS_INTERPRET says otherwise.
COMPILED = not default_interpret()

# Tolerances: error = max |out - ref| / max(max |ref|, 1), per output array (o, dq, dk, dv).
# fp32 inputs: interpreted (CPU), the kernel's errors are 1e-7 .. 1e-6. Compiled, Triton runs fp32
# dots in TF32 (the kernel sets no dot precision): measured 2.6e-4 .. 8.9e-4 on an H200.
FP32_TOL = 2e-3 if COMPILED else 1e-5
# bf16 inputs against the float64 reference on the same (bf16-rounded) inputs. Measured (CPU,
# interpret mode) on the bf16 cases below and on 3 more seeds of each: o 1.7e-3 .. 3.1e-3 (about one
# bf16 rounding of the output, 2^-9 = 2e-3), dq/dk/dv 2.0e-3 .. 5.5e-3; the GPU test's layout
# (T = 1000, documents up to 300), interpreted on the CPU: o 1.9e-3, dq 4.4e-3, dk 4.5e-3, dv 2.5e-3;
# compiled on an H200 (both block shapes): o 2.4e-3, dq 3.2e-3, dk 3.9e-3, dv 3.3e-3.
# The bounds leave 2-3x over the worst of those.
BF16_TOL_O = 6e-3
BF16_TOL_GRAD = 1.2e-2


def _check_bf16(errs, *context):
    bad = {n: e for n, e in errs.items() if not e < (BF16_TOL_O if n == "o" else BF16_TOL_GRAD)}
    assert not bad, (*context, errs)


# ----------------------------------------------------------------------------------------------------
# inputs and references


def _ids(lengths, rng=None):
    """[T] int32 ids for runs of the given lengths: distinct per run; shuffled (incl. 0 and negative
    ids, not increasing) when an rng is given."""
    n = len(lengths)
    ids = np.arange(1, n + 1) if rng is None else rng.permutation(4 * n)[:n] - n
    return np.repeat(ids, lengths).astype(np.int32)


def _random_lengths(rng, T, max_len):
    """Random run lengths summing to T, with a share of single-token documents."""
    lengths = []
    while sum(lengths) < T:
        n = 1 if rng.random() < 0.25 else int(rng.integers(1, max_len + 1))
        lengths.append(min(n, T - sum(lengths)))
    return lengths


def _inputs(rng, B, T, H, D, E, dtype=jnp.float32):
    """q, k [B,T,H,D], v [B,T,H,E] and loss weights w [B,T,H,E], as `dtype` jax arrays."""
    q = rng.normal(size=(B, T, H, D))
    k = rng.normal(size=(B, T, H, D))
    v = rng.normal(size=(B, T, H, E))
    w = rng.normal(size=(B, T, H, E))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, w))


def _reference(q, k, v, w, seg, scale):
    """Dense float64 attention: (o, (dq, dk, dv)) of sum(o * w), as numpy float64."""
    with jax.enable_x64(True):
        q, k, v, w = (jnp.asarray(np.asarray(jnp.asarray(x, jnp.float32), np.float64)) for x in (q, k, v, w))
        B, T = q.shape[:2]
        seg = jnp.zeros((B, T), jnp.int64) if seg is None else jnp.asarray(np.asarray(seg), jnp.int64)
        causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
        mask = causal[None, None] & (seg[:, None, :, None] == seg[:, None, None, :])  # [B, 1, T, T]

        def attend(q, k, v):
            s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
            p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
            return jnp.einsum("bhts,bshe->bthe", p, v)

        o, vjp = jax.vjp(attend, q, k, v)
        grads = vjp(w)
        return np.asarray(o), tuple(np.asarray(g) for g in grads)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "interpret"))
def _kernel(q, k, v, w, seg, *, scale, block_q, block_k, interpret=None):
    """The kernel's (o, (dq, dk, dv)) of sum(o * w)."""

    def loss(q, k, v):
        o = flash_attention(q, k, v, seg, scale=scale, block_q=block_q, block_k=block_k, interpret=interpret)
        return jnp.sum(o.astype(jnp.float32) * w), o

    (_, o), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return o, grads


def _err(out, ref):
    """max |out - ref| / max(max |ref|, 1) (out must be finite): relative to the largest entry, and
    absolute where the reference is ~0 (dq = dk = 0 exactly when every document is one token; the
    inputs are O(1), so 1 is their natural unit)."""
    out, ref = np.asarray(jnp.asarray(out, jnp.float32), np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out))
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1.0))


def _errors(q, k, v, w, seg, scale, block_q, block_k, interpret=None):
    """Per-array errors of the kernel against the float64 reference on the same inputs."""
    o, grads = _kernel(q, k, v, w, seg, scale=scale, block_q=block_q, block_k=block_k, interpret=interpret)
    ro, rgrads = _reference(q, k, v, w, seg, scale)
    errs = {"o": _err(o, ro)}
    errs.update({n: _err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, rgrads)})
    return errs


# Layouts: (B, T, H, D, E, block_q, block_k, rows), rows = one list of run lengths per row, or None
# (segment_ids=None: one document per row), or "random:<max_len>" (random runs, shuffled ids).
CASES = {
    # T = 150 not a multiple of the blocks; D = 48 pads to 64, E = 32 != D. Row 0: single-token
    # documents (0, 1, 64), documents ending on block boundaries (31, 63, 127); row 1: one document
    # across many blocks between two short ones.
    "ragged_T_unequal_dims": (2, 150, 2, 48, 32, 32, 64, [[1, 1, 30, 32, 1, 63, 22], [3, 140, 7]]),
    "no_segment_ids": (2, 150, 2, 48, 32, 64, 32, None),
    "one_token": (1, 1, 1, 48, 32, 16, 16, [[1]]),
    "one_token_no_ids": (1, 1, 2, 16, 8, 16, 32, None),
    "bq16_bk32": (2, 100, 3, 24, 40, 16, 32, "random:40"),
    "bq32_bk16": (2, 100, 2, 48, 32, 32, 16, "random:40"),
    "all_single_tokens": (1, 40, 2, 16, 16, 16, 16, [[1] * 40]),
    "T_block_multiple": (2, 128, 2, 32, 32, 32, 32, [[16, 48, 64], [128]]),
}


def _case(name, rng):
    B, T, H, D, E, bq, bk, rows = CASES[name]
    if rows is None:
        seg = None
    elif isinstance(rows, str):
        max_len = int(rows.split(":")[1])
        seg = jnp.asarray(np.stack([_ids(_random_lengths(rng, T, max_len), rng) for _ in range(B)]))
    else:
        assert len(rows) == B and all(sum(r) == T for r in rows)
        seg = jnp.asarray(np.stack([_ids(r) for r in rows]))
    return (B, T, H, D, E, bq, bk), seg


# ----------------------------------------------------------------------------------------------------
# values and gradients


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_matches_float64_reference(name):
    """fp32 inputs: output and dq, dk, dv of sum(o * w) match the dense float64 reference to ~1e-5
    (TF32 level when compiled on a GPU), at ragged T, padded/unequal head dims, block_q != block_k,
    single-token and long documents, documents ending on block boundaries, no segment ids, T = 1."""
    rng = np.random.default_rng(list(CASES).index(name))
    (B, T, H, D, E, bq, bk), seg = _case(name, rng)
    q, k, v, w = _inputs(rng, B, T, H, D, E)
    scale = 0.7 * D ** -0.5  # not the default, so the scale is checked to be applied
    errs = _errors(q, k, v, w, seg, scale, bq, bk)
    assert max(errs.values()) < FP32_TOL, errs


def test_fp32_default_scale_and_blocks():
    """scale=None means D^-0.5 of the unpadded head dim; the default blocks (64) work at T < 64."""
    rng = np.random.default_rng(11)
    q, k, v, w = _inputs(rng, 1, 50, 2, 20, 12)
    seg = jnp.asarray(_ids([10, 1, 39])[None])
    o = flash_attention(q, k, v, seg)
    ro, _ = _reference(q, k, v, w, seg, 20 ** -0.5)
    assert _err(o, ro) < FP32_TOL


def _rounded(xs, dtype):
    return tuple(jnp.asarray(jnp.asarray(x, dtype), jnp.float32) for x in xs)


@pytest.mark.parametrize("name", ["ragged_T_unequal_dims", "long_document"])
def test_bf16_matches_float64_reference(name):
    """bf16 inputs: output and gradients within BF16_TOL_O / BF16_TOL_GRAD of the float64
    reference evaluated on the same bf16-rounded inputs (and bf16-rounded output cotangent)."""
    rng = np.random.default_rng(100 + len(name))
    if name == "long_document":  # softmax over up to 200 keys, three heads, sharper scores
        B, T, H, D, E, bq, bk = 1, 200, 3, 64, 64, 64, 32
        seg = jnp.asarray(_ids([5, 195])[None])
        q, k, v, w = _inputs(rng, B, T, H, D, E)
        q = q * 2.0
    else:
        (B, T, H, D, E, bq, bk), seg = _case(name, rng)
        q, k, v, w = _inputs(rng, B, T, H, D, E)
    qb, kb, vb, wb = (x.astype(jnp.bfloat16) for x in (q, k, v, w))
    scale = D ** -0.5
    o, grads = _kernel(qb, kb, vb, wb.astype(jnp.float32), seg, scale=scale, block_q=bq, block_k=bk)
    assert o.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    ro, rgrads = _reference(*_rounded((qb, kb, vb, wb), jnp.bfloat16), seg, scale)
    errs = {"o": _err(o, ro)}
    errs.update({n: _err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, rgrads)})
    _check_bf16(errs)


# ----------------------------------------------------------------------------------------------------
# documents and causality


def test_documents_are_isolated_and_causal():
    """Perturbing q, k, v of other documents leaves a document's output bit-identical, and so does
    perturbing any later token; gradients of a loss on one document (or on earlier tokens) are
    exactly zero outside it (after them)."""
    rng = np.random.default_rng(7)
    B, T, H, D, E = 1, 96, 2, 32, 16
    lengths = [20, 30, 46]  # documents [0, 20), [20, 50), [50, 96); blocks of 16
    seg = jnp.asarray(_ids(lengths)[None])
    q, k, v, w = _inputs(rng, B, T, H, D, E)
    kw = dict(scale=D ** -0.5, block_q=16, block_k=16)
    base, _ = _kernel(q, k, v, w, seg, **kw)
    docs = [slice(0, 20), slice(20, 50), slice(50, 96)]

    def perturbed(sl):
        noise = lambda x: x.at[:, sl].set(jnp.asarray(rng.normal(size=x[:, sl].shape) * 5, x.dtype))  # noqa: E731
        return noise(q), noise(k), noise(v)

    for d, own in enumerate(docs):
        for other in docs[:d] + docs[d + 1:]:
            o, _ = _kernel(*perturbed(other), w, seg, **kw)
            np.testing.assert_array_equal(np.asarray(o[:, own]), np.asarray(base[:, own]))
            assert not np.array_equal(np.asarray(o[:, other]), np.asarray(base[:, other]))

    # Causality: tokens at and after t (t mid-block, mid-document; and one-document rows) do not
    # change tokens before t.
    for segment_ids, t in ((seg, 37), (None, 37), (None, 64)):
        o0, _ = _kernel(q, k, v, w, segment_ids, **kw)
        o, _ = _kernel(*perturbed(slice(t, T)), w, segment_ids, **kw)
        np.testing.assert_array_equal(np.asarray(o[:, :t]), np.asarray(o0[:, :t]))
        assert not np.array_equal(np.asarray(o[:, t:]), np.asarray(o0[:, t:]))

    # Backward: a loss on document 1 only has zero gradients outside it; a loss on tokens < t has
    # zero gradients at tokens >= t.
    zero_outside = lambda sl: jnp.zeros_like(w).at[:, sl].set(w[:, sl])  # noqa: E731
    _, grads = _kernel(q, k, v, zero_outside(docs[1]), seg, **kw)
    for g in grads:
        g = np.asarray(g)
        assert not np.any(g[:, :20]) and not np.any(g[:, 50:]) and np.any(g[:, 20:50])
    _, grads = _kernel(q, k, v, zero_outside(slice(0, 37)), None, **kw)
    for g in grads:
        g = np.asarray(g)
        assert not np.any(g[:, 37:]) and np.any(g[:, :37])


def _bounds_loop(seg):
    """First and last index of each token's run of equal ids, by walking."""
    B, T = seg.shape
    start, end = np.zeros((B, T), np.int64), np.zeros((B, T), np.int64)
    for b in range(B):
        for t in range(T):
            s = t
            while s > 0 and seg[b, s - 1] == seg[b, t]:
                s -= 1
            e = t
            while e < T - 1 and seg[b, e + 1] == seg[b, t]:
                e += 1
            start[b, t], end[b, t] = s, e
    return start, end


def _check_bounds(seg):
    start, end = document_bounds(jnp.asarray(seg, jnp.int32))
    assert start.dtype == jnp.int32 and end.dtype == jnp.int32
    ref_start, ref_end = _bounds_loop(seg)
    np.testing.assert_array_equal(np.asarray(start), ref_start)
    np.testing.assert_array_equal(np.asarray(end), ref_end)


def test_document_bounds_matches_a_loop():
    """`document_bounds` gives each token's run [start, end] on random layouts, including T = 1 and 2,
    all-singleton rows, one-run rows and ids that repeat in non-adjacent runs (separate runs)."""
    rng = np.random.default_rng(3)
    layouts = [np.array([[5], [-2]]), np.array([[5, 5]]), np.arange(9)[None], np.full((2, 13), -4),
               np.array([[1, 1, 2, 1, 1, 1, 2, 2]])]
    for T in (2, 7, 33, 100):
        layouts.append(np.stack([_ids(_random_lengths(rng, T, int(rng.integers(1, 12))), rng) for _ in range(3)]))
        layouts.append(rng.integers(0, 3, size=(2, T)))  # short runs, ids reused across runs
    for seg in layouts:
        _check_bounds(seg)


# ----------------------------------------------------------------------------------------------------
# arguments


@pytest.mark.parametrize("change, match", [
    (dict(k=(2, 24, 2, 16)), "q and k"),
    (dict(k=(2, 20, 2, 32)), "q and k"),
    (dict(v=(2, 20, 3, 8)), "q and k"),
    (dict(q=(20, 2, 16), k=(20, 2, 16)), "q and k"),
    (dict(seg=(2, 21)), "segment_ids"),
    (dict(seg=(20,)), "segment_ids"),
    (dict(block_q=48), "block_q must be a power of two"),
    (dict(block_k=24), "block_k must be a power of two"),
    (dict(block_k=8), "block_k must be a power of two >= 16"),
])
def test_bad_arguments_raise(change, match):
    """Mismatched q/k/v shapes, a wrong segment_ids shape and bad block sizes are ValueErrors that
    name the problem, raised before anything runs."""
    shapes = dict(q=(2, 20, 2, 16), k=(2, 20, 2, 16), v=(2, 20, 2, 8), seg=(2, 20))
    blocks = dict(block_q=16, block_k=16)
    for key, val in change.items():
        (shapes if key in shapes else blocks)[key] = val
    q, k, v = (jnp.zeros(shapes[n], jnp.float32) for n in "qkv")
    seg = jnp.zeros(shapes["seg"], jnp.int32)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, seg, **blocks)


# ----------------------------------------------------------------------------------------------------
# through k3.mla


def test_mla_flash_entry_matches_xla_entry():
    """`ATTENTION.get('flash')`: bf16 q/k/v run the kernel, which agrees (values and gradients) with
    the float64 reference and with the 'xla' entry to bf16 tolerance; fp32 inputs fall back to the
    'xla' form, bit-identical."""
    rng = np.random.default_rng(21)
    B, T, H, D, E = 2, 70, 2, 48, 32
    seg = jnp.asarray(np.stack([_ids([1, 30, 39]), _ids([70])]))
    q, k, v, w = _inputs(rng, B, T, H, D, E)
    scale = D ** -0.5
    flash, xla = ATTENTION.get("flash"), ATTENTION.get("xla")

    # fp32: the fallback is the XLA path itself.
    np.testing.assert_array_equal(np.asarray(flash(q, k, v, seg, scale)), np.asarray(xla(q, k, v, seg, scale)))

    def value_and_grads(fn, q, k, v):
        def loss(q, k, v):
            o = fn(q, k, v, seg, scale)
            return jnp.sum(o.astype(jnp.float32) * w), o
        (_, o), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return o, grads

    qb, kb, vb, wb = (x.astype(jnp.bfloat16) for x in (q, k, v, w))
    of, gf = jax.jit(functools.partial(value_and_grads, flash))(qb, kb, vb)
    ox, gx = jax.jit(functools.partial(value_and_grads, xla))(qb, kb, vb)
    assert of.dtype == jnp.bfloat16 and of.shape == (B, T, H, E)
    names = ("o", "dq", "dk", "dv")
    # Flash against the float64 reference (same bf16 inputs; the cotangent reaches both as bf16).
    ro, rgrads = _reference(*_rounded((qb, kb, vb, wb), jnp.bfloat16), seg, scale)
    _check_bf16({n: _err(a, b) for n, a, b in zip(names, (of, *gf), (ro, *rgrads))}, "flash vs float64")
    # Flash against xla: two bf16 results, each about one bf16 rounding off, so twice the bounds.
    # Measured (4 seeds): o 4.9e-3 .. 5.7e-3, dq 3.3e-3 .. 5.1e-3, dk 4.0e-3 .. 7.5e-3, dv 0.
    errs = {n: _err(a, b) for n, a, b in zip(names, (of, *gf), (ox, *gx))}
    assert errs["o"] < 2 * BF16_TOL_O and max(errs.values()) < 2 * BF16_TOL_GRAD, ("flash vs xla", errs)
    # Not the fallback: the kernel's bf16 result is not bit-identical to XLA's.
    assert not np.array_equal(np.asarray(of), np.asarray(ox))


# ----------------------------------------------------------------------------------------------------
# compiled kernels (GPU)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled (Triton) kernels need a GPU")
def test_compiled_kernel_matches_float64_reference_on_gpu():
    """The compiled kernels (interpret=False), bf16, at a moderate size with documents of random
    lengths: output and gradients within the bf16 bounds of the float64 reference, for two block
    shapes."""
    rng = np.random.default_rng(2024)
    B, T, H, D, E = 2, 1000, 4, 48, 32
    seg = jnp.asarray(np.stack([_ids(_random_lengths(rng, T, 300), rng) for _ in range(B)]))
    q, k, v, w = _inputs(rng, B, T, H, D, E)
    qb, kb, vb, wb = (x.astype(jnp.bfloat16) for x in (q, k, v, w))
    scale = D ** -0.5
    ro, rgrads = _reference(*_rounded((qb, kb, vb, wb), jnp.bfloat16), seg, scale)
    for bq, bk in ((64, 64), (128, 32)):
        o, grads = _kernel(qb, kb, vb, wb.astype(jnp.float32), seg, scale=scale, block_q=bq, block_k=bk,
                           interpret=False)
        errs = {"o": _err(o, ro)}
        errs.update({n: _err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, rgrads)})
        _check_bf16(errs, (bq, bk))


def test_reused_ids_are_separate_documents_and_wide_ids_work():
    """Runs that reuse an id (1, 2, 1) are three documents, whatever the block layout; negative ids
    behave like positive ones."""
    rng = np.random.default_rng(77)
    q, k, v, w = _inputs(rng, 1, 50, 2, 16, 16)
    lengths = [10, 30, 10]
    runs = jnp.asarray(_ids(lengths)[None])  # 1, 2, 3
    ro, rgrads = _reference(q, k, v, w, runs, 0.25)
    for ids in (np.repeat([1, 2, 1], lengths), np.repeat([5, -7, 5], lengths)):
        for bq, bk in ((16, 16), (32, 16)):
            o, grads = _kernel(q, k, v, w, jnp.asarray(ids[None], jnp.int32), scale=0.25, block_q=bq, block_k=bk)
            errs = [_err(o, ro)] + [_err(a, b) for a, b in zip(grads, rgrads)]
            assert max(errs) < FP32_TOL, (ids, bq, bk, errs)
