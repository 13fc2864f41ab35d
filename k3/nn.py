"""Small building blocks shared by the layers: parameters with logical axes, dtypes, RMSNorm (and
the bytes it keeps for its backward, `NORM_BYTES`, which the planner's formulas share).

Every parameter carries logical axis names in its ``out_sharding`` metadata (``embed``, ``heads``,
``experts`` ...). Model code names only these; `k3.sharding` maps them onto a device mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

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


# Bytes an RMSNorm keeps for its backward per input element (its fp32 copy and the normalised
# product), measured as the `k3.plan` docstring describes.
NORM_BYTES = 8.0


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis; variance in fp32, result in x.dtype."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis of width ``dim`` with a learned gain (init 1)."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, axis_name: str = "norm"):
        self.eps = eps
        self.weight = param(rngs, ones, (dim,), (axis_name,))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        return rms_norm(x_BTD, self.weight[...], self.eps)


def cast(w: nnx.Param | jax.Array, dtype) -> jax.Array:
    """A parameter's value in the compute dtype."""
    value = w[...] if isinstance(w, nnx.Variable) else w
    return value.astype(dtype)
