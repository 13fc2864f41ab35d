"""Small building blocks shared by the layers: parameters with logical axes, dtypes, RMSNorm (and
the bytes it keeps for its backward, `norm_bytes`, which the planner's formulas share).

Every parameter carries logical axis names in its ``out_sharding`` metadata (``embed``, ``heads``,
``experts`` ...). Model code names only these; `k3.sharding` maps them onto a device mesh.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.common import compute_dtype  # one definition for the library and its kernels

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def param(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: Sequence[int],
    axes: Sequence[str | None],
    dtype=jnp.float32,
) -> nnx.Param:
    """A trainable parameter of ``shape`` named by logical ``axes`` (one name per dimension)."""
    if len(axes) != len(shape):
        raise ValueError(f"param of shape {tuple(shape)} needs {len(shape)} axis names, got {axes}")
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=tuple(axes))


def normal(std: float) -> Initializer:
    """N(0, std^2) initializer."""
    return jax.nn.initializers.normal(stddev=std)


def ones(key, shape, dtype=jnp.float32):
    """All-ones initializer (norm gains)."""
    del key
    return jnp.ones(shape, dtype)


def zeros(key, shape, dtype=jnp.float32):
    """All-zeros initializer."""
    del key
    return jnp.zeros(shape, dtype)


def norm_bytes(a: int) -> float:
    """Bytes an RMSNorm keeps for its backward per input element at ``a`` compute-dtype bytes: its
    input (`rms_norm`'s VJP recomputes the rest; the inverse RMS per row is negligible)."""
    return float(a)


def recomputed(residuals):
    """``residuals`` (any pytree) behind `jax.lax.optimization_barrier`, for a custom VJP's backward
    that recomputes forward values from them. Without the barrier XLA merges the recomputation with
    the forward's identical expressions (common subexpressions, when no remat separates the two) and
    the forward then writes those intermediates to memory in fp32 for the backward to read, the
    traffic the recomputation was meant to avoid: for SiTU-GLU's experts in K3 1024:12, two fp32
    copies of every [E, C, F] hidden (BENCHMARKS.md)."""
    return jax.lax.optimization_barrier(residuals)


def _einsum_terms(eq: str) -> tuple[str, str, str]:
    """(x, w, y) index strings of a two-operand einsum 'x,w->y' whose every index appears in at least
    two of the three (no index summed within one operand), so both transposes are einsums too."""
    ins, _, y = eq.replace(" ", "").partition("->")
    x, _, w = ins.partition(",")
    if not (y and x and w) or "." in eq or any((c in x) + (c in w) + (c in y) < 2 for c in set(x + w + y)):
        raise ValueError(f"weight_einsum: {eq!r} must be 'x,w->y' with every index in two of the three terms")
    return x, w, y


_CONTEXT = threading.local()  # per thread: another thread may be tracing another step meanwhile


def _fp32_weight_grads_stack() -> list[bool]:
    return _CONTEXT.__dict__.setdefault("fp32_weight_grads", [])


@contextlib.contextmanager
def fp32_weight_grads():
    """Inside (while tracing), `weight_einsum` returns its weight gradient in fp32 straight from the
    GEMM. The train step enters it under gradient accumulation (`k3.steps`)."""
    _fp32_weight_grads_stack().append(True)
    try:
        yield
    finally:
        _fp32_weight_grads_stack().pop()


def weight_einsum(eq: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """jnp.einsum(eq, x, w) for a weight w, e.g. 'ecd,edf->ecf': x [E, C, D], w [E, D, F] -> [E, C, F].

    Inside `fp32_weight_grads` its gradient with respect to w comes out of the GEMM in fp32 (float64
    for float64 weights) whatever w's dtype, and x's in x's dtype. Why: under gradient accumulation
    the step adds each micro-batch's gradients into an fp32 sum. A bf16 weight gradient is written,
    read back, converted and added (12 bytes per parameter and micro-batch); an fp32 one lets XLA
    fold the add into the GEMM (8 bytes) and rounds nothing. Without accumulation the bf16 gradient
    moves fewer bytes, so outside the context this is the plain einsum."""
    if _fp32_weight_grads_stack():
        _einsum_terms(eq)
        return _fp32_grad_einsum(eq, x, w)
    return jnp.einsum(eq, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp32_grad_einsum(eq, x, w):
    # The weight's cotangent dtype differs from a bf16 w's, which JAX's custom VJPs accept.
    return jnp.einsum(eq, x, w)


def _weight_einsum_fwd(eq, x, w):
    return jnp.einsum(eq, x, w), (x, w)


def _weight_einsum_bwd(eq, res, dy):
    x, w = res
    xs, ws, ys = _einsum_terms(eq)
    dx = jnp.einsum(f"{ys},{ws}->{xs}", dy, w).astype(x.dtype)
    dw = jnp.einsum(f"{xs},{ys}->{ws}", x, dy, preferred_element_type=jnp.promote_types(w.dtype, jnp.float32))
    return dx, dw


_fp32_grad_einsum.defvjp(_weight_einsum_fwd, _weight_einsum_bwd)


@functools.partial(jax.checkpoint, static_argnums=(2,))
def sigmoid_gated(x: jax.Array, gate: jax.Array, dtype) -> jax.Array:
    """x * sigmoid(gate) computed in fp32, returned in ``dtype``: x and gate of one shape [...].

    Under `jax.checkpoint` autodiff keeps x and gate as given (bf16) and recomputes the product in the
    backward, instead of keeping three fp32 intermediates of x's size that XLA mostly fuses away."""
    return (x.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis: x [..., D], weight [D] -> [..., D] in
    x.dtype, computed in fp32 (float64 for float64 x).

    Its backward keeps x as given and the inverse RMS per row, and recomputes the normalised x:
    autodiff kept three fp32 copies of x's size (x, x r, x r w) for every norm.
    With xh = x r and u = dy w:  dx = r (u - xh mean(u xh)),  dweight = sum over rows of dy xh.
    Reverse mode only (a custom VJP).
    """
    return _rms_norm_fwd(x, weight, eps)[0]


def _rms_norm_fwd(x, weight, eps):
    dt = compute_dtype(x)
    x32 = x.astype(dt)
    r = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (x32 * r * weight.astype(dt)).astype(x.dtype), (x, weight, r)


def _rms_norm_bwd(eps, res, dy):
    del eps
    x, weight, r = recomputed(res)
    xh = x.astype(r.dtype) * r
    dy = dy.astype(r.dtype)
    u = dy * weight.astype(r.dtype)
    dx = r * (u - xh * jnp.mean(u * xh, axis=-1, keepdims=True))
    dw = jnp.sum((dy * xh).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dw.reshape(weight.shape).astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis of width ``dim`` with a learned gain (init 1)."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, axis_name: str = "norm"):
        self.eps = eps
        self.weight = param(rngs, ones, (dim,), (axis_name,))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        return rms_norm(x_BTD, self.weight[...], self.eps)


# `jax.ad_checkpoint.checkpoint_name` of every parameter cast to the compute dtype, so a remat policy
# can keep the cast copy (`k3.model.REMAT_POLICIES`'s '*_kernels' policies) instead of converting
# the fp32 parameter again when the layer is recomputed.
WEIGHT_CAST = "weight_cast"


def cast(w: nnx.Param | jax.Array, dtype) -> jax.Array:
    """A parameter's value in the compute dtype, named `WEIGHT_CAST` for remat policies."""
    value = w[...] if isinstance(w, nnx.Variable) else w
    return checkpoint_name(value.astype(dtype), WEIGHT_CAST)


# Serving layout of a layer's input projections: the weights [D, *rest] that all read the layer's
# input x, concatenated once into one [D, N] matrix. A decode step multiplies a few rows of x by each
# of them; XLA then merges those small dots into one by concatenating the weights, which copies every
# one of them at every step. Stored fused, the step reads them once, in one matmul.
FUSED_INPUTS = "w_in"


def project_inputs(layer: nnx.Module, x_BTD: jax.Array, names: Sequence[str], dtype) -> list[jax.Array]:
    """The named input projections of ``layer``: x [B, T, D] times each weight [D, *rest] ->
    [B, T, *rest] in ``dtype``, one matmul when `fuse_inputs` has fused them (same values up to the
    matmul's rounding)."""
    fused = getattr(layer, FUSED_INPUTS, None)
    if fused is None:
        ws = [getattr(layer, n) for n in names]
        return [jnp.einsum(f"btd,d{'hkjl'[:w.ndim - 1]}->bt{'hkjl'[:w.ndim - 1]}", x_BTD, cast(w, dtype))
                for w in ws]
    y, starts = project_columns(layer, x_BTD, [n for n, _ in layer.fused_shapes], dtype)
    rest = dict(layer.fused_shapes)
    return [y[..., starts[n]:starts[n] + math.prod(rest[n])].reshape(x_BTD.shape[:2] + tuple(rest[n])) for n in names]


def project_columns(layer: nnx.Module, x_BTD: jax.Array, names: Sequence[str], dtype) -> tuple[jax.Array, dict]:
    """(y [B, T, N], {name: first column}): `project_inputs`' outputs flattened past [B, T] and side by
    side in ``names``' order. With `fuse_inputs`' layout in that order y is its matmul's output as is,
    so a kernel can take it whole instead of XLA copying column slices out of it."""
    fused = getattr(layer, FUSED_INPUTS, None)
    if fused is not None and [n for n, _ in layer.fused_shapes] == list(names):
        y = jnp.einsum("btd,dn->btn", x_BTD, cast(fused, dtype))
        sizes = [math.prod(rest) for _, rest in layer.fused_shapes]
    else:
        parts = [p.reshape(x_BTD.shape[:2] + (-1,)) for p in project_inputs(layer, x_BTD, names, dtype)]
        y, sizes = jnp.concatenate(parts, axis=-1), [p.shape[-1] for p in parts]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return y, dict(zip(names, starts))


def fuse_inputs(layer: nnx.Module, names: Sequence[str]) -> None:
    """Replaces ``layer``'s input-projection weights ``names`` (each [D, *rest], unstacked) by one
    [D, sum(prod(rest))] parameter `FUSED_INPUTS`, in place; `project_inputs` reads either layout.
    For serving (`k3.model.served`): the fused matrix is one parameter, so training it would change
    Muon's per-matrix orthogonalisation."""
    ws = [getattr(layer, n) for n in names]
    D = ws[0].shape[0]
    if any(w.ndim < 2 or w.shape[0] != D for w in ws):
        raise ValueError(f"fuse_inputs: {names} must all be [D, ...] with one D, got {[w.shape for w in ws]}")
    setattr(layer, FUSED_INPUTS, nnx.Param(jnp.concatenate([w[...].reshape(D, -1) for w in ws], axis=1),
                                           out_sharding=("embed", None)))
    layer.fused_shapes = tuple((n, tuple(w.shape[1:])) for n, w in zip(names, ws))
    for n in names:
        setattr(layer, n, None)
