"""The one-token KDA decode step (`pallas_kernels.kda_decode`, `k3.kda.layer.DECODE_STEPS`) against a
float64 NumPy step and the layer's own decode path: awkward sizes, both gate kinds, the gate at its
bound, rows that are padding, bf16; interpreted on a CPU, compiled on a GPU
(`pallas_kernels.common.default_interpret`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_model_cfg
from k3 import decode
from k3.kda.layer import KDA
from k3.model import Model, served
from pallas_kernels.kda_decode import kda_decode_step


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _step64(y, z, convs, dtb, alog, onw, S, ring, n, beta_col, gate_col, bounded, lb=-5.0, eps=1e-6, l2eps=1e-6):
    """The step written out in float64, one head at a time: (o [B, H, K], state, ring)."""
    y, z, dtb, alog, onw, S, ring = (np.asarray(a, np.float64) for a in (y, z, dtb, alog, onw, S, ring))
    convs = [np.asarray(c, np.float64) for c in convs]
    B, H, K = y.shape[0], dtb.shape[0], dtb.shape[1]
    o, S_new, ring_new = np.zeros((B, H, K)), S.copy(), ring.copy()
    for b in range(B):
        live = n[b] > 0
        for h in range(H):
            qkv = []
            for j, w in enumerate(convs):
                cols = slice(j * H * K + h * K, j * H * K + (h + 1) * K)
                hist = np.concatenate([ring[b, :, cols], y[b, None, cols]])  # oldest first, new token last
                a = (hist * w[:, h * K:(h + 1) * K]).sum(0)
                qkv.append(a * _sig(a))
                if live:
                    ring_new[b, :, cols] = hist[1:]
            q, k, v = qkv
            q, k = q / np.sqrt(q @ q + l2eps), k / np.sqrt(k @ k + l2eps)
            zz = z[b, h * K:(h + 1) * K] + dtb[h]
            rate = np.exp(alog[h])
            g = lb * _sig(rate * zz) if bounded else -rate * np.logaddexp(zz, 0.0)
            beta = _sig(y[b, beta_col + h])
            if not live:
                g, beta = np.zeros(K), 0.0
            St = S[b, h] * np.exp(g)[:, None]
            St = St + beta * np.outer(k, v - k @ St)
            S_new[b, h] = St
            oh = (q * K ** -0.5) @ St
            oh = oh / np.sqrt(np.mean(oh * oh) + eps) * onw
            o[b, h] = oh * _sig(y[b, gate_col + h * K:gate_col + (h + 1) * K])
    return o, S_new, ring_new


def _inputs(rng, B, H, K, R, extra):
    C = 3 * H * K
    fa_col = C + extra  # the decay path's rank-K down-projection
    beta_col = fa_col + K + extra
    gate_col = beta_col + H + extra
    N = gate_col + H * K + extra
    f = lambda *s, scale=1.0: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    return dict(y=f(B, N), wfb=f(K, H * K, scale=K ** -0.5), convs=[f(R + 1, H * K, scale=0.5) for _ in range(3)],
                dtb=f(H, K), alog=f(H), onw=f(K), S=f(B, H, K, K), ring=f(B, R, C),
                n=(np.arange(B) % 3 != 1).astype(np.int32), fa_col=fa_col, beta_col=beta_col, gate_col=gate_col)


def _z(a, round_to=None):
    """z = fa w_fb [B, H K] in float64; with ``round_to`` (bf16) the weight and z rounded to it first and
    after, as the kernel and the layer's einsum do."""
    rnd = (lambda x: x) if round_to is None else (  # noqa: E731
        lambda x: np.asarray(jnp.asarray(x, round_to), np.float64))
    K = a["wfb"].shape[0]
    fa = np.asarray(a["y"], np.float64)[:, a["fa_col"]:a["fa_col"] + K]
    return rnd(fa @ rnd(np.asarray(a["wfb"], np.float64)))


