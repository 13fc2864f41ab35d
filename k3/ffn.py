"""Gated feed-forward networks: SwiGLU (K2) and SiTU-GLU (K3).

SiTU-GLU(a, u) = b1*tanh(a/b1) * sigmoid(a) * b2*tanh(u/b2) with a = W_gate x, u = W_up x,
b1 = 4 and b2 = 25 in K3: each output is bounded by b1*b2 = 100, and it equals SwiGLU to first
order near 0 (b*tanh(z/b) = z + O(z^3/b^2)).

The bytes a gated FFN keeps for its backward and sends under tensor parallelism are here too
(`glu_bytes`, `dense_residual_bytes`, `dense_tensor_bytes`), for the planner (`k3.plan`) and for
the MoE's experts, which run the same activation (`k3.moe.cost`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3.nn import cast, compute_dtype, normal, param, recomputed


def _glu_parts(g, u, kind, beta_gate, beta_up):
    """(output, d out / d gate, d out / d up) of the gated activation, elementwise, in g's dtype."""
    if kind == "swiglu":
        sig = jax.nn.sigmoid(g)
        act = g * sig
        return act * u, u * sig * (1.0 + g * (1.0 - sig)), act
    if kind == "situ":
        sig = jax.nn.sigmoid(g)
        tg, tu = jnp.tanh(g / beta_gate), jnp.tanh(u / beta_up)
        a, b = beta_gate * tg * sig, beta_up * tu
        da = (1.0 - tg * tg) * sig + a * (1.0 - sig)
        return a * b, b * da, a * (1.0 - tu * tu)
    raise ValueError(f"unknown activation {kind!r}; expected 'swiglu' or 'situ'")


def glu_parts_output(gate, up, *, kind: str, beta_gate: float, beta_up: float):
    """The gated activation alone, elementwise in the inputs' dtype (for kernels that apply it to
    their own fp32 accumulators; `glu_activation` is the differentiable form)."""
    return _glu_parts(gate, up, kind, beta_gate, beta_up)[0]


# `jax.ad_checkpoint.checkpoint_name` of every gated activation's output, so a remat policy can keep
# it (`k3.model.REMAT_POLICIES`'s 'dots_kernels_glu') rather than recompute it for the down
# projection's weight gradient.
GLU_OUTPUT = "glu_output"
# The routed experts' gate and up products ([E, C, F] or [R, F]) and their combined outputs [N, k, W],
# named for `k3.model.REMAT_POLICIES`'s 'dots_kernels_glu_experts': the batched expert GEMMs have a
# batch dimension, so the 'dots' policies recompute them for the GLU's backward and the combine
# weights' gradient.
EXPERT_PRODUCTS = "expert_products"


def glu_activation(gate: jax.Array, up: jax.Array, kind: str, beta_gate: float = 4.0,
                   beta_up: float = 25.0) -> jax.Array:
    """Gated activation of ``gate`` and ``up`` (same shape, e.g. [N, F] or [E, C, F]), computed in
    fp32, cast back to gate's dtype; its output is named `GLU_OUTPUT` for remat policies.

    kind: 'swiglu' -> silu(gate) * up; 'situ' -> SiTU-GLU with the given betas.
    Its backward recomputes the activation from gate and up in one elementwise pass, where autodiff
    saved fp32 intermediates of the whole hidden for a second pass to read: on the H200, K2 1024:12
    without remat lost 15 GiB of peak memory and 18 ms per step of expert dispatch and copies with
    it (BENCHMARKS.md). Reverse mode only (a custom VJP).
    """
    return checkpoint_name(_glu(gate, up, kind, beta_gate, beta_up), GLU_OUTPUT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _glu(gate, up, kind, beta_gate, beta_up):
    dt = compute_dtype(gate, up)
    return _glu_parts(gate.astype(dt), up.astype(dt), kind, beta_gate, beta_up)[0].astype(gate.dtype)


def _glu_fwd(gate, up, kind, beta_gate, beta_up):
    return _glu(gate, up, kind, beta_gate, beta_up), (gate, up)


def _glu_bwd(kind, beta_gate, beta_up, res, dout):
    gate, up = recomputed(res)
    dt = compute_dtype(gate, up)
    _, d_gate, d_up = _glu_parts(gate.astype(dt), up.astype(dt), kind, beta_gate, beta_up)
    d = dout.astype(dt)
    return (d * d_gate).astype(gate.dtype), (d * d_up).astype(up.dtype)


_glu.defvjp(_glu_fwd, _glu_bwd)


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
        return self.down(self.hidden(x_ND))

    def down(self, hidden_NF: jax.Array) -> jax.Array:
        """W_down of a hidden [..., F] (`hidden`'s output) -> [..., D]."""
        return jnp.einsum("...f,fd->...d", hidden_NF, cast(self.w_down, self.dtype))

    def hidden(self, x_ND: jax.Array) -> jax.Array:
        """act(W_gate x, W_up x): [..., F] in the compute dtype, what W_down reads."""
        x = x_ND.astype(self.dtype)
        gate = jnp.einsum("...d,df->...f", x, cast(self.w_gate, self.dtype))
        up = jnp.einsum("...d,df->...f", x, cast(self.w_up, self.dtype))
        return glu_activation(gate, up, self.activation, self.beta_gate, self.beta_up)


def glu_bytes(a: int) -> float:
    """Bytes a gated FFN keeps for its backward per hidden element, at ``a`` compute-dtype bytes:
    gate and up, which `glu_activation`'s VJP saves (it recomputes the activation's derivative from
    them), and the activation's output, which the down projection's weight gradient reads. On the
    H200 that VJP cut K2 1024:12's measured peak from 60.7 to 45.6 GiB at 32K tokens without remat
    (BENCHMARKS.md), autodiff having kept about 18 bytes per hidden element (SwiGLU; 22 for SiTU)."""
    return 3.0 * a


def dense_residual_bytes(m, lay, a: int, qk_clip: bool) -> tuple[dict, float]:
    """Bytes one dense FFN layer keeps for its backward pass, per device: ({'ffn': bytes}, 0).

    m: the model config; lay: the planner's layout (`k3.plan.Layout`: local tokens N, the FFN-width
    divisor); a: compute-dtype bytes. N F GLU + N D a: the hidden activations at F = dense_ffn_dim
    per device (GLU = `glu_bytes`) and the output. No transient; ``qk_clip`` is MLA's setting (the
    planner's per-layer formulas share one signature).
    """
    del qk_clip
    N, D = lay.tokens, m.d_model
    return {"ffn": N * (m.dense_ffn_dim // lay.mlp_div) * glu_bytes(a) + N * D * a}, 0


def dense_tensor_bytes(m, lay, a: int, tp: int) -> list[float]:
    """Bytes each tensor-parallel collective of one dense FFN layer sends per device and pass over a
    tensor group of ``tp``: the all-reduce of its output, N D a 2 (tp - 1) / tp."""
    return [lay.tokens * m.d_model * a * (2 * (tp - 1) / tp)]
