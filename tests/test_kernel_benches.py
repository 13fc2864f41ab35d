"""The kernel benchmarks' command lines run end to end at a tiny shape (kernels interpreted on a CPU):
rows for jnp and every variant, the kernels' outputs checked against jnp, the JSON with its command."""

import json

import jax.numpy as jnp
import pytest

from pallas_kernels import bench_attn_res, bench_launch, bench_moe_decode, bench_short_conv


def test_short_conv_bench_rows_and_json(tmp_path):
    out = tmp_path / "conv.json"
    rows = bench_short_conv.main(["--shape=1x40x2x16", "--variants=8:32:2:4,4:16:4:2:g,4:16:4:2:tp", "--iters=1",
                                  f"--json={out}"])
    assert [(r["impl"], r["norm"], r["rows"]) for r in rows] == [
        ("jnp", True, ""), ("pallas", True, "s"), ("pallas", True, "g"), ("pallas", True, "tp"),
        ("jnp", False, ""), ("pallas", False, "s"), ("pallas", False, "g"), ("pallas", False, "tp")]
    assert all(r["max_rel_diff_vs_jnp"] < 1e-2 and r["fwdbwd_ms"] > 0 for r in rows)
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("python -m pallas_kernels.bench_short_conv --shape=1x40x2x16")
    assert saved["timing"] == "pipelined" and len(saved["rows"]) == 8


def test_moe_decode_bench_rows_and_json(tmp_path):
    out = tmp_path / "moe.json"
    rows = bench_moe_decode.main(["--shape=3x2x5x16x32",
                                  "--variants=16:16:4:1,8:32:2:2:d,16:32:4:2:g,16:32:4:2:g16,16:32:4:2:f16,"
                                  "16:32:4:2:g16s,16:32:4:2:fs", "--iters=1", f"--json={out}"])
    assert [(r["impl"], r["variant"]) for r in rows] == [("gather", ""), ("pallas", "16:16:4:1"),
                                                        ("pallas", "8:32:2:2:d"), ("grouped", "16:32:4:2:g"),
                                                        ("grouped", "16:32:4:2:g16"),
                                                        ("fused", "16:32:4:2:f16"), ("grouped", "16:32:4:2:g16s"),
                                                        ("fused", "16:32:4:2:fs")]
    assert all(r["max_rel_diff"] < 2e-2 and r["ms"] > 0 for r in rows)
    assert 2 <= rows[0]["distinct_experts"] <= 5 and rows[0]["bytes"] >= 2 * 3 * 16 * 32 * 2
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("python -m pallas_kernels.bench_moe_decode --shape=3x2x5x16x32")
    # the profiled kernel time (on a CPU the trace's host-side XLA ops): positive, and its kernels named
    timed = bench_moe_decode.main(["--shape=3x2x5x16x32", "--variants=16:32:4:2:g", "--iters=1", "--kernel_time"])
    assert all(r["kernel_ms"] > 0 and r["kernels"] and sum(r["kernels"].values()) == pytest.approx(r["kernel_ms"])
               for r in timed)
    with pytest.raises(SystemExit, match="NxKxExDxF"):
        bench_moe_decode.main(["--shape=3x6x5x16x32"])
    with pytest.raises(SystemExit, match="block_in:block_out"):
        bench_moe_decode.main(["--shape=3x2x5x16x32", "--variants=16:16"])
    with pytest.raises(SystemExit, match="block_in:block_out"):
        bench_moe_decode.main(["--shape=3x2x5x16x32", "--variants=16:16:4:1:x"])
    with pytest.raises(SystemExit, match="block_in:block_out"):
        bench_moe_decode.main(["--shape=3x2x5x16x32", "--variants=16:16:4:1:gx"])


def test_launch_bench_chains_and_json(tmp_path):
    """Each form's chain adds steps x kernels (the bench checks it before timing); rows, floor and JSON."""
    out = tmp_path / "launch.json"
    rows = bench_launch.main(["--shape=8x32", "--steps=2", "--kernels=3", "--iters=1", "--step_kernels=100",
                              f"--json={out}"])
    assert [r["form"] for r in rows] == list(bench_launch.FORMS)
    for r in rows:
        assert r["us_per_kernel"] > 0 and r["bytes_per_kernel"] == 2 * 8 * 32 * 2
        assert r["step_floor_ms"] == pytest.approx(r["us_per_kernel"] * 100 / 1e3)
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("python -m pallas_kernels.bench_launch --shape=8x32") and len(saved["rows"]) == 2
    x = jnp.full((8, 16), 3.0, jnp.bfloat16)
    assert float(bench_launch.chain("pallas", 2, 2)(x)[0, 0]) == 7.0
    with pytest.raises(ValueError, match="unknown form"):
        bench_launch.chain("cuda_graph", 1, 1)
    with pytest.raises(SystemExit, match="ROWSxD"):
        bench_launch.main(["--shape=8"])
    with pytest.raises(SystemExit, match="positive"):
        bench_launch.main(["--kernels=0"])


