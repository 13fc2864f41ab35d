"""Input contract of the KDA cores, shared by the jnp reference (`k3.kda.ops`) and the Pallas kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def validate_kda_inputs(q, k, v, g, beta, initial_state=None, segment_ids=None, cu_seqlens=None):
    """Checks the shapes of a KDA core's arguments (q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
    initial_state [B, H, K, V]; segment_ids [B, T] or cu_seqlens [N + 1]); returns (B, T, H, K, V)."""
    q_shape = jnp.shape(q)
    if len(q_shape) != 4:
        raise ValueError(f"q must be [B, T, H, K]; got shape {q_shape}")
    B, T, H, K = q_shape
    if jnp.shape(k) != q_shape:
        raise ValueError(f"k must have the shape of q {q_shape} ([B, T, H, K]); got {jnp.shape(k)}")
    v_shape = jnp.shape(v)
    if len(v_shape) != 4 or v_shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with (B, T, H) = {(B, T, H)}; got shape {v_shape}")
    V = v_shape[3]
    if jnp.shape(g) != q_shape:
        raise ValueError(f"g must have the shape of q {q_shape} ([B, T, H, K]); got {jnp.shape(g)}")
    if jnp.shape(beta) != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}; got shape {jnp.shape(beta)}")
    if initial_state is not None and jnp.shape(initial_state) != (B, H, K, V):
        raise ValueError(
            f"initial_state must be [B, H, K, V] = {(B, H, K, V)}; got shape {jnp.shape(initial_state)}"
        )
    if segment_ids is not None and jnp.shape(segment_ids) != (B, T):
        raise ValueError(f"segment_ids must be [B, T] = {(B, T)}; got shape {jnp.shape(segment_ids)}")
    if cu_seqlens is not None:
        validate_cu_seqlens(cu_seqlens, B, T, segment_ids)
    return B, T, H, K, V


def validate_cu_seqlens(cu_seqlens, B, T, segment_ids):
    """Packed-row boundaries: one row (B = 1), rising from 0 to T, not together with segment_ids."""
    if segment_ids is not None:
        raise ValueError("pass either segment_ids or cu_seqlens, not both")
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (packed rows); got B = {B}")
    cu_shape = jnp.shape(cu_seqlens)
    if len(cu_shape) != 1 or cu_shape[0] < 2:
        raise ValueError(f"cu_seqlens must be [N + 1] with N >= 1; got shape {cu_shape}")
    try:
        cu = np.asarray(cu_seqlens)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return  # traced values can only be checked for shape
    if cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T}; got {cu.tolist()}")
