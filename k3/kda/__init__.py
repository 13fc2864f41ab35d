"""Kimi Delta Attention: the layer (`k3.kda.layer`), the delta-rule cores and their table
(`k3.kda.ops`; the Pallas kernel registers there as the 'pallas' core), and the core over a
sequence split across devices (`k3.kda.parallel`)."""

from k3.kda.layer import KDA
from k3.kda.ops import KDA_CORES, kda_core

__all__ = ["KDA", "KDA_CORES", "kda_core"]
