"""`experiments.aot_report`'s reading of a compiled module (a hand-written HLO text with known answers),
the GPU target description, and its errors. Compiling for a GPU needs the CUDA plugin, which the test
environment does not have; `k3.backends.targeting` is tested here too."""

import jax
import pytest

from experiments import aot_report as A
from k3 import backends
from k3.kda.ops import KDA_CORES

HLO = """HloModule jit_step, is_scheduled=true

%fused_mul (param_0: f32[1024,256], param_1: f32[]) -> f32[1024,256] {
  %param_0 = f32[1024,256]{1,0} parameter(0)
  %param_1 = f32[] parameter(1)
  %broadcast = f32[1024,256]{1,0} broadcast(%param_1), dimensions={}
  ROOT %multiply = f32[1024,256]{1,0} multiply(%param_0, %broadcast), metadata={op_name="jit(step)/optimizer/mul"}
}

%fused_slice (param_0.1: bf16[4,512,128], param_1.1: s32[]) -> bf16[1,512,128] {
  %param_0.1 = bf16[4,512,128]{2,1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %dynamic-slice = bf16[1,512,128]{2,1,0} dynamic-slice(%param_0.1, %param_1.1, %c, %c), dynamic_slice_sizes={1,512,128}
}

%gemm_body (p0: bf16[512,128], p1: bf16[128,256]) -> bf16[512,256] {
  %p0 = bf16[512,128]{1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  ROOT %dot = bf16[512,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/mixer/dot_general"}
}

%body (carry: (s32[], bf16[4,512,128], bf16[128,256])) -> (s32[], bf16[4,512,128], bf16[128,256]) {
  %carry = (s32[], bf16[4,512,128]{2,1,0}, bf16[128,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %stack = bf16[4,512,128]{2,1,0} get-tuple-element(%carry), index=1
  %w = bf16[128,256]{1,0} get-tuple-element(%carry), index=2
  %x = bf16[1,512,128]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%fused_slice
  %x2 = bf16[512,128]{1,0} bitcast(%x)
  %y = bf16[512,256]{1,0} fusion(%x2, %w), kind=kCustom, calls=%gemm_body
  %kda = f32[512,128]{1,0} custom-call(%x2), custom_call_target="__gpu$xla.gpu.triton", backend_config={debug = false, name = "kda_chunk_bwd", num_warps = 2 : i32}
  ROOT %t = (s32[], bf16[4,512,128]{2,1,0}, bf16[128,256]{1,0}) tuple(%i, %stack, %w)
}

%cond (carry.1: (s32[], bf16[4,512,128], bf16[128,256])) -> pred[] {
  %carry.1 = (s32[], bf16[4,512,128]{2,1,0}, bf16[128,256]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: f32[1024,256], s: f32[], init: (s32[], bf16[4,512,128], bf16[128,256])) -> (f32[1024,256], f32[1024,256]) {
  %a = f32[1024,256]{1,0} parameter(0)
  %s = f32[] parameter(1)
  %init = (s32[], /*index=1*/bf16[4,512,128]{2,1,0}, bf16[128,256]{1,0}) parameter(2)
  %m = f32[1024,256]{1,0} fusion(%a, %s), kind=kLoop, calls=%fused_mul
  %loop = (s32[], bf16[4,512,128]{2,1,0}, bf16[128,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %c2 = f32[1024,256]{1,0} copy(%m)
  ROOT %out = (f32[1024,256]{1,0}, f32[1024,256]{1,0}) tuple(%m, %c2)
}
"""


