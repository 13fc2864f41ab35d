"""Kimi K2 as published: 61 MLA layers with RoPE, 384 experts top-8 at full width, SwiGLU."""

from k3.config import default_config


def get_config():
    c = default_config()
    c.name = "k2_full"
    m = c.model
    m.vocab_size = 163840
    m.d_model = 7168
    m.n_layers = 61
    m.mixer = "mla"
    m.first_k_dense = 1
    m.dense_ffn_dim = 18432
    m.activation = "swiglu"
    m.residual = "plain"
    m.norm_eps = 1e-6
    m.dtype = "bfloat16"
    m.remat = True
    m.layer_loop = "scan"  # sharded over many devices, gather one layer group at a time; compile time flat in depth
    m.mla.update(dict(n_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64,
                      v_head_dim=128, use_rope=True, rope_theta=50000.0, output_gate=False,
                      norm_eps=1e-6))
    m.moe.update(dict(n_experts=384, top_k=8, expert_dim=2048, latent_dim=0, shared_dim=2048,
                      routed_scaling=2.827, balancing="sign", sign_rate=1e-3))
    c.optim.update(dict(name="muon", schedule="wsd", weight_decay=0.1, qk_clip=True, qk_clip_tau=100.0,
                        per_head_muon=False))
    c.data.seq_len = 4096
    return c