def test_attn_res_bench_rows_and_bad_shape(capsys):
    rows = bench_attn_res.main(["--shape=3x1x16x16", "--variants=2:1,2:1:4:1", "--iters=1"])
    assert [r["impl"] for r in rows] == ["jnp", "pallas", "pallas"]
    assert all(r["max_rel_diff_vs_jnp"] < 2e-2 for r in rows)
    assert (rows[1]["steps"], rows[1]["n_valid"], rows[2]["steps"], rows[2]["n_valid"]) == (1, 3, 4, 1)
    assert "block:warps:steps:n" in capsys.readouterr().out
    # decode-sized: one token per row, the mix with its norm, the forward's kernel time profiled
    timed = bench_attn_res.main(["--shape=3x2x1x16", "--variants=1:1,2:4", "--iters=1", "--kernel_time", "--norm"])
    assert all(r["max_rel_diff_vs_jnp"] < 2e-2 and r["fwd_kernel_ms"] > 0 and r["fwd_kernels"] for r in timed)
    assert "fwd kernels" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="MxBxTxD"):
        bench_attn_res.main(["--shape=2x16x16"])


def test_gemm_bench_rows_flops_and_json(tmp_path, monkeypatch):
    """`experiments.bench_gemms` times each shape forward and backward: its TFLOP/s are the shape's
    2 M N K (4 M N K backward) over the time, with peak fractions when the device's peak is known."""
    from experiments import bench_gemms

    monkeypatch.setattr(bench_gemms, "SHAPES", (("dense", "nd,df->nf", (64, 32), (32, 16)),
                                                 ("expert", "ecd,edf->ecf", (2, 8, 16), (2, 16, 8))))
    monkeypatch.setattr(bench_gemms, "device_peak_flops", lambda: 1e12)
    out = tmp_path / "g.json"
    rows = bench_gemms.main([f"--json={out}"])
    assert [r["name"] for r in rows] == ["dense", "expert"]
    r = rows[0]
    assert r["fwd_tflops"] == pytest.approx(2 * 64 * 32 * 16 / (r["fwd_ms"] * 1e-3) / 1e12)
    assert r["bwd_peak_frac"] == pytest.approx(r["bwd_tflops"] * 1e12 / 1e12)
    assert json.loads(out.read_text())["rows"][1]["name"] == "expert"


def test_gemm_bench_accumulate_times_both_ways(monkeypatch):
    """`bench_gemms --accumulate=M`: the expert shapes only, each with the old and the new summed
    weight gradient per micro-batch, their peak fractions and the speed-up between them."""
    from experiments import bench_gemms

    monkeypatch.setattr(bench_gemms, "SHAPES", (("dense", "nd,df->nf", (64, 32), (32, 16)),
                                                 ("expert", "ecd,edf->ecf", (2, 8, 16), (2, 16, 8))))
    monkeypatch.setattr(bench_gemms, "device_peak_flops", lambda: 1e12)
    rows = bench_gemms.main(["--accumulate=3"])
    assert [r["name"] for r in rows] == ["expert"] and rows[0]["micro_batches"] == 3
    r = rows[0]
    assert r["speedup"] == pytest.approx(r["old_ms"] / r["new_ms"])
    assert r["new_peak_frac"] == pytest.approx(2 * 2 * 8 * 16 * 8 / (r["new_ms"] * 1e-3) / 1e12)


def test_trace_kernel_ms_sums_the_device_kernels_or_else_the_host_xla_ops():
    """A GPU trace: only the device process's complete events count (not the host's, nor metadata); a CPU
    trace without a device process: the XLA op events (those with an 'hlo_op' argument)."""
    from pallas_kernels.common import trace_kernel_ms

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    gpu = meta + [{"ph": "X", "pid": 1, "name": "gemm", "dur": 3.0}, {"ph": "X", "pid": 1, "name": "gemm", "dur": 1.0},
                  {"ph": "X", "pid": 1, "name": "pad", "dur": 0.5}, {"ph": "X", "pid": 2, "name": "py", "dur": 9.0}]
    assert trace_kernel_ms(gpu) == {"gemm": 4.0e-3, "pad": 0.5e-3}
    cpu = [meta[1], {"ph": "X", "pid": 2, "name": "dot.1", "dur": 2.0, "args": {"hlo_op": "dot.1"}},
           {"ph": "X", "pid": 2, "name": "PjitFunction", "dur": 7.0, "args": {}}]
    assert trace_kernel_ms(cpu) == {"dot.1": 2.0e-3}
