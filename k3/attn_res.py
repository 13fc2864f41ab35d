"""Residual streams: plain pre-norm residuals (K2) and Block Attention Residuals (K3).

Block AttnRes replaces ``h + f(norm(h))``. Each sublayer reads a softmax mix, over depth, of the
candidates [token embedding, completed block sums..., running partial sum of the current block]:
    logit_m = sum_d w_d * gamma_d * v_md / rms(v_m),   input = sum_m softmax(logit)_m * v_m
with a learned pseudo-query w (zero-initialised, so the first mix is a uniform mean) and an
RMSNorm gain gamma, softmax in fp32. A block is ``attn_res_block_size`` layers; its sum (attention
and FFN outputs) joins the bank when the next block starts.

The stream is a pytree of fixed shapes (the bank is a buffer of ``n_slots`` with a count), so a
scanned layer stack can carry it and block boundaries can depend on a traced layer index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3.nn import ones, param, zeros


class AttnResMix(nnx.Module):
    """One depth mix: pseudo-query [D] (init 0) and key-norm gain [D] (init 1)."""

    def __init__(self, d_model: int, eps: float, *, rngs: nnx.Rngs):
        self.eps = eps
        self.query = param(rngs, zeros, (d_model,), ("embed",))
        self.norm = param(rngs, ones, (d_model,), ("embed",))

    def __call__(self, cands_MBTD: jax.Array, valid_M: jax.Array) -> jax.Array:
        """Mix of the valid candidates. cands: [M, B, T, D]; valid: [M] bool -> [B, T, D]."""
        with jax.named_scope("attn_res"):
            v = cands_MBTD.astype(jnp.float32)
            rstd = jax.lax.rsqrt(jnp.mean(jnp.square(v), axis=-1) + self.eps)  # [M, B, T]
            w = (self.query[...] * self.norm[...]).astype(jnp.float32)
            logits = jnp.einsum("mbtd,d->mbt", v, w) * rstd
            logits = jnp.where(valid_M[:, None, None], logits, -jnp.inf)
            p = jax.nn.softmax(logits, axis=0)
            return jnp.einsum("mbt,mbtd->btd", p, v).astype(cands_MBTD.dtype)


def n_bank_slots(n_layers: int, block_size: int) -> int:
    """Bank capacity: the embedding plus every block that can complete before the output mix."""
    return 1 + -(-n_layers // block_size)


def init_stream(emb_BTD: jax.Array, residual: str, n_slots: int) -> dict:
    """Starting stream from the token embedding."""
    if residual == "plain":
        return {"h": emb_BTD}
    bank = jnp.zeros((n_slots,) + emb_BTD.shape, emb_BTD.dtype).at[0].set(emb_BTD)
    return {"bank": bank, "count": jnp.ones((), jnp.int32), "partial": jnp.zeros_like(emb_BTD),
            "has_partial": jnp.zeros((), bool)}


def read(stream: dict, mix: AttnResMix | None) -> jax.Array:
    """The input of the next sublayer (before its pre-norm): [B, T, D]."""
    if "h" in stream:
        return stream["h"]
    bank = stream["bank"]
    cands = jnp.concatenate([bank, stream["partial"][None]], axis=0)
    valid = jnp.concatenate([jnp.arange(bank.shape[0]) < stream["count"], stream["has_partial"][None]])
    return mix(cands, valid)


def add_attention(stream: dict, out_BTD: jax.Array, layer_idx, block_size: int) -> dict:
    """Adds an attention sublayer's output; at a block's first layer the finished block is banked."""
    if "h" in stream:
        return {"h": stream["h"] + out_BTD.astype(stream["h"].dtype)}
    out = out_BTD.astype(stream["partial"].dtype)
    starts = (layer_idx % block_size) == 0
    push = jnp.logical_and(starts, stream["has_partial"])
    count = stream["count"]
    pushed = jax.lax.dynamic_update_index_in_dim(stream["bank"], stream["partial"], count, axis=0)
    return {
        "bank": jnp.where(push, pushed, stream["bank"]),
        "count": count + push.astype(jnp.int32),
        "partial": jnp.where(starts, out, stream["partial"] + out),
        "has_partial": jnp.ones((), bool),
    }


def add_ffn(stream: dict, out_BTD: jax.Array) -> dict:
    """Adds an FFN sublayer's output to the running sum."""
    if "h" in stream:
        return {"h": stream["h"] + out_BTD.astype(stream["h"].dtype)}
    return {**stream, "partial": stream["partial"] + out_BTD.astype(stream["partial"].dtype)}
