"""Tests for k3.kda.ops: chunked vs token recurrence vs a numpy reference, packed documents, gates."""

import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3.kda import ops as kda

H, K, V = 2, 8, 6
LOWER_BOUND = -5.0


# One compiled function per (shape, static flags), shared by all tests.
recurrent = jax.jit(kda.recurrent_kda, static_argnames=("output_final_state",))
chunk = jax.jit(kda.chunk_kda_reference, static_argnames=("output_final_state", "chunk_size"))


def _l2n(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True))


def _inputs(rng, B, T, g_BTHK=None):
    """float64 numpy inputs: L2-normalised q, k; beta in (0, 1); g in [-5, 0) unless given."""
    q = _l2n(rng.normal(size=(B, T, H, K)))
    k = _l2n(rng.normal(size=(B, T, H, K)))
    v = rng.normal(size=(B, T, H, V))
    g = rng.uniform(LOWER_BOUND, -5e-3, size=(B, T, H, K)) if g_BTHK is None else g_BTHK
    beta = rng.uniform(0.05, 0.95, size=(B, T, H))
    h0 = rng.normal(size=(B, H, K, V))
    return q, k, v, g, beta, h0


def _gate_regimes(rng, T):
    """[4, T, H, K] log decays, one regime per batch row: at the bound, near 0, mixed, unbounded."""
    at_bound = np.full((T, H, K), LOWER_BOUND)
    near_zero = np.full((T, H, K), -1e-3)
    mixed = rng.uniform(LOWER_BOUND, 0.0, size=(T, H, K))
    # Kimi Linear's gate with a large rate: tens of nats per token, far below any bound.
    A_log = np.full((H,), 3.0, np.float32)
    unbounded = np.asarray(kda.kda_gate_softplus(rng.normal(2.0, 3.0, size=(T, H, K)), A_log), np.float64)
    return np.stack([at_bound, near_zero, mixed, unbounded])


def _max_rel_err(ref, out):
    ref, out = np.asarray(ref), np.asarray(out)
    return np.max(np.abs(ref - out)) / np.max(np.abs(ref))


def _naive_kda(q, k, v, g, beta, scale=None, h0=None):
    """Plain numpy float64: S = (I - beta k k^T) Diag(alpha) S + beta k v^T, o = S^T (scale q)."""
    B, T, _, _ = q.shape
    scale = K**-0.5 if scale is None else scale
    o = np.zeros((B, T, H, V))
    S_final = np.zeros((B, H, K, V))
    for b in range(B):
        for h in range(H):
            S = np.zeros((K, V)) if h0 is None else h0[b, h].copy()
            for t in range(T):
                kt = k[b, t, h][:, None]
                transition = np.eye(K) - beta[b, t, h] * kt @ kt.T
                S = transition @ np.diag(np.exp(g[b, t, h])) @ S + beta[b, t, h] * kt @ v[b, t, h][None, :]
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            S_final[b, h] = S
    return o, S_final


# ----------------------------------------------------------------------------------------------------
# Chunked form == token recurrence == numpy reference
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "T, chunk_size, with_h0",
    [
        (1, 64, True),
        (63, 64, False),
        (64, 64, True),
        (64, 16, False),
        (65, 64, False),
        (65, 16, True),
        (200, 64, True),
        (200, 16, False),
        (50, 12, True),  # chunk not a multiple of the 8-token sub-tile
        (20, 5, False),  # chunk smaller than a sub-tile
    ],
)
def test_chunk_matches_recurrent_float64(x64, T, chunk_size, with_h0):
    rng = np.random.default_rng(T + chunk_size)
    g = _gate_regimes(rng, T)
    q, k, v, g, beta, h0 = _inputs(rng, g.shape[0], T, g)
    h0 = h0 if with_h0 else None

    o_ref, S_ref = recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, S = chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size)

    assert o.dtype == jnp.float64 and S.dtype == jnp.float64
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(S))
    # Per gate regime (batch row), so a small row cannot hide behind a large one.
    for b in range(g.shape[0]):
        assert _max_rel_err(o_ref[b], o[b]) < 1e-10, b
        assert _max_rel_err(S_ref[b], S[b]) < 1e-10, b


def test_recurrent_matches_numpy_reference(x64):
    rng = np.random.default_rng(1)
    q, k, v, g, beta, h0 = _inputs(rng, 2, 40)
    o_ref, S_ref = _naive_kda(q, k, v, g, beta, scale=0.7, h0=h0)
    o, S = recurrent(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True)
    assert _max_rel_err(o_ref, o) < 1e-12
    assert _max_rel_err(S_ref, S) < 1e-12


