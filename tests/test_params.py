"""Parameter and FLOP accounting reproduces the published counts (abstract shapes only)."""

import json
import os
import subprocess
import sys

import pytest

from experiments.configs import k2_full, k3_full, ladder
from k3.attn_res import attn_res_candidates
from k3.kda.cost import kda_core_flops
from k3.params import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_k3_full_counts():
    r = report(k3_full.get_config())
    assert r["total_params"] == pytest.approx(2.7795e12, rel=5e-3)
    assert r["active_params"] == pytest.approx(104.19e9, rel=5e-3)
    assert r["embedding_params"] == r["lm_head_params"] == 163840 * 7168
    f = r["flops_per_token"]
    assert f["6N"] == pytest.approx(6 * (r["active_params"] - r["lm_head_params"]))
    assert f["full"] > f["6N"]


def test_k2_full_counts():
    r = report(k2_full.get_config())
    assert r["total_params"] == pytest.approx(1.026e12, rel=5e-3)
    assert 31.7e9 * 0.995 <= r["active_params"] <= 32.9e9 * 1.005


def test_flop_terms():
    # kda_kernels.md A.7: about 1.71e5 forward FLOPs per token-head at C=64, K=V=128.
    assert kda_core_flops(128, 128, 64) == pytest.approx(1.71e5, rel=0.01)
    # K3: 8 blocks of 12 layers over 93 layers; the output mix reads 9 sources.
    assert attn_res_candidates(1, 12) == 1 + 2 + 2
    # Layer 12 opens block 1: its attention reads 2 candidates, its FFN 3, and the output mix one more.
    assert attn_res_candidates(13, 12) - attn_res_candidates(12, 12) == 2 + 3 + 1


def test_ladder_styles_match_routed_compute():
    k2 = report(ladder.ladder_config("k2", 256))
    k3 = report(ladder.ladder_config("k3", 256))
    assert k2["routed_active_params"] > 0
    # K3: twice the active experts at half the width: the same routed parameters per token.
    assert k3["routed_active_params"] == k2["routed_active_params"]
    with pytest.raises(ValueError, match="style"):
        ladder.ladder_config("k4", 256)


def test_params_cli_prints_json():
    out = subprocess.run([sys.executable, "-m", "launch.params", "--config=experiments/configs/k3_tiny.py"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert {"total_params", "active_params", "flops_per_token"} <= set(data)
    bad = subprocess.run([sys.executable, "-m", "launch.params", "--config=experiments/configs/k3_tiny.py",
                          "--config.model.bogus=1"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "bogus" in bad.stderr