def _run(a, gate_kind, dtype=jnp.float32):
    return kda_decode_step(jnp.asarray(a["y"], dtype), jnp.asarray(a["wfb"]),
                           *[jnp.asarray(c, dtype) for c in a["convs"]], a["dtb"], a["alog"], a["onw"], a["S"],
                           a["ring"], a["n"], fa_col=a["fa_col"], beta_col=a["beta_col"], gate_col=a["gate_col"],
                           gate_kind=gate_kind, out_dtype=jnp.float32)


@pytest.mark.parametrize("B,H,K,R,extra", [(1, 1, 16, 3, 0), (3, 2, 16, 1, 5), (5, 3, 32, 2, 7), (2, 4, 32, 3, 1)])
@pytest.mark.parametrize("gate_kind", ["bounded", "softplus"])
def test_kernel_against_float64(B, H, K, R, extra, gate_kind):
    a = _inputs(np.random.default_rng(B * 100 + H * 10 + K + R), B, H, K, R, extra)
    o, S, ring = _run(a, gate_kind)
    want = _step64(a["y"], _z(a), a["convs"], a["dtb"], a["alog"], a["onw"], a["S"], a["ring"], a["n"],
                   a["beta_col"], a["gate_col"], gate_kind == "bounded")
    for got, ref in zip((o, S, ring), want):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5)


def test_kernel_with_the_gate_at_its_bound_and_bf16_inputs():
    """z far past the sigmoid's knee puts g at the lower bound (-5 per token) for every channel; bf16
    projections go through the same fp32 math."""
    rng = np.random.default_rng(7)
    a = _inputs(rng, 4, 2, 16, 3, 3)
    a["y"][:, a["fa_col"]:a["fa_col"] + 16] = 1.0
    a["wfb"] = np.full_like(a["wfb"], 60.0 / 16)  # z = 60 exactly, in bf16 too
    a["alog"] = np.zeros_like(a["alog"])
    a["dtb"] = np.zeros_like(a["dtb"])
    assert np.all(_z(a) == 60.0)
    o, S, _ = _run(a, "bounded")
    want = _step64(a["y"], _z(a), a["convs"], a["dtb"], a["alog"], a["onw"], a["S"], a["ring"], a["n"],
                   a["beta_col"], a["gate_col"], True)
    np.testing.assert_allclose(np.asarray(S), want[1], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(o), want[0], rtol=2e-5, atol=2e-5)
    bf = {k: (np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32) if k == "y" else v) for k, v in a.items()}
    bf["convs"] = [np.asarray(jnp.asarray(c, jnp.bfloat16), np.float32) for c in a["convs"]]
    o16, S16, _ = _run(a, "bounded", jnp.bfloat16)
    want16 = _step64(bf["y"], _z(bf, jnp.bfloat16), bf["convs"], bf["dtb"], bf["alog"], bf["onw"], bf["S"],
                     bf["ring"], bf["n"], bf["beta_col"], bf["gate_col"], True)
    np.testing.assert_allclose(np.asarray(S16), want16[1], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(o16), want16[0], rtol=2e-5, atol=2e-5)


