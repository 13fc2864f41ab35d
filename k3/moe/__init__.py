"""Routed experts: the MoE layer and the expert-matmul backends (`k3.moe.layer`), load balancing
without an auxiliary loss (`k3.moe.balancing`), expert parallelism over a mesh
(`k3.moe.expert_parallel`), and what a layer costs: the bytes it keeps, the all-to-all's rows and
bytes, its tensor-parallel traffic (`k3.moe.cost`)."""

from k3.moe.balancing import BALANCERS
from k3.moe.layer import EXPERT_BACKENDS, MoE

__all__ = ["BALANCERS", "EXPERT_BACKENDS", "MoE"]
