"""Scaling-ladder model configs: K2-style, K3-style and K2 plus one K3 mechanism, at a given shape.

Use as ``--config=experiments/configs/ladder.py:k3,256`` (arm, d_model[, n_layers]). The styles keep
the real models' ratios at small scale: K3 routes twice as many experts (2x the pool) in a latent
of half the width, so the routed FLOPs per token equal K2's; KDA:MLA is 3:1 with a final MLA; K3
uses Block AttnRes, SiTU-GLU and Quantile Balancing, K2 plain residuals, SwiGLU, RoPE and sign
updates. Default depth grows with width (d_model / 32 layers, rounded up to a multiple of 4, at
least 4).

Arms (`ARMS`): 'k2', 'k3', and K2 with one of K3's three mechanisms swapped in:
  'k2+kda_hybrid'    the sequence mixer: 3 KDA : 1 Gated MLA (NoPE, output gate), last layer MLA;
  'k2+attn_res'      depth: Block Attention Residuals instead of plain residuals;
  'k2+latent_moe_qb' width: Stable LatentMoE (2x experts, 2x top-k, half-width latent with its
                     RMSNorm, SiTU-GLU, the K3 shared-expert width) with Quantile Balancing.
"""

from k3.config import default_config

LADDER_WIDTHS = (128, 160, 224, 288, 384)
ARMS = ("k2", "k3", "k2+kda_hybrid", "k2+attn_res", "k2+latent_moe_qb")


def default_depth(d_model: int) -> int:
    return max(4, -(-(d_model // 32) // 4) * 4)


def _use_kda_hybrid(m):
    m.mixer = "hybrid"
    m.mla.update(dict(use_rope=False, output_gate=True))


def _use_attn_res(m):
    m.residual = "attn_res"


def _use_latent_moe_qb(m):
    d = m.d_model
    m.activation = "situ"
    m.moe.update(dict(n_experts=64, top_k=4, expert_dim=d, latent_dim=d // 2, shared_dim=3 * d // 4,
                      routed_scaling=1.0, balancing="quantile_hist"))


def arm_config(arm: str, d_model: int, n_layers: int = 0):
    """A full config (model + training defaults) for one ladder rung of ``arm``.

    d_model: a multiple of 32 (heads of 32); n_layers: 0 = `default_depth`.
    """
    if arm not in ARMS:
        raise ValueError(f"unknown ladder arm {arm!r}; expected one of {', '.join(ARMS)}")
    if d_model % 32 or d_model <= 0:
        raise ValueError(f"ladder d_model must be a positive multiple of 32, got {d_model}")
    c = default_config()
    c.name = f"ladder_{arm}_{d_model}"
    m = c.model
    m.d_model = d_model
    m.n_layers = n_layers or default_depth(d_model)
    m.vocab_size = 4096
    m.first_k_dense = 1
    m.dense_ffn_dim = 3 * d_model
    heads = d_model // 32
    m.mla.update(dict(n_heads=heads, q_lora_rank=d_model // 2, kv_lora_rank=d_model // 4, qk_nope_dim=32,
                      qk_rope_dim=16, v_head_dim=32))
    m.kda.update(dict(n_heads=heads, head_dim=32))
    m.attn_res_block_size = max(1, m.n_layers // 4)
    # K2 everywhere first; K3 and the mechanism arms swap pieces in.
    m.mixer, m.activation, m.residual, m.norm_eps = "mla", "swiglu", "plain", 1e-6
    m.mla.update(dict(use_rope=True, output_gate=False))
    m.moe.update(dict(n_experts=32, top_k=2, expert_dim=d_model, latent_dim=0,
                      shared_dim=d_model // 4, routed_scaling=2.827, balancing="sign"))
    if arm == "k3":
        _use_kda_hybrid(m)
        _use_attn_res(m)
        _use_latent_moe_qb(m)
        m.norm_eps = 1e-5
    elif arm == "k2+kda_hybrid":
        _use_kda_hybrid(m)
    elif arm == "k2+attn_res":
        _use_attn_res(m)
    elif arm == "k2+latent_moe_qb":
        _use_latent_moe_qb(m)
    c.optim.schedule = "wsd"
    c.data.seq_len = 1024
    c.data.batch_size = 64
    return c


def ladder_config(style: str, d_model: int):
    """The 'k2' or 'k3' rung at ``d_model`` with the default depth."""
    if style not in ("k2", "k3"):
        raise ValueError(f"ladder style must be 'k2' or 'k3', got {style!r}")
    return arm_config(style, d_model)


def get_config(arg: str = "k3,128"):
    arm, _, rest = arg.partition(",")
    width, _, layers = rest.partition(",")
    return arm_config(arm.strip(), int(width or 128), int(layers or 0))
