"""Chunked Kimi Delta Attention in Pallas: forward and backward kernels for a lower-bounded gate.

Math (per row b, head h; fla's conventions, see `k3.kda.ops`): within a chunk of C tokens with
Gamma = cumsum(g) (chunk-local, fp32) and tokens i, j of the same document,

    Aqk[i, j] = scale * sum_d q_id k_jd exp(Gamma_id - Gamma_jd)    (j <= i)
    L[i, j]   = beta_i * sum_d k_id k_jd exp(Gamma_id - Gamma_jd)   (j < i)
    T = (I + L)^-1,  w = T (beta k exp(Gamma)),  u = T (beta v)
    v_new = u - w S,  o = (scale q exp(Gamma)) S + Aqk v_new
    S <- Diag(exp(Gamma_last)) S + (k exp(Gamma_last - Gamma))^T v_new

Why the lower bound matters. Aqk and L need exp(Gamma_i - Gamma_j) as a matmul, i.e. split into a
row factor exp(Gamma_i - mu) and a column factor exp(mu - Gamma_j) around a reference mu. Over a
whole 64-token chunk the factors overflow; around the middle token of a 16-token row strip they
cannot when g >= -5: inside the strip |Gamma - mu| <= 8 * 5 = 40 nats, and every earlier column has
mu - Gamma_j <= 0 (only underflow, where the true product is negligible too). So each row strip of
Aqk and L is ONE dense matmul [16, K] x [K, C] against all columns, with the column factor zeroed
past the strip. There is no element-wise pairwise-decay path. The kernel accepts -10 <= lower_bound
< 0 (40 -> 80 nats, still finite in fp32) and clamps g into [lower_bound, 0]; an unbounded (softplus)
gate must use the reference path (`k3.kda.ops.kda_core` does this).

Kernels (each one `pallas_call`; grids over chunks are parallel, grids over value blocks walk the
chunks in a `fori_loop` with the fp32 state in registers, loading chunk n + 1 before storing chunk n):

    prologue  _gate_fwd    (NT, H, B)        Gamma = chunk-local cumsum of g clamped into [lower_bound, 0]
              _l2norm_fwd  (NT, H, B)        qk_l2norm only: q, k normalised, their inverse norms kept
    forward   _intra_fwd   (NT, H, B)        Aqk, L by row strips; T strip by strip from T = I - L T
                                             with 16 x 16 Neumann inverses; w, u; decayed qg, kg
              _state_fwd   (V/BV, H, B)      the state chain: v_new, o = qg S_in + Aqk v_new, per-chunk states
    backward  _state_bwd   (V/BV, H, B)      reverse chain: dh per chunk, dv_new, d initial state
              _chunk_bwd   (NT, H, B)        K <= 64: the rest, one program per chunk: dv, dL = -T^T dT T^T
                                             and dAqk over the whole chunk (dT summed over key blocks of
                                             BK), then per key block the terms through the states and,
                                             by row strips, dq, dk, dGamma; dbeta over all keys
              or, K > 64, the same in three kernels ('split' in `_BACKWARDS`):
              _inter_bwd   (NT, K/BKI, H, B) the terms through the states (dq, dk, dGamma parts; dw)
              _pairs_bwd   (NT, H, B)        whole-chunk: dv, dbeta (values), dL = -T^T dT T^T, dAqk
              _intra_bwd   (NT, K/BK, H, B)  by row strips: the rest of dq, dk, dGamma, dbeta (keys)
              or in two ('two'): _pairs_bwd with the states instead of dw, and _keys_bwd
              (NT, K/BK, H, B), the state and strip terms of one key block in one program
              or ('chain') the reverse chain forms the terms through the states per value block
              in place of dh, and _pairs_bwd and _intra_bwd add the value blocks' parts
              The kernel that completes dGamma turns it into dg (reverse cumsum, clamp mask).
    epilogue  _l2norm_bwd  (NT, H, B)        qk_l2norm only: dq, dk (fp32 from the kernels) through the norm

Every kernel loads its operands before its first store: Triton cannot hoist a load above a store to
another pointer, so interleaving them exposes each load's latency (this, with 4 warps, took the
forward+backward from 16.9 to 9.5 ms at 8 x 4096 x 16 x 128; BENCHMARKS.md).

Padding and the masks for packed documents are plain XLA around a `custom_vjp` core; the gate's
clamp and cumsum and the q/k norms are kernels inside it (as XLA fusions they took 1.7 of 9.8 ms of
device time at 8x4096x16x128 on an H100).

Document boundaries (`segment_ids`) are masks inside the kernels: pairs of tokens from different
documents are zeroed in Aqk and L (T is then block diagonal over documents), tokens of a document
that starts inside a chunk do not see the incoming state, and only the chunk's last document writes
the outgoing state. T need not be a multiple of C: padding with k = v = beta = g = 0 leaves the state
unchanged.

Backend. The GPU path is the Pallas Triton lowering: it lowers `dot_general` with 16-row operands
and equal power-of-two splits of register arrays (`jnp.split`), which is all the strip structure
needs, and the same kernel source runs in interpret mode on the CPU (JAX 0.10.2) and compiled on the
H200 (JAX 0.11.2). Mosaic GPU, the backend JAX recommends, has no `dot_general` lowering; its wgmma
needs M % 64 == 0 and its Python API changes between the two JAX versions this code must support,
so a Mosaic GPU variant would be a second kernel that the CPU tests cannot interpret.

Precision: gates, Gamma, the state and every accumulator are fp32. With fp32 inputs every matmul is
full fp32 (HIGHEST). With bf16 inputs the pair matrices, the inverses and their backward take fp32
operands that the GPU runs as TF32, and the large matmuls take either TF32 operands with fp32
intermediates (`matmul_dtype='float32'`) or bf16 operands and bf16 storage of the intermediates
(`matmul_dtype='bfloat16'`, the default for 16-bit inputs and what the bf16 model uses). The
backward's strip products, whose dGamma sums cancel, run in three bf16 passes ('bf16x3',
`_Cfg.strip_precision`). Measured against fla
on identical bf16 inputs (BENCHMARKS.md): o differs by 2.3e-3, the gradients by 2.8e-3 to 5.8e-3.
Interpret mode computes fp32 products exactly; with K3_PALLAS_EMULATE_TF32=1 it rounds their operands
as the GPU's TF32 and bf16x3 products do, so the CPU reproduces the GPU's errors (the gate gradient's
6.6e-3 with single-pass TF32 strips against 6.2e-3 measured on an H100).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels.common import (KDA_INPUTS, KDA_RESIDUALS, default_interpret, document_index, pow2_at_least_16,
                                    triton_params)
from pallas_kernels.kda_inputs import validate_kda_inputs

__all__ = ["chunk_kda"]

_SUB = 16  # rows of a strip: the unit of the pair matmuls inside a chunk
_CHUNKS = (16, 32, 64)
_MIN_LOWER_BOUND = -10.0  # 8 tokens * 10 nats = 80 < log(float32 max) = 88.7
_L2_EPS = 1e-6  # `k3.kda.ops.l2_normalize`'s default, for qk_l2norm


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static configuration shared by the kernels (hashable: it is a custom_vjp nondiff argument)."""

    C: int  # chunk
    K: int  # padded key dim
    V: int  # padded value dim
    BV: int  # value block of the sequential kernels
    BK: int  # key block of the backward's strip part (fused: a static loop inside the program)
    NT: int  # chunks per row
    scale: float
    mm_dtype: str  # operand and storage dtype of the large matmuls: 'bfloat16' or 'float32'
    h_dtype: str  # storage of the per-chunk states and their gradients
    interpret: bool
    exact: bool  # full-fp32 matmuls; otherwise fp32 operands may run as TF32 on the GPU
    launch: tuple = ()  # ((kernel, warps, stages), ...) overriding _LAUNCH
    backward: str = "fused"  # `_BACKWARDS` entry: the reverse chain and the kernels after it
    BKI: int = 0  # key block of the split backward's inter-chunk kernel (0: BK)
    BP: int = 0  # column block of the pairs backward kernel (0: the whole min(K, V))
    BF: int = 0  # key block of the forward's pair sums (0: the whole K)
    emulate_tf32: bool = False  # interpret mode: round fp32 operands as the GPU's tensor-core products do
    # The backward's strip products (dq, dk, dGamma through the pair factors), a `_DOTS` key. One TF32
    # pass there doubles dg's error against the float64 recurrence (H100 at 8x4096x16x128: 6.2e-3 vs
    # fla's 3.3e-3; under `K3_PALLAS_EMULATE_TF32=1` on the CPU: 6.6e-3), since dGamma sums products of
    # e^{+-Gamma}-rescaled factors that cancel. Three bf16 passes bring it to the other gradients' level
    # (2.4e-3 emulated), as three TF32 passes do, with half the tensor-core work of the latter.
    # 'bf16x2' rounds the pair matrices (dAqk, beta dL) once and splits the factors: dg keeps its level
    # (the rounded pair enters both sides of every cancelling pair), dq, dk and dg lose about 15%
    # (1x1000x2x128 emulated: dq 2.87e-3 -> 3.31e-3, over fla's 3.22e-3 at 8x4096x16x128 on an H100),
    # and `kda_intra_bwd` takes 2.38 ms against 2.98 (same H100 and shape): a speed knob, not the default.
    # 'tf32_rounded' rounds the factors to TF32 before one TF32 pass (`strip_factors`): the cancelling
    # pairs then meet identical values on both sides. Emulated at 1x1000x2x128, bf16 variant, seeds 0
    # and 1: dq 2.87e-3 / 2.94e-3, dg 2.92e-3 / 3.00e-3, as bf16x3's 2.87e-3 / 2.92e-3 and 2.90e-3 /
    # 2.97e-3 (plain 'tf32': dg 6.79e-3 / 6.62e-3). On an H100 at 8x4096x16x128 its errors equal the
    # default's to 1e-5 and `kda_intra_bwd` takes 2.905 ms against 2.979 (whole pass 0.2-1.8% faster at
    # three shapes); not yet timed at 1x65536x32x128, so not yet the default.
    strip_precision: str = "bf16x3"
    lower_bound: float = -5.0  # g is clamped into [lower_bound, 0] inside `_gate_fwd_kernel`
    qk_l2norm: bool = False  # q and k arrive raw and are L2-normalised by `_l2norm_fwd_kernel`
    order: str = "heads"  # `_GRID_ORDERS` entry: the chunk grids' fastest-varying index

    def __post_init__(self):
        if not self.BKI:
            object.__setattr__(self, "BKI", self.BK)
        if not self.BP:
            object.__setattr__(self, "BP", min(self.K, self.V))
        if not self.BF:
            object.__setattr__(self, "BF", self.K)

    def launch_of(self, name):
        base = dict(_LAUNCH, **(_LAUNCH_SMALL_K if self.K <= _SMALL_K else {}))
        return dict(base, **{n: (w, s) for n, w, s in self.launch})[name]

    @property
    def dqk_dtype(self):
        """dq and dk leave the strip kernels in fp32 when the L2 norm's backward still follows, so they
        are rounded once; otherwise in the inputs' dtype."""
        return jnp.float32 if self.qk_l2norm or self.exact else jnp.bfloat16

    @property
    def md(self):
        return jnp.dtype(self.mm_dtype)

    @property
    def prec_mm(self):
        return self._prec("tf32")

    @property
    def prec_tile(self):
        return self._prec("tf32")

    @property
    def prec_strip(self):
        return self._prec(_STRIP_DOTS.get(self.strip_precision, self.strip_precision))

    def strip_factors(self, *factors):
        """The strip products' decay-rescaled factors (kc, rq, rk), as every product and every
        elementwise use of them must see them: for 'tf32_rounded', rounded to TF32 once, so the
        product that carries a pair's contribution to dGamma_i and the one that carries its negative
        to dGamma_j multiply the same values and cancel, though each runs as one TF32 pass."""
        if self.strip_precision != "tf32_rounded" or self.prec_strip == "exact":
            return factors
        return tuple(_round_tf32(x) for x in factors)

    def _prec(self, fast):
        """A product's precision, a `_DOTS` key: 'exact' for fp32 inputs, else `fast` (a GPU form),
        with its rounding modelled on the operands in interpret mode when emulate_tf32 is set."""
        if self.exact or (self.interpret and not self.emulate_tf32):
            return "exact"  # the interpreter's fp32 products are exact
        return fast + "_emulated" if self.interpret else fast


