"""Implementation tables: 'auto' per platform, errors that name the setting, config validation,
and the profile breakdown's kernel categories."""

import gzip
import json

import pytest
from flax import nnx

from conftest import tiny_model_cfg
from experiments.profile_step import categorize, hlo_fusion_summaries, hlo_op_context, parse_trace, top_fusions
from k3.backends import BackendError, Table
from k3.config import ConfigError, default_config, validate
from k3.kda.layer import KDA
from k3.mla.layer import ATTENTION, MLA
from k3.moe.layer import EXPERT_BACKENDS
from k3.kda.ops import KDA_CORES


def test_table_resolves_auto_per_platform_and_names_the_setting():
    t = Table("model.x.impl", default="slow", auto={"gpu": "fast"})
    t.register("slow")(lambda: "slow")
    t.register("fast", platforms=("gpu",))(lambda: "fast")
    assert t.choices() == ("auto", "slow", "fast")
    assert t.resolve("auto", "gpu") == "fast" and t.resolve("auto", "cpu") == "slow"
    assert t.get("fast", "gpu")() == "fast"
    with pytest.raises(BackendError, match=r"model.x.impl='fast' runs only on gpu.*'auto' \(here: 'slow'\)"):
        t.resolve("fast", "cpu")
    with pytest.raises(BackendError, match=r"model.x.impl='nope' is not one of"):
        t.resolve("nope", "cpu")
    with pytest.raises(BackendError, match="registered twice"):
        t.register("slow")(lambda: None)


def test_tracing_contexts_belong_to_their_thread():
    """`targeting` and `fp32_weight_grads` hold in the thread that entered them only: the ladder runner
    traces the next run's step on a background thread while the main thread traces its own."""
    import threading

    from k3 import backends, nn

    here = backends.platform()
    entered, release, seen = threading.Event(), threading.Event(), {}

    def other():
        with backends.targeting("tpu"), nn.fp32_weight_grads():
            seen["inside"] = (backends.platform(), bool(nn._fp32_weight_grads_stack()))
            entered.set()
            release.wait(30)

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(30)
    assert backends.platform() == here and not nn._fp32_weight_grads_stack()
    release.set()
    t.join()
    assert seen["inside"] == ("tpu", True)


def test_default_tables_pick_the_fast_paths_on_gpu_and_references_elsewhere():
    assert KDA_CORES.resolve("auto", "gpu") == "pallas" and KDA_CORES.resolve("auto", "cpu") == "chunk"
    assert EXPERT_BACKENDS.resolve("auto", "gpu") == "capacity"
    assert EXPERT_BACKENDS.resolve("auto", "tpu") == "ragged"
    assert ATTENTION.resolve("auto", "gpu") == "flash" and ATTENTION.resolve("auto", "cpu") == "xla"


@pytest.mark.parametrize("key,bad", [("model.kda.impl", "flash"), ("model.moe.expert_impl", "megablocks"),
                                     ("model.mla.attention_impl", "splash"), ("model.kda.decode_impl", "cuda")])
def test_config_validates_backend_names_from_the_tables(key, bad):
    cfg = default_config()
    node = cfg
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = bad
    with pytest.raises(ConfigError, match=f"{key} must be one of .*'auto'.*got '{bad}'"):
        validate(cfg)
    node[leaf] = "auto"
    validate(cfg)


def test_expert_capacity_must_be_positive():
    cfg = default_config()
    cfg.model.moe.expert_capacity = 0.0
    with pytest.raises(ConfigError, match="expert_capacity"):
        validate(cfg)


