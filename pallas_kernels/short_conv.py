"""KDA's short-convolution branch as one Pallas kernel forward and one backward.

The math is `k3.kda.layer.conv_branch_xla`'s (that function is the reference and the portable
backend): per channel c, with W taps and the current token last,
    pre_t = sum_i w[W-1-i] * m_i(t) * y_{t-i},    m_i(t) = [token t-i exists and shares t's document]
    a_t = silu(pre_t),    out_t = a_t * rsqrt(sum_{c in head} a_t^2 + eps)   (q and k; v stops at a)
and backward, from dout:
    da = r dout - a r^3 sum_head(a dout)        (just dout without the norm)
    dpre = da * sig(pre) (1 + pre (1 - sig(pre)))
    dy_s = sum_i w[W-1-i] m_i(s + i) dpre_{s+i},    dw[W-1-i] = sum_t m_i(t) y_{t-i} dpre_t.
XLA splits this into several fusions that write fp32 copies of y, pre and the shifted products of
every branch (8-45% of HBM bandwidth in the K3 1024:12 train step's profile). Here a program owns
a tile of ``block`` tokens by up to ``channels`` channels (whole heads; neighbouring programs take
the neighbouring channels of the same tokens, so together they read whole rows): the forward reads
y and writes the branch output; the backward walks ``steps`` such token blocks, reads y and dout,
writes dy and keeps the taps' gradient in registers, one partial row per tap and program summed by
XLA. A shifted tile is loaded at a row offset inside the kernel (the W-1 rows before a block come
again from cache, not from a copy); the backward recomputes pre at the W-1 rows after its block
instead of storing it.

Rows are the B*T tokens flattened; which earlier taps a token may see is one int32 of bits per
token (`tap_bits`, bit i-1: token t-i is in t's document), so rows of different sequences and
packed documents never mix.

Kernels (Pallas Triton; fp32 math):
    _fwd  grid (C / tile, N / block): y [N, C], bits [N], w [W, C] -> out [N, C]
    _bwd  grid (C / tile, N / (block steps)): y, bits, w, dout -> dy [N, C],
          dw partials [N / (block steps) * W, C]

Contract: block, steps, the channel tile and the head dim are powers of two, the tile a multiple
of the head dim and a divisor of C; N is any size (rows past it are masked). The same source runs
interpreted on a CPU and compiled on a GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import compute_dtype, default_interpret, triton_params

__all__ = ["conv_silu_pallas", "tap_bits"]


def tap_bits(segment_ids_BT: jax.Array | None, B: int, T: int, W: int) -> jax.Array:
    """[B*T] int32: bit i-1 set when token t-i (1 <= i < W) exists in t's row and shares its segment."""
    t = jnp.arange(T)
    bits = jnp.zeros((B, T), jnp.int32)
    for i in range(1, W):
        ok = jnp.broadcast_to(t >= i, (B, T))
        if segment_ids_BT is not None:
            seg = jnp.asarray(segment_ids_BT)
            prev = jnp.pad(seg, ((0, 0), (i, 0)), constant_values=-1)[:, :T]
            ok = ok & (prev == seg)
        bits = bits | (ok.astype(jnp.int32) << (i - 1))
    return bits.reshape(B * T)


def _tile_loader(N, BT, BC, slices):
    """Loads of [BT, BC] tiles at a row offset from token ``t0``, zero outside [0, N). ``slices``:
    rows addressed as a slice (compiled; masked lanes may point before row 0), else as a gathered
    index vector clipped into range (interpret mode, whose slices would clamp a negative start)."""
    c0 = pl.program_id(0) * BC
    cols = c0 + jnp.arange(BC)

    def rows_at(t0, off):
        r = t0 + off + jnp.arange(BT)
        ok = (r >= 0) & (r < N)
        return (pl.ds(t0 + off, BT) if slices else jnp.clip(r, 0, N - 1)), ok

    def tile(ref, t0, off, dt):
        r, ok = rows_at(t0, off)
        mask = jnp.broadcast_to(ok[:, None], (BT, BC))
        idx = (r, pl.ds(c0, BC)) if slices else (r[:, None], cols[None, :])
        return pltriton.load(ref.at[idx], mask=mask, other=0).astype(dt)

    def bits(ref, t0, off):
        r, ok = rows_at(t0, off)
        return pltriton.load(ref.at[r], mask=ok, other=0)

    def store(ref, t0, val):
        r = t0 + jnp.arange(BT)  # unclipped: rows past N are masked, never written twice
        mask = jnp.broadcast_to((r < N)[:, None], (BT, BC))
        idx = (pl.ds(t0, BT), pl.ds(c0, BC)) if slices else (r[:, None], cols[None, :])
        pltriton.store(ref.at[idx], val.astype(ref.dtype), mask=mask)

    return tile, bits, store


