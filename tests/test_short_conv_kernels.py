"""KDA's conv-branch kernels (`pallas_kernels.short_conv`; interpreted on a CPU, compiled on a GPU)
against a float64 reference written from the formula, the jnp backend `k3.kda.layer.conv_branch_xla`,
and the KDA layer on a CPU mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from conftest import tiny_model_cfg
from k3.kda import layer as kda_layer
from k3.sharding import Sharder
from pallas_kernels.short_conv import conv_silu_pallas


def conv_plain(y_BTC, w_WC, seg_BT, head_dim, eps=1e-6):
    """out[b, t] = silu(sum_i w[W-1-i] y[b, t-i] [t-i >= 0, same segment]), per-head L2 norm when
    head_dim: one gather per tap, masks from numpy."""
    B, T, C = y_BTC.shape
    W = w_WC.shape[0]
    seg = np.ones((B, T), np.int64) if seg_BT is None else np.asarray(seg_BT)
    pre = 0.0
    for i in range(W):
        src = np.maximum(np.arange(T) - i, 0)
        ok = (np.arange(T) >= i)[None, :] & (seg[:, src] == seg)
        pre = pre + jnp.where(ok[..., None], y_BTC[:, src], 0.0) * w_WC[W - 1 - i]
    a = pre * jax.nn.sigmoid(pre)
    if head_dim:
        a4 = a.reshape(B, T, C // head_dim, head_dim)
        a = (a4 / jnp.sqrt(jnp.sum(a4 * a4, -1, keepdims=True) + eps)).reshape(B, T, C)
    return a


def _inputs(seed, B, T, C, dtype, docs=3):
    rng = np.random.default_rng(seed)
    y = jnp.asarray(rng.standard_normal((B, T, C)) * 2.0, dtype)
    w = jnp.asarray(rng.standard_normal((4, C)), jnp.float32 if dtype == jnp.bfloat16 else dtype)
    seg = jnp.asarray(np.sort(rng.integers(0, docs, (B, T)), axis=1), jnp.int32)
    dout = jnp.asarray(rng.standard_normal((B, T, C)), dtype)
    return y, w, seg, dout


@pytest.mark.parametrize("B,T,C,head_dim,kw", [
    (2, 37, 64, 32, dict(block=8, channels=64, steps=2)),    # tokens not a multiple of a block, two heads a tile
    (1, 1, 32, 0, dict(block=8, channels=32, steps=1)),      # one token, no norm (v)
    (3, 20, 64, 16, dict(block=4, channels=16, steps=4)),    # a tile of one head, several documents a row
    (2, 45, 128, 0, {}),                                     # the defaults: two channel tiles
    (2, 37, 64, 32, dict(block=8, channels=64, steps=2, dw_tiles=False)),  # taps' gradient summed every step
    (3, 20, 64, 16, dict(block=4, channels=16, steps=4, dw_tiles=False)),
    (2, 37, 64, 32, dict(block=8, channels=64, steps=2, split_backward=False)),  # backward in one kernel
    (1, 1, 32, 0, dict(block=8, channels=32, steps=1, split_backward=False)),
    (3, 20, 64, 16, dict(block=4, channels=16, steps=4, dw_tiles=False, split_backward=False)),
])
def test_kernels_match_float64_reference(x64, B, T, C, head_dim, kw):
    """Output and the gradients of y and the taps, in float64, against autodiff of `conv_plain`."""
    y, w, seg, dout = _inputs(B * 100 + T, B, T, C, jnp.float64)
    got, got_vjp = jax.vjp(lambda y, w: conv_silu_pallas(y, w, seg, head_dim, **kw), y, w)
    want, want_vjp = jax.vjp(lambda y, w: conv_plain(y, w, seg, head_dim), y, w)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("y", "w"), got_vjp(dout), want_vjp(dout)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-11, err_msg=name)


def test_no_segments_and_a_row_start_never_see_the_previous_row(x64):
    """Without segment ids every row starts afresh: row 1's first token ignores row 0's last ones."""
    y, w, _, _ = _inputs(3, 2, 5, 16, jnp.float64)
    got = conv_silu_pallas(y, w, None, 0, block=4, channels=16)
    np.testing.assert_allclose(got, conv_plain(y, w, None, 0), rtol=1e-12, atol=1e-12)
    alone = conv_silu_pallas(y[1:], w, None, 0, block=4, channels=16)
    np.testing.assert_allclose(got[1:], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("head_dim,split", [(32, True), (0, True), (32, False)])
def test_kernels_bf16_match_jnp_backend(head_dim, split):
    """bf16 projections as in training: kernels and `conv_branch_xla` agree to bf16 rounding, and the
    gradients keep their inputs' dtypes."""
    y, w, seg, dout = _inputs(7, 2, 40, 64, jnp.bfloat16)
    got, got_vjp = jax.vjp(lambda y, w: conv_silu_pallas(y, w, seg, head_dim, split_backward=split), y, w)
    want, want_vjp = jax.vjp(lambda y, w: kda_layer.conv_branch_xla(y, w, seg, head_dim), y, w)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    for name, a, b in zip(("y", "w"), got_vjp(dout), want_vjp(dout)):
        assert a.dtype == b.dtype, name
        scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2,
                                   atol=1e-2 * scale, err_msg=name)


