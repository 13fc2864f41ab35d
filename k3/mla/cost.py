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

from pallas_kernels.common import pow2_at_least_16

# Bytes per element of the named tensor, measured as the `k3.plan` docstring describes.
MLA_SCORE_BYTES = 16.0  # per attention score [B, H, T, S]: fp32 logits, exp, bf16 probabilities, mask


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


def _flash_core(N, H, dqk, dv, a, f):
    # Its inputs padded to powers of two (q, k to P(d_qk), v to P(d_v)), its output and log-sum-exp,
    # three int32 document indices per token; the output sliced back to d_v when that pads.
    sliced = N * H * dv * a if pow2_at_least_16(dv) > dv else 0
    return N * H * (2 * pow2_at_least_16(dqk) + 2 * pow2_at_least_16(dv)) * a + N * H * f + 12 * N + sliced


def _sdpa_core(N, H, dqk, dv, a, f):
    # jax.nn.dot_product_attention's inputs with v padded to d_qk, two fp32 row terms per query and
    # head, and the output as the layer reads it (XLA's softmax adds its scores, counted apart).
    return N * H * 3 * dqk * a + 2 * N * H * f + N * H * dv * a


# The attention core's residuals besides the scores, per `k3.mla.layer.ATTENTION` entry:
# (N tokens, H heads, d_qk, d_v, a, f) -> bytes. 'cudnn' and 'pallas' take the sdpa layout too;
# their kernels' own saved statistics cannot be traced without a GPU.
ATTENTION_CORE_BYTES = {"flash": _flash_core, "xla": _sdpa_core, "cudnn": _sdpa_core, "pallas": _sdpa_core}


def mla_residual_bytes(m, lay, a: int, qk_clip: bool) -> tuple[dict, float]:
    """Bytes one MLA layer keeps for its backward pass, per device, and its largest transient:
    ({'mla': bytes}, transient bytes).

    m: the model config; lay: the planner's layout; a: compute-dtype bytes; qk_clip: optim.qk_clip.
    N local tokens (b sequences of t), S the full sequence, H heads per device, r_q, r_kv the latent
    ranks, d_r the rope width:
      N D a                              the layer's input
      N r_q 2a + N f, N r_kv 2a + N f    each latent and its RMSNorm's output and inverse RMS (the
                                         query latent only with q_lora_rank > 0)
      2 N d_r f                          RoPE's cos and sin for q and k (with use_rope)
      2 N H d_v a                        the output gate's logits and the gated output (with the gate)
      the core's own residuals           `ATTENTION_CORE_BYTES` of the attention entry
      b H t S MLA_SCORE                  XLA's softmax keeps its scores (the context-parallel path
                                         materialises the same); the fused kernels do not
      context > 1: + the gathered k, v: b S H (d_qk + d_v) a
    Within 2% of the residuals JAX traces for the layer on the flash and XLA paths
    (`tests/test_plan.py::test_mla_residuals_are_what_the_traced_layer_keeps`).
    transient: the backward's score gradient, 8 b H t S, or QK-Clip's second score pass (fp32
    logits and mask, 9 b H t S); with a fused kernel QK-Clip's 5 b H t S, plus cuDNN's [b, 1, t, S]
    bool document mask.
    """
    f = 4
    N = lay.tokens
    q = m.mla
    H = q.n_heads // lay.mla_heads_div
    dqk, dv = q.qk_nope_dim + q.qk_rope_dim, q.v_head_dim
    scores = mla_scores(m, lay)
    fused = lay.attention != "xla"
    mla = 0.0 if fused else scores * MLA_SCORE_BYTES
    mla += N * m.d_model * a + N * q.kv_lora_rank * 2 * a + N * f
    if q.q_lora_rank > 0:
        mla += N * q.q_lora_rank * 2 * a + N * f
    if q.use_rope:
        mla += 2 * N * q.qk_rope_dim * f
    if q.output_gate:
        mla += 2 * N * H * dv * a
    mla += ATTENTION_CORE_BYTES[lay.attention](N, H, dqk, dv, a, f)
    if lay.cp > 1:
        mla += lay.micro * lay.seq * H * (dqk + dv) * a
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
