"""What a KDA layer costs: forward FLOPs (summed by `k3.params`) and the bytes it keeps for its
backward and sends under context parallelism (summed by `k3.plan`).

The formulas sit in a module of their own, beside the layer and its cores rather than in them,
because their readers only do arithmetic on config values: the FLOP count and the planner use them
without building a layer, and a change to the layer or to a core's residuals finds its cost
estimate in the same package.

Byte formulas read the planner's layout (`k3.plan.Layout`: local tokens and sequences, the head
divisor, the context-parallel degree, the KDA core the planned platform runs) and the compute-dtype
bytes ``a``; fp32 values count f = 4 bytes.
"""

from __future__ import annotations

# Bytes per element of N*H*K that a KDA layer keeps for its backward besides its input (N D a),
# fitted to the residuals JAX traces for the layer in bf16 (K 32-128, C 16-64; within 0.3%,
# `tests/test_plan.py::test_kda_residuals_are_what_the_traced_layer_keeps`):
# the jnp chunked core with XLA's conv branches, a + b C/K + c K/C + d C;
KDA_CHUNK_FIT = (370.4, 43.2, 7.76, 1.91)
# outside the Pallas core's own residuals, per conv backend (`k3.kda.layer.CONV_BACKENDS`): projections,
# conv branches, gates and the output norm. The Pallas conv kernels keep 131 bytes less than XLA's conv.
# (Fitted when the Pallas core's gate clamp kept a 1-byte mask outside the core: 1 less since the core
# keeps the raw gate instead, `kda_pallas_core_bytes`.)
KDA_LAYER_BYTES = {"pallas": 38.2, "xla": 169.5}


def kda_core_flops(K: int, V: int, C: int) -> float:
    """Forward FLOPs per token per head of the chunked KDA core at key width K, value width V and
    chunk C: 6KV + 2C(K+V) + 2CV + 2.5CK + 2C^2/3 (kda_kernels.md A.7)."""
    return 6 * K * V + 2 * C * (K + V) + 2 * C * V + 2.5 * C * K + 2 * C * C / 3


def kda_flops(kda_cfg, n_layers: int = 1) -> float:
    """Forward FLOPs per token of the KDA cores of ``n_layers`` layers (``model.kda``: every head at
    K = V = head_dim and chunk_size). The layer count multiplies the integer head count before the
    fractional per-head cost, so that a model's total is rounded once."""
    k = kda_cfg
    return n_layers * k.n_heads * kda_core_flops(k.head_dim, k.head_dim, k.chunk_size)


def kda_chunk_layer_bytes(chunk_size: int, head_dim: int) -> float:
    """Bytes per element of N*H*K that a whole KDA layer (XLA conv branches) keeps for its backward on
    a jnp core ('chunk', 'reference', 'recurrent'), besides its input: `KDA_CHUNK_FIT` at chunk C and
    head dim K."""
    a, b, c, d = KDA_CHUNK_FIT
    C, K = chunk_size, head_dim
    return a + b * C / K + c * K / C + d * C


def kda_pallas_core_bytes(chunk_size: int, head_dim: int, a: int) -> float:
    """Bytes per element of N*H*K of the Pallas KDA kernel's own residuals at compute-dtype bytes ``a``
    beyond those of the fit (`KDA_LAYER_BYTES`): the chunk states V a / C, the pair matrices T (fp32)
    and Aqk, C (4 + a) / K, and the raw gate (fp32, for the clamp's mask in the backward), 4."""
    C, K = chunk_size, head_dim
    return K * a / C + C * (4 + a) / K + 4


def kda_residual_bytes(m, lay, a: int, qk_clip: bool) -> tuple[dict, float]:
    """Bytes one KDA layer keeps for its backward pass, per device: ({'kda': bytes}, transient).

    m: the model config; lay: the planner's layout; a: compute-dtype bytes. With N local tokens,
    D = d_model, H heads per device, K = V = head_dim, C = chunk_size and X = N H K:
      N D a, the layer's input; X KDA_LAYER_BYTES[conv] outside the core (conv backend ``lay.kda_conv``);
      the core: on 'pallas' its kernel's residuals X `kda_pallas_core_bytes` + N H (3 f + a) (beta
      and the per-head gate terms) + N K a (the decay's low-rank input, rank K);
      on a jnp core `kda_chunk_layer_bytes` - KDA_LAYER_BYTES['xla'] per element;
      context > 1: + the gathered state pairs cp b H K (K + V) f.
    The transient is 0.0: nothing KDA holds briefly outgrows its residuals. ``qk_clip`` is MLA's
    setting (the planner's per-layer formulas share one signature).
    """
    del qk_clip
    f = 4
    k = m.kda
    H = k.n_heads // lay.kda_heads_div
    K = V = k.head_dim
    C = k.chunk_size
    N = lay.tokens
    X = N * H * K
    if lay.kda_core == "pallas":
        core = X * kda_pallas_core_bytes(C, K, a) + N * H * (3 * f + a) + N * K * a
    else:
        core = X * (kda_chunk_layer_bytes(C, K) - KDA_LAYER_BYTES["xla"])
    kda = N * m.d_model * a + X * KDA_LAYER_BYTES[lay.kda_conv] + core
    if lay.cp > 1:
        kda += lay.cp * lay.micro * H * K * (K + V) * f  # the gathered state pairs
    return {"kda": kda}, 0.0


def kda_input_bytes(m, lay, a: int) -> float:
    """Bytes of the Pallas KDA kernel's own inputs for one layer, per device, which a remat policy in
    `k3.model.SAVES_KDA_INPUTS` keeps across the whole forward: q, k, v after the conv branches in the
    compute dtype (``a`` bytes), the gate and its chunk-local cumsum in fp32 (the clamp's mask needs
    the gate), beta in fp32 per head: N H (K (3a + 8) + 4) with N local tokens, H heads per device and
    K = V = head_dim."""
    k = m.kda
    H = k.n_heads // lay.kda_heads_div
    return float(lay.tokens * H * (k.head_dim * (3 * a + 8) + 4))


def kda_context_bytes(m, lay, a: int) -> int:
    """Bytes one KDA layer's context-parallel all-gather holds per pass, per device (the planner
    multiplies by cp - 1): the fp32 state pairs b H K 2K of the local sequences, H heads per
    device. ``a`` is unused: the states stay fp32 whatever the compute dtype."""
    del a
    return lay.micro * (m.kda.n_heads // lay.kda_heads_div) * m.kda.head_dim * 2 * m.kda.head_dim * 4
