"""The h200 ladder's learning-rate bracket: x4 and x8 the shared rule's rate at the smallest size, for
the arms whose x2 run beat the rule (so their optimum was not yet bracketed).

    python -m experiments.run_ladder --ladder=experiments/configs/ladder_h200_lr.py \
        --out=experiments/results/h200 --arms=k2,k3 --jobs=sweep
"""

from experiments.configs import ladder_h200


def get_config():
    c = ladder_h200.get_config()
    c.lr_sweep = "4.0,8.0"
    return c