def test_kernel_rejects_bad_shapes_and_head_dims():
    a = _inputs(np.random.default_rng(0), 2, 2, 16, 3, 0)
    with pytest.raises(ValueError, match="ring"):
        kda_decode_step(a["y"], a["wfb"], *a["convs"], a["dtb"], a["alog"], a["onw"], a["S"], a["ring"][:, :2],
                        a["n"], fa_col=a["fa_col"], beta_col=a["beta_col"], gate_col=a["gate_col"])
    with pytest.raises(ValueError, match="gate_col"):
        kda_decode_step(a["y"], a["wfb"], *a["convs"], a["dtb"], a["alog"], a["onw"], a["S"], a["ring"], a["n"],
                        fa_col=a["fa_col"], beta_col=a["beta_col"], gate_col=a["y"].shape[1])
    with pytest.raises(ValueError, match="fa_col"):  # fa's K columns past y's end
        kda_decode_step(a["y"], a["wfb"], *a["convs"], a["dtb"], a["alog"], a["onw"], a["S"], a["ring"], a["n"],
                        fa_col=a["y"].shape[1] - 8, beta_col=a["beta_col"], gate_col=a["gate_col"])
    with pytest.raises(ValueError, match="w_fb"):  # an up-projection for other heads
        kda_decode_step(a["y"], a["wfb"][:, :16], *a["convs"], a["dtb"], a["alog"], a["onw"], a["S"], a["ring"],
                        a["n"], fa_col=a["fa_col"], beta_col=a["beta_col"], gate_col=a["gate_col"])
    with pytest.raises(ValueError, match="gate_kind"):
        kda_decode_step(a["y"], a["wfb"], *a["convs"], a["dtb"], a["alog"], a["onw"], a["S"], a["ring"], a["n"],
                        fa_col=a["fa_col"], beta_col=a["beta_col"], gate_col=a["gate_col"], gate_kind="relu")
    b = _inputs(np.random.default_rng(0), 2, 2, 8, 3, 0)
    with pytest.raises(ValueError, match="head_dim 8"):
        kda_decode_step(b["y"], b["wfb"], *b["convs"], b["dtb"], b["alog"], b["onw"], b["S"], b["ring"], b["n"],
                        fa_col=b["fa_col"], beta_col=b["beta_col"], gate_col=b["gate_col"])


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("fused", [False, True])
def test_layer_decode_step_equals_the_layers_own_path(gate, fused):
    """`KDA.extend` one token at a time with 'pallas' equals 'xla' over several steps (a padding row
    included), in the training layout and the served one (fused input projections)."""
    def layer(impl):
        cfg = tiny_model_cfg(**{"kda.head_dim": 16, "kda.n_heads": 3, "kda.gate": gate, "kda.decode_impl": impl})
        cfg.dtype = "float32"
        m = KDA(cfg, rngs=nnx.Rngs(5))
        if fused:
            m.fuse_inputs()
        return m

    ref, fast = layer("xla"), layer("pallas")
    assert ref.decode_step is None and fast.decode_step is not None
    x = jax.random.normal(jax.random.key(1), (3, 5, 32))
    n = jnp.array([1, 0, 1])
    caches = [m.init_cache(3) for m in (ref, fast)]
    caches = [{k: v + 0.1 * jax.random.normal(jax.random.key(2), v.shape) for k, v in c.items()} for c in caches]
    for t in range(5):
        outs = []
        for i, m in enumerate((ref, fast)):
            y, caches[i] = m.extend(x[:, t:t + 1], caches[i], jnp.zeros(3, jnp.int32), n)
            outs.append(y)
        np.testing.assert_allclose(np.asarray(outs[1])[n > 0], np.asarray(outs[0])[n > 0], rtol=2e-4, atol=2e-5)
        for k in ("state", "conv"):
            np.testing.assert_allclose(np.asarray(caches[1][k]), np.asarray(caches[0][k]), rtol=2e-4, atol=2e-5)


def test_served_model_decodes_the_same_tokens_with_the_kernel():
    """Greedy decoding of a tiny served K3 after a prompt: 'pallas' steps give 'xla's logits."""
    def run(impl):
        cfg = tiny_model_cfg(n_layers=5, **{"kda.head_dim": 16, "kda.decode_impl": impl})
        model = served(Model(cfg, rngs=nnx.Rngs(3)))
        ext = jax.jit(lambda t, c: decode.extend(model, t, c))
        toks = jax.random.randint(jax.random.key(4), (2, 9), 0, 97)
        lg, cache = ext(toks[:, :4], decode.init_cache(model, 2, 16))  # the prompt: the general path
        out = [lg[:, -1:]]
        for i in range(4, 9):
            lg, cache = ext(toks[:, i:i + 1], cache)
            out.append(lg)
        return np.asarray(jnp.concatenate(out, axis=1))

    np.testing.assert_allclose(run("pallas"), run("xla"), rtol=1e-4, atol=1e-4)
