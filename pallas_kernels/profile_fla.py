"""Per-kernel device time of fla's `chunk_kda` forward+backward, the peer of `bench_kda --profile_dir`.

    python -m pallas_kernels.profile_fla 8x4096x16x128 1x8192x96x128

bf16 q, k, v, beta and an fp32 gate in [-5, 0), called as `bench_kda` calls fla
(use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5). Five calls after three warm-ups under
`torch.profiler`; prints each CUDA kernel's ms per call, heaviest first. Needs a CUDA GPU, torch and
fla-core (imported here only).
"""

from __future__ import annotations

import sys


def kernel_table(shape, calls=5):
    """[(kernel name, ms per call, launches per call)] of fla's forward+backward at shape (B, T, H, K)."""
    import torch
    from fla.ops.kda import chunk_kda

    B, T, H, K = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    normal = lambda: torch.randn(B, T, H, K, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = normal(), normal(), normal()
    gate = -5.0 * torch.rand(B, T, H, K, device="cuda", generator=gen)
    beta = torch.rand(B, T, H, device="cuda", generator=gen).to(torch.bfloat16)
    do = normal()
    leaves = [x.requires_grad_() for x in (q, k, v, gate, beta)]

    def step():
        o, _ = chunk_kda(*leaves, use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)
        o.backward(do)
        for x in leaves:
            x.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / calls / 1e3, e.count // calls)
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main(argv=None):
    for text in (argv if argv is not None else sys.argv[1:]) or ["8x4096x16x128"]:
        rows = kernel_table(tuple(int(x) for x in text.split("x")))
        print(f"== fla {text}: {sum(r[1] for r in rows):.3f} ms device per fwd+bwd")
        for name, ms, n in rows[:25]:
            print(f"{ms:8.3f} ms  x{n:<3d} {name[:100]}")


if __name__ == "__main__":
    main()