# Triton (num_warps, num_stages) per kernel. The chain kernels hold one [BV, K] state and walk the
# chunks; the chunk kernels hold a chunk's [C, K] operands and [C, C] pair matrices.
# Measured on the H200 at chunk 32 (BENCHMARKS.md): 4 warps beat 8 for every kernel; pipelining the
# chains (stages 2) did not pay, as their next chunk's loads are already issued ahead by hand.
_LAUNCH = {"intra_fwd": (4, 1), "state_fwd": (4, 1), "state_bwd": (4, 1),
           "chunk_bwd": (4, 1), "inter_bwd": (4, 1), "pairs_bwd": (4, 1), "intra_bwd": (4, 1),
           "pairs_h_bwd": (4, 1), "keys_bwd": (4, 1), "gate_fwd": (4, 1), "l2norm_fwd": (4, 1),
           "l2norm_bwd": (4, 1), "state_terms_bwd": (8, 1)}
# The reverse chain that also forms the terms through the states ('chain' backward) holds this chunk's
# S_in, k and Gamma besides the state: at K = V = 128, value block 64, chunk 32, bf16, ptxas (sm_90,
# `compile_report`) spills 848 B per thread with 4 warps and 24 B with 8. Even so it took 2.47 ms on an
# H100 at 8x4096x16x128 where the plain chain and `kda_inter_bwd` took 1.74 together.
# Head dims up to _SMALL_K leave a 4-warp program mostly idle on its [C, K] tiles. Measured on the
# H200 at 8x4096x32x32, chunk 32, bf16 (pallas_kernels/results/bench_kda_split_h200_k32_warps.json):
# chunk_bwd 3.94 ms with 4 warps, 2.84 with 2, 4.19 with 1; intra_fwd 1.18 / 1.13 / 0.94; the state
# chains stayed best at 4.
_SMALL_K = 32
_LAUNCH_SMALL_K = {"intra_fwd": (1, 1), "chunk_bwd": (2, 1)}


def _round_tf32(x):
    """fp32 -> the nearest TF32 value (10 explicit mantissa bits, ties away from zero), as fp32."""
    if x.dtype != jnp.float32:
        return x
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type((bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000), jnp.float32)


def _round_bf16(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def _dot_tf32_emulated(a, b, dims):
    return _dot_exact(_round_tf32(a), _round_tf32(b), dims)


def _three_pass_emulated(rounding):
    """The three-pass product on the parts of each fp32 operand that ``rounding`` keeps:
    hi*lo + lo*hi + hi*hi, smallest first, as the GPU's TF32x3 and BF16x3 products sum them."""
    def dot(a, b, dims):
        a_hi, b_hi = rounding(a), rounding(b)
        a_lo, b_lo = rounding(a - a_hi), rounding(b - b_hi)
        return _dot_exact(a_hi, b_lo, dims) + _dot_exact(a_lo, b_hi, dims) + _dot_exact(a_hi, b_hi, dims)
    return dot


def _dot_with(precision):
    return lambda a, b, dims: lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                                              preferred_element_type=jnp.float32)


_dot_exact = _dot_with(lax.Precision.HIGHEST)


def _two_pass(cast, dot):
    """a rounded once, b split into its high and low parts: a_hi b_lo + a_hi b_hi, two passes. Used
    where a is a pair matrix (dA, dP) that meets the same rounded values in every product it enters,
    so the pair's +/- contributions to dGamma still cancel exactly; b (the decay-rescaled factors,
    which differ between the two sides of a pair) keeps about 16 bits."""
    def f(a, b, dims):
        a_hi, b_hi = cast(a), cast(b)
        b_lo = cast(b - b_hi.astype(jnp.float32))
        return dot(a_hi, b_lo, dims) + dot(a_hi, b_hi, dims)
    return f


# A product's precision (`_Cfg._prec`) -> how to run it. On the GPU 'tf32' is one tensor-core pass on
# TF32-rounded fp32 operands (about 3 decimal digits), 'tf32x3' three passes (about fp32's accuracy) and
# 'bf16x3' three bf16 passes on each operand's bf16 high and low parts (about 5 digits, bf16 tensor cores
# at twice TF32's rate); bf16 operands are exact in all three. 'bf16x2' (`_two_pass`) rounds the first
# operand to bf16 and splits only the second. The interpreter computes fp32 products exactly unless the
# '_emulated' forms model the rounding.
_DOTS = {"exact": _dot_exact, "tf32": _dot_with(lax.Precision.DEFAULT),
         "tf32x3": _dot_with(lax.DotAlgorithmPreset.TF32_TF32_F32_X3),
         "bf16x3": _dot_with(lax.DotAlgorithmPreset.BF16_BF16_F32_X3),
         "tf32_emulated": _dot_tf32_emulated, "tf32x3_emulated": _three_pass_emulated(_round_tf32),
         "bf16x3_emulated": _three_pass_emulated(_round_bf16),
         "bf16x2": _two_pass(lambda x: x.astype(jnp.bfloat16), _dot_with(lax.Precision.DEFAULT)),
         "bf16x2_emulated": _two_pass(_round_bf16, _dot_exact)}


def _mm(a, b, prec):
    """[M, K] @ [K, N] -> [M, N] fp32; ``prec`` a `_DOTS` key."""
    return _DOTS[prec](a, b, ((1,), (0,)))


def _mm_nt(a, b, prec):
    """[M, K] @ [N, K]^T -> [M, N] fp32."""
    return _DOTS[prec](a, b, ((1,), (1,)))


def _mm_tn(a, b, prec):
    """[K, M]^T @ [K, N] -> [M, N] fp32."""
    return _DOTS[prec](a, b, ((0,), (0,)))


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _neumann_inverse(L, eye, prec):
    """(I + L)^-1 of a strictly lower 16 x 16 tile: (I - L)(I + L^2)(I + L^4)(I + L^8), exact as L^16 = 0."""
    P = eye - L
    X = _mm(L, L, prec)
    for i in range(3):
        P = P + _mm(P, X, prec)
        if i < 2:
            X = _mm(X, X, prec)
    return P


