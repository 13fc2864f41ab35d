"""Routed experts: the MoE layer and the expert-matmul backends (`k3.moe.layer`), load balancing
without an auxiliary loss (`k3.moe.balancing`) and expert parallelism over a mesh
(`k3.moe.expert_parallel`)."""

from k3.moe.balancing import BALANCERS
from k3.moe.layer import EXPERT_BACKENDS, MoE

__all__ = ["BALANCERS", "EXPERT_BACKENDS", "MoE"]