def test_kernels_bytes_flops_and_loop_trips_of_a_known_module():
    fl = A.kernel_floors(HLO, hbm_bytes_per_s=1e12, peak_flops=1e14)
    by = {k["name"]: k for k in fl["kernels"]}
    assert set(by) == {"m", "x", "y", "kda_chunk_bwd", "c2"} and fl["launches"] == 1 + 4 * 3 + 1
    mb = 1024 * 256 * 4
    assert by["m"]["bytes"] == 2 * mb + 4 and by["m"]["category"] == "optimizer"
    # The slice fusion reads one [512, 128] bf16 slice of its stacked operand, not the stack.
    assert by["x"]["bytes"] == 2 * 512 * 128 * 2 + 4 and by["x"]["calls"] == 4
    gemm = by["y"]
    assert gemm["flops"] == 2 * 512 * 256 * 128 and gemm["category"] == "dense matmuls"
    assert gemm["floor_ms"] == pytest.approx(1e3 * max(gemm["bytes"] / 1e12, gemm["flops"] / 1e14))
    assert by["kda_chunk_bwd"]["category"] == "KDA" and by["kda_chunk_bwd"]["bytes"] == 512 * 128 * (2 + 4)
    assert by["c2"]["category"] == "copies/transposes" and by["c2"]["bytes"] == 2 * mb
    cats = fl["categories"]
    assert cats["KDA"]["kernels"] == 4 and cats["dense matmuls"]["flops"] == 4 * gemm["flops"]
    assert sum(c["floor_ms"] for c in cats.values()) == pytest.approx(
        sum(k["floor_ms"] * k["calls"] for k in fl["kernels"]))
    assert fl["unknown_trip_loops"] == 0
    assert A.kernel_floors(HLO.replace('backend_config={"known_trip_count":{"n":"4"}}', ""),
                           hbm_bytes_per_s=1e12, peak_flops=1e14)["unknown_trip_loops"] == 1


def test_a_fusion_that_gathers_from_a_parameter_reads_what_it_gathers():
    """The loss's target-logit gather (through a bitcast, as XLA emits it) is charged the gathered
    elements, not the [tokens, vocabulary] operand; the other operands are read whole."""
    hlo = """HloModule jit_loss, is_scheduled=true

%fused_gather (p0: bf16[8192,1024], p1: s32[8192,2]) -> bf16[8192,1] {
  %p0 = bf16[8192,1024]{1,0} parameter(0)
  %b = bf16[8,1024,1024]{2,1,0} bitcast(%p0)
  %p1 = s32[8192,2]{1,0} parameter(1)
  %g = bf16[8192,1,1]{2,1,0} gather(%b, %p1), offset_dims={1,2}, collapsed_slice_dims={0}, start_index_map={0,1}, index_vector_dim=1, slice_sizes={1,1,1}
  ROOT %r = bf16[8192,1]{1,0} bitcast(%g)
}

ENTRY %main (z: bf16[8192,1024], t: s32[8192,2]) -> bf16[8192,1] {
  %z = bf16[8192,1024]{1,0} parameter(0)
  %t = s32[8192,2]{1,0} parameter(1)
  ROOT %zt = bf16[8192,1]{1,0} fusion(%z, %t), kind=kLoop, calls=%fused_gather
}
"""
    fl = A.kernel_floors(hlo, hbm_bytes_per_s=1e12, peak_flops=1e14)
    (k,) = fl["kernels"]
    assert k["bytes"] == 8192 * 2 + 8192 * 2 * 4 + 8192 * 2  # gathered + indices + result
    also_read = hlo.replace("  ROOT %r", "  %n = bf16[8,1024,1024]{2,1,0} negate(%b)\n  ROOT %r")
    whole = A.kernel_floors(also_read, hbm_bytes_per_s=1e12, peak_flops=1e14)["kernels"][0]
    assert whole["bytes"] == 8192 * 1024 * 2 + 8192 * 2 * 4 + 8192 * 2  # another use reads it whole


def test_target_text_and_errors():
    text = A.target_config_text(A.TARGETS["h200"])
    assert "core_count: 132" in text and "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert "memory_bandwidth: 4800000000000" in text
    with pytest.raises(SystemExit, match="unknown --target 'a100x'"):
        A.compile_only_device("a100x")
    with pytest.raises(ValueError, match="no ENTRY"):
        A.kernel_floors("HloModule m\n", hbm_bytes_per_s=1.0, peak_flops=1.0)


def test_targeting_resolves_auto_for_another_platform():
    here = KDA_CORES.resolve("auto")
    with backends.targeting("gpu"):
        assert backends.platform() == "gpu" and KDA_CORES.resolve("auto") == KDA_CORES.auto["gpu"]
        assert KDA_CORES.resolve("jla") == "jla"  # a GPU-only entry is allowed while targeting a GPU
    assert KDA_CORES.resolve("auto") == here and backends.platform() == "cpu"
    with pytest.raises(backends.BackendError, match="unknown platform 'gpux'"):
        with backends.targeting("gpux"):
            pass


def test_analyse_a_saved_module(tmp_path, capsys):
    path = tmp_path / "step.hlo"
    path.write_text(HLO)
    [floors] = A.main([f"--analyse={path}", "--top=2"])
    out = capsys.readouterr().out
    assert floors["launches"] == 14 and "kernels per step: 14" in out and "| KDA | 4 |" in out
    with pytest.raises(SystemExit, match="cannot read --analyse file"):
        A.main([f"--analyse={tmp_path / 'missing.hlo'}"])


