"""The KDA benchmark scripts on a tiny shape on the CPU: they run, check and record what they claim."""

import json

import numpy as np
import pytest

from pallas_kernels import bench_kda, bench_kda_split


def test_bench_kda_records_errors_against_the_float64_recurrence(tmp_path):
    out = tmp_path / "b.json"
    bench_kda.main(["--shapes=1x70x3x32", "--impls=pallas_bf16,reference", "--iters=1", "--warmup=0",
                    f"--out={out}"])
    case = json.loads(out.read_text())["cases"][0]
    acc = case["accuracy"]
    assert acc["heads"] == 2 and set(acc["rel_err"]) == {"pallas_bf16", "reference"}
    for errs in acc["rel_err"].values():
        assert set(errs) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
        # bf16 inputs and outputs: errors of the order of bf16 rounding, never zero
        assert all(1e-5 < e < 1e-2 for e in errs.values()), errs
    assert "within_fla" not in acc  # no fla on a CPU: nothing to compare against
    for rec in case["impls"].values():
        assert np.isfinite(rec["fwd_bwd"]["median_ms"]) and rec["fwd_bwd"]["timer"] == "pipelined"
        assert np.isfinite(rec["fwd_bwd"]["per_call"]["median_ms"])


def test_bench_kda_profile_records_each_kernels_time(tmp_path):
    out = tmp_path / "b.json"
    bench_kda.main(["--shapes=1x40x2x16", "--impls=reference", "--iters=1", "--warmup=0", "--no-accuracy",
                    "--no-check", f"--profile_dir={tmp_path / 'trace'}", f"--out={out}"])
    rec = json.loads(out.read_text())["cases"][0]["impls"]["reference"]
    for mode in ("fwd", "fwd_bwd"):
        prof = rec[mode]["profile"]
        ms = [row[1] for row in prof["kernels"]]
        assert prof["kernels"] and ms == sorted(ms, reverse=True) and 0 < sum(ms) <= prof["total_ms"] + 1e-9


def test_accuracy_contract_compares_each_quantity_with_fla():
    class Fake:
        def __init__(self, scale):
            self.scale = scale

        def outputs(self, mode):
            o, grads = ref
            noisy = lambda x: x * (1 + self.scale)  # noqa: E731
            return noisy(o), tuple(noisy(g) for g in grads)

    inputs, do = bench_kda.make_inputs((1, 20, 2, 16, 16))
    ref = bench_kda.float64_reference(inputs, do, 2)
    ref = (np.asarray(ref[0], np.float32), tuple(np.asarray(g, np.float32) for g in ref[1]))
    ok = {"fwd_bwd": {}}
    case = {"impls": {"pallas_bf16": dict(ok), "fla": dict(ok)}}
    bench_kda.run_accuracy({"pallas_bf16": Fake(1e-3), "fla": Fake(1e-2)}, case, inputs, do, 2)
    acc = case["accuracy"]
    assert acc["rel_err"]["pallas_bf16"]["o"] == pytest.approx(1e-3, rel=1e-2)
    assert all(acc["within_fla"]["pallas_bf16"].values())


def test_tuning_flag_parses_launches_and_rejects_bad_values():
    assert bench_kda.parse_tuning("backward=two,bk=16,launch=keys_bwd/8/1+intra_bwd/8/2") == dict(
        backward="two", bk=16, launch=(("keys_bwd", 8, 1), ("intra_bwd", 8, 2)))
    for bad in ("bk=x", "launch=keys_bwd/8", "bk"):
        with pytest.raises(Exception, match="--tuning"):
            bench_kda.parse_tuning(bad)


def test_bench_kda_split_rejects_an_unknown_kernel_name():
    assert bench_kda_split.parse_launch("intra_fwd=4/2,state_bwd=8") == (("intra_fwd", 4, 2), ("state_bwd", 8, 1))
    with pytest.raises(SystemExit, match="unknown kernel 'intra'"):
        bench_kda_split.parse_launch("intra=4/1")


def test_bench_kda_split_bytes_moved_from_shapes_alone(tmp_path):
    """--no_time: every kernel's bytes (operands and results once) from abstract shapes, nothing run.
    Checked by hand for the gate kernel (g in, Gamma out, fp32) and the state chain of the 'split'
    backward; 'chain' drops the inter kernel and dh and adds the value blocks' parts of the terms."""
    import jax
    import jax.numpy as jnp
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    assert bench_kda_split.moved_bytes(lambda a, b: (a + b, a.astype(jnp.bfloat16)), (x, x)) == 3 * 128 + 64
    B, T, H, K = 2, 128, 3, 128  # 'split' after the chain; 6 rows x heads: value blocks of 16, eight parts
    split = bench_kda_split.split((B, T, H, K), 32, "bfloat16", 1, timing=False)
    chain = bench_kda_split.split((B, T, H, K), 32, "bfloat16", 1, backward="chain", timing=False)
    Tp, NT, f32, bf16 = 128, 4, 4, 2
    tok = B * Tp * H * K
    assert split["gate_fwd"] == dict(compile_s=None, median_ms=None, bytes=2 * f32 * tok)
    # in: qg, kg, w (bf16), Gamma (fp32) [tok]; Aqk [B, Tp, H, C] bf16; dO [tok] bf16; mf [B, Tp];
    # dht [B, H, V, K] fp32. out: dh [B, H, NT V, K] bf16, dv_new [tok] fp32, dh0 [B, H, V, K] fp32
    want = (3 * bf16 + f32) * tok + bf16 * B * Tp * H * 32 + bf16 * tok + f32 * B * Tp + f32 * B * H * K * K
    want += bf16 * B * H * NT * K * K + f32 * tok + f32 * B * H * K * K
    assert split["state_bwd"]["bytes"] == want
    # every kernel sees operands padded to whole chunks, dO included
    ragged = bench_kda_split.split((B, 100, H, K), 32, "bfloat16", 1, timing=False)
    assert {n: r["bytes"] for n, r in ragged.items()} == {n: r["bytes"] for n, r in split.items()}
    assert "inter_bwd" not in chain and "state_bwd" not in chain and "state_terms_bwd" in chain
    parts = 8 * (2 * f32 * tok + bf16 * tok + f32 * B * NT * H * K)  # dq0, dk0, dw, dGamma's last rows
    assert chain["intra_bwd"]["bytes"] - split["intra_bwd"]["bytes"] == parts - (2 * f32 * tok + bf16 * tok
                                                                                 + f32 * B * NT * H * K)
    out = tmp_path / "s.json"
    bench_kda_split.main(["--shape=1x40x2x32", "--variants=32:bfloat16", "--no_time", f"--out={out}"])
    rec = json.loads(out.read_text())
    assert rec["timed"] is False and rec["variants"]["32:bfloat16"]["intra_fwd"]["bytes"] > 0
