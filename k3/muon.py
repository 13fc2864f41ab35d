"""Muon with a folded Newton-Schulz iteration: the same update as ``optax.contrib.muon``, fewer passes.

Muon orthogonalises each matrix's (Nesterov) momentum G with five steps of the quintic iteration

    X_0 = G / (||G||_F + eps),    X_{k+1} = a X_k + b A_k X_k + c A_k^2 X_k,    A_k = X_k X_k^T

(X oriented so that it has no more rows than columns). ``optax.contrib.muon`` writes it as above:
a normalisation pass over G, then per step the Gram matmul, a small A @ A, the B @ X matmul and an
elementwise a X + B X over the whole matrix. :func:`newton_schulz` applies the same polynomial as
one matmul per step, X_{k+1} = M_k X_k with the small M_k = a I + b A_k + c A_k^2 formed in fp32:
no elementwise pass over X. The normalisation folds into the first step: ||G||_F^2 = trace(G G^T),
so X_1 = (M_0 / (||G||_F + eps)) G with A_0 = G G^T / (||G||_F + eps)^2, and G is read by the two
matmuls only. Per step that is two reads and one write of X (Gram, then M X) against about four
reads and two writes. Every product accumulates in fp32, and the first Gram matrix and each M are
formed in fp32 (optax forms them in X's dtype: bf16 under ``optim.mu_dtype='bfloat16'``). On an
H200 the whole update runs 1.18x as fast as optax's for K3 1024:12 and 1.03x for K2 1024:12, whose
square 1024 x 1024 experts leave it bound by the matmuls (BENCHMARKS.md).

:func:`muon` composes it exactly as ``optax.contrib.muon`` composes its own (Muon leaves: momentum,
orthogonalisation, consistent-RMS scale, decoupled weight decay, learning rate; the others: AdamW),
with the same optimizer-state tree, so a checkpoint of either restores into the other. Selected by
``optim.newton_schulz`` (`k3.optim.NEWTON_SCHULZ`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers, MuonState

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic's (a, b, c), as optax's default


def _matrix_axes(ndim: int, dims: MuonDimensionNumbers) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(batch, reduction, output) axes of an ndim-array, each ascending; batch = all the others."""
    as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)
    red = tuple(a % ndim for a in as_tuple(dims.reduction_axis))
    out = tuple(a % ndim for a in as_tuple(dims.output_axis))
    if set(red) & set(out):
        raise ValueError(f"reduction axes {red} and output axes {out} overlap")
    batch = tuple(a for a in range(ndim) if a not in red and a not in out)
    return batch, red, out


def _to_matrices(x: jax.Array, dims: MuonDimensionNumbers):
    """x -> (x_BRO [batch, reduction, output], inverse); a copy only when the axes are out of order."""
    batch, red, out = _matrix_axes(x.ndim, dims)
    perm = batch + red + out
    size = lambda axes: math.prod(x.shape[a] for a in axes)
    x_BRO = jnp.transpose(x, perm).reshape(size(batch), size(red), size(out))
    moved = tuple(x.shape[a] for a in perm)
    inv = tuple(perm.index(a) for a in range(x.ndim))
    return x_BRO, lambda y: jnp.transpose(y.reshape(moved), inv)


def newton_schulz(x: jax.Array, dims: MuonDimensionNumbers, steps: int = 5, coeffs=NS_COEFFS,
                  eps: float = 1e-8) -> jax.Array:
    """Orthogonalises every matrix of ``x`` (any rank, same shape and dtype out) by ``steps`` quintic
    Newton-Schulz steps, in the folded form of the module docstring.

    ``dims`` names the reduction (input) and output axes of each matrix; every other axis is a batch
    axis. The matmuls take x's dtype and accumulate in fp32; the first Gram matrix (whose trace is the
    squared norm) and every M are formed in fp32. Matches optax's
    ``orthogonalize_via_newton_schulz`` (Frobenius preconditioning) up to rounding.
    """
    x_BRO, back = _to_matrices(x, dims)
    return back(_newton_schulz_BRO(x_BRO, steps, coeffs, eps))


