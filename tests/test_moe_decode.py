"""Decoding's routed experts (`k3.moe.layer.DECODE_EXPERTS`, `pallas_kernels.moe_decode`) against a
float64 per-route loop and the training backends: awkward sizes, bf16; the kernel is interpreted on a
CPU and compiled on a GPU (`pallas_kernels.common.default_interpret`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import greedy_step_logits, tiny_model_cfg
from k3.ffn import glu_parts_output
from k3.moe.layer import (ANY_ROUTES_DECODE, DECODE_EXPERTS, DROPLESS_DECODE_TOKENS, MoE, dense_experts,
                          gathered_experts, grouped_fused_routed_experts, grouped_routed_experts,
                          pallas_routed_experts)
from pallas_kernels.common import pow2_at_least_16
from pallas_kernels.moe_decode import (SLOT_MAX_ROUTES, check_slots, grouped_glu, grouped_glu_fused, routed_glu,
                                       routed_glu_supported)

BETAS = (4.0, 25.0)


def _weights(rng, E, D, F, scale=0.3):
    return (rng.normal(size=(E, D, F)) * scale, rng.normal(size=(E, D, F)) * scale, rng.normal(size=(E, F, D)) * scale)


def _loop64(x, experts, wg, wu, wd, kind):
    """Per route, in float64: act(x W_gate[e], x W_up[e]) W_down[e]."""
    out = []
    for xr, e in zip(np.asarray(x, np.float64), experts):
        g, u = xr @ wg[e], xr @ wu[e]
        h = np.asarray(glu_parts_output(jnp.asarray(g), jnp.asarray(u), kind=kind, beta_gate=BETAS[0],
                                        beta_up=BETAS[1]), np.float64)
        out.append(h @ wd[e])
    return np.stack(out)


@pytest.mark.parametrize("R,E,D,F,block_in,block_out", [(1, 5, 16, 16, 64, 128), (7, 3, 64, 32, 16, 16),
                                                          (12, 9, 32, 128, 32, 64)])
@pytest.mark.parametrize("kind", ["situ", "swiglu"])
def test_routed_glu_kernel_against_float64(R, E, D, F, block_in, block_out, kind, x64):
    rng = np.random.default_rng(R * 100 + E)
    x = rng.normal(size=(R, D))
    experts = rng.integers(0, E, R)
    experts[: R // 2] = E - 1  # routes sharing an expert
    wg, wu, wd = _weights(rng, E, D, F)
    act = functools.partial(glu_parts_output, kind=kind, beta_gate=BETAS[0], beta_up=BETAS[1])
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    want = _loop64(x, experts, wg, wu, wd, kind)
    for defer in (False, True):
        got = routed_glu(f32(x), jnp.asarray(experts), f32(wg), f32(wu), f32(wd), act=act, block_in=block_in,
                         block_out=block_out, defer_sum=defer)
        assert got.dtype == jnp.float32
        assert np.abs(np.asarray(got, np.float64) - want).max() <= 1e-5 * np.abs(want).max()
    # bf16 operands: fp32 accumulation, the hidden and the output rounded to bf16.
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    got16 = routed_glu(bf(x), jnp.asarray(experts), bf(wg), bf(wu), bf(wd), act=act)
    assert got16.dtype == jnp.bfloat16
    assert np.abs(np.asarray(got16, np.float64) - want).max() <= 2e-2 * np.abs(want).max()


def _distinct_routes(rng, N, k, E, skew):
    """[N, k] expert ids, distinct per token; with ``skew`` every token picks experts 0..k-1."""
    if skew:
        return np.tile(np.arange(k), (N, 1))
    return np.argsort(rng.uniform(size=(N, E)), axis=1)[:, :k]


@pytest.mark.parametrize("N,k,E,D,F,block_in,block_out,down,skew", [
    (1, 1, 3, 16, 16, 0, 128, 0, False),      # one token, one route
    (3, 2, 8, 32, 64, 16, 32, 16, False),      # N k < E; narrower down-projection programs
    (9, 4, 8, 64, 16, 32, 16, 32, False),      # N k >= E; wider ones
    (20, 3, 5, 16, 32, 0, 128, 0, True),       # every token on the same experts; N > 16 (M = 32)
    (70, 2, 8, 16, 128, 0, 0, 0, False),      # N > 64 (M = 128): 64-column programs by default
])
@pytest.mark.parametrize("kind", ["situ", "swiglu"])
@pytest.mark.parametrize("glu", [grouped_glu, grouped_glu_fused], ids=["two_kernels", "one_kernel"])
@pytest.mark.parametrize("slots", [False, True], ids=["by_expert", "by_slot"])
def test_grouped_glu_kernel_against_float64(N, k, E, D, F, block_in, block_out, down, skew, kind, glu, slots, x64):
    rng = np.random.default_rng(N * 100 + E)
    x = rng.normal(size=(N, D))
    idx = _distinct_routes(rng, N, k, E, skew)
    wg, wu, wd = _weights(rng, E, D, F)
    act = functools.partial(glu_parts_output, kind=kind, beta_gate=BETAS[0], beta_up=BETAS[1])
    want = _loop64(np.repeat(x, k, axis=0), idx.reshape(-1), wg, wu, wd, kind).reshape(N, k, D)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    if slots and pow2_at_least_16(N * k) > SLOT_MAX_ROUTES:  # past the slot grid's bound: refused
        with pytest.raises(ValueError, match="at most"):
            glu(f32(x), jnp.asarray(idx), f32(wg), f32(wu), f32(wd), act=act, slots=True)
        return
    got = glu(f32(x), jnp.asarray(idx), f32(wg), f32(wu), f32(wd), act=act, block_in=block_in,
              block_out=block_out, block_out_down=down, slots=slots)
    assert got.shape == (N, k, D) and got.dtype == jnp.float32
    assert np.abs(np.asarray(got, np.float64) - want).max() <= 1e-5 * np.abs(want).max()
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    got16 = glu(bf(x), jnp.asarray(idx), bf(wg), bf(wu), bf(wd), act=act, slots=slots)
    assert got16.dtype == jnp.bfloat16
    assert np.abs(np.asarray(got16, np.float64) - want).max() <= 2e-2 * np.abs(want).max()


@pytest.mark.parametrize("glu", [grouped_glu, grouped_glu_fused], ids=["two_kernels", "one_kernel"])
def test_slot_grid_with_repeated_and_few_experts_against_float64(glu, x64):
    """Slots hold the distinct experts in order of first appearance: tokens that share experts in
    other orders, fewer distinct experts than slots, and many experts none of the routes use."""
    rng = np.random.default_rng(7)
    N, k, E, D, F = 6, 3, 40, 32, 64
    idx = np.array([[5, 39, 0], [0, 5, 39], [12, 0, 7], [39, 12, 5], [7, 5, 0], [0, 12, 39]])
    x = rng.normal(size=(N, D))
    wg, wu, wd = _weights(rng, E, D, F)
    act = functools.partial(glu_parts_output, kind="situ", beta_gate=BETAS[0], beta_up=BETAS[1])
    want = _loop64(np.repeat(x, k, axis=0), idx.reshape(-1), wg, wu, wd, "situ").reshape(N, k, D)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    got = glu(f32(x), jnp.asarray(idx), f32(wg), f32(wu), f32(wd), act=act, slots=True)
    assert np.abs(np.asarray(got, np.float64) - want).max() <= 1e-5 * np.abs(want).max()


def test_slot_grid_bounds():
    """The slot grid is off by default and refused past SLOT_MAX_ROUTES padded routes, with the bound
    in the message."""
    assert check_slots(True, SLOT_MAX_ROUTES) and not check_slots(False, 4 * SLOT_MAX_ROUTES)
    with pytest.raises(ValueError, match=f"at most {SLOT_MAX_ROUTES} routes"):
        check_slots(True, 2 * SLOT_MAX_ROUTES)
    act = functools.partial(glu_parts_output, kind="situ", beta_gate=BETAS[0], beta_up=BETAS[1])
    w = jnp.zeros((96, 16, 16))
    with pytest.raises(ValueError, match="at most"):
        grouped_glu(jnp.zeros((40, 16)), jnp.zeros((40, 2), jnp.int32), w, w, w, act=act, slots=True)


def test_routed_glu_rejects_bad_shapes():
    act = functools.partial(glu_parts_output, kind="swiglu", beta_gate=4.0, beta_up=25.0)
    w = jnp.zeros((3, 24, 16))
    with pytest.raises(ValueError, match="powers of two"):
        routed_glu(jnp.zeros((2, 24)), jnp.zeros((2,), jnp.int32), w, w, jnp.zeros((3, 16, 24)), act=act,
                   interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        routed_glu(jnp.zeros((2, 16)), jnp.zeros((3,), jnp.int32), jnp.zeros((3, 16, 16)), jnp.zeros((3, 16, 16)),
                   jnp.zeros((3, 16, 16)), act=act, interpret=True)
    w16 = jnp.zeros((3, 16, 16))
    with pytest.raises(ValueError, match="powers of two"):
        grouped_glu(jnp.zeros((2, 24)), jnp.zeros((2, 1), jnp.int32), w, w, jnp.zeros((3, 16, 24)), act=act)
    with pytest.raises(ValueError, match="do not match"):  # idx for another number of tokens
        grouped_glu(jnp.zeros((2, 16)), jnp.zeros((3, 1), jnp.int32), w16, w16, w16, act=act)
    with pytest.raises(ValueError, match="do not match"):
        grouped_glu(jnp.zeros((2, 16)), jnp.zeros((2, 1), jnp.int32), w16, w16, jnp.zeros((3, 32, 16)), act=act)
    with pytest.raises(ValueError, match="powers of two"):
        grouped_glu_fused(jnp.zeros((2, 24)), jnp.zeros((2, 1), jnp.int32), w, w, jnp.zeros((3, 16, 24)), act=act)
    with pytest.raises(ValueError, match="do not match"):
        grouped_glu_fused(jnp.zeros((2, 16)), jnp.zeros((3, 1), jnp.int32), w16, w16, w16, act=act)


@pytest.mark.parametrize("D", [32, 24])  # 24: not a power of two, the Pallas entry takes the gather form
def test_decode_backends_equal_the_dense_reference(D):
    rng = np.random.default_rng(D)
    N, k, E, F = 3, 2, 8, 16
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, E, (N, k)))
    ws = [jnp.asarray(w, jnp.float32) for w in _weights(rng, E, D, F)]
    # fp32 matmuls in full: a GPU's default lets XLA's dots round their inputs (2e-3 apart from the
    # kernel's exact fp32 sums on an H100), which would measure the reference, not the backends.
    with jax.default_matmul_precision("float32"):
        ref, _ = dense_experts(x, idx, *ws, "situ", BETAS)
        for fn in (gathered_experts, pallas_routed_experts, grouped_routed_experts, grouped_fused_routed_experts):
            np.testing.assert_allclose(fn(x, idx, *ws, "situ", BETAS), ref, rtol=2e-5, atol=2e-5)
    assert DECODE_EXPERTS.resolve("auto", "gpu") == "grouped" and DECODE_EXPERTS.resolve("auto", "cpu") == "train"


def test_grouped_fused_backend_takes_the_two_kernel_form_past_its_token_bound(monkeypatch):
    """'grouped_fused' runs the one-kernel form up to FUSED_MAX_TOKENS tokens (whose default tiles
    compile without spills) and `grouped_glu` above; both equal the dense reference."""
    import pallas_kernels.moe_decode as md

    used = []
    for name in ("grouped_glu", "grouped_glu_fused"):
        inner = getattr(md, name)
        monkeypatch.setattr(md, name, lambda *a, _f=inner, _n=name, **kw: used.append(_n) or _f(*a, **kw))
    rng = np.random.default_rng(3)
    E, D, F, k = 8, 16, 32, 2
    ws = [jnp.asarray(w, jnp.float32) for w in _weights(rng, E, D, F)]
    for N in (md.FUSED_MAX_TOKENS, md.FUSED_MAX_TOKENS + 1):
        x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
        idx = jnp.asarray(_distinct_routes(rng, N, k, E, False))
        with jax.default_matmul_precision("float32"):
            ref, _ = dense_experts(x, idx, *ws, "situ", BETAS)
            np.testing.assert_allclose(grouped_fused_routed_experts(x, idx, *ws, "situ", BETAS), ref,
                                       rtol=2e-5, atol=2e-5)
    assert used == ["grouped_glu_fused", "grouped_glu"]


@pytest.mark.parametrize("impl", [pytest.param("gather", marks=pytest.mark.slow),
                                  pytest.param("pallas", marks=pytest.mark.slow), "grouped", "grouped_fused"])
def test_moe_decode_flag_uses_the_decode_backend_only_below_e_routes(impl):
    """A decoding call takes the decode backend with fewer routes than experts; the grouped ones also with more,
    up to DROPLESS_DECODE_TOKENS tokens, dropless (equal to the dense reference)."""
    cfg = tiny_model_cfg(**{"moe.decode_impl": impl})
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    calls = []
    inner = moe.decode_experts
    moe.decode_experts = lambda *a: calls.append(a[1].shape) or inner(*a)
    E, k = cfg.moe.n_experts, cfg.moe.top_k
    few = jax.random.normal(jax.random.key(1), (1, max(1, (E - 1) // k), cfg.d_model))
    y_dec, _ = moe(few, decode=True)
    y_train, _ = moe(few)
    np.testing.assert_allclose(y_dec, y_train, rtol=2e-5, atol=2e-5)
    many = jax.random.normal(jax.random.key(2), (2, E, cfg.d_model))
    y_many, st = moe(many, decode=True)  # N k >= E: the training backend, except for the grouped ones
    longer = jax.random.normal(jax.random.key(3), (1, DROPLESS_DECODE_TOKENS + 1, cfg.d_model))
    moe(longer, decode=True)  # past the dropless bound: the training backend for every impl
    width = cfg.moe.latent_dim or cfg.d_model
    assert routed_glu_supported(width, cfg.moe.expert_dim)  # so 'grouped' takes the call itself
    assert calls == [(few.shape[1], k)] + ([(2 * E, k)] if impl in ANY_ROUTES_DECODE else [])
    assert float(st["dropped"]) == 0
    moe.experts = dense_experts
    np.testing.assert_allclose(y_many, moe(many)[0], rtol=2e-5, atol=2e-5)


def test_decode_with_many_routes_is_dropless_under_capacity():
    """A decoding call with N k >= E (speculative verification) under the 'capacity' backend drops no
    route up to DROPLESS_DECODE_TOKENS tokens, even when every token picks the same experts, and equals
    the dense reference; the training call at the same tokens drops, and so does a longer decode call."""
    cfg = tiny_model_cfg(**{"moe.expert_impl": "capacity", "moe.decode_impl": "train", "moe.expert_capacity": 1.25})
    moe = MoE(cfg, rngs=nnx.Rngs(5))
    E, k = cfg.moe.n_experts, cfg.moe.top_k
    moe.router_bias[...] = jnp.zeros((E,), jnp.float32).at[:k].set(10.0)  # every token to experts 0..k-1
    n = max(E, 33)  # N k >= E, and N past the configured capacity's rows
    x = jax.random.normal(jax.random.key(6), (1, n, cfg.d_model))
    capacity_experts = moe.experts
    y_dec, st_dec = moe(x, decode=True)
    y_train, st_train = moe(x)
    assert float(st_dec["dropped"]) == 0 and float(st_train["dropped"]) > 0
    moe.experts = dense_experts
    y_ref, _ = moe(x)
    scale = float(np.abs(np.asarray(y_ref)).max())
    np.testing.assert_allclose(y_dec, y_ref, rtol=1e-4, atol=1e-4 * scale)
    assert np.abs(np.asarray(y_train) - np.asarray(y_ref)).max() > 0.1 * scale
    moe.experts = capacity_experts
    longer = jax.random.normal(jax.random.key(7), (1, DROPLESS_DECODE_TOKENS + 1, cfg.d_model))
    assert float(moe(longer, decode=True)[1]["dropped"]) > 0  # a prompt keeps the training capacity


def test_model_decode_with_routed_experts_equals_the_training_backend():
    """Greedy token-by-token decoding of a tiny K3 (latent MoE, SiTU) with 'gather', 'pallas' and
    'grouped' / 'grouped_fused' routed experts gives the logits of the training backend ('train')."""
    toks = jax.random.randint(jax.random.key(4), (2, 6), 0, 97)

    def run(impl):
        cfg = tiny_model_cfg(n_layers=5, first_k_dense=1, **{"moe.decode_impl": impl})
        return np.asarray(greedy_step_logits(cfg, toks, 16))

    want = run("train")
    for impl in ("gather", "pallas", "grouped", "grouped_fused"):
        np.testing.assert_allclose(run(impl), want, rtol=1e-4, atol=1e-4)
