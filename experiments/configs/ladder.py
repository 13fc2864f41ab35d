"""Scaling-ladder configs: K2-style or K3-style models at a given width, with shared data settings.

Use as ``--config=experiments/configs/ladder.py:k3,256`` (style, d_model). The two styles keep the
real models' ratios at small scale: K3 routes twice as many experts (2x the pool) in a latent of
half the width, so the routed FLOPs per token equal K2's; KDA:MLA is 3:1 with a final MLA; K3 uses
Block AttnRes, SiTU-GLU and Quantile Balancing, K2 plain residuals, SwiGLU, RoPE and sign updates.
Depth grows with width (d_model / 32 layers, rounded up to a multiple of 4, at least 4).
"""

from k3.config import default_config

LADDER_WIDTHS = (128, 160, 224, 288, 384)


def ladder_config(style: str, d_model: int):
    """A full config (model + training defaults) for one ladder rung."""
    if style not in ("k2", "k3"):
        raise ValueError(f"ladder style must be 'k2' or 'k3', got {style!r}")
    if d_model % 32:
        raise ValueError(f"ladder d_model must be a multiple of 32, got {d_model}")
    c = default_config()
    c.name = f"ladder_{style}_{d_model}"
    m = c.model
    m.style = style
    m.d_model = d_model
    m.n_layers = max(4, -(-(d_model // 32) // 4) * 4)
    m.vocab_size = 4096
    m.first_k_dense = 1
    m.dense_ffn_dim = 3 * d_model
    heads = d_model // 32
    m.mla.update(dict(n_heads=heads, q_lora_rank=d_model // 2, kv_lora_rank=d_model // 4, qk_nope_dim=32,
                      qk_rope_dim=16, v_head_dim=32))
    m.kda.update(dict(n_heads=heads, head_dim=32))
    m.attn_res_block_size = max(1, m.n_layers // 4)
    if style == "k3":
        m.mixer, m.activation, m.residual, m.norm_eps = "hybrid", "situ", "attn_res", 1e-5
        m.mla.update(dict(use_rope=False, output_gate=True))
        m.moe.update(dict(n_experts=64, top_k=4, expert_dim=d_model, latent_dim=d_model // 2,
                          shared_dim=3 * d_model // 4, routed_scaling=1.0, balancing="quantile_hist"))
        c.optim.schedule = "wsd"
    else:
        m.mixer, m.activation, m.residual, m.norm_eps = "mla", "swiglu", "plain", 1e-6
        m.mla.update(dict(use_rope=True, output_gate=False))
        m.moe.update(dict(n_experts=32, top_k=2, expert_dim=d_model, latent_dim=0,
                          shared_dim=d_model // 4, routed_scaling=2.827, balancing="sign"))
        c.optim.schedule = "wsd"
    c.data.seq_len = 1024
    c.data.batch_size = 64
    return c


def get_config(arg: str = "k3,128"):
    style, _, width = arg.partition(",")
    return ladder_config(style.strip(), int(width or 128))
