"""`pallas_kernels.compile_report` on a CPU: the capture of every KDA kernel as lowered for CUDA
(with its launch), the parsing of ptxas' report, and the error when no GPU compiler is installed.
Compiling to PTX needs the CUDA plugin, which the test environment does not have."""

import pytest

from pallas_kernels import compile_report as R
from pallas_kernels import kda as P


def _captured(shape, **kw):
    fn, args = R.kda_forward_backward(shape, 32, "bfloat16", **kw)
    return R.capture_triton_kernels(fn, *args)


def test_capture_finds_every_kda_kernel_with_its_launch():
    big = _captured((1, 40, 2, 128), launch=(("pairs_bwd", 8, 2),), backward="split")
    names = [k.name for k in big]
    assert names == ["kda_l2norm_fwd"] * 2 + ["kda_gate_fwd", "kda_intra_fwd", "kda_state_fwd", "kda_state_bwd",
                                              "kda_inter_bwd", "kda_pairs_bwd", "kda_intra_bwd"
                                              ] + ["kda_l2norm_bwd"] * 2
    launches = {k.name: (k.num_warps, k.num_stages) for k in big}
    assert launches["kda_pairs_bwd"] == (8, 2) and launches["kda_intra_fwd"] == P._LAUNCH["intra_fwd"]
    assert all(k.module[:4] == b"ML\xefR" for k in big)  # MLIR bytecode

    small = {k.name: (k.num_warps, k.num_stages) for k in _captured((1, 40, 2, 32))}
    assert set(small) == {"kda_l2norm_fwd", "kda_gate_fwd", "kda_intra_fwd", "kda_state_fwd", "kda_state_bwd",
                          "kda_chunk_bwd", "kda_l2norm_bwd"}
    split = [k.name for k in _captured((1, 40, 2, 128))]  # one row: still 'split' by default
    assert "kda_intra_bwd" in split and "kda_keys_bwd" not in split
    two = [k.name for k in _captured((1, 40, 2, 128), backward="two")]
    assert "kda_keys_bwd" in two and "kda_intra_bwd" not in two
    assert small["kda_chunk_bwd"] == P._LAUNCH_SMALL_K["chunk_bwd"]


_PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kda_pairs_bwd' for 'sm_90a'
ptxas info    : Function properties for kda_pairs_bwd
    1712 bytes stack frame, 1840 bytes spill stores, 1640 bytes spill loads
ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized
ptxas info    : Used 255 registers, used 1 barriers, 1712 bytes cumulative stack size
"""


def test_ptxas_report_and_mma_counts_are_parsed():
    assert R.parse_ptxas(_PTXAS) == dict(registers=255, spill_store_bytes=1840, spill_load_bytes=1640,
                                         stack_bytes=1712, wgmma_serialized=True)
    with pytest.raises(ValueError, match="no register/spill line"):
        R.parse_ptxas("ptxas fatal   : Unresolved extern function")
    ptx = "wgmma.mma_async.sync.aligned.m64n32k16\n mma.sync.aligned.m16n8k16 ...\nmma.sync.aligned.m16n8k8"
    assert R.count_mma(ptx) == dict(wgmma=1, mma=2)


def test_missing_gpu_compiler_or_ptxas_is_a_clear_error(monkeypatch, tmp_path):
    from jax._src.lib import triton

    monkeypatch.setattr(triton, "has_compilation_handler", lambda platform: False)
    with pytest.raises(SystemExit, match="jax-cuda12-plugin=="):
        R.main(["--shape=1x40x2x32"])
    monkeypatch.setenv("PTXAS", str(tmp_path / "missing"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(R.sys, "path", [str(tmp_path)])
    with pytest.raises(SystemExit, match="no ptxas found"):
        R.find_ptxas()
    with pytest.raises(SystemExit, match="B x T x H x K"):
        R.main(["--shape=1x40x2"])
