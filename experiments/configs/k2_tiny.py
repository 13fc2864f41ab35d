"""Tiny K2-style model: MLA with RoPE everywhere, plain residuals, SwiGLU, full-width MoE, sign balancing."""

from k3.config import default_config


def get_config():
    c = default_config()
    c.name = "k2_tiny"
    m = c.model
    m.mixer = "mla"
    m.activation = "swiglu"
    m.residual = "plain"
    m.norm_eps = 1e-6
    m.mla.update(dict(use_rope=True, output_gate=False))
    m.moe.update(dict(latent_dim=0, expert_dim=64, shared_dim=64, routed_scaling=2.827, balancing="sign"))
    c.optim.update(dict(schedule="wsd", qk_clip=True))
    return c