def test_gpu_only_kernels_on_cpu_fail_at_construction_naming_the_fallback():
    with pytest.raises(BackendError, match=r"model.mla.attention_impl='cudnn' runs only on gpu.*'xla'"):
        MLA(tiny_model_cfg(**{"mla.attention_impl": "cudnn"}), rngs=nnx.Rngs(0))
    # 'auto' builds everywhere, and the layers hold the concrete choice.
    assert KDA(tiny_model_cfg(**{"kda.impl": "auto"}), rngs=nnx.Rngs(0)).impl == "chunk"
    with pytest.raises(BackendError, match=r"model.kda.impl='jla' runs only on gpu.*'auto'.*'chunk'"):
        KDA(tiny_model_cfg(**{"kda.impl": "jla"}), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("changes, message", [
    ({}, "dtype='float32'"),
    ({"model.dtype": "bfloat16", "model.kda.head_dim": 32}, "head_dim=32"),
    ({"model.dtype": "bfloat16", "model.kda.head_dim": 64, "model.kda.n_heads": 3}, "n_heads \\* head_dim=192"),
])
def test_jla_kda_needs_bf16_and_its_head_dims(changes, message):
    cfg = default_config()
    cfg.model.kda.impl = "jla"
    for key, value in changes.items():
        node, leaf = cfg, key.split(".")
        for part in leaf[:-1]:
            node = node[part]
        node[leaf[-1]] = value
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
    cfg.model.update({"dtype": "bfloat16"})
    cfg.model.kda.update({"head_dim": 128, "n_heads": 2})
    validate(cfg)


def test_categorize_by_scope_and_by_library_kernel_name():
    assert categorize("loop_fusion_3", "jit(train_step)/optimizer/mul") == "optimizer"
    assert categorize("fusion_9", "MoE/routed_experts/dot_general") == "expert matmuls"
    assert categorize("input_scatter_fusion", "routed_experts/scatter-add") == "expert dispatch"
    assert categorize("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma", "") == "attention"
    assert categorize("flash_doc_dkdv", "") == "attention"
    assert categorize("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n", "") == "fp32 matmuls"
    assert categorize("nvjet_sm90_tst_128x160", "") == "dense matmuls"
    assert categorize("kda_intra_fwd", "") == "KDA"
    assert categorize("transpose_fusion", "") == "copies/transposes"
    assert categorize("loop_add_fusion", "") == "norms/elementwise"
    # backward ops carry "transpose(jvp(...))" scopes; only the kernel's name says it is a copy
    assert categorize("input_add_reduce_fusion", "transpose(jvp(Model))/norm/mul") == "norms/elementwise"


def test_trace_parser_maps_kernels_to_scopes_through_the_hlo(tmp_path):
    hlo = "\n".join([
        "HloModule jit_train_step",
        "%fused_computation.1 (p: f32[4]) -> f32[4] {",
        '  %m = f32[4] multiply(%p, %p), metadata={op_name="jit(train_step)/optimizer/mul"}',
        "}",
        "ENTRY %main (a: f32[4]) -> f32[4] {",
        '  ROOT %loop_multiply_fusion.7 = f32[4] fusion(%a), kind=kLoop, calls=%fused_computation.1',
        "}",
    ])
    ctx = hlo_op_context(hlo)
    assert "optimizer" in ctx["loop_multiply_fusion.7"] and "optimizer" in ctx["loop_multiply_fusion_7"]
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "loop_multiply_fusion_7", "dur": 3000.0, "args": {"hlo_op": "command_buffer_1"}},
        {"ph": "X", "pid": 1, "name": "sm90_xmma_gemm_f32f32_tf32f32", "dur": 1000.0, "args": {"hlo_op": "x"}},
        {"ph": "X", "pid": 2, "name": "python", "dur": 9e6, "args": {}},
    ]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    res = parse_trace(str(path), n_steps=2, op_context=ctx)
    assert res["ms"]["optimizer"] == pytest.approx(1.5) and res["ms"]["fp32 matmuls"] == pytest.approx(0.5)
    assert res["total_ms"] == pytest.approx(2.0) and abs(sum(res["share"].values()) - 1) < 1e-9
    # Kernels run inside a CUDA graph name no HLO instruction, so only "x" is listed by instruction.
    assert res["top_ops"] == [("x", pytest.approx(0.5), 0.5, "sm90_xmma_gemm_f32f32_tf32f32", "fp32 matmuls")]


