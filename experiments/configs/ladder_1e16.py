"""The single-epoch BPE ladder: 5 sizes per arm from ~1e14 to >= 1e16 FLOPs (6ND), each arm at its own
learning rate, on the embedded site-packages corpus (source and headers) with a 16,384-token BPE.

Shapes. Depth grows with width. At one shape K3 has ~1.4x K2's non-embedding active parameters
(its shared experts are 3/4 of d_model wide, K2's 1/4), so K3 takes shapes of its own (``arm_sizes``)
that cover the same compute range; 20 tokens per parameter, C = 6 N D = 120 N^2:

    K2                 160x4  192x6  224x8  256x10  288x11   N 1.08M .. 9.23M, C 1.4e14 .. 1.02e16
    K3                 128x4  160x6  192x8  224x8   256x10   N 0.97M .. 9.46M, C 1.1e14 .. 1.07e16
    mechanism arms     160x4  192x6  224x8                   (K2's three smallest shapes)

(N and C as printed by ``--dry_run`` with this file's vocabulary.) The largest run reads
20 x 9.46M = 189M tokens, so the training split must hold that many: the runner refuses the ladder
otherwise (``max_epochs = 1``). The corpus is the installed distributions' Python, docs and
C/C++/CUDA sources (``data.suffixes='code'``); ``--set=data.extra_roots=/usr/include`` adds a
machine's system headers. ``python -m experiments.corpus_stats --source=site_packages
--suffixes=code [--extra_roots=...]`` sizes it on a machine; at 3.3-3.4 bytes per token 189M tokens
are about 630-650 MB of text. The GPU machines' image holds 642.2 MB of training text with
``--set=data.extra_roots=/usr/include:/usr/local/cuda/targets/x86_64-linux/include``
(experiments/RESULTS.md), so the commands below pass that setting there.

Stages (each command resumes where a deadline stopped it; results of several machines merge). On
machines that keep nothing between commands, seed OUT with the points recorded so far, which then
count as done, and bring back the ``points.jsonl`` it writes under a new name::

    mkdir -p OUT && cp experiments/results/bpe_1e16/points*.jsonl OUT/

Each command then prepares the data again: its first run starts 1.5-2 minutes in on the H100 machine.

1. Learning-rate sweep at the shared rule, x0.5 / x1 / x2 / x4 / x8 at each arm's 3 smallest sizes (the
   first sweeps, at each arm's smallest size, still improved from x2 to x4, so x8 brackets the optimum):

       python -m experiments.run_ladder --ladder=experiments/configs/ladder_1e16.py --out=OUT \\
           --arms=k2,k3 --jobs=main,sweep --sizes=160x4,192x6,224x8,128x4,160x6,192x8 \\
           --set=data.extra_roots=/usr/include:/usr/local/cuda/targets/x86_64-linux/include --deadline_s=540

   The sweep's four rates of one (arm, size) train as one vmapped program (``population = 4``,
   `experiments.run_ladder`), whose step has about as many kernels as one run's (compiled for the
   H200: 4.3-4.5x fewer per run-step, BENCHMARKS.md). On an H100 a population trained 1.7-1.9x the
   tokens per second of single runs (K2 192x6, K3 160x6; BENCHMARKS.md); the runner records each
   population's speed (``population``, ``mfu_full``).

2. Fit each arm's rule and set it: ``python -m experiments.fit --results=OUT`` prints
   ``lr_rules = "k2=...;k3=..."``; put that into ``c.lr_rules`` below. Done: the value below is the fit
   of stage 1's sweep (three sizes per arm, C = 6ND; experiments/RESULTS.md). Changing it renames the
   own-rule runs (their ids carry the rule's hash), so the recorded stage-3 points would not count.
3. Main runs at each arm's own rule (all sizes), the shared-rule runs the sweep did not make, seeds
   and same-seed repeats:

       python -m experiments.run_ladder --ladder=experiments/configs/ladder_1e16.py --out=OUT \\
           --arms=k2,k3 --jobs=main,shared,seeds,repeats --set=data.extra_roots=... --deadline_s=540

4. Mechanism arms, at the shared rule (compare them with K2's shared-rule points: ``experiments.fit``
   reports both), with seed 1 at their two smallest sizes:

       python -m experiments.run_ladder --ladder=experiments/configs/ladder_1e16.py --out=OUT \\
           --arms=k2+kda_hybrid,k2+attn_res,k2+latent_moe_qb --jobs=main,seeds --set=data.extra_roots=...

   These arms have no speed recorded yet: the runner estimates them at the slowest recorded arm's
   until each arm's first run measures its own (``--dry_run``: about 680 s of training on the H100).
5. The mechanism arms at their own rates (at the shared rule, stage 4, their multipliers also measure
   the rule's distance from each arm's optimum): their sweep, x0.5 / x2 / x4 / x8 at their three sizes
   (36 runs as 9 four-rate populations)::

       python -m experiments.run_ladder --ladder=experiments/configs/ladder_1e16.py --out=OUT \\
           --arms=k2+kda_hybrid,k2+attn_res,k2+latent_moe_qb --jobs=sweep --set=data.extra_roots=... --deadline_s=540

   then their fitted rules added to ``c.lr_rules`` (each arm's own-rule runs are named by its own
   rule's hash, so K2's and K3's recorded runs keep counting) and ``--jobs=main`` for their own-rule
   main runs.
"""

from experiments.run_ladder import default_ladder


def get_config():
    c = default_ladder()
    c.name = "bpe_1e16"
    c.arms = "k2,k3,k2+kda_hybrid,k2+attn_res,k2+latent_moe_qb"
    c.baseline = "k2"
    c.sizes = "160x4,192x6,224x8,256x10,288x11"
    c.arm_sizes = ";".join(["k3=128x4,160x6,192x8,224x8,256x10"]
                           + [f"{arm}=160x4,192x6,224x8"
                              for arm in ("k2+kda_hybrid", "k2+attn_res", "k2+latent_moe_qb")])
    c.tokens_per_param = 20.0
    c.seq_len = 512
    c.batch_size = 64
    c.branches = "0.4:0.5"
    c.extra_seeds = "1"
    c.seed_sizes = 2
    c.repeats = 1
    c.lr_sweep = "0.5,2.0,4.0,8.0"
    c.sweep_sizes = 3
    c.lr_rules = "k2=17338.8:-0.424893;k3=76584.7:-0.466488"  # stage 2: experiments.fit, 6ND convention
    c.max_epochs = 1.0
    c.population = 4  # the sweep's 4 rates of one (arm, size) train as one program (run_ladder's docstring)
    c.eval_batches = 0
    c.overrides = "model.dtype=bfloat16"
    c.data.source = "site_packages"
    c.data.suffixes = "code"
    c.data.tokenizer = "bpe"
    c.data.vocab_size = 16384
    c.data.val_fraction = 0.02
    return c