def test_ladder_mode_names_a_bad_ladder_or_arm_before_compiling(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        A.main([f"--ladder={tmp_path / 'none.py'}"])
    with pytest.raises(SystemExit, match="not in the ladder's arms|unknown"):
        A.main(["--ladder=experiments/configs/ladder_1e16.py", "--arms=k9"])
    with pytest.raises(SystemExit, match="unknown job"):
        A.main(["--ladder=experiments/configs/ladder_1e16.py", "--jobs=mains"])
    with pytest.raises(SystemExit, match="unknown config key model.nope"):  # --set reaches every run's config
        A.main(["--ladder=experiments/configs/ladder_1e16.py", "--arms=k2", "--set", "model.nope=1"])


def test_floor_gaps_set_each_traced_op_against_its_floor():
    """`experiments.profile_step.floor_gaps` joins a trace's per-op times to `kernel_floors` by HLO
    instruction name: floors scale with the traced calls, the loss is measured minus floor, a GEMM
    gets its TFLOP/s and peak fraction, ops the HLO lacks are left out, a CPU (no rates) gives {}."""
    from experiments.profile_step import floor_gaps

    by = {k["instr"]: k for k in A.kernel_floors(HLO, hbm_bytes_per_s=1e12, peak_flops=1e14)["kernels"]}
    assert by["kda"]["name"] == "kda_chunk_bwd" and by["y"]["name"] == "y"
    ops = {"y": [1.0, 4.0, "nvjet_sm90_tst", "dense matmuls"], "m": [0.5, 1.0, "loop_multiply_fusion", "optimizer"],
           "gone": [9.0, 1.0, "fusion_x", "norms/elementwise"]}
    g = floor_gaps(ops, HLO, hbm_bytes_per_s=1e12, peak_flops=1e14)
    rows = {r["op"]: r for r in g["top"]}
    assert set(rows) == {"y", "m"} and g["matched_ms"] == pytest.approx(1.5)
    y = rows["y"]
    assert y["floor_ms"] == pytest.approx(4 * by["y"]["floor_ms"])
    assert y["lost_ms"] == pytest.approx(1.0 - y["floor_ms"])
    assert y["tflops"] == pytest.approx(4 * 2 * 512 * 256 * 128 / 1e-3 / 1e12) and y["peak_frac"] == pytest.approx(
        y["tflops"] * 1e12 / 1e14)
    assert "tflops" not in rows["m"] and rows["m"]["x_floor"] == pytest.approx(0.5 / by["m"]["floor_ms"])
    assert g["lost_ms_by_category"]["optimizer"] == pytest.approx(0.5 - by["m"]["floor_ms"])
    assert [r["op"] for r in g["top"]] == sorted(rows, key=lambda o: -rows[o]["lost_ms"])
    assert [r["op"] for r in g["below"]] == [o for o in sorted(rows, key=lambda o: rows[o]["lost_ms"])
                                             if rows[o]["lost_ms"] < 0]
    fast = floor_gaps(dict(ops, y=[1e-6, 4.0, "nvjet_sm90_tst", "dense matmuls"]), HLO, hbm_bytes_per_s=1e12,
                      peak_flops=1e14)
    assert [r["op"] for r in fast["below"]][:1] == ["y"] and fast["below"][0]["x_floor"] < 1
    assert floor_gaps(ops, HLO) == {}  # this CPU: no HBM bandwidth or peak known


def test_population_step_stacks_the_state_and_vmaps_the_gpu_step():
    """`--population`: the abstract state gains a leading member axis and the step, traced with the GPU's
    backends, returns one loss per member (traced only: no GPU compiler needed)."""
    from experiments.run_ladder import load_ladder, plan_runs

    cfg = plan_runs(load_ladder("experiments/configs/ladder_micro.py"), ["k3"], ["32x2"], ["sweep"])[0]["cfg"]
    one, state1, batch = A.abstract_train_step(cfg)
    three, state3, batch3 = A.abstract_train_step(cfg, population=3)
    assert batch3 == batch
    assert all(b.shape == (3,) + a.shape for a, b in zip(jax.tree.leaves(state1), jax.tree.leaves(state3)))
    _, metrics = jax.eval_shape(three, state3, batch)
    assert metrics["loss"].shape == (3,) and jax.eval_shape(one, state1, batch)[1]["loss"].shape == ()
