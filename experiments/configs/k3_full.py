"""Kimi K3 as published: 93 layers (69 KDA + 24 Gated MLA), 896 experts top-16 in a 3584 latent."""

from k3.config import default_config


def get_config():
    c = default_config()
    c.name = "k3_full"
    m = c.model
    m.vocab_size = 163840
    m.d_model = 7168
    m.n_layers = 93
    m.mixer = "hybrid"
    m.mla_period = 4
    m.first_k_dense = 1
    m.dense_ffn_dim = 33792
    m.activation = "situ"
    m.residual = "attn_res"
    m.attn_res_block_size = 12
    m.norm_eps = 1e-5
    m.dtype = "bfloat16"
    m.remat = True
    m.layer_loop = "scan"  # sharded over many devices, gather one layer group at a time; compile time flat in depth
    m.mla.update(dict(n_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64,
                      v_head_dim=128, use_rope=False, output_gate=True, norm_eps=1e-6))
    m.kda.update(dict(n_heads=96, head_dim=128, conv_size=4, gate="bounded", gate_lower_bound=-5.0,
                      chunk_size=64))
    m.moe.update(dict(n_experts=896, top_k=16, expert_dim=3072, latent_dim=3584, shared_dim=6144,
                      routed_scaling=1.0, balancing="quantile_hist", hist_bins=1000))
    c.optim.update(dict(name="muon", schedule="cosine", warmup_frac=0.01, weight_decay=0.1,
                        qk_clip=True, per_head_muon=True))
    c.data.seq_len = 8192
    return c