FUSION_HLO = "\n".join([
    "HloModule jit_train_step",
    "%fused_a (p0: bf16[8,16], p1: f32[16]) -> (f32[8,16], bf16[8,16]) {",
    "  %p0 = bf16[8,16]{1,0} parameter(0)",
    "  %c = f32[8,16]{1,0} convert(%p0)",
    "  %e = f32[8,16]{1,0} exponential(%c)",
    "  %e2 = f32[8,16]{1,0} exponential(%e)",
    "  ROOT %t = (f32[8,16]{1,0}, bf16[8,16]{1,0}) tuple(%e2, %p0)",
    "}",
    "ENTRY %main (a: bf16[8,16], b: f32[16]) -> f32[8,16] {",
    "  %a = bf16[8,16]{1,0} parameter(0)",
    "  %b = f32[16]{0} parameter(1)",
    "  %loop_exp_fusion.3 = (f32[8,16]{1,0}, bf16[8,16]{1,0}) fusion(%a, %b), kind=kLoop, calls=%fused_a",
    "  ROOT %g = f32[8,16]{1,0} get-tuple-element(%loop_exp_fusion.3), index=0",
    "}",
])


def test_fusion_summaries_count_bytes_moved_and_ops():
    """Reads = operands (bf16 [8, 16] + f32 [16]), writes = both tuple results; the fused body's
    opcodes counted; the trace's '_' spelling of the name finds the '.' one; unknown names skipped."""
    got = hlo_fusion_summaries(FUSION_HLO, ["loop_exp_fusion_3", "not_there"])
    assert list(got) == ["loop_exp_fusion_3"]
    f = got["loop_exp_fusion_3"]
    assert f["writes"] == ["f32[8,16]", "bf16[8,16]"] and f["write_bytes"] == 8 * 16 * (4 + 2)
    assert f["reads"] == ["bf16[8,16]", "f32[16]"] and f["read_bytes"] == 8 * 16 * 2 + 16 * 4
    assert f["ops"] == {"exponential": 2, "convert": 1, "tuple": 1}
    # 1088 bytes, 3 calls per step, 1 ms per step at 1e6 B/s: 1088 * 3 / 1e6 s = 3.264 ms -> 3.264
    res = {"kernels": {"loop_exp_fusion_3": [1.0, "norms/elementwise"], "nvjet_gemm": [5.0, "dense matmuls"]},
           "calls": {"loop_exp_fusion_3": 3.0, "nvjet_gemm": 1.0}}
    rows = top_fusions(res, FUSION_HLO, hbm_bytes_per_s=1e6)
    assert [r["name"] for r in rows] == ["loop_exp_fusion_3"]
    assert rows[0]["hbm_frac"] == pytest.approx(1088 * 3 / 1e6 / 1e-3)


def test_balancer_table_drives_routing_updates_and_validation():
    """Each balancing rule is one `Balancer` entry: its extra routes, its statistic and its update;
    the config accepts exactly the table's names and checks top_k + extra routes <= n_experts."""
    import jax.numpy as jnp

    from k3.moe.balancing import BALANCERS, sign_update

    assert set(BALANCERS.choices()) == {"auto", "none", "sign", "quantile", "quantile_hist"}
    assert [BALANCERS.get(n).extra_routes for n in ("none", "sign", "quantile", "quantile_hist")] == [0, 0, 1, 1]
    assert BALANCERS.get("quantile_hist").summable and not BALANCERS.get("quantile").summable
    bias, load = jnp.array([0.1, -0.2, 0.0]), jnp.array([5.0, 1.0, 3.0])
    cfg = default_config().model.moe
    assert jnp.array_equal(BALANCERS.get("none").update(bias, {"load": load}, cfg, 9), bias)
    assert jnp.array_equal(BALANCERS.get("sign").update(bias, {"load": load}, cfg, 9),
                           sign_update(bias, load, cfg.sign_rate))
    c = default_config()
    c.model.moe.top_k, c.model.moe.n_experts = 4, 4
    with pytest.raises(ConfigError, match=r"balancing='quantile_hist' ranks top-\(k\+1\)"):
        validate(c)
    c.model.moe.balancing = "sign"
    validate(c)
