"""Residual streams: plain pre-norm residuals (K2) and Block Attention Residuals (K3).

Block AttnRes replaces ``h + f(norm(h))``. Each sublayer reads a softmax mix, over depth, of the
candidates [token embedding, completed block sums..., running partial sum of the current block]:
    logit_m = sum_d w_d * gamma_d * v_md / rms(v_m),   input = sum_m softmax(logit)_m * v_m
with a learned pseudo-query w (zero-initialised, so the first mix is a uniform mean) and an
RMSNorm gain gamma, softmax in fp32. A block is ``attn_res_block_size`` layers; its sum (attention
and FFN outputs) joins the bank when the next block starts.

The stream is a pytree of fixed shapes (the bank is a buffer of ``n_slots`` with a count), so a
scanned layer stack can carry it and block boundaries can depend on a traced layer index.

What the depth mixes cost is here too: their forward FLOPs (`attn_res_flops`, summed by
`k3.params`), and the bytes a layer's mixes keep for the backward and a layer boundary saves
(`attn_res_bytes`, `stream_carry_bytes`, summed by `k3.plan`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3.nn import ones, param, zeros

# Bytes per candidate element [M, N, D] of one depth mix (fp32 candidates and their squares),
# measured as the `k3.plan` docstring describes.
ATTN_RES_BYTES = 12.0


class AttnResMix(nnx.Module):
    """One depth mix: pseudo-query [D] (init 0) and key-norm gain [D] (init 1)."""

    def __init__(self, d_model: int, eps: float, *, rngs: nnx.Rngs):
        self.eps = eps
        self.query = param(rngs, zeros, (d_model,), ("embed",))
        self.norm = param(rngs, ones, (d_model,), ("embed",))

    def __call__(self, cands_MBTD: jax.Array, valid_M: jax.Array, extra_BTD: jax.Array | None = None,
                 extra_valid=None) -> jax.Array:
        """Mix of the valid candidates -> [B, T, D].

        cands: [M, B, T, D]; valid: [M] bool; extra: an optional further candidate [B, T, D] with its
        validity (a bool scalar). Passing the running partial sum as ``extra`` instead of
        concatenating it to the bank keeps the [M + 1, B, T, D] copy out of every sublayer.
        """
        with jax.named_scope("attn_res"):
            w = (self.query[...] * self.norm[...]).astype(jnp.float32)

            def logits(v):  # [..., B, T, D] fp32 -> [..., B, T]
                rstd = jax.lax.rsqrt(jnp.mean(jnp.square(v), axis=-1) + self.eps)
                return jnp.einsum("...btd,d->...bt", v, w) * rstd

            v = cands_MBTD.astype(jnp.float32)
            lg = jnp.where(valid_M[:, None, None], logits(v), -jnp.inf)  # [M, B, T]
            if extra_BTD is None:
                p = jax.nn.softmax(lg, axis=0)
                return jnp.einsum("mbt,mbtd->btd", p, v).astype(cands_MBTD.dtype)
            ve = extra_BTD.astype(jnp.float32)
            le = jnp.where(extra_valid, logits(ve), -jnp.inf)  # [B, T]
            top = jnp.maximum(jnp.max(lg, axis=0), le)
            top = jnp.where(jnp.isfinite(top), top, 0.0)
            e, ee = jnp.exp(lg - top), jnp.exp(le - top)
            out = jnp.einsum("mbt,mbtd->btd", e, v) + ee[..., None] * ve
            return (out / (jnp.sum(e, axis=0) + ee)[..., None]).astype(cands_MBTD.dtype)


def n_bank_slots(n_layers: int, block_size: int) -> int:
    """Bank capacity: the embedding plus every block that can complete before the output mix."""
    return 1 + -(-n_layers // block_size)


def attn_res_candidates(n_layers: int, block_size: int) -> int:
    """Total number of depth-mix candidates over all mixes (2 per layer + the output mix)."""
    total, completed = 0, 0
    for layer in range(n_layers):
        # Attention mix: embedding, completed blocks, and the partial (at a block start: the block
        # that just finished, banked right after); layer 0's attention reads the embedding alone.
        total += 1 if layer == 0 else 2 + completed
        if layer > 0 and layer % block_size == 0:
            completed += 1
        total += 2 + completed  # FFN mix: the partial now holds this layer's attention output
    return total + 1 + completed + 1


def attn_res_flops(m) -> float:
    """Forward FLOPs per token of all of a model's depth mixes (model config ``m``): 6 D per
    candidate (`attn_res_candidates`): a multiply-add per element each for its mean square, its logit
    and the weighted sum; 0.0 with plain residuals."""
    if m.residual != "attn_res":
        return 0.0
    return 6 * m.d_model * attn_res_candidates(m.n_layers, m.attn_res_block_size)


def attn_res_bytes(m, tokens: int) -> dict:
    """Bytes one layer's two depth mixes keep for the backward, per device: {'attn_res': 2
    ATTN_RES M N D} over M = bank slots + 1 candidates of N = ``tokens`` local tokens and D =
    d_model; {} with plain residuals."""
    if m.residual != "attn_res":
        return {}
    M = n_bank_slots(m.n_layers, m.attn_res_block_size) + 1
    return {"attn_res": 2 * ATTN_RES_BYTES * M * tokens * m.d_model}


def stream_carry_bytes(m, tokens: int, a: int) -> int:
    """Bytes of the stream saved at a layer boundary, per device, in a-byte compute dtype: the bank
    plus the partial sum (bank slots + 1) N D a under Block AttnRes, the hidden state N D a with
    plain residuals (N = ``tokens`` local tokens, D = d_model)."""
    if m.residual == "attn_res":
        return (n_bank_slots(m.n_layers, m.attn_res_block_size) + 1) * tokens * m.d_model * a
    return tokens * m.d_model * a


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
    return mix(bank, jnp.arange(bank.shape[0]) < stream["count"], stream["partial"], stream["has_partial"])


def add_attention(stream: dict, out_BTD: jax.Array, layer_idx, block_size: int) -> dict:
    """Adds an attention sublayer's output; at a block's first layer the finished block is banked."""
    if "h" in stream:
        return {"h": stream["h"] + out_BTD.astype(stream["h"].dtype)}
    out = out_BTD.astype(stream["partial"].dtype)
    starts = (layer_idx % block_size) == 0
    push = jnp.logical_and(starts, stream["has_partial"])
    count = stream["count"]
    # One slot is written either way (with its own value when nothing is pushed): a select between
    # the whole old and new bank would copy all of it at every layer.
    bank = stream["bank"]
    slot = jnp.where(push, stream["partial"], jax.lax.dynamic_index_in_dim(bank, count, 0, keepdims=False))
    return {
        "bank": jax.lax.dynamic_update_index_in_dim(bank, slot, count, axis=0),
        "count": count + push.astype(jnp.int32),
        "partial": jnp.where(starts, out, stream["partial"] + out),
        "has_partial": jnp.ones((), bool),
    }


def add_ffn(stream: dict, out_BTD: jax.Array) -> dict:
    """Adds an FFN sublayer's output to the running sum."""
    if "h" in stream:
        return {"h": stream["h"] + out_BTD.astype(stream["h"].dtype)}
    return {**stream, "partial": stream["partial"] + out_BTD.astype(stream["partial"].dtype)}