# Leaves up to this many elements are grouped by `newton_schulz_grouped` ('grouped' in
# `k3.optim.NEWTON_SCHULZ`). Grouping copies a leaf into the group and back (about 4 bytes an element
# in bf16, ~3.5 us for 4M elements at 4.8 TB/s) and saves the leaf's own launches (two GEMMs and a
# few small kernels per step, each several us on a GPU), so small leaves gain and the large expert
# stacks, whose GEMMs fill the device anyway, stay alone.
GROUP_MAX_ELEMS = 1 << 22


def newton_schulz_grouped(xs, dims, steps: int = 5, coeffs=NS_COEFFS, eps: float = 1e-8,
                          max_elems: int = GROUP_MAX_ELEMS) -> list:
    """`newton_schulz` of every ``xs[i]`` under ``dims[i]``, with the leaves whose matrices have the
    same [R, O] shape and dtype (and at most ``max_elems`` elements per leaf) concatenated along the
    batch axis and orthogonalised together: one chain of batched matmuls per group instead of one per
    leaf. Every matrix is still orthogonalised on its own (its own Gram matrix and norm), so the
    result equals the per-leaf one up to the GEMMs' rounding.

    Args:
      xs: arrays of any rank; dims: their `MuonDimensionNumbers` (same length).
    Returns:
      list of arrays, each of its input's shape and dtype.
    """
    mats = [_to_matrices(x, d) for x, d in zip(xs, dims)]
    groups = {}
    for i, (m, _) in enumerate(mats):
        key = (m.shape[1:], m.dtype) if m.size <= max_elems else i
        groups.setdefault(key, []).append(i)
    out = [None] * len(mats)
    for members in groups.values():
        parts = [mats[i][0] for i in members]
        if len(parts) == 1:
            ys = [_newton_schulz_BRO(parts[0], steps, coeffs, eps)]
        else:
            ends = np.cumsum([p.shape[0] for p in parts])[:-1].tolist()
            ys = jnp.split(_newton_schulz_BRO(jnp.concatenate(parts, axis=0), steps, coeffs, eps), ends, axis=0)
        for i, y in zip(members, ys):
            out[i] = mats[i][1](y)
    return out


def _newton_schulz_BRO(x_BRO: jax.Array, steps: int, coeffs, eps: float) -> jax.Array:
    """The folded iteration on [B, R, O] matrices (see `newton_schulz`); same shape and dtype out."""
    a, b, c = (float(v) for v in coeffs)
    R, O = x_BRO.shape[1:]
    # The iteration runs on the short side: A is min(R, O) square. Contracting the long side in place
    # (rather than transposing X) keeps X where it is.
    gram_eq, apply_eq = ("bro,bso->brs", "brs,bso->bro") if R <= O else ("bro,brp->bop", "bop,brp->bro")
    n = min(R, O)
    lp = x_BRO.dtype  # the big matmuls' input dtype (bf16 under optim.mu_dtype='bfloat16')
    acc = jnp.promote_types(lp, jnp.float32)  # accumulation, and the dtype of M
    eye = jnp.eye(n, dtype=acc)

    def mm(eq, u, v, out=lp):
        # A dot whose output is its inputs' dtype is left plain: cuBLAS still accumulates in fp32,
        # and XLA keeps it a library GEMM where a fused fp32-to-bf16 convert made it a slower Triton
        # GEMM on the H200 (BENCHMARKS.md).
        if out == lp:
            return jnp.einsum(eq, u, v)
        return jnp.einsum(eq, u, v, preferred_element_type=out)

    def poly(A):
        # A @ A comes out in x's dtype like optax's; the sum that forms M is in fp32.
        A_lp = A.astype(lp)
        A2 = mm("bij,bjk->bik", A_lp, A_lp)
        return a * eye + b * A.astype(acc) + c * A2.astype(acc)

    def step(y, M):
        return mm(apply_eq, M.astype(lp), y)

    def gram(y, dtype=lp):
        return mm(gram_eq, y, y, dtype)

    if steps < 1:
        raise ValueError(f"Newton-Schulz needs at least one step, got {steps}")
    A0 = gram(x_BRO, acc)  # fp32: its trace is the squared norm
    scale = 1.0 / (jnp.sqrt(jnp.trace(A0, axis1=1, axis2=2)) + eps)[:, None, None]
    y = step(x_BRO, poly(A0 * scale * scale) * scale)
    for _ in range(steps - 1):
        y = step(y, poly(gram(y)))
    return y


