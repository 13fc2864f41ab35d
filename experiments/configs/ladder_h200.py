"""The K2-vs-K3 ladder run on one H200: 4 sizes per arm (0.2M-2M non-embedding active parameters),
20 tokens per parameter of the embedded corpus at byte level, bf16 compute.

    python -m experiments.run_ladder --ladder=experiments/configs/ladder_h200.py \
        --out=experiments/results/h200 --arms=k2,k3 --compile_cache=/tmp/jax_cache

The mechanism arms (K2 plus one K3 mechanism) run at the three smallest sizes:

    python -m experiments.run_ladder --ladder=experiments/configs/ladder_h200.py \
        --out=experiments/results/h200 --arms=k2+kda_hybrid,k2+attn_res,k2+latent_moe_qb \
        --sizes=64x4,96x4,128x4 --jobs=main
"""

from experiments.run_ladder import default_ladder


def get_config():
    c = default_ladder()
    c.name = "h200"
    c.arms = "k2,k3,k2+kda_hybrid,k2+attn_res,k2+latent_moe_qb"
    c.baseline = "k2"
    c.sizes = "64x4,96x4,128x4,160x4"
    c.tokens_per_param = 20.0
    c.seq_len = 512
    c.batch_size = 32
    c.branches = "0.4:0.5"
    c.extra_seeds = "1"
    c.seed_sizes = 2
    c.lr_sweep = "0.5,2.0"
    c.sweep_sizes = 1
    c.eval_batches = 0
    c.overrides = "model.dtype=bfloat16"
    # The byte-level standard-library split (9.47M tokens) is read up to 3.2 times by the largest
    # runs (experiments/RESULTS_byte_ladder.md); this ladder predates the single-epoch rule and says so here.
    c.max_epochs = 3.5
    return c