@pytest.mark.parametrize("head_dim", [32, 0])
def test_bf16_backward_errors_against_float64(x64, head_dim):
    """With bf16 inputs over many tokens, each backward's error against float64 math on the same
    (rounded) inputs: the two-pass backward keeps dpre in fp32 between its kernels, so its error
    stays within 1.5x the one-kernel backward's (the taps' gradient sums every token's dpre)."""
    y, w, seg, dout = _inputs(11, 2, 512, 64, jnp.bfloat16)
    up = lambda a: a.astype(jnp.float64)  # noqa: E731
    _, want_vjp = jax.vjp(lambda y, w: conv_plain(y, w, seg, head_dim), up(y), up(w))
    want = want_vjp(up(dout))
    errs = {}
    for split in (True, False):
        _, vjp = jax.vjp(lambda y, w: conv_silu_pallas(y, w, seg, head_dim, split_backward=split), y, w)
        errs[split] = [float(jnp.max(jnp.abs(up(a) - b)) / jnp.max(jnp.abs(b))) for a, b in zip(vjp(dout), want)]
    for i, name in enumerate(("y", "w")):
        assert errs[True][i] <= 1.5 * errs[False][i] + 1e-6, (name, errs)


def test_odd_head_dim_uses_the_reference_and_bad_shapes_fail():
    """The 'pallas' backend runs `conv_branch_xla` at a head dim the tiles cannot take; the kernels
    themselves refuse it and mismatched shapes, with errors that name the problem."""
    y, w, seg, _ = _inputs(9, 1, 6, 24, jnp.float32)
    np.testing.assert_allclose(kda_layer.CONV_BACKENDS.get("pallas")(y, w, seg, 12),
                               kda_layer.conv_branch_xla(y, w, seg, 12), rtol=1e-6)
    with pytest.raises(ValueError, match="head dim must be a power of two; got 12"):
        conv_silu_pallas(y, w, seg, 12)
    with pytest.raises(ValueError, match="taps"):
        conv_silu_pallas(y, w[:, :8], seg, 0)
    with pytest.raises(ValueError, match="segment_ids"):
        conv_silu_pallas(y, w, seg[:, :3], 0)
    with pytest.raises(ValueError, match="block must be a power of two"):
        conv_silu_pallas(y, w, seg, 8, block=6)


@pytest.mark.parametrize("axes", [("data", "fsdp", "tensor"), ("data", "context", "tensor")])
def test_kda_layer_on_a_mesh_equals_one_device(axes):
    """The KDA layer with the kernels on an 8-device CPU mesh (heads over tensor; with context the
    layer keeps XLA's conv, whose halo crosses devices) against the xla backend on one device:
    output and every parameter's gradient."""
    cfg = tiny_model_cfg(**{"kda.n_heads": 4, "kda.head_dim": 8, "dtype": "float32"})
    sharder = Sharder(Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), axes))
    layers = []
    for impl, sh in (("xla", None), ("pallas", sharder)):
        cfg.kda.conv_impl = impl
        layers.append(kda_layer.KDA(cfg, rngs=nnx.Rngs(0), sharder=sh))
    x = jax.random.normal(jax.random.key(2), (4, 16, cfg.d_model), jnp.float32)
    seg = jnp.asarray(np.repeat(np.array([[1] * 6 + [2] * 10]), 4, 0), jnp.int32)

    r = jax.random.normal(jax.random.key(3), (4, 16, cfg.d_model), jnp.float32)

    def out_and_grads(layer):
        graphdef, params = nnx.split(layer)

        def loss(params):
            out = nnx.merge(graphdef, params)(x, seg)
            return jnp.sum(out * r), out

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    ((_, o1), g1), ((_, o2), g2) = out_and_grads(layers[0]), out_and_grads(layers[1])
    np.testing.assert_allclose(o2, o1, rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))))