def test_final_state_is_none_unless_requested():
    args = [jnp.asarray(x, jnp.float32) for x in _inputs(np.random.default_rng(2), 1, 5)[:5]]
    o, S = jax.eval_shape(kda.recurrent_kda, *args)
    assert S is None and o.shape == (1, 5, H, V)
    o, S = jax.eval_shape(functools.partial(kda.chunk_kda_reference, chunk_size=4), *args)
    assert S is None and o.shape == (1, 5, H, V)


def test_fp32_chunk_at_bound_matches_float64(x64):
    """320 nats of decay per 64-token chunk: any exp of a positive exponent would overflow fp32."""
    rng = np.random.default_rng(3)
    T = 200
    g = np.full((4, T, H, K), LOWER_BOUND)
    q, k, v, g, beta, h0 = _inputs(rng, 4, T, g)
    o_ref, S_ref = recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, h0)]
    o, S = chunk(*f32[:5], initial_state=f32[5], output_final_state=True, chunk_size=64)
    assert o.dtype == jnp.float32 and S.dtype == jnp.float32
    assert _max_rel_err(o_ref, o) < 1e-4
    assert _max_rel_err(S_ref, S) < 1e-4


def test_chunk_gradients_match_recurrent_float64(x64):
    """Gradients of o and the final state w.r.t. every input, with packed documents and all gates."""
    rng = np.random.default_rng(13)
    T = 40
    g = _gate_regimes(rng, T)
    inputs = _inputs(rng, g.shape[0], T, g)
    segment_ids = np.cumsum(rng.uniform(size=(g.shape[0], T)) < 0.1, axis=1)

    def loss(fn):
        def f(q, k, v, g, beta, h0):
            o, S = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, segment_ids=segment_ids)
            return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.sin(S))

        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4, 5)))

    grads_ref = loss(kda.recurrent_kda)(*inputs)
    grads = loss(functools.partial(kda.chunk_kda_reference, chunk_size=16))(*inputs)
    for name, d_ref, d in zip("q k v g beta h0".split(), grads_ref, grads):
        assert np.all(np.isfinite(d)), name
        assert _max_rel_err(d_ref, d) < 1e-9, name


def test_fp32_chunk_unbounded_gate_has_finite_gradients():
    """Masking after exp would give inf * 0 = NaN in the gradient of g, even with finite outputs."""
    rng = np.random.default_rng(4)
    T = 40
    g = _gate_regimes(rng, T)[3:]
    q, k, v, g, beta, _ = (jnp.asarray(x, jnp.float32) for x in _inputs(rng, 1, T, g))
    assert float(g.min()) < -50.0

    def loss(q, k, v, g, beta):
        o, _ = kda.chunk_kda_reference(q, k, v, g, beta, chunk_size=16)
        return jnp.sum(o**2), o

    grads, o = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(q, k, v, g, beta)
    assert bool(jnp.all(jnp.isfinite(o)))
    assert all(bool(jnp.all(jnp.isfinite(d))) for d in grads)


# ----------------------------------------------------------------------------------------------------
# Packed documents
# ----------------------------------------------------------------------------------------------------

# Row 0: documents start mid-chunk (5, 6), at a chunk boundary (32) and mid-chunk again (48); id 1 is
# reused by two separate documents. Row 1: a length-1 document exactly at a chunk start (16).
_DOC_LENGTHS = ([5, 1, 26, 16, 2], [16, 1, 33])
_DOC_IDS = ([3, 1, 4, 1, 5], [0, 1, 2])
_PACKED_T, _PACKED_CHUNK = 50, 16


def _segment_ids():
    return np.stack([np.repeat(ids, lengths) for ids, lengths in zip(_DOC_IDS, _DOC_LENGTHS)])


_IMPLS = {"recurrent": recurrent, "chunk": functools.partial(chunk, chunk_size=_PACKED_CHUNK)}


def _separate_documents(inputs):
    """Each document as its own row, zero-padded at the end to the packed length.

    Padding with k = g = beta = 0 leaves the state unchanged, so a row's final state is its document's.
    Rows after the first document of a packed row get a zero initial state.
    """
    q, k, v, g, beta, h0 = inputs
    rows, row_h0, spans = [], [], []
    for b, lengths in enumerate(_DOC_LENGTHS):
        starts = np.cumsum([0] + lengths)
        for d, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
            pad_end = [(0, _PACKED_T - (e - s))]
            rows.append([np.pad(x[b, s:e], pad_end + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta)])
            row_h0.append(h0[b] if d == 0 else np.zeros_like(h0[b]))
            spans.append((b, s, e, d == len(lengths) - 1))
    return [np.stack(x) for x in zip(*rows)] + [np.stack(row_h0)], spans


