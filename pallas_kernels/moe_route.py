"""A decode step's MoE routing after the router matmul, as one Pallas kernel.

What it computes. From the router logits l = x W_r [N, E] (fp32) and the selection bias b [E]:

    s      = sigmoid(l)                                      scores, fp32
    idx    = top_k(s + b)                                    [N, k], descending, lower expert first on ties
    w[n,j] = s[n, idx[n,j]] / (sum_j s[n, idx[n,j]] + 1e-20) * scaling

which is `k3.moe.layer.MoE.route` without the Quantile Balancing threshold (a decode step updates no
balancing statistics).

Why a kernel. XLA compiles this as the router's split-K GEMM, a fusion of the sum of its partial
products with the sigmoid and bias, a sort for the top-k, a slice of its first k columns and a gather
of the picked scores: five launches per MoE layer for a few hundred numbers (compiled for an H100, K3
d_model 1024 with 15 MoE layers at batch 8: 75 of the step's 367 kernels). A decode step's kernels are
mostly too small to fill the GPU, so each launch costs about its fixed latency.

Design (Pallas Triton). One program holds every token's E scores in registers ([M, E] with M and E
powers of two) and runs k rounds of: row max, the lowest column attaining it, record, mask out.
`route_topk` starts from the logits of XLA's router GEMM (N and E padded to powers of two; padding
columns are never picked), which spreads the router's read over the GPU: a layer's routing is two
launches, or one where the router's columns lead a wider matmul that XLA runs anyway (a served MoE's
input matrix, `k3.moe.layer.MoE.fuse_inputs`), whose output the kernel reads in place. A version
that formed the logits inside the one program too (walking W_r in row blocks) made K3's decode step
twice as slow on an H100 (3.08 ms against 1.44, 15 routers of 1024 x 64, batch 8;
BENCHMARKS.md): one program's serial loop of loads and reductions over D took about 0.1 ms a layer.
The same source runs in Pallas interpret mode on a CPU (the tests) and compiled on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import default_interpret, triton_params

# Scores a program holds in registers at most (M x E fp32 plus masks and indices of that size): with
# 32 warps, 8 x 1024 at top-16 compiles for sm_90 without spills, 16 x 1024 spills (`compile_report`).
MAX_ROUTE_ELEMENTS = 1 << 13


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def route_topk_supported(n_tokens: int, n_experts: int, k: int) -> bool:
    """Whether `route_topk` takes N tokens over E experts with top-k: k a power of two <= E and the
    padded score tile small enough for one program's registers."""
    return 0 < k <= n_experts and k == _pow2(k) and _pow2(n_tokens) * _pow2(n_experts) <= MAX_ROUTE_ELEMENTS


def _top_k_rounds(s, bias_ref, idx_ref, w_ref, *, n_experts, scaling):
    M, Ep = s.shape
    k = idx_ref.shape[1]
    col = lax.broadcasted_iota(jnp.int32, (M, Ep), 1)
    biased = s + bias_ref[...].astype(jnp.float32)[None, :]
    # A NaN score ranks below every number (as XLA's top-k on a CPU; on a GPU XLA ranks it first): a
    # diverged logit cannot make a row's max NaN and leave no column attaining it.
    biased = jnp.where((col < n_experts) & (biased == biased), biased, -jnp.inf)
    slot = lax.broadcasted_iota(jnp.int32, (M, k), 1)
    idx = jnp.zeros((M, k), jnp.int32)
    picked = jnp.zeros((M, k), jnp.float32)
    taken = col < 0
    for j in range(k):  # k is small and static: unrolled rounds of max, first untaken argmax, mask
        top = jnp.max(biased, axis=1, keepdims=True)
        i = jnp.min(jnp.where((biased == top) & ~taken, col, Ep), axis=1, keepdims=True)
        hit = col == i
        p = jnp.sum(jnp.where(hit, s, 0.0), axis=1, keepdims=True)
        biased = jnp.where(hit, -jnp.inf, biased)
        taken = taken | hit
        idx = jnp.where(slot == j, i, idx)
        picked = jnp.where(slot == j, p, picked)
    idx_ref[...] = idx
    w_ref[...] = picked / (jnp.sum(picked, axis=1, keepdims=True) + 1e-20) * scaling


def _route_kernel(logit_ref, bias_ref, idx_ref, w_ref, *, n_experts, scaling):
    _top_k_rounds(jax.nn.sigmoid(logit_ref[...].astype(jnp.float32)), bias_ref, idx_ref, w_ref,
                  n_experts=n_experts, scaling=scaling)


def route_topk(logits_NE: jax.Array, bias_E: jax.Array, k: int, scaling: float = 1.0, *, num_warps: int = 0,
               interpret: bool | None = None):
    """(idx [N, k] int32, weights [N, k] fp32): each token's top-k experts by sigmoid score plus bias and
    their normalised combine weights (see the module docstring).

    logits: [N, C >= E] router logits in the first E columns, E = bias's length (any float dtype; used
    in fp32); the columns past E are not read, so a wider matmul output that starts with the router's
    columns is taken whole, without a copy of the slice (for N and E powers of two); bias: [E]
    selection bias; k: routes per token (a power of two, `route_topk_supported`); scaling: the routed
    experts' output scale; num_warps: 0 for one warp per 256 padded scores, from 4 to 32 (about 8 of
    each [M, E] array per thread)."""
    if logits_NE.ndim != 2 or bias_E.ndim != 1 or logits_NE.shape[1] < bias_E.shape[0]:
        raise ValueError(f"route_topk: bias {bias_E.shape} does not match logits {logits_NE.shape}")
    N, E = logits_NE.shape[0], bias_E.shape[0]
    if not route_topk_supported(N, E, k):
        raise ValueError(f"route_topk: top-{k} of {E} experts for {N} tokens is not supported "
                         f"(k a power of two <= E, padded N x E <= {MAX_ROUTE_ELEMENTS})")
    interpret = default_interpret() if interpret is None else interpret
    M, Ep = _pow2(N), _pow2(E)
    num_warps = num_warps or min(32, max(4, M * Ep // 256))
    logits = logits_NE.astype(jnp.float32)
    if (M, Ep) != (N, E):
        logits = jnp.pad(logits[:, :E], ((0, M - N), (0, Ep - E)))
        bias_E = jnp.pad(bias_E, (0, Ep - E))
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    idx, w = pl.pallas_call(
        functools.partial(_route_kernel, n_experts=E, scaling=float(scaling)),
        grid=(1,),
        in_specs=[whole((M, Ep)), whole((Ep,))],
        out_specs=[whole((M, k)), whole((M, k))],
        out_shape=[jax.ShapeDtypeStruct((M, k), jnp.int32), jax.ShapeDtypeStruct((M, k), jnp.float32)],
        interpret=interpret, compiler_params=triton_params(interpret, num_warps, 1), name="moe_route_topk",
    )(logits, bias_E.astype(jnp.float32))
    return (idx, w) if M == N else (idx[:N], w[:N])
