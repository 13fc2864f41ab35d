"""The Pallas chunked-KDA kernel against the float64 token recurrence: values, gradients, documents.

On the CPU the kernels run in Pallas interpret mode; on a GPU machine `K3_PALLAS_INTERPRET=0` runs
the same tests on the compiled Triton kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import all_eqns, tiny_model_cfg
from k3.model import Model, cross_entropy
from k3.kda import ops as kda
from pallas_kernels import kda as pallas_kda
from pallas_kernels.kda import chunk_kda

LB = -5.0


def _l2n(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True))


def _inputs(rng, B, T, H, K, V, gate="mixed"):
    """float64 numpy inputs; gate: 'mixed' (U(lb, 0)), 'bound' (g = lb), 'near0' (g = -1e-3), or
    'rows' (one regime per batch row: bound, near0, mixed)."""
    q = _l2n(rng.normal(size=(B, T, H, K)))
    k = _l2n(rng.normal(size=(B, T, H, K)))
    v = rng.normal(size=(B, T, H, V))
    regimes = {
        "mixed": lambda: rng.uniform(LB, 0.0, size=(T, H, K)),
        "bound": lambda: np.full((T, H, K), LB),
        "near0": lambda: np.full((T, H, K), -1e-3),
    }
    names = ["bound", "near0", "mixed"] if gate == "rows" else [gate] * B
    g = np.stack([regimes[names[b % len(names)]]() for b in range(B)])
    beta = rng.uniform(0.05, 0.95, size=(B, T, H))
    h0 = rng.normal(size=(B, H, K, V))
    do = rng.normal(size=(B, T, H, V))
    dht = rng.normal(size=(B, H, K, V))
    return q, k, v, g, beta, h0, do, dht


def _rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out))
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _value_and_grads(fn, q, k, v, g, beta, h0, do, dht, **kw):
    """(o, final state) and the gradients of <o, do> + <S_T, dht> w.r.t. (q, k, v, g, beta, h0)."""

    def f(q, k, v, g, beta, h0):
        o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
        loss = jnp.sum(o.astype(jnp.float32 if o.dtype != jnp.float64 else o.dtype) * do)
        return loss + jnp.sum(ht * dht), (o, ht)

    grads, (o, ht) = jax.grad(f, argnums=range(6), has_aux=True)(q, k, v, g, beta, h0)
    return o, ht, grads


def _reference(args, segment_ids=None):
    args64 = [jnp.asarray(np.asarray(a, np.float64)) for a in args]
    fn = functools.partial(kda.recurrent_kda, segment_ids=segment_ids)
    return _value_and_grads(fn, *args64)


def _kernel(args, dtype, segment_ids=None, **kw):
    q, k, v, g, beta, h0, do, dht = args
    cast = lambda x, d: jnp.asarray(np.asarray(x), d)  # noqa: E731
    fn = functools.partial(chunk_kda, segment_ids=segment_ids, **kw)
    return jax.jit(_value_and_grads, static_argnums=0)(
        fn, cast(q, dtype), cast(k, dtype), cast(v, dtype), cast(g, jnp.float32),
        cast(beta, jnp.float32), cast(h0, jnp.float32), cast(do, jnp.float32), cast(dht, jnp.float32))


def _rounded(args, dtype):
    """The inputs the kernel actually sees (q, k, v rounded to dtype), back in float64."""
    q, k, v, *rest = args
    r = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # noqa: E731
    return [r(q), r(k), r(v), *rest]


def _check(args, dtype, tol_fwd, tol_grad, segment_ids=None, **kw):
    o, ht, grads = _kernel(args, dtype, segment_ids=segment_ids, **kw)
    ro, rht, rgrads = _reference(_rounded(args, dtype), segment_ids=segment_ids)
    errs = {"o": _rel(o, ro), "ht": _rel(ht, rht)}
    errs.update({f"d{n}": _rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "h0"), grads, rgrads)})
    fwd_bad = {n: e for n, e in errs.items() if n in ("o", "ht") and not e < tol_fwd}
    grad_bad = {n: e for n, e in errs.items() if n not in ("o", "ht") and not e < tol_grad}
    assert not fwd_bad and not grad_bad, errs
    return o, ro


@pytest.mark.parametrize("T", [1, 17, 64, 100, 1000])
def test_fp32_matches_float64_recurrence(x64, T):
    args = _inputs(np.random.default_rng(T), 1, T, 2, 16, 16)
    _check(args, jnp.float32, 1e-5, 1e-4)


def test_fp32_gate_regimes_and_odd_dims(x64):
    """g at the bound, near 0 and mixed (one per row), with K and V not powers of two."""
    args = _inputs(np.random.default_rng(5), 3, 100, 2, 24, 72, gate="rows")  # V pads to 2 blocks of 64
    o, ro = _check(args, jnp.float32, 1e-5, 1e-4)
    for b in range(3):
        assert _rel(o[b], ro[b]) < 1e-5


@pytest.mark.parametrize("T, gate", [(100, "rows"), (1000, "mixed")])
def test_bf16_inputs_with_fp32_intermediates(x64, T, gate):
    args = _inputs(np.random.default_rng(T + 1), 3 if gate == "rows" else 1, T, 2, 32, 32, gate=gate)
    _check(args, jnp.bfloat16, 2e-3, 5e-3, matmul_dtype="float32")


def test_bf16_inputs_default_to_bf16_intermediates(x64):
    """16-bit inputs take matmul_dtype='bfloat16' unless told otherwise: bf16 operands and storage,
    still a few 1e-3."""
    args = _inputs(np.random.default_rng(9), 1, 200, 2, 32, 32)
    o, _ = _check(args, jnp.bfloat16, 6e-3, 1e-2)
    o_bf16, _, _ = _kernel(args, jnp.bfloat16, matmul_dtype="bfloat16")
    o_fp32, _, _ = _kernel(args, jnp.bfloat16, matmul_dtype="float32")
    assert np.array_equal(np.asarray(o), np.asarray(o_bf16)) and not np.array_equal(np.asarray(o), np.asarray(o_fp32))


@pytest.mark.parametrize("chunk_size", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_packed_documents_equal_separate_runs(x64, chunk_size):
    """Documents of lengths 1, 40, 23, 64, 22 in one row (boundaries inside and at chunk edges)."""
    rng = np.random.default_rng(chunk_size)
    lengths = [1, 40, 23, 64, 22]
    T = sum(lengths)
    q, k, v, g, beta, h0, do, dht = _inputs(rng, 1, T, 2, 16, 16)
    seg = np.repeat(np.arange(len(lengths)) * 3 + 1, lengths)[None].astype(np.int32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    packed, packed_ht = chunk_kda(*map(f32, (q, k, v, g, beta)), initial_state=f32(h0),
                                  output_final_state=True, segment_ids=jnp.asarray(seg),
                                  chunk_size=chunk_size)
    start = 0
    for i, n in enumerate(lengths):
        sl = slice(start, start + n)
        part, part_ht = chunk_kda(*(f32(x[:, sl]) for x in (q, k, v, g, beta)),
                                  initial_state=f32(h0) if i == 0 else None, output_final_state=True,
                                  chunk_size=chunk_size)
        assert _rel(packed[:, sl], part) < 1e-5
        start += n
    assert _rel(packed_ht, part_ht) < 1e-5  # the row's final state is its last document's

    # Gradients through the packed row against the float64 recurrence with the same resets.
    _check((q, k, v, g, beta, h0, do, dht), jnp.float32, 1e-5, 1e-4, segment_ids=jnp.asarray(seg),
           chunk_size=chunk_size)


@pytest.mark.parametrize("backward,bk,bp,bv", [("fused", 32, 0, 0), ("fused", 64, 0, 32), ("split", 32, 0, 0),
                                               ("split", 64, 16, 64), ("two", 32, 16, 16), ("two", 64, 0, 0),
                                               ("chain", 32, 16, 16), ("chain", 64, 0, 32), ("chain", 32, 0, 64)])
def test_backward_kernels_equal_reference_gradient(x64, backward, bk, bp, bv):
    """Every backward plan (`_BACKWARDS`) at an awkward size against the gradient of the jnp chunked
    reference: T = 77 (not a multiple of the chunk), K = 48 padded to 64 (two key blocks of 32 when
    bk = 32, one of 64 otherwise), V = 40 padded to 64, packed documents with boundaries inside chunks;
    the pairs kernels over the whole width or in column blocks of bp = 16; the state chains over the
    whole value width (bv = 64) or in blocks of bv = 16 (the default for 4 rows x heads) or 32 ('chain':
    the state terms in one, four or two value-block parts)."""
    B, T, H, K, V = 2, 77, 2, 48, 40
    args = [np.asarray(np.asarray(x, np.float32), np.float64)
            for x in _inputs(np.random.default_rng(bk), B, T, H, K, V)]
    seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [20, 33, 24]), np.repeat([7, 8], [64, 13])]), jnp.int32)

    def kernel(q, k, v, g, beta, initial_state, output_final_state):
        cfg, inputs = pallas_kda._prepare(q, k, v, g, beta, scale=None, initial_state=initial_state,
                                          segment_ids=seg, interpret=None, chunk_size=32,
                                          lower_bound=LB, check_gate=False, matmul_dtype=None)
        assert (cfg.K, cfg.BK, cfg.backward) == (64, 64, "fused")
        cfg = pallas_kda.with_overrides(cfg, bk=bk, bp=bp, bv=bv, backward=backward)
        o, ht = pallas_kda._kda(cfg, *inputs)
        return o[:, :T, :, :V], ht.swapaxes(-1, -2)[:, :, :K, :V]

    f32 = [jnp.asarray(a, jnp.float32) for a in args]
    o, ht, grads = jax.jit(_value_and_grads, static_argnums=0)(kernel, *f32)
    ref = functools.partial(kda.chunk_kda_reference, segment_ids=seg, chunk_size=32)
    ro, rht, rgrads = _value_and_grads(ref, *map(jnp.asarray, args))
    errs = {"o": _rel(o, ro), "ht": _rel(ht, rht)}
    errs.update({f"d{n}": _rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "h0"), grads, rgrads)})
    assert all(e < 1e-5 for e in errs.values()), errs


def test_tf32_rounding_and_the_emulated_products():
    """`_round_tf32` keeps 10 mantissa bits (rounding to nearest, ties away from zero); the emulated
    products are as accurate as their GPU forms: one TF32 pass about 1e-3, three passes (TF32 or
    bf16) near fp32, against float64 products of the same fp32 operands."""
    x = jnp.asarray([1.0, 1.0 + 2.0**-11, 1.0 + 2.0**-12, -(1.0 + 3 * 2.0**-12), 3.0e-20, 0.0], jnp.float32)
    want = np.asarray([1.0, 1.0 + 2.0**-10, 1.0, -(1.0 + 2.0**-10), 0.0, 0.0])  # a tie, below half, above
    got = np.asarray(pallas_kda._round_tf32(x), np.float64)
    np.testing.assert_array_equal(got[:4], want[:4])
    assert abs(got[4] / 3.0e-20 - 1) <= 2.0**-11 and got[5] == 0.0
    rng = np.random.default_rng(7)
    a, b = rng.normal(size=(16, 48)).astype(np.float32), rng.normal(size=(48, 24)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    dims = ((1,), (0,))
    err = {name: _rel(pallas_kda._DOTS[name](jnp.asarray(a), jnp.asarray(b), dims), ref)
           for name in ("tf32_emulated", "tf32x3_emulated", "bf16x3_emulated", "bf16x2_emulated")}
    assert 1e-4 < err["tf32_emulated"] < 2e-3 and err["tf32x3_emulated"] < 1e-6, err
    assert err["bf16x3_emulated"] < 2e-5 and 3e-4 < err["bf16x2_emulated"] < 4e-3, err
    # the two-pass product rounds only its first operand: exact in bf16, it keeps about 16 bits
    a16 = np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
    ref16 = a16.astype(np.float64) @ b.astype(np.float64)
    assert _rel(pallas_kda._DOTS["bf16x2_emulated"](jnp.asarray(a16), jnp.asarray(b), dims), ref16) < 2e-5
    # the GPU form (bf16 operands, fp32 accumulation) computes the same two products
    gpu = pallas_kda._DOTS["bf16x2"](jnp.asarray(a), jnp.asarray(b), dims)
    assert _rel(gpu, pallas_kda._DOTS["bf16x2_emulated"](jnp.asarray(a), jnp.asarray(b), dims)) < 1e-6


def test_gate_gradient_accuracy_with_the_gpu_products_modelled(x64, monkeypatch):
    """With the GPU's TF32 and bf16x3 rounding modelled (K3_PALLAS_EMULATE_TF32=1), the gate at its
    bound: the default three-pass strip products keep dg at the other gradients' error level, and one
    TF32 pass there (the old behaviour, 6.2e-3 against fla's 3.3e-3 on an H100) loses it by an order
    of magnitude; the other gradients do not depend on it. The two-pass 'bf16x2' keeps dg too, and
    'tf32_rounded' (one TF32 pass, the factors rounded first) keeps every gradient at the default's
    level. Both intermediate dtypes."""
    monkeypatch.setenv("K3_PALLAS_EMULATE_TF32", "1")
    args = _inputs(np.random.default_rng(11), 1, 77, 1, 128, 128, gate="bound")
    ro, _, rgrads = _reference(_rounded(args, jnp.bfloat16))
    for md, limit in (("float32", 2e-3), ("bfloat16", 3.5e-3)):
        errs = {}
        for name, tuning in (("default", None), ("tf32", dict(strip_precision="tf32")),
                             ("bf16x2", dict(strip_precision="bf16x2")),
                             ("tf32_rounded", dict(strip_precision="tf32_rounded"))):
            o, _, grads = _kernel(args, jnp.bfloat16, tuning=tuning, matmul_dtype=md)
            errs[name] = {n: _rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta"), grads, rgrads)}
        assert errs["default"]["g"] < limit and errs["tf32"]["g"] > 1e-2, (md, errs)
        assert errs["default"]["g"] < 1.1 * max(errs["default"][n] for n in "qkv"), (md, errs)
        # two passes with the pair matrices rounded once keep the cancellation (dg), not dq's last bits
        assert errs["bf16x2"]["g"] < min(limit, 1.1 * max(errs["bf16x2"][n] for n in "qkv")), (md, errs)
        # one TF32 pass on factors rounded beforehand: both sides of a pair see the same values
        rounded = errs["tf32_rounded"]
        assert rounded["g"] < min(limit, 1.1 * max(rounded[n] for n in "qkv")), (md, errs)
        assert all(rounded[n] < 1.05 * errs["default"][n] for n in ("q", "k", "v", "g", "beta")), (md, errs)
        assert all(abs(errs["tf32"][n] / errs["default"][n] - 1) < 0.05 for n in ("q", "k", "v")), (md, errs)


def test_bf16_values_reach_the_products_unrounded(x64, monkeypatch):
    """bf16 variant with the GPU's rounding modelled, no initial state, bf16 beta (as in training): u
    = T diag(beta) v keeps v exact and rounds T beta, so o and dq carry no extra rounding of beta v.
    Rounding beta v instead gives o 3.30e-3 and dq 3.39e-3 on these inputs, and 8-19% more error in
    dq, dk and dg at 1x1000x2x128 (BENCHMARKS.md)."""
    monkeypatch.setenv("K3_PALLAS_EMULATE_TF32", "1")
    q, k, v, g, beta, h0, do, dht = _inputs(np.random.default_rng(200), 1, 256, 2, 128, 128)
    beta = np.asarray(jnp.asarray(beta, jnp.bfloat16).astype(jnp.float32), np.float64)
    args = (q, k, v, g, beta, 0 * h0, do, 0 * dht)
    ro, _, rgrads = _reference(_rounded(args, jnp.bfloat16))
    o, _, grads = _kernel(args, jnp.bfloat16, matmul_dtype="bfloat16")
    errs = dict(o=_rel(o, ro), dq=_rel(grads[0], rgrads[0]), dk=_rel(grads[1], rgrads[1]))
    assert errs["o"] < 3.1e-3 and errs["dq"] < 3.2e-3 and errs["dk"] < 3.2e-3, errs


def test_backward_plan_by_key_dim():
    """The fused backward up to K = 64, 'split' above it (timed on an H100, `_backward_plan`), whatever
    the rows; `chunk_kda` takes that plan unless tuning names another."""
    plan = pallas_kda._backward_plan
    assert [plan(K) for K in (16, 64, 128, 256)] == ["fused", "fused", "split", "split"]
    for B in (1, 2):
        cfg, _ = pallas_kda._prepare(*_inputs(np.random.default_rng(0), B, 20, 1, 100, 32)[:5], scale=None,
                                     initial_state=None, segment_ids=None, interpret=True, chunk_size=16,
                                     lower_bound=LB, check_gate=False, matmul_dtype=None)
        assert cfg.backward == "split" and pallas_kda.with_overrides(cfg, backward="two").backward == "two"


def test_chain_value_block_gives_enough_programs():
    """The state chains' value block: the widest of 64 / 32 / 16 that gives at least 128 programs
    (rows x heads x V / block), else 16; never wider than V."""
    rule = pallas_kda._chain_value_block
    assert [rule(n, 128) for n in (128, 96, 64, 32, 16, 1)] == [64, 64, 64, 32, 16, 16]
    assert [rule(n, 64) for n in (128, 64, 1)] == [64, 32, 16]
    assert rule(1000, 16) == 16 and rule(1000, 32) == 32


def test_block_overrides_must_divide_the_padded_dims():
    cfg, _ = pallas_kda._prepare(*_inputs(np.random.default_rng(0), 1, 20, 1, 64, 32)[:5], scale=None,
                                 initial_state=None, segment_ids=None, interpret=True, chunk_size=16,
                                 lower_bound=LB, check_gate=False, matmul_dtype=None)
    assert pallas_kda.with_overrides(cfg, bp=16, bk=128).BP == 16
    for bad in (dict(bp=24), dict(bk=8), dict(bki=48), dict(bv=12), dict(bf=96)):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a power of two"):
            pallas_kda.with_overrides(cfg, **bad)
    with pytest.raises(ValueError, match="launch names unknown kernels \\['keys_fwd'\\]"):
        pallas_kda.with_overrides(cfg, launch=(("keys_fwd", 8, 1),))
    with pytest.raises(ValueError, match="strip_precision must be one of"):
        pallas_kda.with_overrides(cfg, strip_precision="fp16")
    with pytest.raises(ValueError, match="backward must be"):
        pallas_kda.with_overrides(cfg, backward="fast")
    with pytest.raises(ValueError, match="order must be one of"):
        pallas_kda.with_overrides(cfg, order="rows")


def test_without_initial_or_final_state(x64):
    q, k, v, g, beta, *_ = _inputs(np.random.default_rng(3), 2, 70, 2, 16, 16)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    o, ht = chunk_kda(*map(f32, (q, k, v, g, beta)))
    assert ht is None
    ro, _ = kda.recurrent_kda(*map(jnp.asarray, (q, k, v, g, beta)))
    assert _rel(o, ro) < 1e-5


def test_gate_below_bound_is_clamped_or_rejected(x64):
    q, k, v, g, beta, *_ = _inputs(np.random.default_rng(4), 1, 40, 2, 16, 16)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    low = g.copy()
    low[0, 5:9] = -12.0
    o, _ = chunk_kda(*map(f32, (q, k, v, low, beta)))
    ro, _ = kda.recurrent_kda(*map(jnp.asarray, (q, k, v, np.maximum(low, LB), beta)))
    assert _rel(o, ro) < 1e-5
    with pytest.raises(Exception, match="below lower_bound"):
        jax.block_until_ready(chunk_kda(*map(f32, (q, k, v, low, beta)), check_gate=True))
    # Within the bound, checked mode changes nothing.
    o_checked, _ = chunk_kda(*map(f32, (q, k, v, g, beta)), check_gate=True)
    np.testing.assert_array_equal(np.asarray(o_checked), np.asarray(chunk_kda(*map(f32, (q, k, v, g, beta)))[0]))


@pytest.mark.parametrize("backward", ["fused", "split"])
def test_gate_gradient_through_the_clamp_and_the_cumsum(x64, backward):
    """dg, formed inside the strip kernels (reverse cumsum of dGamma within each chunk, then the clamp's
    mask): equal to the float64 gradient through an inclusive clamp (gradient 1 on [lower_bound, 0]
    with both ends, where a saturated sigmoid puts g, and exactly 0 outside), T = 45 not a multiple of
    the chunk, K = 48 padded to 64; 'split' runs it in the key-blocked strip kernel."""
    rng = np.random.default_rng(21)
    q, k, v, g, beta, *_ = _inputs(rng, 1, 45, 2, 48, 32)
    g = g.copy()
    g[0, 3, 0, :5], g[0, 6, 1, :2] = -7.0, 0.25  # outside
    g[0, 4, 1, :3], g[0, 5, 0, :3] = LB, 0.0  # at the bounds
    do = rng.normal(size=v.shape)

    def loss(fn, g):
        o, _ = fn(q, k, v, g, beta)
        return jnp.sum(o * do)

    def kernel(q, k, v, g, beta):
        return chunk_kda(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)), chunk_size=16,
                         tuning=dict(backward=backward))

    def reference(q, k, v, g, beta):
        inside = (g >= LB) & (g <= 0.0)
        g = jnp.where(inside, g, jax.lax.stop_gradient(jnp.clip(g, LB, 0.0)))
        return kda.recurrent_kda(q, k, v, g, beta)

    dg = np.asarray(jax.grad(functools.partial(loss, kernel))(jnp.asarray(g, jnp.float32)), np.float64)
    rdg = np.asarray(jax.grad(functools.partial(loss, reference))(jnp.asarray(g)))
    outside = (g < LB) | (g > 0.0)
    assert np.all(dg[outside] == 0.0) and np.all(rdg[0, 4, 1, :3] != 0.0) and np.all(rdg[0, 5, 0, :3] != 0.0)
    assert _rel(dg, rdg) < 2e-5


@pytest.mark.parametrize("dtype, tol_fwd, tol_grad", [(jnp.float32, 1e-5, 1e-4), (jnp.bfloat16, 4e-3, 6e-3)])
def test_qk_l2norm_in_the_kernels_equals_normalising_first(x64, dtype, tol_fwd, tol_grad):
    """qk_l2norm=True on raw q, k (scaled far from unit norm, one all-zero key) against the float64
    recurrence on l2-normalised inputs, gradients taken w.r.t. the raw q, k; T = 37, K = 40 padded to
    64, packed documents. In bf16 the normalised q and k are rounded once more than the reference's
    (rounded raw inputs, normalised in float64), hence the looser bound."""
    rng = np.random.default_rng(31)
    args = list(_inputs(rng, 2, 37, 2, 40, 24))
    args[0] = 3.0 * rng.normal(size=args[0].shape)
    args[1] = 0.2 * rng.normal(size=args[1].shape)
    args[1][1, 5, 0] = 0.0
    seg = jnp.asarray(np.repeat([[1, 2], [4, 4]], [20, 17], axis=1), jnp.int32)
    o, ht, grads = _kernel(args, dtype, segment_ids=seg, qk_l2norm=True)
    rounded = [jnp.asarray(a) for a in _rounded(args, dtype)]

    def ref(q, k, *rest, **kw):
        return kda.recurrent_kda(kda.l2_normalize(q), kda.l2_normalize(k), *rest, segment_ids=seg, **kw)

    ro, rht, rgrads = _value_and_grads(ref, *rounded)
    errs = {"o": _rel(o, ro), "ht": _rel(ht, rht)}
    errs.update({f"d{n}": _rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "h0"), grads, rgrads)})
    assert errs["o"] < tol_fwd and errs["ht"] < tol_fwd, errs
    assert all(e < tol_grad for n, e in errs.items() if n.startswith("d")), errs


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_size=48), "chunk_size"),
    (dict(lower_bound=-20.0), "lower_bound"),
    (dict(lower_bound=0.0), "lower_bound"),
    (dict(matmul_dtype="float16"), "matmul_dtype"),
    (dict(tuning=dict(bq=16)), "unknown tuning keys \\['bq'\\]"),
    (dict(tuning=dict(bv=24)), "bv must be a power of two"),
])
def test_bad_arguments(kwargs, match):
    q, k, v, g, beta, *_ = (jnp.asarray(x, jnp.float32) for x in _inputs(np.random.default_rng(0), 1, 8, 2, 16, 16))
    with pytest.raises(ValueError, match=match):
        chunk_kda(q, k, v, g, beta, **kwargs)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda(q, k, v, g, beta[..., :1])


def test_tuning_changes_the_kernels_not_the_result(x64):
    """`chunk_kda(tuning=...)`: another backward plan, key, column and value blocks give the same
    output and gradients as the defaults (K = V = 128 takes the 'split' backward, the forward's pair
    sums in two key blocks of 64 and value blocks of 16 for one row and head by default; bf=128 sums
    them over the whole width, bv=64 walks the state in two value blocks, order='chunks' launches the
    chunk grids chunks-first)."""
    args = [np.asarray(np.asarray(x, np.float32), np.float64)
            for x in _inputs(np.random.default_rng(5), 1, 40, 1, 128, 128)]
    o0, ht0, g0 = _kernel(args, jnp.float32)
    o1, ht1, g1 = _kernel(args, jnp.float32, tuning=dict(backward="two", bk=32, bp=64, bv=64, bf=128,
                                                         order="chunks"))
    assert _rel(o1, o0) < 1e-6 and _rel(ht1, ht0) < 1e-6
    assert all(_rel(a, b) < 1e-5 for a, b in zip(g1, g0))


@pytest.mark.parametrize("backward", ["fused", "split", "two", "chain"])
def test_launch_order_changes_nothing_but_the_order(backward):
    """The chunk grids launched chunks-first (tuning order='chunks') instead of heads-first (the
    default): each program still reads and writes its own blocks, so output, final state and gradients
    are bit-identical (two rows, three heads, two key blocks per chunk, a ragged last chunk)."""
    args = _inputs(np.random.default_rng(17), 2, 45, 3, 64, 48)
    base = dict(backward=backward, bk=32, bki=32)
    o0, ht0, g0 = _kernel(args, jnp.bfloat16, tuning=base, qk_l2norm=True)
    o1, ht1, g1 = _kernel(args, jnp.bfloat16, tuning=dict(base, order="chunks"), qk_l2norm=True)
    for a, b in zip((o1, ht1, *g1), (o0, ht0, *g0)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert _rel(o0, np.zeros_like(o0)) > 0  # not a vacuous comparison of empty outputs


def _state_fwd_outputs(jaxpr):
    """Output shapes of the kda_state_fwd calls in a jaxpr (nested jaxprs included)."""
    return [[tuple(v.aval.shape) for v in eqn.outvars] for eqn in all_eqns(jaxpr)
            if "kda_state_fwd" in str(eqn.params.get("name", ""))]


def test_forward_without_backward_writes_no_states(x64):
    """The chain kernel forms o itself, so a forward that no backward follows never writes v_new or the
    per-chunk states [B, H, NT * V, K]; with a backward it does. Both give the same o and final state,
    bit for bit (two rows, a ragged last chunk, packed documents)."""
    q, k, v, g, beta, h0, do, dht = _inputs(np.random.default_rng(23), 2, 70, 2, 64, 48)
    seg = np.repeat(np.asarray([[0] * 30 + [1] * 40]), 2, axis=0)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(x, jnp.float32) for x in (g, beta, h0)]
    fn = functools.partial(chunk_kda, output_final_state=True, segment_ids=jnp.asarray(seg))

    def forward(q, k, v, g, beta, h0):
        return fn(q, k, v, g, beta, initial_state=h0)

    def loss(*a):
        o, ht = forward(*a)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(ht * dht), (o, ht)

    fwd_only = _state_fwd_outputs(jax.make_jaxpr(forward)(*args).jaxpr)
    with_bwd = _state_fwd_outputs(jax.make_jaxpr(jax.grad(loss, has_aux=True))(*args).jaxpr)
    NT, K, V = 3, 64, 64  # 70 tokens in chunks of 32; K and V padded to powers of two
    assert len(fwd_only) == 1 and len(with_bwd) == 1, (fwd_only, with_bwd)
    assert len(fwd_only[0]) == 2 and len(with_bwd[0]) == 4, (fwd_only, with_bwd)  # + v_new, states
    assert (2, 2, NT * V, K) not in fwd_only[0] and (2, 2, NT * V, K) in with_bwd[0], (fwd_only, with_bwd)
    o0, ht0 = jax.jit(forward)(*args)
    _, (o1, ht1) = jax.jit(jax.grad(loss, has_aux=True))(*args)
    np.testing.assert_array_equal(np.asarray(o0, np.float32), np.asarray(o1, np.float32))
    np.testing.assert_array_equal(np.asarray(ht0), np.asarray(ht1))
    assert _rel(o0, np.zeros_like(o0)) > 0


@pytest.mark.slow
def test_tiny_k3_same_loss_and_grads_with_pallas():
    """The whole model: KDA layers through the kernel give the reference's loss and gradients."""
    results = []
    tokens = jax.random.randint(jax.random.key(3), (2, 40), 0, 97)
    seg = jnp.concatenate([jnp.ones((2, 13), jnp.int32), jnp.full((2, 27), 2, jnp.int32)], axis=1)
    for impl in ("chunk", "pallas"):
        cfg = tiny_model_cfg(dtype="float32", **{"kda.impl": impl})
        model = Model(cfg, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(p):
            logits, _ = nnx.merge(graphdef, p, rest)(tokens, seg)
            return cross_entropy(logits[:, :-1], tokens[:, 1:])

        results.append(jax.jit(jax.value_and_grad(loss_fn))(params))
    (loss_ref, g_ref), (loss_pl, g_pl) = results
    assert abs(float(loss_ref) - float(loss_pl)) < 1e-5
    flat_ref, flat_pl = jax.tree.leaves(g_ref), jax.tree.leaves(g_pl)
    assert len(flat_ref) == len(flat_pl)
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(flat_ref, flat_pl))
    den = sum(float(jnp.sum(a ** 2)) for a in flat_ref)
    assert (num / den) ** 0.5 < 1e-4


@pytest.mark.parametrize("mesh", [dict(data=2, tensor=2), dict(context=4)])
def test_kda_layer_with_pallas_on_a_mesh_equals_one_device(mesh):
    """On a mesh the kernel runs per device under shard_map: batch and heads split, or the sequence
    split with the state pairs composed across devices."""
    import math

    from k3 import sharding
    from k3.kda.layer import KDA

    cfg = tiny_model_cfg(**{"kda.impl": "pallas"})
    x = jax.random.normal(jax.random.key(0), (4, 40, 32))
    seg = jnp.asarray(np.repeat([[0] * 15 + [1] * 25], 4, 0))
    ref = KDA(cfg, rngs=nnx.Rngs(0))(x, seg)
    sizes = {a: 1 for a in sharding.MESH_AXES} | mesh
    if jax.device_count() < math.prod(sizes.values()):
        pytest.skip(f"needs {math.prod(sizes.values())} devices (the CPU suite forces 8 host devices)")
    sh = sharding.Sharder(sharding.make_mesh(sizes, jax.devices()[:math.prod(sizes.values())]))
    out = jax.jit(lambda x, s: KDA(cfg, rngs=nnx.Rngs(0), sharder=sh)(x, s))(x, seg)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