@pytest.mark.parametrize("impl", list(_IMPLS))
def test_packed_documents_equal_separate_runs(x64, impl):
    run = _IMPLS[impl]
    inputs = _inputs(np.random.default_rng(5), 2, _PACKED_T)
    q, k, v, g, beta, h0 = inputs
    o, S = run(q, k, v, g, beta, initial_state=h0, output_final_state=True, segment_ids=_segment_ids())

    (*docs, docs_h0), spans = _separate_documents(inputs)
    o_docs, S_docs = run(*docs, initial_state=docs_h0, output_final_state=True)
    for row, (b, s, e, last) in enumerate(spans):
        np.testing.assert_allclose(o[b, s:e], o_docs[row, : e - s], rtol=1e-10, atol=1e-12)
        if last:
            np.testing.assert_allclose(S[b], S_docs[row], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", list(_IMPLS))
def test_cu_seqlens_equals_segment_ids(x64, impl):
    run = _IMPLS[impl]
    q, k, v, g, beta, h0 = _inputs(np.random.default_rng(6), 1, _PACKED_T)
    cu_seqlens = np.cumsum([0] + _DOC_LENGTHS[0])
    seg = _segment_ids()[:1]
    o_seg, S_seg = run(q, k, v, g, beta, initial_state=h0, output_final_state=True, segment_ids=seg)
    o_cu, S_cu = run(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    np.testing.assert_allclose(o_cu, o_seg, rtol=0, atol=1e-14)
    np.testing.assert_allclose(S_cu, S_seg, rtol=0, atol=1e-14)


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
def test_causality(x64, impl):
    rng = np.random.default_rng(7)
    T, t = 40, 21  # t is in the middle of the second 16-token chunk
    inputs = _inputs(rng, 1, T)[:5]
    perturbed = [x.copy() for x in inputs]
    for x, fresh in zip(perturbed, _inputs(np.random.default_rng(8), 1, T)[:5]):
        x[:, t + 1 :] = fresh[:, t + 1 :]

    run = jax.jit(functools.partial(kda.kda_core, impl=impl, chunk_size=16))
    o, _ = run(*inputs)
    o_perturbed, _ = run(*perturbed)
    np.testing.assert_allclose(o_perturbed[:, : t + 1], o[:, : t + 1], rtol=0, atol=1e-14)
    assert np.max(np.abs(o_perturbed[:, t + 1 :] - o[:, t + 1 :])) > 1e-3


# ----------------------------------------------------------------------------------------------------
# Gates and helpers
# ----------------------------------------------------------------------------------------------------


def test_bounded_gate_range_and_bound():
    A_log = jnp.array([0.0, 0.5])
    z = jnp.asarray(np.random.default_rng(9).normal(0.0, 1.5, size=(3, 7, 2, K)), jnp.bfloat16)
    g = kda.kda_gate_bounded(z, A_log, lower_bound=-5.0)
    assert g.dtype == jnp.float32 and g.shape == z.shape
    assert bool(jnp.all((g > -5.0) & (g < 0.0)))

    g_large = kda.kda_gate_bounded(jnp.full((2, K), 20.0), A_log, lower_bound=-3.0)
    np.testing.assert_allclose(g_large, -3.0, rtol=1e-6)
    assert bool(jnp.all(g_large >= -3.0))

    expected = -5.0 / (1.0 + np.exp(-np.exp([0.0, 0.5])[:, None] * np.asarray(z, np.float64)))
    np.testing.assert_allclose(g, expected, rtol=1e-5)


def test_softplus_gate_formula():
    A_log = jnp.array([-1.0, 2.0])
    z = np.random.default_rng(10).normal(0.0, 10.0, size=(4, 2, K)).astype(np.float32)
    g = kda.kda_gate_softplus(z, A_log)
    assert g.dtype == jnp.float32 and g.shape == z.shape
    expected = -np.exp([-1.0, 2.0])[:, None] * np.logaddexp(0.0, z.astype(np.float64))
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-30)
    assert bool(jnp.all(g <= 0.0))


def test_l2_normalize():
    x = jnp.asarray(np.random.default_rng(11).normal(size=(3, 5, 16)), jnp.bfloat16)
    y = kda.l2_normalize(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(jnp.linalg.norm(y.astype(jnp.float32), axis=-1), 1.0, atol=1e-2)
    assert bool(jnp.all(kda.l2_normalize(jnp.zeros((2, 4))) == 0.0))


# ----------------------------------------------------------------------------------------------------
# Dispatch and validation
# ----------------------------------------------------------------------------------------------------


def _f32_inputs(B=1, T=6):
    q, k, v, g, beta, h0 = (jnp.asarray(x, jnp.float32) for x in _inputs(np.random.default_rng(12), B, T))
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("impl, target", [("recurrent", "recurrent_kda"), ("chunk", "chunk_kda_reference"),
                                          ("reference", "chunk_kda_reference")])
def test_kda_core_dispatch(monkeypatch, impl, target):
    calls = []
    monkeypatch.setattr(kda, target, lambda *args, **kwargs: calls.append((args, kwargs)) or ("o", "S"))
    q, k, v, g, beta, h0 = _f32_inputs()
    out = kda.kda_core(q, k, v, g, beta, impl=impl, initial_state=h0, output_final_state=True, chunk_size=32)
    assert out == ("o", "S")
    (args, kwargs), = calls
    assert len(args) == 5 and args[0] is q
    expected = dict(scale=None, initial_state=h0, output_final_state=True, segment_ids=None)
    if impl in ("chunk", "reference"):
        expected["chunk_size"] = 32
    assert kwargs == expected


def test_kda_core_pallas_forwards_kwargs(monkeypatch):
    calls = []
    fake = types.ModuleType("pallas_kernels.kda")
    fake.chunk_kda = lambda *args, **kwargs: calls.append((args, kwargs)) or ("o", "S")
    monkeypatch.setitem(sys.modules, "pallas_kernels.kda", fake)
    q, k, v, g, beta, h0 = _f32_inputs()
    seg = jnp.zeros((1, 6), jnp.int32)
    out = kda.kda_core(
        q, k, v, g, beta, impl="pallas", scale=0.5, initial_state=h0, output_final_state=True,
        segment_ids=seg, chunk_size=32, matmul_dtype="bfloat16",
    )  # fmt: skip
    assert out == ("o", "S")
    (args, kwargs), = calls
    assert len(args) == 5 and args[0] is q
    assert kwargs == dict(
        scale=0.5, initial_state=h0, output_final_state=True, segment_ids=seg, chunk_size=32,
        lower_bound=-5.0, matmul_dtype="bfloat16",
    )


def test_kda_core_pallas_unbounded_gate_uses_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(kda, "chunk_kda_reference", lambda *a, **kw: calls.append(kw) or ("o", "S"))
    monkeypatch.setitem(sys.modules, "pallas_kernels.kda", None)  # the kernel must not be needed
    assert kda.kda_core(*_f32_inputs()[:5], impl="pallas", gate_lower_bound=None) == ("o", "S")
    assert len(calls) == 1


def test_kda_core_pallas_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pallas_kernels.kda", None)  # makes the import fail
    with pytest.raises(ImportError, match="Pallas KDA kernel is not available"):
        kda.kda_core(*_f32_inputs()[:5], impl="pallas")


def test_kda_core_unknown_impl():
    with pytest.raises(ValueError, match="'flash'"):
        kda.kda_core(*_f32_inputs()[:5], impl="flash")


def _replace(index, value):
    args = list(_f32_inputs(B=2)[:5])
    args[index] = value
    return args


@pytest.mark.parametrize("fn", [kda.recurrent_kda, kda.chunk_kda_reference, kda.kda_core])
@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (_replace(0, jnp.zeros((2, 6, H))), {}, "q must be"),
        (_replace(1, jnp.zeros((2, 6, H, K + 1))), {}, "k must"),
        (_replace(2, jnp.zeros((2, 5, H, V))), {}, "v must"),
        (_replace(3, jnp.zeros((2, 6, H, 1))), {}, "g must"),
        (_replace(4, jnp.zeros((2, 6, H, 1))), {}, "beta must"),
        (_replace(4, jnp.zeros((2, 6, H))), dict(initial_state=jnp.zeros((2, H, V, K))), "initial_state"),
        (_replace(4, jnp.zeros((2, 6, H))), dict(segment_ids=jnp.zeros((2, 5), jnp.int32)), "segment_ids"),
    ],
)
def test_bad_shapes_raise(fn, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize(
    "B, kwargs, match",
    [
        (2, dict(cu_seqlens=np.array([0, 3, 6])), "batch size 1"),
        (1, dict(cu_seqlens=np.array([0, 3, 5])), "rise from 0"),
        (1, dict(cu_seqlens=np.array([[0, 6]])), "cu_seqlens must be"),
        (1, dict(cu_seqlens=np.array([0, 6]), segment_ids=np.zeros((1, 6), np.int32)), "not both"),
        (1, dict(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_packing_arguments_raise(B, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kda.chunk_kda_reference(*_f32_inputs(B=B)[:5], **kwargs)


def test_bad_gate_arguments_raise():
    with pytest.raises(ValueError, match="A_log"):
        kda.kda_gate_bounded(jnp.zeros((4, 2, K)), jnp.zeros((3,)))
    with pytest.raises(ValueError, match="A_log"):
        kda.kda_gate_softplus(jnp.zeros((4, 2, K)), jnp.zeros((2, 1)))
    with pytest.raises(ValueError, match="lower_bound"):
        kda.kda_gate_bounded(jnp.zeros((4, 2, K)), jnp.zeros((2,)), lower_bound=1.0)
