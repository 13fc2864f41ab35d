"""A micro-ladder for CPU tests: 3 sizes x 2 arms, a few steps each, on a small slice of the corpus."""

from experiments.run_ladder import default_ladder


def get_config():
    c = default_ladder()
    c.name = "micro"
    c.arms = "k2,k3"
    c.sizes = "32x2,64x2,96x2"
    c.tokens_per_param = 0.01
    c.min_steps = 10
    c.seq_len = 32
    c.batch_size = 4
    c.branches = "0.4:0.5"
    c.extra_seeds = "1"
    c.seed_sizes = 1
    c.lr_sweep = "0.5"
    c.sweep_sizes = 1
    c.eval_batches = 2
    c.ckpt_every = 0.2
    c.data.max_docs = 40
    c.data.val_fraction = 0.1
    return c
