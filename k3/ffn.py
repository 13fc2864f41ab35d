"""Gated feed-forward networks: SwiGLU (K2) and SiTU-GLU (K3).

SiTU-GLU(a, u) = b1*tanh(a/b1) * sigmoid(a) * b2*tanh(u/b2) with a = W_gate x, u = W_up x,
b1 = 4 and b2 = 25 in K3: each output is bounded by b1*b2 = 100, and it equals SwiGLU to first
order near 0 (b*tanh(z/b) = z + O(z^3/b^2)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3.nn import cast, normal, param


def glu_activation(gate: jax.Array, up: jax.Array, kind: str, beta_gate: float = 4.0,
                   beta_up: float = 25.0) -> jax.Array:
    """Gated activation of ``gate`` and ``up`` (same shape), computed in fp32, cast back.

    kind: 'swiglu' -> silu(gate) * up; 'situ' -> SiTU-GLU with the given betas.
    """
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    if kind == "swiglu":
        out = jax.nn.silu(g) * u
    elif kind == "situ":
        out = beta_gate * jnp.tanh(g / beta_gate) * jax.nn.sigmoid(g) * (beta_up * jnp.tanh(u / beta_up))
    else:
        raise ValueError(f"unknown activation {kind!r}; expected 'swiglu' or 'situ'")
    return out.astype(gate.dtype)


class GLUMLP(nnx.Module):
    """x_...D -> W_down act(W_gate x, W_up x): the dense FFN and the shared experts.

    Parameters: w_gate, w_up [D, F] (embed, mlp); w_down [F, D] (mlp, embed).
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str, init_std: float,
                 dtype, rngs: nnx.Rngs, beta_gate: float = 4.0, beta_up: float = 25.0,
                 in_axis: str = "embed"):
        self.activation, self.beta_gate, self.beta_up, self.dtype = activation, beta_gate, beta_up, dtype
        self.w_gate = param(rngs, normal(init_std), (d_model, d_ff), (in_axis, "mlp"))
        self.w_up = param(rngs, normal(init_std), (d_model, d_ff), (in_axis, "mlp"))
        self.w_down = param(rngs, normal(init_std), (d_ff, d_model), ("mlp", in_axis))

    def __call__(self, x_ND: jax.Array) -> jax.Array:
        x = x_ND.astype(self.dtype)
        gate = jnp.einsum("...d,df->...f", x, cast(self.w_gate, self.dtype))
        up = jnp.einsum("...d,df->...f", x, cast(self.w_up, self.dtype))
        h = glu_activation(gate, up, self.activation, self.beta_gate, self.beta_up)
        return jnp.einsum("...f,fd->...d", h, cast(self.w_down, self.dtype))