def _strip(G_ref, r, C, keys=slice(None)):
    """Decay factors of row strip r (tokens 16r..16r+15) against every column of the chunk, around
    the strip's middle token mu: the row factor e^{Gamma_i - mu} [16, K] and the column factor
    e^{mu - Gamma_j} [C, K], zero for the columns j >= 16(r + 1) that no row of the strip sees.
    ``keys`` selects a block of key channels (every channel is independent).

    Inside the strip |Gamma - mu| <= 8 |lower_bound| (finite for lower_bound >= -10); earlier columns
    have mu - Gamma_j <= 0, so nothing overflows and one matmul gives the whole strip of pairs.
    """
    mu = G_ref[pl.ds(r * _SUB + _SUB // 2, 1), keys]
    row_f = jnp.exp(G_ref[pl.ds(r * _SUB, _SUB), keys] - mu)
    live = _iota((C, 1), 0) < (r + 1) * _SUB
    col_f = jnp.exp(jnp.where(live, mu - G_ref[:, keys], -jnp.inf))
    return row_f, col_f


def _row_tiles(x, nb, axis=0):
    """[C, ...] -> nb tiles of 16 along ``axis`` (an equal power-of-two split, which Triton lowers)."""
    return [x] if nb == 1 else jnp.split(x, nb, axis=axis)


def _last_decay(G_ref, mf_ref, n, C):
    """[1, K] decay of the state over chunk n; the old state survives the chunk only if the chunk's
    last token still belongs to its document."""
    last = pl.ds(n * C + C - 1, 1)
    return jnp.exp(G_ref[last, :]) * mf_ref[last][None, :]


def _total(ref, cols=slice(None)):
    """ref[:, cols] in fp32 for a [C, BK] or [1, BK] block; a ref that also has a leading axis of
    value-block parts (the reverse chain that forms the state terms writes one per value block) is
    summed over it."""
    if len(ref.shape) == 2:
        return ref[:, cols].astype(jnp.float32)
    return functools.reduce(jnp.add, [ref[p, :, cols].astype(jnp.float32) for p in range(ref.shape[0])])


# ----------------------------------------------------------------------------------------------------
# Element-wise prologue and epilogue: the gate's clamp and chunk-local cumsum, the L2 norm of q and k.
# As XLA fusions around the core they cost 1.7 of 9.8 ms of device time at 8x4096x16x128 (H100
# profile, BENCHMARKS.md): XLA lowers the cumsum to a log-depth scan over strided slices and splits
# the norm's backward into four passes over [T, K].
# ----------------------------------------------------------------------------------------------------


def _gate_fwd_kernel(g_ref, G_ref, *, cfg: _Cfg):
    """One chunk and head: Gamma [C, K] = cumsum over the chunk of g [C, K] clamped into
    [lower_bound, 0]."""
    G_ref[...] = jnp.cumsum(jnp.minimum(jnp.maximum(g_ref[...], cfg.lower_bound), 0.0), axis=0)


def _gate_masks(cfg, g_ref, nb, keys=slice(None)):
    """Per row tile r of the chunk: whether g [16, BK] lies in [lower_bound, 0], both ends included (g
    sits exactly at the bound wherever the gate's sigmoid saturates); the clamp passes the gradient
    there and stops it outside."""
    tiles = (g_ref[pl.ds(r * _SUB, _SUB), keys] for r in range(nb))
    return [(g >= cfg.lower_bound) & (g <= 0.0) for g in tiles]


def _gate_grads(dG_tiles):
    """Gamma = cumsum(clamp(g)) within the chunk, so dg_t = sum_{s >= t} dGamma_s where g is inside the
    clamp's range (`_gate_masks`), else 0. Triton lowers only the forward cumsum, so the reverse one is
    a tile's total minus its inclusive prefix plus the element, plus the totals of the tiles below.
    Yields (r, f) for the row tiles of one chunk, last first, where f(inside_r) gives dg_r [16, BK] from
    the complete dGamma tiles. The caller stores tile r's other outputs first, then f's: K = 128, chunk
    32, bf16, sm_90, `kda_intra_bwd` spills 508 B per thread so, 704 B with dg formed before the store
    of dq and dk, 692 B with every tile's dg formed before the first store."""
    totals = [jnp.sum(d, axis=0, keepdims=True) for d in dG_tiles]
    below = 0.0
    for r in reversed(range(len(dG_tiles))):
        d, total, after = dG_tiles[r], totals[r], below
        yield r, lambda inside, d=d, total=total, after=after: jnp.where(
            inside, total - jnp.cumsum(d, axis=0) + d + after, 0.0)
        below = below + total


def _l2norm_fwd_kernel(x_ref, y_ref, r_ref, *, cfg: _Cfg):
    """One chunk and head: y = x r [C, K] with r = (sum_d x_d^2 + eps)^-1/2 [C] (fp32, kept for the
    backward), as `k3.kda.ops.l2_normalize`."""
    x = x_ref[...].astype(jnp.float32)
    r = lax.rsqrt(jnp.sum(x * x, axis=1) + _L2_EPS)
    y_ref[...] = (x * r[:, None]).astype(y_ref.dtype)
    r_ref[...] = r


def _l2norm_bwd_kernel(y_ref, r_ref, dy_ref, dx_ref, *, cfg: _Cfg):
    """One chunk and head: dx = r (dy - y <dy, y>) [C, K] from the stored y (the gradient of x r with
    r = (|x|^2 + eps)^-1/2, written in y = x r)."""
    y, dy = y_ref[...].astype(jnp.float32), dy_ref[...].astype(jnp.float32)
    proj = jnp.sum(dy * y, axis=1)[:, None]
    dx_ref[...] = (r_ref[...][:, None] * (dy - y * proj)).astype(dx_ref.dtype)


# ----------------------------------------------------------------------------------------------------
# Forward kernels. Each loads its inputs before its first store: a load that follows a store to
# another block cannot be hoisted above it, and its latency then serialises the kernel.
# ----------------------------------------------------------------------------------------------------


def _intra_fwd_kernel(q_ref, k_ref, v_ref, G_ref, beta_ref, doc_ref, mf_ref, ml_ref,
                      w_ref, u_ref, aqk_ref, t_ref, qg_ref, kg_ref, *, cfg: _Cfg):
    """One chunk: Aqk [C, C], T = (I + L)^-1 [C, C], w [C, K], u [C, V], and the decayed queries
    qg = scale q e^Gamma and keys kg = k e^{Gamma_last - Gamma} [C, K] that the state kernels use."""
    C, nb, md, pt, pm = cfg.C, cfg.C // _SUB, cfg.md, cfg.prec_tile, cfg.prec_mm
    f32 = jnp.float32
    k = k_ref[...].astype(f32)
    doc = doc_ref[...]
    col = _iota((_SUB, C), 1)
    A, L = [], []
    # Key channels are independent in the pair sums: blocks of BF bound the live [C, BF] factors (at
    # K = 128, chunk 32, bf16 the whole width spills 592 B per thread and blocks of 64 none, by
    # `compile_report` for sm_90; see _FWD_PAIR_BLOCK for the timing).
    bk = cfg.BF
    blocks = [slice(None)] if bk == cfg.K else [pl.ds(j * bk, bk) for j in range(cfg.K // bk)]
    for r in range(nb):
        rows = pl.ds(r * _SUB, _SUB)
        qk = kk = 0.0
        for blk in blocks:
            row_f, col_f = _strip(G_ref, r, C, blk)
            kc = (k if len(blocks) == 1 else k_ref[:, blk].astype(f32)) * col_f
            qk = qk + _mm_nt(q_ref[rows, blk].astype(f32) * row_f, kc, pt)
            kk = kk + _mm_nt(k_ref[rows, blk].astype(f32) * row_f, kc, pt)
        row = _iota((_SUB, C), 0) + r * _SUB
        same = doc_ref[rows][:, None] == doc[None, :]
        A.append(jnp.where((col <= row) & same, cfg.scale * qk, 0.0))
        L.append(jnp.where((col < row) & same, beta_ref[rows].astype(f32)[:, None] * kk, 0.0))

    G = G_ref[...]
    beta = beta_ref[...].astype(f32)[:, None]
    mf, ml = mf_ref[...][:, None], ml_ref[...][:, None]
    eG = jnp.exp(G)
    kb = (beta * mf * k * eG).astype(md)
    # u = T diag(beta) v with beta folded into T's columns, not into v: v arrives exact in md, so the
    # product's operands carry T's rounding only. Rounding beta v instead was the largest error of
    # the bf16 variant's gradients (emulated GPU rounding on the CPU, 1x1000x2x128: dq 3.19e-3
    # against 2.87e-3 this way, o 4.17e-3 against 3.91e-3; BENCHMARKS.md).
    vm = v_ref[...].astype(md)
    beta_cols = beta_ref[...].astype(f32)[None, :]

    # Row strips of T from T = I - L T: (I + L_rr) T_r = I_r - sum_{s<r} L_rs T_s, then the strips
    # of w = T kb and u = (T diag(beta)) v. Tiles of a strip come from an equal split (no selection matmuls).
    eye = (_iota((_SUB, _SUB), 0) == _iota((_SUB, _SUB), 1)).astype(f32)
    T, w, u = [], [], []
    for r in range(nb):
        L_r = _row_tiles(L[r], nb, axis=1)  # tiles L_rs [16, 16]
        rhs = (col == _iota((_SUB, C), 0) + r * _SUB).astype(f32)
        for s_ in range(r):
            rhs = rhs - _mm(L_r[s_], T[s_], pt)
        T_r = _mm(_neumann_inverse(L_r[r], eye, pt), rhs, pt)
        T.append(T_r)
        w.append(_mm(T_r.astype(md), kb, pm))
        u.append(_mm((T_r * beta_cols).astype(md), vm, pm))
    qg = cfg.scale * q_ref[...].astype(f32) * eG * mf
    kg = k * jnp.exp(G_ref[pl.ds(C - 1, 1), :] - G) * ml

    for r in range(nb):
        rows = pl.ds(r * _SUB, _SUB)
        aqk_ref[rows, :] = A[r].astype(aqk_ref.dtype)
        t_ref[rows, :] = T[r]
        w_ref[rows, :] = w[r].astype(w_ref.dtype)
        u_ref[rows, :] = u[r].astype(u_ref.dtype)
    qg_ref[...] = qg.astype(qg_ref.dtype)
    kg_ref[...] = kg.astype(kg_ref.dtype)


def _state_fwd_kernel(kg_ref, G_ref, w_ref, u_ref, mf_ref, h0_ref, qg_ref, aqk_ref, o_ref, *out_refs,
                      cfg: _Cfg, keep_states: bool):
    """One (row, head, value block): the chunk chain and the output, four matmuls a step. The state
    is kept transposed, St = S^T [BV, K]. Per chunk: v_new = u - w S_in, o = qg S_in + Aqk v_new,
    S_out = decay S_in + kg^T v_new; only the last feeds the next step, so the output's two products
    sit off the chain's critical path, and S_in goes from registers into o instead of through memory
    to a separate output kernel. With keep_states v_new and the state entering each chunk are saved
    for the backward (out_refs: v_new, h, then the final state; else the final state only). Chunk
    n + 1's operands are loaded before chunk n's stores, so their latency overlaps the step."""
    C, md, pm, NT = cfg.C, cfg.md, cfg.prec_mm, cfg.NT
    vn_ref, h_ref, ht_ref = out_refs if keep_states else (None, None, *out_refs)
    j = pl.program_id(0)

    def load(n):
        rows = pl.ds(n * C, C)
        return (w_ref[rows, :], u_ref[rows, :], kg_ref[rows, :], qg_ref[rows, :], aqk_ref[rows, :],
                _last_decay(G_ref, mf_ref, n, C))

    def body(n, carry):
        St, (w, u, kg, qg, aqk, decay) = carry
        nxt = load(jnp.minimum(n + 1, NT - 1))
        Sm = St.astype(md)
        if keep_states:
            h_ref[pl.ds(n * cfg.V + j * cfg.BV, cfg.BV), :] = Sm.astype(h_ref.dtype)
        vn = (u.astype(jnp.float32) - _mm_nt(w, Sm, pm)).astype(md)
        rows = pl.ds(n * C, C)
        if keep_states:
            vn_ref[rows, :] = vn.astype(vn_ref.dtype)
        o_ref[rows, :] = (_mm_nt(qg, Sm, pm) + _mm(aqk, vn, pm)).astype(o_ref.dtype)
        return St * decay + _mm_tn(vn, kg, pm), nxt

    St, _ = lax.fori_loop(0, NT, body, (h0_ref[...].astype(jnp.float32), load(0)))
    ht_ref[...] = St


# ----------------------------------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------------------------------


def _state_bwd_kernel(qg_ref, kg_ref, G_ref, w_ref, aqk_ref, do_ref, mf_ref, dht_ref, *refs, cfg: _Cfg,
                      terms: bool):
    """Reverse chunk chain: dv_new, d initial state, and either dh_n (the gradient of the state
    leaving chunk n) for the kernels after the chain, or (terms) this value block's part of the terms
    through the states, formed from dS_out while it is in registers: dq0, dk0, dw [C, K] and dGamma's
    last-row term [1, K] per chunk (`_state_terms`; they are sums over the value channels, so each
    value block writes its own slab and the readers add them, `_total`). With terms, refs starts with
    the inputs h (S_in^T per chunk), v_new, k and ml. As in the forward chain, the next chunk's operands
    are loaded before this chunk's stores."""
    C, md, pm, NT, f32 = cfg.C, cfg.md, cfg.prec_mm, cfg.NT, jnp.float32
    j = pl.program_id(0)
    if terms:
        h_ref, vn_ref, k_ref, ml_ref, dvn_ref, dh0_ref, dq0_ref, dk0_ref, dw_ref, dge_ref = refs
    else:
        dh_ref, dvn_ref, dh0_ref = refs

    def load(n):
        rows = pl.ds(n * C, C)
        return (qg_ref[rows, :], kg_ref[rows, :], w_ref[rows, :], aqk_ref[rows, :], do_ref[rows, :].astype(md),
                _last_decay(G_ref, mf_ref, n, C))

    def body(i, carry):
        dSt, (qg, kg, w, aqk, dO, decay) = carry
        n = NT - 1 - i
        nxt = load(jnp.maximum(n - 1, 0))
        rows = pl.ds(n * C, C)
        if terms:  # this chunk's operands of the terms, loaded here: carried ahead they would spill
            h, vn = h_ref[pl.ds(n * cfg.V + j * cfg.BV, cfg.BV), :], vn_ref[rows, :].astype(md)
            k, G, G_end = k_ref[rows, :].astype(f32), G_ref[rows, :], G_ref[pl.ds(n * C + C - 1, 1), :]
            mf, ml = mf_ref[rows], ml_ref[rows]
        dSm = dSt.astype(md)
        if not terms:
            dh_ref[pl.ds(n * cfg.V + j * cfg.BV, cfg.BV), :] = dSm.astype(dh_ref.dtype)
        dvn = _mm_tn(aqk, dO, pm) + _mm_nt(kg, dSm, pm)
        dvn_ref[rows, :] = dvn
        if terms:  # off the chain's critical path: nothing below feeds the next step
            Sh = h.astype(md)
            dq0 = cfg.scale * jnp.exp(G) * mf[:, None] * _mm(dO, Sh, pm)
            dk0 = jnp.exp(G_end - G) * ml[:, None] * _mm(vn, dSm, pm)
            dd = jnp.sum(h.astype(f32) * dSt, axis=0)[None, :]
            dq0_ref[rows, :] = dq0
            dk0_ref[rows, :] = dk0
            dw_ref[rows, :] = (-_mm(dvn.astype(md), Sh, pm)).astype(dw_ref.dtype)
            dge_ref[pl.ds(n, 1), :] = decay * dd + jnp.sum(k * dk0, axis=0)[None, :]
        return dSt * decay + _mm_tn(dO, qg, pm) - _mm_tn(dvn.astype(md), w, pm), nxt

    dSt, _ = lax.fori_loop(0, NT, body, (dht_ref[...].astype(f32), load(NT - 1)))
    dh0_ref[...] = dSt


def _chunk_bwd_kernel(q_ref, k_ref, v_ref, G_ref, g_ref, beta_ref, doc_ref, mf_ref, ml_ref, t_ref, h_ref,
                      dh_ref, do_ref, vn_ref, dvn_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref,
                      *, cfg: _Cfg):
    """One chunk and head: everything of the backward that follows the state chain.

    1. Whole chunk (no strip factors): from dv_new back through u = T (beta v) to dv and the value
       part of dbeta; dw = -dv_new S_in^T per key block and dT = dv_new (beta v)^T + dw kb^T summed
       over the key blocks; dL = -T^T dT T^T and dAqk (both masked to the pairs that exist).
    2. Per key block [C, BK] (every term is per key channel): the terms through the states
       (o = qg S_in, S_out = decay S_in + kg^T v_new, v_new = u - w S_in), then dkb = T^T dw and,
       by row strips, dL and dAqk back through the factorisation of `_strip`. Per strip r with
       P = (x_r row_f) (k col_f)^T: d(x_r) = row_f (dP kc), d(k) = col_f (dP^T xr),
       dGamma_r += xr (dP kc), dGamma -= kc (dP^T xr); dbeta gathers every key block's part.
    3. dg from dGamma (`_gate_grads`).

    dw, dL, dAqk and the state terms stay in registers; the outputs are stored after every load.
    """
    f32, md, pm, pt, ps, C, BK = jnp.float32, cfg.md, cfg.prec_mm, cfg.prec_tile, cfg.prec_strip, cfg.C, cfg.BK
    nb, nk = C // _SUB, cfg.K // BK
    blocks = [pl.ds(j * BK, BK) for j in range(nk)]
    T = t_ref[...]
    beta = beta_ref[...].astype(f32)
    mf = mf_ref[...]
    bmf = (beta * mf)[:, None]
    dvn = dvn_ref[...]
    dvn_m, dO, vn = dvn.astype(md), do_ref[...].astype(md), vn_ref[...].astype(md)
    v = v_ref[...].astype(f32)

    def dw_of(blk):  # v_new = u - w S_in
        return -_mm(dvn_m, h_ref[:, blk].astype(md), pm)

    # 1. Whole chunk. w = T kb with kb = beta mf k e^Gamma; dT needs dw kb^T over all key channels.
    dvb = _mm_tn(T, dvn, pt)
    dT = _mm_nt(dvn, beta[:, None] * v, pt)
    dw_kept = []
    for blk in blocks:
        dw = dw_of(blk)
        kb = bmf * k_ref[:, blk].astype(f32) * jnp.exp(G_ref[:, blk])
        dT = dT + _mm_nt(dw, kb, pt)
        if nk == 1:  # one block: keep it; several: recompute each in step 2 (registers)
            dw_kept.append(dw)
    row, col = _iota((C, C), 0), _iota((C, C), 1)
    doc = doc_ref[...]
    same = doc[:, None] == doc[None, :]
    dL = jnp.where((row > col) & same, -_mm_nt(_mm_tn(T, dT, pt), T, pt), 0.0)
    dA = jnp.where((row >= col) & same, cfg.scale * _mm_nt(dO, vn, pm), 0.0)
    dL_r, dA_r = _row_tiles(dL, nb), _row_tiles(dA, nb)
    dv = (beta[:, None] * dvb).astype(dv_ref.dtype)
    dbeta = jnp.sum(v * dvb, axis=1)

    # 2. Per key block.
    keep_state = mf_ref[pl.ds(C - 1, 1)][None, :]
    last_row = _iota((C, 1), 0) == C - 1
    row_dbeta = [0.0] * nb
    out = []  # (dq, dk, dG) row tiles of each key block
    for j, blk in enumerate(blocks):
        q, k, G = q_ref[:, blk].astype(f32), k_ref[:, blk].astype(f32), G_ref[:, blk]
        eG = jnp.exp(G)
        G_end = G_ref[pl.ds(C - 1, 1), blk]
        h, dh = h_ref[:, blk], dh_ref[:, blk]  # S_in^T, dS_out^T [V, BK]
        dd = jnp.sum(h.astype(f32) * dh.astype(f32), axis=0)[None, :]  # d decay [1, BK]
        # qg = scale q e^Gamma on the rows that see the state
        dq = cfg.scale * eG * mf[:, None] * _mm(dO, h.astype(md), pm)
        # kg = k e^{Gamma_end - Gamma} on the rows of the chunk's last document
        dk = jnp.exp(G_end - G) * ml_ref[...][:, None] * _mm(vn, dh.astype(md), pm)
        kg_dkg = k * dk
        dG_end = keep_state * jnp.exp(G_end) * dd + jnp.sum(kg_dkg, axis=0)[None, :]
        dG = q * dq - kg_dkg + jnp.where(last_row, dG_end, 0.0)

        dkb = _mm_tn(T, dw_kept[j] if nk == 1 else dw_of(blk), pt)  # w = T kb
        k_eG_dkb = k * eG * dkb
        dk = dk + bmf * eG * dkb
        dG = dG + bmf * k_eG_dkb
        dbeta = dbeta + mf * jnp.sum(k_eG_dkb, axis=1)

        # Column-side terms accumulate over the strips in [C, BK]; row-side terms stay per strip.
        row_dq, row_dk, row_dG = [], [], []
        for r in range(nb):
            rows = pl.ds(r * _SUB, _SUB)
            row_f, col_f = _strip(G_ref, r, C, blk)
            kc, rq, rk = cfg.strip_factors(k * col_f, q_ref[rows, blk].astype(f32) * row_f,
                                           k_ref[rows, blk].astype(f32) * row_f)
            row_dbeta[r] = row_dbeta[r] + jnp.sum(dL_r[r] * _mm_nt(rk, kc, ps), axis=1)
            dP = beta_ref[rows].astype(f32)[:, None] * dL_r[r]
            Xq, Xk = _mm(dA_r[r], kc, ps), _mm(dP, kc, ps)
            Y = _mm_tn(dA_r[r], rq, ps) + _mm_tn(dP, rk, ps)
            dk = dk + col_f * Y
            dG = dG - kc * Y
            row_dq.append(row_f * Xq)
            row_dk.append(row_f * Xk)
            row_dG.append(rq * Xq + rk * Xk)
        tiles = zip(_row_tiles(dq, nb), _row_tiles(dk, nb), _row_tiles(dG, nb), row_dq, row_dk, row_dG)
        out.append([((dq_r + a).astype(dq_ref.dtype), (dk_r + b).astype(dk_ref.dtype), dG_r + c)
                    for dq_r, dk_r, dG_r, a, b, c in tiles])

    inside = [_gate_masks(cfg, g_ref, nb, blk) for blk in blocks]
    dv_ref[...] = dv
    for r, db_r in enumerate(_row_tiles(dbeta, nb)):
        dbeta_ref[pl.ds(r * _SUB, _SUB)] = db_r + row_dbeta[r]
    for blk, tiles, mask in zip(blocks, out, inside):
        for r, dg in _gate_grads([dG for _, _, dG in tiles]):
            rows = pl.ds(r * _SUB, _SUB)
            dq_ref[rows, blk], dk_ref[rows, blk] = tiles[r][0], tiles[r][1]
            dg_ref[rows, blk] = dg(mask[r])


# The same backward in several programs per chunk, for key dims where the fused kernel spills (K = 128,
# BENCHMARKS.md). 'split': three kernels (state terms, whole-chunk pairs, strips), dq0/dk0/dw and
# dA/dL going through memory. 'two': the pairs kernel takes the state instead of dw, and one kernel per
# key block does the state and the strip terms, so only dA/dL go through memory. On an H100 at
# 8x4096x16x128, chunk 32, bf16, 'split' (key blocks 64, column block 32) takes 1.47 + 1.42 + 2.63 ms and
# 'two' at its best blocks (64, 16) 1.78 + 4.11 ms: one program per key block redoes the strip work that
# 'split' shares. 'two' was faster with one row only while the grids walked a head's chunks first
# (`_backward_plan`).


def _state_terms(cfg, q_ref, k_ref, G_ref, mf_ref, ml_ref, h_ref, dh_ref, do_ref, vn_ref, dvn_ref):
    """One chunk and key block [C, BK], the terms through the states: o = qg S_in,
    S_out = decay S_in + kg^T v_new, v_new = u - w S_in. Returns the first parts of dq and dk [C, BK],
    dGamma's last-row term [1, BK] (`_state_dG` forms the rest) and dw [C, BK], all fp32 (h_ref,
    dh_ref: S_in^T and dS_out^T [V, BK])."""
    f32, md, pm, C = jnp.float32, cfg.md, cfg.prec_mm, cfg.C
    G = G_ref[...]
    G_end = G_ref[pl.ds(C - 1, 1), :]
    keep_state = mf_ref[pl.ds(C - 1, 1)][None, :]
    Sh = h_ref[...].astype(md)
    dSh = dh_ref[...].astype(md)
    dd = jnp.sum(h_ref[...].astype(f32) * dh_ref[...].astype(f32), axis=0)[None, :]  # d decay [1, BK]
    # qg = scale q e^Gamma on the rows that see the state
    dq = cfg.scale * jnp.exp(G) * mf_ref[...][:, None] * _mm(do_ref[...].astype(md), Sh, pm)
    # kg = k e^{Gamma_end - Gamma} on the rows of the chunk's last document
    dk = jnp.exp(G_end - G) * ml_ref[...][:, None] * _mm(vn_ref[...].astype(md), dSh, pm)
    dG_end = keep_state * jnp.exp(G_end) * dd + jnp.sum(k_ref[...].astype(f32) * dk, axis=0)[None, :]
    return dq, dk, dG_end, -_mm(dvn_ref[...].astype(md), Sh, pm)


def _state_dG(cfg, q_ref, k_ref, dq, dk, dG_end):
    """dGamma's part through the states [C, BK] from `_state_terms`' dq, dk [C, BK] and last-row term
    dG_end [1, BK]: q dq - k dk, plus dG_end on the chunk's last row. Formed where it is used, so the
    split backward stores one [1, BK] row per chunk instead of a [C, BK] fp32 block."""
    f32 = jnp.float32
    last_row = _iota((cfg.C, 1), 0) == cfg.C - 1
    return q_ref[...].astype(f32) * dq - k_ref[...].astype(f32) * dk + jnp.where(last_row, dG_end, 0.0)


def _strip_terms(cfg, q_ref, k_ref, G_ref, beta_ref, mf_ref, t_ref, da_ref, dl_ref, dw, dq, dk, dG):
    """One chunk and key block [C, BK], by row strips: from dw (w = T kb) and dL, dAqk back through
    the strip factorisation of `_strip`, added to the parts dq, dk, dGamma [C, BK] fp32 so far. Per
    strip r with P = (x_r row_f) (k col_f)^T: d(x_r) = row_f (dP kc), d(k) = col_f (dP^T xr),
    dGamma_r += xr (dP kc), dGamma -= kc (dP^T xr). Returns per row strip (dq, dk, dGamma [16, BK],
    this key block's part of dbeta [16])."""
    f32, pt, ps, C = jnp.float32, cfg.prec_tile, cfg.prec_strip, cfg.C
    nb = C // _SUB
    k = k_ref[...].astype(f32)
    beta = beta_ref[...].astype(f32)
    mf = mf_ref[...]
    bmf = (beta * mf)[:, None]
    eG = jnp.exp(G_ref[...])
    dkb = _mm_tn(t_ref[...], dw, pt)  # w = T kb, kb = beta mf k e^Gamma
    k_eG_dkb = k * eG * dkb
    dk = dk + bmf * eG * dkb
    dG = dG + bmf * k_eG_dkb
    dbeta = mf * jnp.sum(k_eG_dkb, axis=1)

    # Column-side terms accumulate over the strips in [C, BK]; row-side terms stay per strip.
    row_dq, row_dk, row_dG, row_dbeta = [], [], [], []
    for r in range(nb):
        rows = pl.ds(r * _SUB, _SUB)
        row_f, col_f = _strip(G_ref, r, C)
        kc, rq, rk = cfg.strip_factors(k * col_f, q_ref[rows, :].astype(f32) * row_f,
                                       k_ref[rows, :].astype(f32) * row_f)
        dA, dL = da_ref[rows, :], dl_ref[rows, :]
        row_dbeta.append(jnp.sum(dL * _mm_nt(rk, kc, ps), axis=1))
        dP = beta_ref[rows].astype(f32)[:, None] * dL
        Xq, Xk = _mm(dA, kc, ps), _mm(dP, kc, ps)
        Y = _mm_tn(dA, rq, ps) + _mm_tn(dP, rk, ps)
        dk = dk + col_f * Y
        dG = dG - kc * Y
        row_dq.append(row_f * Xq)
        row_dk.append(row_f * Xk)
        row_dG.append(rq * Xq + rk * Xk)
    tiles = zip(_row_tiles(dq, nb), _row_tiles(dk, nb), _row_tiles(dG, nb), _row_tiles(dbeta, nb))
    return [(dq_r + row_dq[r], dk_r + row_dk[r], dG_r + row_dG[r], db_r + row_dbeta[r])
            for r, (dq_r, dk_r, dG_r, db_r) in enumerate(tiles)]


def _store_strips(cfg, strips, g_ref, dq_ref, dk_ref, dg_ref, dbeta_ref):
    """Stores one key block's dq, dk, dbeta part and dg (`_gate_grads` of the complete dGamma)."""
    inside = _gate_masks(cfg, g_ref, len(strips))
    for r, dg in _gate_grads([dG for _, _, dG, _ in strips]):
        dq, dk, _, dbeta = strips[r]
        rows = pl.ds(r * _SUB, _SUB)
        dq_ref[rows, :] = dq.astype(dq_ref.dtype)
        dk_ref[rows, :] = dk.astype(dk_ref.dtype)
        dg_ref[rows, :] = dg(inside[r])
        dbeta_ref[rows] = dbeta


def _pairs_terms(cfg, k_ref, v_ref, G_ref, beta_ref, doc_ref, mf_ref, t_ref, do_ref, vn_ref, dvn_ref, *,
                 dw_ref=None, h_ref=None):
    """One chunk, whole-chunk matmuls: from dv_new and dw back through u = T (beta v), w = T kb and
    T = (I + L)^-1. Returns dv [C, V] (as column blocks of BP), the value part of dbeta [C], dL and dAqk
    [C, C] (masked to the pairs that exist).

    dT = dv_new (beta v)^T + dw kb^T sums over the value and key channels in column blocks of BP, so one
    block's [C, BP] operands are live at a time (K = V = 128, chunk 32, bf16, sm_90 by `compile_report`:
    the whole width spills 1144 B per thread, blocks of 32 236 B, blocks of 16 32 B). With dw_ref
    [C, K] (from `_inter_bwd_kernel`) the key part is its own loop. With h_ref (S_in^T [V, K]) instead,
    dw = -dv_new S_in^T is not formed: dT = dv_new (beta v - kb S_in)^T, one [C, K] x [K, BP] product
    per value block."""
    f32, md, pm, pt, C = jnp.float32, cfg.md, cfg.prec_mm, cfg.prec_tile, cfg.C
    T = t_ref[...]
    beta = beta_ref[...].astype(f32)[:, None]
    bmf = beta * mf_ref[...][:, None]
    if h_ref is not None:
        kb_m = (bmf * k_ref[...].astype(f32) * jnp.exp(G_ref[...])).astype(md)
    dT = jnp.zeros((C, C), f32)
    dv, dbeta = [], 0.0
    for j in range(cfg.V // cfg.BP):
        blk = pl.ds(j * cfg.BP, cfg.BP)
        dvn, v = dvn_ref[:, blk], v_ref[:, blk].astype(f32)
        dvb = _mm_tn(T, dvn, pt)
        z = beta * v
        if h_ref is not None:
            z = z - _mm_nt(kb_m, h_ref[blk, :].astype(md), pm)
        dT = dT + _mm_nt(dvn, z, pt)
        dv.append(beta * dvb)
        dbeta = dbeta + jnp.sum(v * dvb, axis=1)
    if dw_ref is not None:
        for j in range(cfg.K // cfg.BP):
            blk = pl.ds(j * cfg.BP, cfg.BP)
            kb = bmf * k_ref[:, blk].astype(f32) * jnp.exp(G_ref[:, blk])
            dT = dT + _mm_nt(_total(dw_ref, blk), kb, pt)
    row, col = _iota((C, C), 0), _iota((C, C), 1)
    doc = doc_ref[...]
    same = doc[:, None] == doc[None, :]
    dL = -_mm_nt(_mm_tn(T, dT, pt), T, pt)
    dA = cfg.scale * _mm_nt(do_ref[...].astype(md), vn_ref[...].astype(md), pm)
    return dv, dbeta, jnp.where((row > col) & same, dL, 0.0), jnp.where((row >= col) & same, dA, 0.0)


def _store_pairs(cfg, terms, dv_ref, dbeta_ref, da_ref, dl_ref):
    dv, dbeta, dL, dA = terms
    for j, dv_j in enumerate(dv):
        dv_ref[:, pl.ds(j * cfg.BP, cfg.BP)] = dv_j.astype(dv_ref.dtype)
    dbeta_ref[...] = dbeta
    dl_ref[...] = dL
    da_ref[...] = dA


def _inter_bwd_kernel(q_ref, k_ref, G_ref, mf_ref, ml_ref, h_ref, dh_ref, do_ref, vn_ref, dvn_ref,
                      dq_ref, dk_ref, dge_ref, dw_ref, *, cfg: _Cfg):
    """One chunk and key block [C, BKI]: `_state_terms` into memory."""
    dq, dk, dG_end, dw = _state_terms(cfg, q_ref, k_ref, G_ref, mf_ref, ml_ref, h_ref, dh_ref, do_ref, vn_ref,
                                      dvn_ref)
    dq_ref[...], dk_ref[...], dge_ref[...], dw_ref[...] = dq, dk, dG_end, dw.astype(dw_ref.dtype)


def _pairs_bwd_kernel(k_ref, v_ref, G_ref, beta_ref, doc_ref, mf_ref, t_ref, do_ref, vn_ref,
                      dvn_ref, last_ref, dv_ref, dbeta_ref, da_ref, dl_ref, *, cfg: _Cfg, from_state: bool):
    """One chunk: `_pairs_terms`. last_ref is dw [C, K] written by `_inter_bwd_kernel` ('split'),
    or with from_state the state entering the chunk, S_in^T [V, K] ('two'), so no dw goes through
    memory."""
    terms = _pairs_terms(cfg, k_ref, v_ref, G_ref, beta_ref, doc_ref, mf_ref, t_ref, do_ref, vn_ref, dvn_ref,
                         **{"h_ref" if from_state else "dw_ref": last_ref})
    _store_pairs(cfg, terms, dv_ref, dbeta_ref, da_ref, dl_ref)


def _intra_bwd_kernel(q_ref, k_ref, G_ref, g_ref, beta_ref, mf_ref, t_ref, dw_ref, da_ref, dl_ref,
                      dq0_ref, dk0_ref, dge_ref, dq_ref, dk_ref, dg_ref, dbeta_ref, *, cfg: _Cfg):
    """One chunk and key block [C, BK]: `_strip_terms` added to the state terms read from memory."""
    dq0, dk0 = _total(dq0_ref), _total(dk0_ref)
    dG0 = _state_dG(cfg, q_ref, k_ref, dq0, dk0, _total(dge_ref))
    strips = _strip_terms(cfg, q_ref, k_ref, G_ref, beta_ref, mf_ref, t_ref, da_ref, dl_ref, _total(dw_ref), dq0,
                          dk0, dG0)
    _store_strips(cfg, strips, g_ref, dq_ref, dk_ref, dg_ref, dbeta_ref)


def _keys_bwd_kernel(q_ref, k_ref, G_ref, g_ref, beta_ref, mf_ref, ml_ref, t_ref, h_ref, dh_ref, do_ref, vn_ref,
                     dvn_ref, da_ref, dl_ref, dq_ref, dk_ref, dg_ref, dbeta_ref, *, cfg: _Cfg):
    """One chunk and key block [C, BK]: `_state_terms` and `_strip_terms` in one program, the state
    terms and dw staying in registers."""
    dq, dk, dG_end, dw = _state_terms(cfg, q_ref, k_ref, G_ref, mf_ref, ml_ref, h_ref, dh_ref, do_ref, vn_ref,
                                      dvn_ref)
    dG = _state_dG(cfg, q_ref, k_ref, dq, dk, dG_end)
    strips = _strip_terms(cfg, q_ref, k_ref, G_ref, beta_ref, mf_ref, t_ref, da_ref, dl_ref, dw, dq, dk, dG)
    _store_strips(cfg, strips, g_ref, dq_ref, dk_ref, dg_ref, dbeta_ref)


# ----------------------------------------------------------------------------------------------------
# pallas_call wrappers
# ----------------------------------------------------------------------------------------------------


# Launch order of the chunk-parallel grids, written (n, h, b) and (n, j, h, b) in the specs: the
# permutation that gives the launched grid. Consecutive programs run side by side, so the order sets
# which stretch of memory is read at once. 'chunks' walks a head's chunks first: a [C, K] tile's rows
# lie H * K elements apart, so with many heads and one row the programs in flight span the whole
# sequence of every operand. 'heads' walks the heads of a chunk first: neighbours read adjacent bytes.
# Forward+backward on an H100, bf16, chunk 32, chunks-first / heads-first with 'split': 8x4096x16x128
# 9.13 / 9.05 ms, 2x16384x32x128 19.17 / 18.25; one row, chunks-first with the then faster 'two' /
# heads-first 'split': 1x8192x96x128 15.18 / 14.29, 1x65536x32x128 41.57 / 37.72 (BENCHMARKS.md).
_GRID_ORDERS = {"chunks": {3: (0, 1, 2), 4: (0, 1, 2, 3)}, "heads": {3: (1, 0, 2), 4: (2, 1, 0, 3)}}
_CHAIN_KERNELS = ("state_fwd", "state_bwd", "state_terms_bwd")  # value-block grids (V / BV, H, B), not reordered


def _ordered(order, spec):
    """`spec` with its index map taking the grid indices in the launched order (see `_GRID_ORDERS`)."""
    def index_map(*ids):
        canon = [0] * len(ids)
        for i, p in enumerate(order):
            canon[p] = ids[i]
        return spec.index_map(*canon)

    return dataclasses.replace(spec, index_map=index_map)


def _call(cfg, kernel, name, grid, in_specs, out_specs, out_shape):
    order = _GRID_ORDERS[cfg.order][len(grid)]
    if name not in _CHAIN_KERNELS and order != tuple(range(len(grid))):
        grid = tuple(grid[p] for p in order)
        in_specs, out_specs = jax.tree.map(functools.partial(_ordered, order), (in_specs, out_specs),
                                           is_leaf=lambda x: isinstance(x, pl.BlockSpec))
    return pl.pallas_call(functools.partial(kernel, cfg=cfg), grid=grid, in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape, interpret=cfg.interpret,
                          compiler_params=triton_params(cfg.interpret, *cfg.launch_of(name)), name=f"kda_{name}")


def _chunk_specs(cfg):
    """BlockSpecs for the chunk-parallel grid (NT, H, B)."""
    C = cfg.C

    def tok(D):
        return pl.BlockSpec((None, C, None, D), lambda n, h, b: (b, n, h, 0))

    per_tok = pl.BlockSpec((None, C, None), lambda n, h, b: (b, n, h))
    per_row = pl.BlockSpec((None, C), lambda n, h, b: (b, n))
    state = pl.BlockSpec((None, None, cfg.V, cfg.K), lambda n, h, b: (b, h, n, 0))
    return tok, per_tok, per_row, state


def _seq_specs(cfg):
    """BlockSpecs for the value-block grid (V / BV, H, B): whole rows, walked inside the kernel."""
    Tp = cfg.NT * cfg.C

    def tok(D):
        return pl.BlockSpec((None, Tp, None, D), lambda j, h, b: (b, 0, h, 0))

    vblk = pl.BlockSpec((None, Tp, None, cfg.BV), lambda j, h, b: (b, 0, h, j))
    per_row = pl.BlockSpec((None, Tp), lambda j, h, b: (b, 0))
    # Per-chunk states [B, H, NT * V, K]: every value block of a (row, head) writes its own rows of
    # the one shared block, so the stores are plain row slices like the outputs'.
    states = pl.BlockSpec((None, None, cfg.NT * cfg.V, cfg.K), lambda j, h, b: (b, h, 0, 0))
    one_state = pl.BlockSpec((None, None, cfg.BV, cfg.K), lambda j, h, b: (b, h, j, 0))
    return tok, vblk, per_row, states, one_state


def _gate_fwd(cfg, g):
    """Gamma [B, Tp, H, K] fp32: chunk-local cumsum of the clamped gate g [B, Tp, H, K] fp32."""
    B, Tp, H, K = g.shape
    tok, _, _, _ = _chunk_specs(cfg)
    return _call(cfg, _gate_fwd_kernel, "gate_fwd", (cfg.NT, H, B), [tok(K)], tok(K),
                 jax.ShapeDtypeStruct(g.shape, jnp.float32))(g)


def _l2norm_fwd(cfg, x):
    """(y [B, Tp, H, K] in x.dtype, r [B, Tp, H] fp32): x L2-normalised over its last axis."""
    B, Tp, H, K = x.shape
    tok, per_tok, _, _ = _chunk_specs(cfg)
    return _call(cfg, _l2norm_fwd_kernel, "l2norm_fwd", (cfg.NT, H, B), [tok(K)], [tok(K), per_tok],
                 [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((B, Tp, H), jnp.float32)])(x)


def _l2norm_bwd(cfg, y, r, dy):
    """dx [B, Tp, H, K] in y.dtype from y and r of `_l2norm_fwd` and dy [B, Tp, H, K] (any float dtype)."""
    B, Tp, H, K = y.shape
    tok, per_tok, _, _ = _chunk_specs(cfg)
    return _call(cfg, _l2norm_bwd_kernel, "l2norm_bwd", (cfg.NT, H, B), [tok(K), per_tok, tok(K)], tok(K),
                 jax.ShapeDtypeStruct(y.shape, y.dtype))(y, r, dy)


def _intra_fwd(cfg, q, k, v, G, beta, doc, mf, ml):
    """w, qg, kg [B, Tp, H, K], u [B, Tp, H, V], Aqk and T [B, Tp, H, C] for every chunk."""
    B, Tp, H, _ = q.shape
    C, K, V, NT, md = cfg.C, cfg.K, cfg.V, cfg.NT, cfg.md
    tok, per_tok, per_row, _ = _chunk_specs(cfg)
    keys = jax.ShapeDtypeStruct((B, Tp, H, K), md)
    return _call(cfg, _intra_fwd_kernel, "intra_fwd", (NT, H, B),
                 [tok(K), tok(K), tok(V), tok(K), per_tok, per_row, per_row, per_row],
                 [tok(K), tok(V), tok(C), tok(C), tok(K), tok(K)],
                 [keys, jax.ShapeDtypeStruct((B, Tp, H, V), md), jax.ShapeDtypeStruct((B, Tp, H, C), md),
                  jax.ShapeDtypeStruct((B, Tp, H, C), jnp.float32), keys, keys],
                 )(q, k, v, G, beta, doc, mf, ml)


def _state_fwd(cfg, kg, G, w, u, mf, h0t, qg, aqk, out_dtype, keep_states=True):
    """The chain and the output: o [B, Tp, H, V] (out_dtype), with keep_states v_new [B, Tp, H, V] and
    the per-chunk states [B, H, NT * V, K] (else None for both), and the final state^T [B, H, V, K]."""
    B, Tp, H, K = kg.shape
    V, NT = cfg.V, cfg.NT
    stok, vblk, srow, states, one_state = _seq_specs(cfg)
    kernel = functools.partial(_state_fwd_kernel, keep_states=keep_states)
    outs = [(vblk, jax.ShapeDtypeStruct((B, Tp, H, V), out_dtype))]
    if keep_states:
        outs += [(vblk, jax.ShapeDtypeStruct((B, Tp, H, V), cfg.md)),
                 (states, jax.ShapeDtypeStruct((B, H, NT * V, K), cfg.h_dtype))]
    outs.append((one_state, jax.ShapeDtypeStruct((B, H, V, K), jnp.float32)))
    res = _call(cfg, kernel, "state_fwd", (V // cfg.BV, H, B),
                [stok(K), stok(K), stok(K), vblk, srow, one_state, stok(K), stok(cfg.C)],
                [spec for spec, _ in outs], [shape for _, shape in outs],
                )(kg, G, w, u, mf, h0t, qg, aqk)
    o, *saved, ht = res
    vn, h = saved if keep_states else (None, None)
    return o, vn, h, ht


def _prologue(cfg, q, k, g):
    """The kernels' q, k (L2-normalised here with cfg.qk_l2norm, their fp32 inverse norms [B, Tp, H]
    kept for the backward; else as given, with empty norms) and Gamma from the raw gate g."""
    norms = ()
    if cfg.qk_l2norm:
        (q, rq), (k, rk) = _l2norm_fwd(cfg, q), _l2norm_fwd(cfg, k)
        norms = (rq, rk)
    return q, k, _gate_fwd(cfg, g), norms


def _forward(cfg, q, k, v, G, beta, h0t, doc, mf, ml, keep_states=True):
    """The core from the kernels' inputs (Gamma, not g): o [B, Tp, H, V], final state^T and the
    intermediates the backward reads (without keep_states, a forward that no backward follows,
    v_new and the per-chunk states are not written: both None)."""
    w, u, aqk, T, qg, kg = _intra_fwd(cfg, q, k, v, G, beta, doc, mf, ml)
    o, vn, h, ht = _state_fwd(cfg, kg, G, w, u, mf, h0t, qg, aqk, v.dtype, keep_states)
    return o, ht, (w, aqk, T, h, vn, qg, kg)


def _state_bwd(cfg, qg, kg, G, w, aqk, do, mf, dht, terms=None):
    """dh [B, H, NT * V, K], dv_new [B, Tp, H, V], d initial state^T [B, H, V, K]. With terms = (h, v_new, k,
    ml), instead of dh the value blocks' parts P = V / BV of the terms through the states: dv_new, d initial
    state^T, dq0, dk0 [P, B, Tp, H, K] fp32, dw [P, B, Tp, H, K] (cfg.md) and dGamma's last-row term
    [P, B, NT, H, K] fp32 (`_total` adds the parts)."""
    B, Tp, H, K = qg.shape
    C, V, NT = cfg.C, cfg.V, cfg.NT
    stok, vblk, srow, states, one_state = _seq_specs(cfg)
    ins = [stok(K), stok(K), stok(K), stok(K), stok(C), vblk, srow, one_state]
    dvn = (vblk, jax.ShapeDtypeStruct((B, Tp, H, V), jnp.float32))
    dh0 = (one_state, jax.ShapeDtypeStruct((B, H, V, K), jnp.float32))
    if terms is None:
        outs, extra = [(states, jax.ShapeDtypeStruct((B, H, NT * V, K), cfg.h_dtype)), dvn, dh0], ()
    else:
        P = V // cfg.BV

        def part(L, dtype):
            spec = pl.BlockSpec((None, None, L, None, K), lambda j, h, b: (j, b, 0, h, 0))
            return spec, jax.ShapeDtypeStruct((P, B, L, H, K), dtype)

        ins += [states, vblk, stok(K), srow]
        outs, extra = [dvn, dh0, part(Tp, jnp.float32), part(Tp, jnp.float32), part(Tp, cfg.md),
                       part(NT, jnp.float32)], terms
    kernel = functools.partial(_state_bwd_kernel, terms=terms is not None)
    name = "state_bwd" if terms is None else "state_terms_bwd"
    return _call(cfg, kernel, name, (V // cfg.BV, H, B), ins, [spec for spec, _ in outs],
                 [shape for _, shape in outs])(qg, kg, G, w, aqk, do, mf, dht, *extra)


def _chunk_bwd(cfg, q, k, v, G, g, beta, doc, mf, ml, T, h, dh, do, vn, dvn):
    """dq, dk [B, Tp, H, K] (cfg.dqk_dtype), dv [B, Tp, H, V], dg [B, Tp, H, K] fp32 and dbeta [B, Tp, H]
    fp32, one program per chunk and head (key blocks of cfg.BK inside it)."""
    B, Tp, H, K = q.shape
    C, V, NT = cfg.C, cfg.V, cfg.NT
    tok, per_tok, per_row, state = _chunk_specs(cfg)
    return _call(cfg, _chunk_bwd_kernel, "chunk_bwd", (NT, H, B),
                 [tok(K), tok(K), tok(V), tok(K), tok(K), per_tok, per_row, per_row, per_row, tok(C), state,
                  state, tok(V), tok(V), tok(V)],
                 [tok(K), tok(K), tok(V), tok(K), per_tok],
                 [jax.ShapeDtypeStruct((B, Tp, H, K), cfg.dqk_dtype),
                  jax.ShapeDtypeStruct((B, Tp, H, K), cfg.dqk_dtype),
                  jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype), jax.ShapeDtypeStruct((B, Tp, H, K), jnp.float32),
                  jax.ShapeDtypeStruct((B, Tp, H), jnp.float32)],
                 )(q, k, v, G, g, beta, doc, mf, ml, T, h, dh, do, vn, dvn)


def _kblock_specs(cfg, BK):
    """BlockSpecs for the grid (NT, K / BK, H, B) of the key-blocked backward kernels."""
    C = cfg.C
    kblk = pl.BlockSpec((None, C, None, BK), lambda n, j, h, b: (b, n, h, j))

    def tok(D):
        return pl.BlockSpec((None, C, None, D), lambda n, j, h, b: (b, n, h, 0))

    per_tok = pl.BlockSpec((None, C, None), lambda n, j, h, b: (b, n, h))
    per_row = pl.BlockSpec((None, C), lambda n, j, h, b: (b, n))
    return kblk, tok, per_tok, per_row


def _chunk_rows(BK):
    """BlockSpec of one [1, BK] row per chunk and key block of a [B, NT, H, K] array (grid (NT, K / BK, H, B))."""
    return pl.BlockSpec((None, 1, None, BK), lambda n, j, h, b: (b, n, h, j))


def _inter_bwd(cfg, q, k, G, mf, ml, h, dh, do, vn, dvn):
    """Inter-chunk parts of dq and dk [B, Tp, H, K] fp32, dw [B, Tp, H, K] in cfg.md and dGamma's
    last-row term per chunk [B, NT, H, K] fp32 (the rest of its part is formed from dq and dk,
    `_state_dG`); every term is per key channel, so the grid splits the keys into blocks.

    dw only feeds TF32 products (dT, dkb), so the bf16 variant stores it in bf16: 6 of its 12 bytes of
    traffic per element saved, and under emulated GPU rounding (1x1000x2x128) dbeta's error moved by
    0.1% and no other. dq and dk stay fp32: their parts cancel in dGamma (bf16 there: dg +10%)."""
    B, Tp, H, K = q.shape
    BK, V, NT = cfg.BKI, cfg.V, cfg.NT
    kblk, tok, _, per_row = _kblock_specs(cfg, BK)
    state = pl.BlockSpec((None, None, V, BK), lambda n, j, h, b: (b, h, n, j))
    f32 = jax.ShapeDtypeStruct((B, Tp, H, K), jnp.float32)
    dw = jax.ShapeDtypeStruct((B, Tp, H, K), cfg.md)
    return _call(cfg, _inter_bwd_kernel, "inter_bwd", (NT, K // BK, H, B),
                 [kblk, kblk, kblk, per_row, per_row, state, state, tok(V), tok(V), tok(V)],
                 [kblk, kblk, _chunk_rows(BK), kblk],
                 [f32, f32, jax.ShapeDtypeStruct((B, NT, H, K), jnp.float32), dw])(q, k, G, mf, ml, h, dh, do, vn, dvn)


def _with_parts(spec, x):
    """`spec` for x, or, where x has one more (leading) axis, for x's value-block parts [P, ...] whole."""
    if x.ndim == len(spec.block_shape):
        return spec
    return pl.BlockSpec((x.shape[0], *spec.block_shape), lambda *ids: (0, *spec.index_map(*ids)))


def _pairs_bwd(cfg, k, v, G, beta, doc, mf, T, do, vn, dvn, *, dw=None, h=None):
    """dv [B, Tp, H, V], the value part of dbeta [B, Tp, H] fp32, dL and dAqk [B, Tp, H, C] fp32, from
    dw [B, Tp, H, K] ('split'; or its value-block parts [P, B, Tp, H, K], 'chain') or from the per-chunk
    states h [B, H, NT * V, K] ('two')."""
    B, Tp, H, K = k.shape
    C, V, NT = cfg.C, cfg.V, cfg.NT
    tok, per_tok, per_row, state = _chunk_specs(cfg)
    from_state = h is not None
    kernel = functools.partial(_pairs_bwd_kernel, from_state=from_state)
    name, last, spec = ("pairs_h_bwd", h, state) if from_state else ("pairs_bwd", dw, _with_parts(tok(K), dw))
    pairs = jax.ShapeDtypeStruct((B, Tp, H, C), jnp.float32)
    return _call(cfg, kernel, name, (NT, H, B),
                 [tok(K), tok(V), tok(K), per_tok, per_row, per_row, tok(C), tok(V), tok(V), tok(V), spec],
                 [tok(V), per_tok, tok(C), tok(C)],
                 [jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype), jax.ShapeDtypeStruct((B, Tp, H), jnp.float32),
                  pairs, pairs],
                 )(k, v, G, beta, doc, mf, T, do, vn, dvn, last)


def _intra_bwd(cfg, q, k, G, g, beta, mf, T, dw, dA, dL, dq0, dk0, dGe):
    """dq, dk [B, Tp, H, K] (cfg.dqk_dtype), dg [B, Tp, H, K] fp32, and the key blocks' parts of dbeta
    [K / BK, B, Tp, H] fp32. dw, dq0, dk0 [B, Tp, H, K] and dGe [B, NT, H, K] may each come as value-block
    parts with a leading axis P (`_state_bwd` with terms)."""
    B, Tp, H, K = q.shape
    C, BK, NT = cfg.C, cfg.BK, cfg.NT
    nk = K // BK
    kblk, tok, per_tok, per_row = _kblock_specs(cfg, BK)
    part = pl.BlockSpec((None, None, C, None), lambda n, j, h, b: (j, b, n, h))
    terms = [_with_parts(spec, x) for spec, x in ((kblk, dw), (kblk, dq0), (kblk, dk0), (_chunk_rows(BK), dGe))]
    return _call(cfg, _intra_bwd_kernel, "intra_bwd", (NT, nk, H, B),
                 [kblk, kblk, kblk, kblk, per_tok, per_row, tok(C), terms[0], tok(C), tok(C), *terms[1:]],
                 [kblk, kblk, kblk, part],
                 [jax.ShapeDtypeStruct((B, Tp, H, K), cfg.dqk_dtype),
                  jax.ShapeDtypeStruct((B, Tp, H, K), cfg.dqk_dtype),
                  jax.ShapeDtypeStruct((B, Tp, H, K), jnp.float32),
                  jax.ShapeDtypeStruct((nk, B, Tp, H), jnp.float32)],
                 )(q, k, G, g, beta, mf, T, dw, dA, dL, dq0, dk0, dGe)


def _split_bwd(cfg, q, k, v, G, g, beta, doc, mf, ml, T, h, dh, do, vn, dvn):
    """`_chunk_bwd`'s outputs from the three split kernels."""
    dq0, dk0, dGe, dw = _inter_bwd(cfg, q, k, G, mf, ml, h, dh, do, vn, dvn)
    dv, dbeta_v, dA, dL = _pairs_bwd(cfg, k, v, G, beta, doc, mf, T, do, vn, dvn, dw=dw)
    dq, dk, dg, dbeta_k = _intra_bwd(cfg, q, k, G, g, beta, mf, T, dw, dA, dL, dq0, dk0, dGe)
    return dq, dk, dv, dg, dbeta_v + jnp.sum(dbeta_k, axis=0)


def _keys_bwd(cfg, q, k, G, g, beta, mf, ml, T, h, dh, do, vn, dvn, dA, dL):
    """dq, dk [B, Tp, H, K] (cfg.dqk_dtype), dg [B, Tp, H, K] fp32 and the key blocks' parts of dbeta
    [K / BK, B, Tp, H] fp32, the state terms formed in the same program as the strip terms."""
    B, Tp, H, K = q.shape
    C, BK, V, NT = cfg.C, cfg.BK, cfg.V, cfg.NT
    nk = K // BK
    kblk, tok, per_tok, per_row = _kblock_specs(cfg, BK)
    state = pl.BlockSpec((None, None, V, BK), lambda n, j, h, b: (b, h, n, j))
    part = pl.BlockSpec((None, None, C, None), lambda n, j, h, b: (j, b, n, h))
    return _call(cfg, _keys_bwd_kernel, "keys_bwd", (NT, nk, H, B),
                 [kblk, kblk, kblk, kblk, per_tok, per_row, per_row, tok(C), state, state, tok(V), tok(V),
                  tok(V), tok(C), tok(C)],
                 [kblk, kblk, kblk, part],
                 [jax.ShapeDtypeStruct((B, Tp, H, K), cfg.dqk_dtype),
                  jax.ShapeDtypeStruct((B, Tp, H, K), cfg.dqk_dtype),
                  jax.ShapeDtypeStruct((B, Tp, H, K), jnp.float32),
                  jax.ShapeDtypeStruct((nk, B, Tp, H), jnp.float32)],
                 )(q, k, G, g, beta, mf, ml, T, h, dh, do, vn, dvn, dA, dL)


def _two_bwd(cfg, q, k, v, G, g, beta, doc, mf, ml, T, h, dh, do, vn, dvn):
    """`_chunk_bwd`'s outputs from the pairs kernel that takes the states and the per-key-block kernel."""
    dv, dbeta_v, dA, dL = _pairs_bwd(cfg, k, v, G, beta, doc, mf, T, do, vn, dvn, h=h)
    dq, dk, dg, dbeta_k = _keys_bwd(cfg, q, k, G, g, beta, mf, ml, T, h, dh, do, vn, dvn, dA, dL)
    return dq, dk, dv, dg, dbeta_v + jnp.sum(dbeta_k, axis=0)


def _with_dh(after):
    """A backward plan whose kernels read dh: the reverse chain stores it, then `after` forms dq, dk, dv,
    dg and dbeta."""
    def plan(cfg, q, k, v, G, g, beta, doc, mf, ml, w, aqk, T, h, vn, qg, kg, do, dht):
        dh, dvn, dh0 = _state_bwd(cfg, qg, kg, G, w, aqk, do, mf, dht)
        return (*after(cfg, q, k, v, G, g, beta, doc, mf, ml, T, h, dh, do, vn, dvn), dh0)
    return plan


def _chain_bwd(cfg, q, k, v, G, g, beta, doc, mf, ml, w, aqk, T, h, vn, qg, kg, do, dht):
    """'split' without `_inter_bwd` and dh: the reverse chain forms the terms through the states itself
    (per value block; `_pairs_bwd` and `_intra_bwd` add the parts). Saves dh's store and load, one
    launch and the re-reads of dO, v_new and dv_new, for P = V / BV stores and loads of the terms."""
    dvn, dh0, dq0, dk0, dw, dGe = _state_bwd(cfg, qg, kg, G, w, aqk, do, mf, dht, terms=(h, vn, k, ml))
    dv, dbeta_v, dA, dL = _pairs_bwd(cfg, k, v, G, beta, doc, mf, T, do, vn, dvn, dw=dw)
    dq, dk, dg, dbeta_k = _intra_bwd(cfg, q, k, G, g, beta, mf, T, dw, dA, dL, dq0, dk0, dGe)
    return dq, dk, dv, dg, dbeta_v + jnp.sum(dbeta_k, axis=0), dh0


# The backward plans (`_Cfg.backward`). Measured on the H200 at chunk 32 (BENCHMARKS.md): fused 3.9 ms
# against split 5.2 ms after the reverse chain at K = 32; at K = 128 the fused program spills (11.1 ms
# with one key block of 128, 29.3 with two of 64) and split takes 5.8 ms. 'chain' forward+backward on an
# H100 against 'split': 9.84 / 8.38 ms at 8x4096x16x128, 16.37 / 13.61 at 1x8192x96x128, 19.85 / 17.11
# at 2x16384x32x128: the terms' products lengthen every step of the latency-bound chain.
_BACKWARDS = {"fused": _with_dh(_chunk_bwd), "split": _with_dh(_split_bwd), "two": _with_dh(_two_bwd),
              "chain": _chain_bwd}
_FUSED_MAX_K = 64


def _backward_plan(K):
    """The `_BACKWARDS` entry for padded key dim K: 'split' above _FUSED_MAX_K. Forward+backward ms,
    bf16, chunk 32, one H100, heads-first grids (`_GRID_ORDERS`), split / two: 8x4096x16x128 9.05 /
    9.08, 1x8192x96x128 14.29 / 14.51, 2x16384x32x128 18.25 / 18.41, 1x65536x32x128 37.72 / 39.05,
    1x32768x16x128 10.29 / 10.50, 2x4096x96x128 14.00 / 14.38 (BENCHMARKS.md). With chunks-first
    grids 'two' had won every one-row shape (1x65536x32x128 41.02 against 45.90): the split kernels
    then read the long rows' strided tiles from far-apart addresses."""
    return "fused" if K <= _FUSED_MAX_K else "split"


def _backward(cfg, q, k, v, G, g, beta, doc, mf, ml, w, aqk, T, h, vn, qg, kg, do, dht):
    """dq, dk (cfg.dqk_dtype), dv, dg (fp32, through the clamp and the cumsum), dbeta, d initial state^T."""
    dq, dk, dv, dg, dbeta, dh0 = _BACKWARDS[cfg.backward](cfg, q, k, v, G, g, beta, doc, mf, ml, w, aqk, T, h, vn,
                                                          qg, kg, do, dht)
    return dq, dk, dv, dg, dbeta.astype(beta.dtype), dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(cfg, q, k, v, g, beta, h0t, doc, mf, ml):
    """o [B, Tp, H, V] and the final state^T [B, H, V, K] from the padded inputs; g is the raw gate."""
    q, k, G, _ = _prologue(cfg, q, k, g)
    o, ht, _ = _forward(cfg, q, k, v, G, beta, h0t, doc, mf, ml, keep_states=False)
    return o, ht


def _kda_fwd(cfg, q, k, v, g, beta, h0t, doc, mf, ml):
    q, k, G, norms = _prologue(cfg, q, k, g)
    o, ht, saved = _forward(cfg, q, k, v, G, beta, h0t, doc, mf, ml)
    # The outputs too: the layer's backward needs o, and an unnamed o would make a remat policy that
    # keeps the residuals still run the forward kernels again to get it.
    o, ht, saved = checkpoint_name((o, ht, saved), KDA_RESIDUALS)
    # The kernels' own inputs: q and k as the kernels read them (normalised), the raw gate (its
    # clamp's mask) and Gamma. The raw q and k are not needed: the norm's backward works from y = x r.
    q, k, v, g, G, beta, norms = checkpoint_name((q, k, v, g, G, beta, norms), KDA_INPUTS)
    return (o, ht), (q, k, v, g, G, beta, norms, doc, mf, ml, *saved)


def _kda_bwd(cfg, res, cts):
    q, k, v, g, G, beta, norms, doc, mf, ml, *saved = res
    do, dht = cts
    dq, dk, dv, dg, dbeta, dh0 = _backward(cfg, q, k, v, G, g, beta, doc, mf, ml, *saved,
                                           do.astype(v.dtype), dht.astype(jnp.float32))
    if cfg.qk_l2norm:
        dq, dk = _l2norm_bwd(cfg, q, norms[0], dq), _l2norm_bwd(cfg, k, norms[1], dk)
    return dq, dk, dv, dg, dbeta, dh0, jnp.zeros_like(doc), jnp.zeros_like(mf), jnp.zeros_like(ml)


_kda.defvjp(_kda_fwd, _kda_bwd)


# ----------------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------------


def _check_gate_callback(g_min, lower_bound):
    if float(g_min) < lower_bound:
        raise ValueError(f"chunk_kda: the log decay g reaches {float(g_min):.4g}, below lower_bound = "
                         f"{lower_bound}; use the reference path (impl='chunk') for an unbounded gate")


# Measured on an H100 at 8x4096x16x128, chunk 32, bf16: kda_intra_fwd 1.35 ms over the whole K = 128,
# 1.26 ms in two key blocks of 64 (no spills), 1.56 ms in four of 32.
_FWD_PAIR_BLOCK = 64
# kda_pairs_bwd at K = V = 128 (same machine and shape): column blocks of 128 1.96 ms (1144 B spilled per
# thread), 64 1.45 ms, 32 1.42 ms.
_PAIRS_BLOCK = 32
# The chains run one program per (value block, head, row), each walking every chunk: with few rows and
# heads, narrower value blocks give the GPU more programs. Measured on an H100 at 1x65536x32x128 (forward
# + reverse chain): value block 64 (64 programs) 11.25 ms, 32 (128) 7.61 ms, 16 (256) 8.69 ms; where 64
# already gives 128 or more, it stays best (2x16384x32x128: 2.95 against 3.13 ms with 32; 8x4096x16x128:
# 1.47 against 1.72 ms).
_CHAIN_PROGRAMS = 128
# Key block of the split backward's state-terms kernel (`kda_inter_bwd`) per matmul dtype. bf16: 128, 1.47
# ms against 1.76 at 64 (H100, 8x4096x16x128). fp32 operands hold twice the bytes of S_in^T and dS_out^T
# [V, BKI]: at 128 ptxas (sm_90) spills 20.7 KB per thread and the kernel took 22.98 of the fp32
# variant's 37.74 ms forward+backward (H100 profile, BENCHMARKS.md); at 64 it spills 436 B, and the
# whole forward+backward takes 15.55 ms (same shape and machine, with the later grid order).
_INTER_KEY_BLOCK = {"bfloat16": 128, "float32": 64}


def _chain_value_block(rows_heads, V):
    """Widest value block in (64, 32, 16) that gives at least _CHAIN_PROGRAMS chain programs."""
    for bv in (64, 32):
        if rows_heads * (max(V, bv) // bv) >= _CHAIN_PROGRAMS:
            return min(V, bv)
    return min(V, 16)


def _prepare(q, k, v, g, beta, *, scale, initial_state, segment_ids, interpret, chunk_size,
             lower_bound, check_gate, matmul_dtype, qk_l2norm=False):
    """Static config and the padded kernel inputs (q, k, v, g, beta, h0^T, doc, mf, ml)."""
    B, T, H, K0, V0 = validate_kda_inputs(q, k, v, g, beta, initial_state, segment_ids)
    if chunk_size not in _CHUNKS:
        raise ValueError(f"chunk_kda: chunk_size must be one of {_CHUNKS}; got {chunk_size!r}")
    if not (_MIN_LOWER_BOUND <= float(lower_bound) < 0):
        raise ValueError(f"chunk_kda: lower_bound must be in [{_MIN_LOWER_BOUND}, 0); got {lower_bound}")
    scale = K0**-0.5 if scale is None else float(scale)
    interpret = default_interpret() if interpret is None else bool(interpret)
    low_precision = any(jnp.dtype(x.dtype).itemsize < 4 for x in (q, k, v))
    in_dtype = jnp.bfloat16 if low_precision else jnp.float32
    C = chunk_size
    NT = max(1, math.ceil(T / C))
    Tp, K, V = NT * C, pow2_at_least_16(K0), pow2_at_least_16(V0)
    BV = _chain_value_block(B * H, V)
    if matmul_dtype is None:
        matmul_dtype = "bfloat16" if low_precision else "float32"
    if matmul_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"chunk_kda: matmul_dtype must be 'float32' or 'bfloat16'; got {matmul_dtype!r}")
    cfg = _Cfg(C=C, K=K, V=V, BV=BV, BK=min(K, 64), BKI=min(K, _INTER_KEY_BLOCK[matmul_dtype]),
               BF=min(K, _FWD_PAIR_BLOCK), BP=min(K, V, _PAIRS_BLOCK), NT=NT, scale=scale,
               mm_dtype=matmul_dtype, h_dtype=matmul_dtype, interpret=interpret, exact=not low_precision,
               emulate_tf32=interpret and os.environ.get("K3_PALLAS_EMULATE_TF32", "0") == "1",
               backward=_backward_plan(K), lower_bound=float(lower_bound),
               qk_l2norm=bool(qk_l2norm))

    g = jnp.asarray(g).astype(jnp.float32)
    if check_gate:
        jax.debug.callback(functools.partial(_check_gate_callback, lower_bound=float(lower_bound)),
                           jnp.min(g))

    def pad(x, dtype, D):
        x = jnp.asarray(x).astype(dtype)
        return jnp.pad(x, [(0, 0), (0, Tp - T), (0, 0), (0, D - x.shape[-1])])

    qp, kp, vp = pad(q, in_dtype, K), pad(k, in_dtype, K), pad(v, in_dtype, V)
    gp = pad(g, jnp.float32, K)
    betap = jnp.pad(jnp.asarray(beta).astype(jnp.float32), [(0, 0), (0, Tp - T), (0, 0)])

    # Documents as float ids (exact below 2^24), and the two per-token masks: sees the incoming
    # state (same document as the token before the chunk), belongs to the chunk's last document.
    doc = jnp.pad(document_index(segment_ids, None, B, T), [(0, 0), (0, Tp - T)], mode="edge")
    doc_BNC = doc.reshape(B, NT, C)
    prev = jnp.concatenate([doc_BNC[:, :1, 0], doc_BNC[:, :-1, -1]], axis=1)
    mf = (doc_BNC == prev[..., None]).reshape(B, Tp).astype(jnp.float32)
    ml = (doc_BNC == doc_BNC[..., -1:]).reshape(B, Tp).astype(jnp.float32)
    docf = doc.astype(jnp.float32)

    if initial_state is None:
        h0t = jnp.zeros((B, H, V, K), jnp.float32)
    else:
        h0 = jnp.asarray(initial_state).astype(jnp.float32)
        h0t = jnp.pad(h0, [(0, 0), (0, 0), (0, K - K0), (0, V - V0)]).swapaxes(-1, -2)

    return cfg, (qp, kp, vp, gp, betap, h0t, docf, mf, ml)


_TUNING = frozenset({"bk", "bki", "bp", "bv", "bf", "launch", "backward", "strip_precision", "order"})
_STRIP_PRECISIONS = ("tf32", "tf32x3", "bf16x3", "bf16x2", "tf32_rounded")
_STRIP_DOTS = {"tf32_rounded": "tf32"}  # strip precisions that run an existing `_DOTS` form


def with_overrides(cfg, *, bk=0, bki=0, bp=0, bv=0, bf=0, launch=(), backward="auto", strip_precision=None,
                   order=None):
    """`cfg` with the benchmark knobs applied: key blocks bk (strip backward), bki (inter-chunk
    backward) and bf (the forward's pair sums), column block bp (pairs backward) and value block bv (the
    state chains; 0 keeps each default), ((kernel, warps, stages), ...) launches over `_LAUNCH`, an
    `_BACKWARDS` backward ('auto' keeps the choice for the key dim), the strip products' precision
    (a `_STRIP_PRECISIONS` entry, 'bf16x3' the default; None keeps it) and the chunk grids' launch
    order (a `_GRID_ORDERS` key; None keeps it)."""
    width = min(cfg.K, cfg.V)
    for name, blk, dim in (("bk", bk, cfg.K), ("bki", bki, cfg.K), ("bp", bp, width), ("bv", bv, cfg.V),
                           ("bf", bf, cfg.K)):
        if blk and (blk < 16 or blk & (blk - 1) or (blk < dim and dim % blk)):
            raise ValueError(f"chunk_kda: {name} must be a power of two >= 16; got {blk}")
    if backward not in ("auto", *_BACKWARDS):
        raise ValueError(f"chunk_kda: backward must be 'auto' or one of {sorted(_BACKWARDS)}; got {backward!r}")
    unknown = sorted({entry[0] for entry in launch} - set(_LAUNCH))
    if unknown:
        raise ValueError(f"chunk_kda: launch names unknown kernels {unknown}; expected some of {sorted(_LAUNCH)}")
    if strip_precision not in (None, *_STRIP_PRECISIONS):
        raise ValueError(f"chunk_kda: strip_precision must be one of {_STRIP_PRECISIONS}; got {strip_precision!r}")
    if order not in (None, *_GRID_ORDERS):
        raise ValueError(f"chunk_kda: order must be one of {sorted(_GRID_ORDERS)}; got {order!r}")
    pick = lambda new, dim, old: min(new, dim) if new else old  # noqa: E731
    return dataclasses.replace(cfg, BK=pick(bk, cfg.K, cfg.BK), BKI=pick(bki, cfg.K, cfg.BKI),
                               BP=pick(bp, width, cfg.BP), BV=pick(bv, cfg.V, cfg.BV), BF=pick(bf, cfg.K, cfg.BF),
                               launch=tuple(launch), backward=cfg.backward if backward == "auto" else backward,
                               strip_precision=strip_precision or cfg.strip_precision, order=order or cfg.order)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              segment_ids=None, interpret=None, chunk_size=32, lower_bound=-5.0, check_gate=False,
              matmul_dtype=None, tuning=None, qk_l2norm=False):
    """Chunked KDA with Pallas kernels, forward and backward (`jax.custom_vjp`).

    Same layout, conventions and return value as `k3.kda.ops.chunk_kda_reference`.

    Args:
      q, k: [B, T, H, K] queries and keys, used as given (the layer L2-normalises them), or
        L2-normalised here with qk_l2norm=True.
      v: [B, T, H, V] values.
      g: [B, T, H, K] per-channel log decay. Values are clamped into [lower_bound, 0] (the kernel's
        contract: a bounded gate such as `k3.kda.ops.kda_gate_bounded`); with `check_gate=True` a
        value below lower_bound raises instead (at run time, through a host callback).
      beta: [B, T, H] delta-rule learning rate.
      scale: query scale; defaults to K ** -0.5.
      initial_state: optional [B, H, K, V] state before the first token (first document of each row).
      output_final_state: whether to return the state after the last token.
      segment_ids: optional [B, T] ints; a change of id starts a new document with a zero state.
      interpret: run the kernels in Pallas interpret mode; None picks it on any backend but GPU (or
        from the environment variable K3_PALLAS_INTERPRET=0/1).
      chunk_size: C in (16, 32, 64); 32 is the fastest on the H200. T need not be a multiple of it.
      lower_bound: the gate's bound, in [-10, 0).
      check_gate: raise when g < lower_bound instead of clamping.
      matmul_dtype: operand and storage dtype of the large matmuls and the saved intermediates
        (w, u, Aqk, v_new, per-chunk states); None: the inputs' precision. 'bfloat16' (the default
        for 16-bit q, k, v): half the bytes and bf16 tensor cores, with errors against the float64
        recurrence below fla's own (BENCHMARKS.md). 'float32' (the default for fp32 inputs, full fp32
        products there): with 16-bit inputs TF32 operands and fp32 intermediates, 20-25% less error
        for 1.7 times the time (H100, 8x4096x16x128).
      tuning: optional dict of `with_overrides` knobs (bk, bki, bp, bv, bf, launch, backward,
        strip_precision, order) replacing the block sizes, Triton launches or backward plan chosen for the shape;
        the result is the same (strip_precision='tf32' trades the gate gradient's accuracy for speed).
      qk_l2norm: L2-normalise q and k over their last axis first, as `k3.kda.ops.l2_normalize` (eps
        1e-6), in kernels of their own: the same as normalising before the call, but faster, and dq,
        dk reach the norm's backward in fp32 (rounded once, not twice).

    Returns:
      (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] float32 or None).
    """
    B, T, H, K0, V0 = validate_kda_inputs(q, k, v, g, beta, initial_state, segment_ids)
    cfg, args = _prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         segment_ids=segment_ids, interpret=interpret, chunk_size=chunk_size,
                         lower_bound=lower_bound, check_gate=check_gate, matmul_dtype=matmul_dtype,
                         qk_l2norm=qk_l2norm)
    if tuning:
        unknown = sorted(set(tuning) - _TUNING)
        if unknown:
            raise ValueError(f"chunk_kda: unknown tuning keys {unknown}; expected some of {sorted(_TUNING)}")
        cfg = with_overrides(cfg, **tuning)
    o, ht = _kda(cfg, *args)
    o = o[:, :T, :, :V0].astype(jnp.asarray(v).dtype)
    final = ht.swapaxes(-1, -2)[:, :, :K0, :V0] if output_final_state else None
    return o, final