def _is_dims(x) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)


def scale_by_muon(dims: dict, beta: float, mu_dtype=None, nesterov: bool = True, steps: int = 5,
                  coeffs=NS_COEFFS, eps: float = 1e-8, group_max_elems: int = 0) -> optax.GradientTransformation:
    """Muon's direction on the leaves of ``dims`` that are `MuonDimensionNumbers`: the bias-corrected
    (Nesterov) momentum, orthogonalised by :func:`newton_schulz` (``group_max_elems`` > 0: by
    :func:`newton_schulz_grouped` with that bound). The state is optax's ``MuonState`` and the
    momentum arithmetic is optax's, so this differs from ``optax.contrib.scale_by_muon`` only in how
    the polynomial is evaluated. ``dims`` has the structure of the (masked) updates."""
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def init_fn(params):
        return MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params, dtype=mu_dtype),
                         ns_coeffs=jnp.asarray(coeffs))

    def update_fn(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                                  optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        # dims leads: under optax.partition the Adam leaves (dims None) are MaskedNodes here.
        dims_leaves, treedef = jax.tree.flatten(dims, is_leaf=_is_dims)
        leaves = treedef.flatten_up_to(mu_hat)
        muon_idx = [i for i, d in enumerate(dims_leaves) if d is not None]
        xs, ds = [leaves[i] for i in muon_idx], [dims_leaves[i] for i in muon_idx]
        if group_max_elems > 0:
            ys = newton_schulz_grouped(xs, ds, steps, coeffs, eps, group_max_elems)
        else:
            ys = [newton_schulz(x, d, steps, coeffs, eps) for x, d in zip(xs, ds)]
        for i, y in zip(muon_idx, ys):
            leaves[i] = y
        out = treedef.unflatten(leaves)
        return out, MuonState(count=count, mu=optax.tree.cast(mu, mu_dtype), ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(init_fn, update_fn)


def _consistent_rms(dims: dict, rms: float) -> optax.GradientTransformation:
    """Scales each Muon leaf by rms * sqrt(max(fan_in, fan_out)), so its update RMS is about ``rms``."""
    def scale(u, d):
        if d is None:
            return u
        _, red, out = _matrix_axes(u.ndim, d)
        fan = max(math.prod(u.shape[a] for a in red), math.prod(u.shape[a] for a in out))
        return u * jnp.asarray(math.sqrt(fan) * rms, u.dtype)

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(lambda d, u: scale(u, d), dims, updates, is_leaf=_is_dims), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def muon(learning_rate, dims: dict, *, beta: float, eps: float, weight_decay: float, consistent_rms: float,
         adam_b1: float, adam_b2: float, adam_learning_rate, mu_dtype=None, nesterov: bool = True,
         steps: int = 5, group_max_elems: int = 0) -> optax.GradientTransformation:
    """``optax.contrib.muon`` with the folded Newton-Schulz (same arguments as used by `k3.optim`;
    same state tree): Muon on the leaves whose ``dims`` entry is a `MuonDimensionNumbers`, AdamW
    (Nesterov when ``nesterov``, no weight decay) on those where it is None. ``group_max_elems`` > 0
    orthogonalises same-shape leaves up to that size together (`newton_schulz_grouped`)."""
    labels = jax.tree.map(lambda d: "adam" if d is None else "muon", dims, is_leaf=_is_dims)
    return optax.partition(
        transforms={
            "muon": optax.chain(
                scale_by_muon(dims, beta, mu_dtype, nesterov, steps, NS_COEFFS, eps, group_max_elems),
                _consistent_rms(dims, consistent_rms),
                optax.add_decayed_weights(weight_decay),
                optax.scale_by_learning_rate(learning_rate),
            ),
            "adam": optax.adamw(learning_rate=adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=eps,
                                weight_decay=0.0, mu_dtype=mu_dtype, nesterov=nesterov),
        },
        param_labels=labels,
    )