def _tap(bits, i):
    """[BT, 1] bool: may the token see its neighbour i back (i >= 1)."""
    return ((bits >> (i - 1)) & 1 == 1)[:, None]


def _pre(tile_y, bits_at, w, W, off):
    """Pre-activation at rows ``off`` from the block and their tap bits."""
    b = bits_at(off)
    acc = tile_y(off) * w[W - 1]
    for i in range(1, W):
        acc = acc + jnp.where(_tap(b, i), tile_y(off - i), 0.0) * w[W - 1 - i]
    return acc, b


def _head_sum(x, K):
    """[BT, BC] -> [BT, BC]: each channel replaced by the sum over its head's K channels."""
    BT, BC = x.shape
    if K == BC:
        return jnp.broadcast_to(jnp.sum(x, axis=1, keepdims=True), (BT, BC))
    s = jnp.sum(x.reshape(BT, BC // K, K), axis=2, keepdims=True)
    return jnp.broadcast_to(s, (BT, BC // K, K)).reshape(BT, BC)


def _weights(w_ref, W, BC, dt):
    c0 = pl.program_id(0) * BC
    return [w_ref[i, pl.ds(c0, BC)].astype(dt)[None, :] for i in range(W)]


def _fwd_kernel(y_ref, bits_ref, w_ref, out_ref, *, N, BT, BC, W, K, eps, dt, slices):
    tile, bits, store = _tile_loader(N, BT, BC, slices)
    w = _weights(w_ref, W, BC, dt)
    t0 = pl.program_id(1) * BT
    pre, _ = _pre(lambda o: tile(y_ref, t0, o, dt), lambda o: bits(bits_ref, t0, o), w, W, 0)
    a = pre * jax.nn.sigmoid(pre)
    if K:
        a = a * lax.rsqrt(_head_sum(a * a, K) + eps)
    store(out_ref, t0, a)


def _dpre_of(pre, d, K, eps):
    """dpre from the pre-activation and the branch output's cotangent d (through the norm when K)."""
    sig = jax.nn.sigmoid(pre)
    if K:
        a = pre * sig
        r = lax.rsqrt(_head_sum(a * a, K) + eps)
        d = r * d - a * (r * r * r * _head_sum(a * d, K))
    return d * sig * (1.0 + pre * (1.0 - sig))


def _add_tap_products(dw, y_at, b, dpre, W, dw_tiles):
    """dw[W-1-i] += m_i(t) y_{t-i} dpre_t for the block's rows t. ``dw_tiles``: whole [BT, BC]
    products carried, reduced over rows once after the loop (one cross-thread reduction per tap and
    program instead of one per step)."""
    dw = list(dw)
    for i in range(W):
        term = y_at(0) * dpre if i == 0 else jnp.where(_tap(b, i), y_at(-i), 0.0) * dpre
        dw[W - 1 - i] = dw[W - 1 - i] + (term if dw_tiles else jnp.sum(term, axis=0, keepdims=True))
    return tuple(dw)


def _walk_blocks(body, steps, BT, BC, W, dw_tiles, dt, dw_ref):
    """Runs ``body(step, dw)`` over the program's blocks and writes its partial row of each tap."""
    dw = lax.fori_loop(0, steps, body, tuple(jnp.zeros((BT if dw_tiles else 1, BC), dt) for _ in range(W)))
    c0 = pl.program_id(0) * BC
    for i in range(W):
        dw_ref[pl.program_id(1) * W + i, pl.ds(c0, BC)] = jnp.sum(dw[i], axis=0)


def _bwd_kernel(y_ref, bits_ref, w_ref, dout_ref, dy_ref, dw_ref, *, N, BT, BC, W, K, eps, dt, steps, slices,
                dw_tiles):
    tile, bits, store = _tile_loader(N, BT, BC, slices)
    w = _weights(w_ref, W, BC, dt)
    first = pl.program_id(1) * steps  # read outside the loop: interpret mode has no program id inside it

    def body(step, dw):
        t0 = (first + step) * BT
        ys = {}

        def tile_y(off):  # each shifted tile of y is loaded once per step
            if off not in ys:
                ys[off] = tile(y_ref, t0, off, dt)
            return ys[off]

        dy = None
        for j in range(W):  # dpre at the tokens j rows after each of the block's rows
            pre, b = _pre(tile_y, lambda o: bits(bits_ref, t0, o), w, W, j)
            dpre = _dpre_of(pre, tile(dout_ref, t0, j, dt), K, eps)  # dout is zero past N, so dpre is too
            if j == 0:
                dw = _add_tap_products(dw, tile_y, b, dpre, W, dw_tiles)
                dy = dpre * w[W - 1]
            else:
                dy = dy + jnp.where(_tap(b, j), dpre, 0.0) * w[W - 1 - j]
        store(dy_ref, t0, dy)
        return dw

    _walk_blocks(body, steps, BT, BC, W, dw_tiles, dt, dw_ref)


def _dpre_kernel(y_ref, bits_ref, w_ref, dout_ref, dpre_ref, *, N, BT, BC, W, K, eps, dt, slices):
    """The split backward's first pass: dpre for one [block, tile] tile (the forward's math plus the
    derivative of the norm and the SiLU), stored for the second pass to read at shifted rows."""
    tile, bits, store = _tile_loader(N, BT, BC, slices)
    w = _weights(w_ref, W, BC, dt)
    t0 = pl.program_id(1) * BT
    pre, _ = _pre(lambda o: tile(y_ref, t0, o, dt), lambda o: bits(bits_ref, t0, o), w, W, 0)
    store(dpre_ref, t0, _dpre_of(pre, tile(dout_ref, t0, 0, dt), K, eps))


def _dy_kernel(y_ref, bits_ref, w_ref, dpre_ref, dy_ref, dw_ref, *, N, BT, BC, W, dt, steps, slices, dw_tiles):
    """The split backward's second pass, linear in dpre: dy from dpre at the W-1 rows after each
    token, the taps' gradient from y at the W-1 rows before it; ``steps`` blocks a program."""
    tile, bits, store = _tile_loader(N, BT, BC, slices)
    w = _weights(w_ref, W, BC, dt)
    first = pl.program_id(1) * steps

    def body(step, dw):
        t0 = (first + step) * BT
        dpre = tile(dpre_ref, t0, 0, dt)
        dw = _add_tap_products(dw, lambda o: tile(y_ref, t0, o, dt), bits(bits_ref, t0, 0), dpre, W, dw_tiles)
        dy = dpre * w[W - 1]
        for j in range(1, W):
            dy = dy + jnp.where(_tap(bits(bits_ref, t0, j), j), tile(dpre_ref, t0, j, dt), 0.0) * w[W - 1 - j]
        store(dy_ref, t0, dy)
        return dw

    _walk_blocks(body, steps, BT, BC, W, dw_tiles, dt, dw_ref)


def _whole(shape):
    return pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))


def _forward(y_NC, bits_N, w_WC, cfg):
    K, eps, BC, block, steps, interpret, num_warps, slices, _, _ = cfg
    N, C = y_NC.shape
    W = w_WC.shape[0]
    dt = compute_dtype(y_NC)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, N=N, BT=block, BC=BC, W=W, K=K, eps=eps, dt=dt, slices=slices),
        grid=(C // BC, pl.cdiv(N, block)),
        in_specs=[_whole((N, C)), _whole((N,)), _whole((W, C))], out_specs=_whole((N, C)),
        out_shape=jax.ShapeDtypeStruct((N, C), y_NC.dtype),
        interpret=interpret, name="kda_short_conv_fwd",
        compiler_params=triton_params(interpret, num_warps, 1),
    )(y_NC, bits_N, w_WC.astype(dt))


def _backward(y_NC, bits_N, w_WC, dout_NC, cfg):
    K, eps, BC, block, steps, interpret, num_warps, slices, dw_tiles, split = cfg
    N, C = y_NC.shape
    W = w_WC.shape[0]
    dt = compute_dtype(y_NC)
    nb = pl.cdiv(N, block * steps)
    whole_in = [_whole((N, C)), _whole((N,)), _whole((W, C)), _whole((N, C))]
    params = triton_params(interpret, num_warps, 1)
    x_NC, walk, name = dout_NC, functools.partial(_bwd_kernel, K=K, eps=eps), "kda_short_conv_bwd"
    if split:
        # dpre in the compute dtype (fp32 for bf16 y): the second pass reads it at W row offsets (W
        # times against the cache), the first pass writes it once. Rounded to bf16 it cost the taps'
        # gradient, a sum over every token, 4x the error of the fused backward.
        x_NC = pl.pallas_call(
            functools.partial(_dpre_kernel, N=N, BT=block, BC=BC, W=W, K=K, eps=eps, dt=dt, slices=slices),
            grid=(C // BC, pl.cdiv(N, block)), in_specs=whole_in, out_specs=_whole((N, C)),
            out_shape=jax.ShapeDtypeStruct((N, C), dt),
            interpret=interpret, name="kda_short_conv_dpre", compiler_params=params,
        )(y_NC, bits_N, w_WC.astype(dt), dout_NC)
        walk, name = _dy_kernel, "kda_short_conv_dy"
    # A program walks ``steps`` token blocks, so the taps' gradient is one partial row per program.
    dy, dw = pl.pallas_call(
        functools.partial(walk, N=N, BT=block, BC=BC, W=W, dt=dt, steps=steps, slices=slices, dw_tiles=dw_tiles),
        grid=(C // BC, nb), in_specs=whole_in, out_specs=[_whole((N, C)), _whole((nb * W, C))],
        out_shape=[jax.ShapeDtypeStruct((N, C), y_NC.dtype), jax.ShapeDtypeStruct((nb * W, C), dt)],
        interpret=interpret, name=name, compiler_params=params,
    )(y_NC, bits_N, w_WC.astype(dt), x_NC)
    return dy, dw.reshape(nb, W, C).sum(axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv(y_NC, bits_N, w_WC, cfg):
    return _forward(y_NC, bits_N, w_WC, cfg)


def _conv_fwd(y_NC, bits_N, w_WC, cfg):
    return _forward(y_NC, bits_N, w_WC, cfg), (y_NC, bits_N, w_WC)


def _conv_bwd(cfg, res, dout_NC):
    y_NC, bits_N, w_WC = res
    dy, dw = _backward(y_NC, bits_N, w_WC, dout_NC, cfg)
    return dy, None, dw.astype(w_WC.dtype)


_conv.defvjp(_conv_fwd, _conv_bwd)


def conv_silu_pallas(y_BTC: jax.Array, w_WC: jax.Array, segment_ids_BT: jax.Array | None, head_dim: int,
                     eps: float = 1e-6, *, block: int = 8, channels: int = 64, steps: int = 32,
                     interpret: bool | None = None, num_warps: int = 4, row_slices: bool = True,
                     dw_tiles: bool = True, split_backward: bool = True) -> jax.Array:
    """`k3.kda.layer.conv_branch_xla` through the Pallas kernels: [B, T, C] in y's dtype.

    y: [B, T, C] projections; w: [W, C] taps (w[W-1] multiplies the current token); segment_ids:
    optional [B, T]; head_dim > 0: L2-normalise each group of head_dim channels after the SiLU (q and
    k), 0: no norm (v). Differentiable in y and w. A program takes ``block`` tokens (the backward:
    ``steps`` blocks in a loop, accumulating the taps' gradient) of a channel tile: the largest power
    of two dividing both C and ``channels`` (at least one head with the norm). Powers of two.
    ``row_slices``: compiled kernels address the shifted tiles as row slices (True) or as gathered
    row indices (False); interpret mode always gathers. ``dw_tiles``: the backward carries the taps'
    products as [block, tile] arrays through its loop and sums their rows once at the end (True), or
    sums them every step (False). ``split_backward``: the backward as two kernels, dpre written once
    in the compute dtype by the first and read at shifted rows by the second (True), or one kernel
    that recomputes dpre at each of the W row offsets (False). ``interpret=None``: compiled on a GPU,
    interpreted elsewhere.
    """
    B, T, C = y_BTC.shape
    W = w_WC.shape[0]
    if w_WC.shape != (W, C):
        raise ValueError(f"conv_silu_pallas: taps {w_WC.shape} need [W, C] with C = {C}")
    BC = math.gcd(C, max(channels, head_dim))
    for name, v in (("block", block), ("channel tile", BC), ("steps", steps), ("head dim", head_dim or 1)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"conv_silu_pallas: the {name} must be a power of two; got {v}")
    if head_dim and (C % head_dim or BC % head_dim):
        raise ValueError(f"conv_silu_pallas: the head dim {head_dim} must divide C = {C}")
    if segment_ids_BT is not None and jnp.shape(segment_ids_BT) != (B, T):
        raise ValueError(f"conv_silu_pallas: segment_ids {jnp.shape(segment_ids_BT)} must be [B, T] = {(B, T)}")
    interpret = default_interpret() if interpret is None else bool(interpret)
    cfg = (int(head_dim), float(eps), BC, block, steps, interpret, num_warps, bool(row_slices) and not interpret,
           bool(dw_tiles), bool(split_backward))
    out = _conv(y_BTC.reshape(B * T, C), tap_bits(segment_ids_BT, B, T, W), w_WC, cfg)
    return out.reshape(B, T, C)
