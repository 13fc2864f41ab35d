"""Helpers every Pallas kernel module here shares: where the kernels run and how operands are padded."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

# `jax.ad_checkpoint.checkpoint_name` labels of what each kernel's custom_vjp saves for its backward,
# so a remat policy can keep them (`k3.model.REMAT_POLICIES`) instead of running the kernel's
# forward a second time inside the backward pass.
KDA_RESIDUALS = "kda_residuals"
ATTENTION_RESIDUALS = "attention_residuals"


def default_interpret() -> bool:
    """Whether kernels called with ``interpret=None`` run in Pallas interpret mode: off a GPU, or as
    the ``K3_PALLAS_INTERPRET`` environment variable says ('0'/'false'/'' = compiled)."""
    env = os.environ.get("K3_PALLAS_INTERPRET")
    if env is not None:
        return env not in ("0", "false", "False", "")
    return jax.default_backend() != "gpu"


def pow2_at_least_16(n: int) -> int:
    """The smallest power of two >= max(n, 16): Triton tiles need power-of-two sides of 16 or more."""
    return max(16, 1 << (int(n) - 1).bit_length())


def document_index(segment_ids_BT, cu_seqlens, B, T):
    """[B, T] int32 index of each token's document within its row: 0, 0, ..., 1, 1, ..., 2, ...

    Counting id changes (rather than comparing ids) makes documents contiguous runs, so masks built
    from "same document" can never join two separate runs that happen to reuse an id.
    """
    if cu_seqlens is not None:
        token_BT = jnp.arange(T)[None, :]
        return (jnp.searchsorted(jnp.asarray(cu_seqlens), token_BT, side="right") - 1).astype(jnp.int32)
    if segment_ids_BT is None:
        return jnp.zeros((B, T), jnp.int32)
    seg_BT = jnp.asarray(segment_ids_BT)
    starts_BT1 = (seg_BT[:, 1:] != seg_BT[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.cumsum(starts_BT1, axis=1)], axis=1)


def tile_dot(a, b, contract, exact: bool):
    """A kernel's 2-D dot_general over the ``contract`` dims ((lhs,), (rhs,)) with fp32 accumulation;
    ``exact`` (fp32 operands) asks for full precision, which Triton would otherwise run as TF32."""
    prec = lax.Precision.HIGHEST if exact else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (contract, ((), ())), precision=prec, preferred_element_type=jnp.float32)


def triton_params(interpret: bool, num_warps: int, num_stages: int):
    """A pallas_call's Triton launch parameters; None in interpret mode (nothing is compiled)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
