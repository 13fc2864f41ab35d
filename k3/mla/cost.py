"""What an MLA layer costs: the attention's forward FLOPs (summed by `k3.params`) and the bytes it
keeps for its backward and sends under context parallelism (summed by `k3.plan`).

The formulas sit in a module of their own, beside the layer and its attention backends rather than
in them, because their readers only do arithmetic on config values: the FLOP count and the planner
use them without building a layer, and a change to the layer or to a backend's residuals finds its
cost estimate in the same package.

Byte formulas read the planner's layout (`k3.plan.Layout`: local tokens and sequences, the head
divisor, the context-parallel degree, the `ATTENTION` entry the planned platform runs) and the
compute-dtype bytes ``a``; fp32 values count f = 4 bytes.
"""

from __future__ import annotations

# Bytes per element of the named tensor, measured as the `k3.plan` docstring describes.
MLA_SCORE_BYTES = 16.0  # per attention score [B, H, T, S]: fp32 logits, exp, bf16 probabilities, mask
MLA_LATENT_BYTES = 7.0  # per element of the q/kv latents (q_lora + kv_lora + rope) and their norms


def mla_flops(mla_cfg, seq_len: int, n_layers: int = 1) -> int:
    """Forward FLOPs per token of causal softmax attention in ``n_layers`` MLA layers at context
    ``seq_len`` (``model.mla``): H T (d_qk + d_v) per layer, i.e. 2 H T (d_qk + d_v) for the scores
    and the weighted values, halved by the causal mask. The projections are parameters (6N)."""
    a = mla_cfg
    return n_layers * a.n_heads * seq_len * (a.qk_nope_dim + a.qk_rope_dim + a.v_head_dim)


def mla_scores(m, lay) -> int:
    """Attention scores [b, H, t, S] one MLA layer forms per device: local sequences b, heads per
    device H, local queries t, keys S (the whole sequence)."""
    return lay.micro * (m.mla.n_heads // lay.mla_heads_div) * lay.t * lay.seq


def mla_residual_bytes(m, lay, a: int, qk_clip: bool) -> tuple[dict, float]:
    """Bytes one MLA layer keeps for its backward pass, per device, and its largest transient:
    ({'mla': bytes}, transient bytes).

    m: the model config; lay: the planner's layout; a: compute-dtype bytes; qk_clip: optim.qk_clip.
    N local tokens (b sequences of t), S the full sequence, H heads per device:
      b H t S MLA_SCORE                  XLA softmax attention (jax.nn.dot_product_attention without
                                         an implementation is the XLA path; the context-parallel path
                                         materialises the same scores); the fused kernels keep only
                                         the output and its log-sum-exp
      + N H ((5 d_qk + d_n + d_v) a + f + d_v (2 a + f))   q, kv up-projection, concatenated q and k,
                                         v padded to d_qk, output, output gate
      + N (r_q + r_kv + d_r) MLA_LATENT  latent projections and their norms
      context > 1: + the gathered k, v: b S H (d_qk + d_v) a
    transient: the backward's score gradient, 8 b H t S, or QK-Clip's second score pass (fp32
    logits and mask, 9 b H t S); with a fused kernel QK-Clip's 5 b H t S, plus cuDNN's [b, 1, t, S]
    bool document mask.
    """
    f = 4
    N = lay.tokens
    q = m.mla
    H = q.n_heads // lay.mla_heads_div
    dqk = q.qk_nope_dim + q.qk_rope_dim
    scores = mla_scores(m, lay)
    # XLA's softmax keeps the scores for the backward; the fused kernels keep only the output and
    # its log-sum-exp (counted below), and cuDNN takes the documents as a [B, 1, T, S] bool mask.
    fused = lay.attention != "xla"
    mla = 0.0 if fused else scores * MLA_SCORE_BYTES
    mla += N * H * ((5 * dqk + q.qk_nope_dim + q.v_head_dim) * a + f + q.v_head_dim * (2 * a + f))
    mla += N * (q.q_lora_rank + q.kv_lora_rank + q.qk_rope_dim) * MLA_LATENT_BYTES
    if lay.cp > 1:
        mla += lay.micro * lay.seq * H * (dqk + q.v_head_dim) * a
    if not fused:
        transient = scores * (9 if qk_clip else 8)
    else:  # QK-Clip's separate logit pass materialises fp32 scores and their mask whatever the kernel
        mask = lay.micro * lay.t * lay.seq if lay.attention == "cudnn" else 0
        transient = scores * 5 * qk_clip + mask
    return {"mla": mla}, transient


def mla_context_bytes(m, lay, a: int) -> int:
    """Bytes one MLA layer's context-parallel all-gather holds per pass, per device (the planner
    multiplies by cp - 1): its local keys and values, N H (d_qk + d_v) a, H heads per device."""
    return lay.tokens * (m.mla.n_heads // lay.mla_heads_div) * (
        m.mla.qk_nope_dim + m.mla.qk_rope_dim + m.mla.v_head_dim) * a
