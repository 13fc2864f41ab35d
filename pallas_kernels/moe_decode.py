"""Routed gated experts for a few tokens, reading only the experts the routes use, as Pallas kernels.

What it computes. For R routes (token row, expert) with inputs x [R, D] and expert ids e [R],

    h[r] = act(x[r] @ W_gate[e[r]], x[r] @ W_up[e[r]])      [F]
    y[r] = h[r] @ W_down[e[r]]                               [D]

with W_gate, W_up [E, D, F] and W_down [E, F, D], ``act`` a gated activation (fp32, elementwise).

Why a kernel. In a decode step the MoE layers see a handful of tokens: at batch 8 with top-4 of 64
experts, 32 routes. The training backends run every expert over padded rows ('capacity': one batched
[E, C, D] x [E, D, F] matmul) and so read all E experts' weights each step; on an H200 that is
3.1 GB of K3's 3.9 GB per-token floor at d_model 1024 (`experiments.aot_report --decode`). Reading
only the routed experts moves R / E of that (4 / 64 at batch 1). Gathering the routed weights with
XLA first (`k3.moe.layer`'s 'gather' decode backend) writes the gathered copy and reads it again.

Design (Pallas Triton). Each route is a matrix-vector product, so there is nothing for tensor cores:
  * gate/up: grid (R, F / block_f); program (r, j) loads e[r], then walks D in steps of block_d,
    loading x[r, d-block] and the [block_d, block_f] tiles of W_gate[e[r]] and W_up[e[r]] (the expert
    index is a scalar read inside the program: the Triton backend has no scalar prefetch), and keeps
    two fp32 [block_f] accumulators; the activation is applied at the end and h stored in x's dtype
    (as the training path's einsum output would be);
  * down: grid (R, D / block_d); the same walk over F.
  Products and sums are fp32 elementwise (a broadcast multiply and a column sum). Every weight byte
  a route needs is read once per route; routes sharing an expert read it again (mostly from L2).
  D and F must be powers of two >= 16 (block loads); `routed_glu_supported` says whether they are.

`grouped_glu` reads each routed expert once for all its routes. Its programs run per (expert, column
block) over every token at once: a [M, block_in] x [block_in, block_out] tensor-core dot per weight tile
(M = the tokens padded to a power of two >= 16), so a program's work is loads, not cross-thread row
sums; an expert no route uses loads nothing. The extra rows cost tensor-core time only, which a
decode step has to spare; there is no sort and nothing drops.
Optionally (``slots=True``) the grid runs over slots instead of experts: slot s takes the s-th
distinct expert of the route list, which each program finds from the list itself ([R, R] comparisons
in registers) and reads from the whole weight arrays, so only min(routes, E) units are launched rather
than one per expert, most of which would load the route list only to return.
The down-projection's programs store their routes' rows in route order (a one-hot [routes, M] tile
product picks each route's token row), so the output is [N, k, D] without a gather kernel after it.
`grouped_glu_fused` does both projections in one kernel: program (expert, column block of h) forms its
block of h and multiplies it by W_down's rows of that block at once, storing fp32 partial sums that the
caller folds, so the down weights stream in the same wave of programs as gate/up's.
The same source runs in Pallas interpret mode on a CPU (the tests) and compiled on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import default_interpret, pow2_at_least_16, pow2_from_16, tile_dot, triton_params


def routed_glu_supported(D: int, F: int) -> bool:
    """Whether `routed_glu` takes experts of width D and hidden F (powers of two >= 16)."""
    return pow2_from_16(D) and pow2_from_16(F)


def _sum_rows(t, defer):
    return t if defer else jnp.sum(t, axis=0)


def _gate_up_kernel(e_ref, x_ref, wg_ref, wu_ref, h_ref, *, act, block_d, D, defer):
    r, j = pl.program_id(0), pl.program_id(1)
    e = e_ref[r]
    bf = h_ref.shape[-1]
    cols = pl.ds(j * bf, bf)

    def step(i, acc):
        g, u = acc
        rows = pl.ds(i * block_d, block_d)
        x = x_ref[rows].astype(jnp.float32)[:, None]
        g = g + _sum_rows(x * wg_ref[e, rows, cols].astype(jnp.float32), defer)
        u = u + _sum_rows(x * wu_ref[e, rows, cols].astype(jnp.float32), defer)
        return g, u

    zero = jnp.zeros((block_d, bf) if defer else (bf,), jnp.float32)
    g, u = lax.fori_loop(0, D // block_d, step, (zero, zero))
    if defer:
        g, u = jnp.sum(g, axis=0), jnp.sum(u, axis=0)
    h_ref[...] = act(g, u).astype(h_ref.dtype)


def _down_kernel(e_ref, h_ref, wd_ref, y_ref, *, block_f, F, defer):
    r, j = pl.program_id(0), pl.program_id(1)
    e = e_ref[r]
    bd = y_ref.shape[-1]
    cols = pl.ds(j * bd, bd)

    def step(i, acc):
        rows = pl.ds(i * block_f, block_f)
        h = h_ref[rows].astype(jnp.float32)[:, None]
        return acc + _sum_rows(h * wd_ref[e, rows, cols].astype(jnp.float32), defer)

    y = lax.fori_loop(0, F // block_f, step, jnp.zeros((block_f, bd) if defer else (bd,), jnp.float32))
    if defer:
        y = jnp.sum(y, axis=0)
    y_ref[...] = y.astype(y_ref.dtype)


# Default tiles: the fastest of `pallas_kernels.bench_moe_decode`'s variants on an H100 at the decode
# benchmark's shape (8 tokens x top-4 of 64 experts, D 512, F 1024): 0.0507 ms against 0.0654 ms for
# 64x128 tiles with 4 warps (experiments/results/decode/h100_bench_moe_decode_b8.json).
def routed_glu(x_RD, expert_R, w_gate_EDF, w_up_EDF, w_down_EFD, *, act, block_in: int = 128,
               block_out: int = 128, num_warps: int = 8, num_stages: int = 3, defer_sum: bool = False,
               interpret: bool | None = None):
    """y [R, D] (x's dtype): each route's gated FFN through its own expert (see the module docstring).

    x: [R, D]; expert: [R] int; w_gate, w_up: [E, D, F]; w_down: [E, F, D]; act: (gate, up) fp32 [n]
    -> [n], elementwise (e.g. SiTU-GLU); block_in: rows of a weight tile (the reduction step);
    block_out: its columns (one program's outputs); num_stages: Triton's software pipelining of the
    weight-tile loop (loads of the next tiles issued while the current ones are summed); defer_sum: keep
    [block_in, block_out] fp32 partial products across the loop and sum their rows once at the end,
    instead of a cross-thread row sum per tile (more registers, fewer reductions). An expert id outside
    [0, E) reads garbage (the router never makes one)."""
    R, D = x_RD.shape
    E, _, F = w_gate_EDF.shape
    if w_up_EDF.shape != (E, D, F) or w_down_EFD.shape != (E, F, D) or expert_R.shape != (R,):
        raise ValueError(f"routed_glu: shapes x {x_RD.shape}, expert {expert_R.shape}, w_gate {w_gate_EDF.shape}, "
                         f"w_up {w_up_EDF.shape}, w_down {w_down_EFD.shape} do not match")
    if not routed_glu_supported(D, F):
        raise ValueError(f"routed_glu: D = {D} and F = {F} must be powers of two >= 16")
    interpret = default_interpret() if interpret is None else interpret
    bf, bd_in = min(block_out, F), min(block_in, D)
    bd, bf_in = min(block_out, D), min(block_in, F)
    expert = expert_R.astype(jnp.int32)
    whole = lambda shape: pl.BlockSpec(shape, lambda r, j: (0,) * len(shape))  # noqa: E731
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, act=act, block_d=bd_in, D=D, defer=defer_sum),
        grid=(R, F // bf),
        in_specs=[whole((R,)), pl.BlockSpec((None, D), lambda r, j: (r, 0)), whole((E, D, F)), whole((E, D, F))],
        out_specs=pl.BlockSpec((None, bf), lambda r, j: (r, j)),
        out_shape=jax.ShapeDtypeStruct((R, F), x_RD.dtype), interpret=interpret,
        compiler_params=triton_params(interpret, num_warps, num_stages), name="moe_decode_gate_up",
    )(expert, x_RD, w_gate_EDF, w_up_EDF)
    return pl.pallas_call(
        functools.partial(_down_kernel, block_f=bf_in, F=F, defer=defer_sum),
        grid=(R, D // bd),
        in_specs=[whole((R,)), pl.BlockSpec((None, F), lambda r, j: (r, 0)), whole((E, F, D))],
        out_specs=pl.BlockSpec((None, bd), lambda r, j: (r, j)),
        out_shape=jax.ShapeDtypeStruct((R, D), x_RD.dtype), interpret=interpret,
        compiler_params=triton_params(interpret, num_warps, num_stages), name="moe_decode_down",
    )(expert, h, w_down_EFD)


def _routes_here(idx_ref):
    """This program's expert's routes ([R] bool; idx: every route's expert id, -1 padding) and whether
    there is any."""
    mine = idx_ref[...] == pl.program_id(0)
    return mine, jnp.sum(mine.astype(jnp.int32)) > 0


SLOT_MAX_ROUTES = 64  # the most (padded) routes whose [R, R] slot search a program does in registers


def _slot_expert(idx_ref):
    """(the expert of this program's slot, program_id(1), as an int32 scalar, its routes [R] bool, whether
    the slot has an expert). Slot s holds the s-th distinct expert of the route list (idx: [R] expert
    ids, -1 padding) in order of first appearance, found by [R, R] comparisons (R <= SLOT_MAX_ROUTES)."""
    idx = idx_ref[...]
    R = idx.shape[0]
    earlier = lax.broadcasted_iota(jnp.int32, (R, R), 1) < lax.broadcasted_iota(jnp.int32, (R, R), 0)
    seen = jnp.max(jnp.where(earlier & (idx[None, :] == idx[:, None]), 1, 0), axis=1)
    first = jnp.where((idx >= 0) & (seen == 0), 1, 0)  # [R]: route r brings a new expert
    rank = jnp.sum(jnp.where(earlier, first[None, :], 0), axis=1)  # new experts before route r
    hit = (first == 1) & (rank == pl.program_id(1))
    e = jnp.sum(jnp.where(hit, idx, 0))
    return e, idx == e, jnp.sum(jnp.where(hit, 1, 0)) > 0


def _program_expert(slots, idx_ref):
    """(expert, its routes [R] bool, whether it has any, this program's column block) of a grouped
    kernel's program: grid (E, blocks) by expert, or with ``slots`` (blocks, S) by `_slot_expert`."""
    if slots:
        e, mine, used = _slot_expert(idx_ref)
        return e, mine, used, pl.program_id(0)
    mine, used = _routes_here(idx_ref)
    return pl.program_id(0), mine, used, pl.program_id(1)


def _expert_tiles(slots, e, j, block, *refs):
    """Tile loaders rows -> [rows, block] of each weight ref: with ``slots`` the refs are whole [E, K, C]
    arrays read at expert e, column block j; else they are the program's own [K, block] blocks."""
    if slots:
        return [lambda rows, r=r: r[e, rows, pl.ds(j * block, block)] for r in refs]
    return [lambda rows, r=r: r[rows, :] for r in refs]


def _gate_up_block(x_ref, wg, wu, *, block_d, block_f, D, exact):
    """(x W_gate, x W_up) [M, block_f] fp32 of a program's weight column block, walking D in block_d steps;
    wg / wu: rows (a pl.ds) -> the [block_d, block_f] tile of W_gate / W_up."""
    def step(i, acc):
        rows = pl.ds(i * block_d, block_d)
        x = x_ref[:, rows]
        return (acc[0] + tile_dot(x, wg(rows), ((1,), (0,)), exact),
                acc[1] + tile_dot(x, wu(rows), ((1,), (0,)), exact))

    zero = jnp.zeros((x_ref.shape[0], block_f), jnp.float32)
    return lax.fori_loop(0, D // block_d, step, (zero, zero))


def _grouped_gate_up_kernel(idx_ref, x_ref, wg_ref, wu_ref, h_ref, *, act, block_d, D, exact, slots):
    e, _, used, j = _program_expert(slots, idx_ref)

    @pl.when(used)
    def _():
        bf = h_ref.shape[-1]
        wg, wu = _expert_tiles(slots, e, j, bf, wg_ref, wu_ref)
        g, u = _gate_up_block(x_ref, wg, wu, block_d=block_d, block_f=bf, D=D, exact=exact)
        h_ref[...] = act(g, u).astype(h_ref.dtype)


def _grouped_down_kernel(idx_ref, h_ref, wd_ref, y_ref, *, block_f, F, k, exact, slots):
    M = h_ref.shape[0]
    R, bd = y_ref.shape
    e, mine, used, j = _program_expert(slots, idx_ref)

    @pl.when(used)
    def _():
        (wd,) = _expert_tiles(slots, e, j, bd, wd_ref)

        def step(i, acc):
            rows = pl.ds(i * block_f, block_f)
            return acc + tile_dot(h_ref[:, rows], wd(rows), ((1,), (0,)), exact)

        y = lax.fori_loop(0, F // block_f, step, jnp.zeros((M, bd), jnp.float32)).astype(y_ref.dtype)
        # Route r = n k + j takes token n's row: a one-hot [R, M] product moves the rows into route
        # order exactly (each sum has one nonzero term), and only this expert's routes are stored.
        token = lax.broadcasted_iota(jnp.int32, (R, M), 0) // k
        pick = (token == lax.broadcasted_iota(jnp.int32, (R, M), 1)).astype(y.dtype)
        pltriton.store(y_ref, tile_dot(pick, y, ((1,), (0,)), exact).astype(y_ref.dtype),
                       mask=jnp.broadcast_to(mine[:, None], (R, bd)))


def _grouped_operands(name, x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD):
    """(N, D, E, F, k, x [M, D] padded to M = a power of two >= 16 rows, the flat route list [routes]
    int32 padded with -1, whether the operands are fp32) of the grouped kernels; ValueError naming
    ``name`` on shapes that do not match or D, F that are not powers of two >= 16."""
    N, D = x_ND.shape
    E, _, F = w_gate_EDF.shape
    k = idx_Nk.shape[-1]
    if (idx_Nk.ndim != 2 or idx_Nk.shape[0] != N or w_up_EDF.shape != (E, D, F)
            or w_down_EFD.shape != (E, F, D)):
        raise ValueError(f"{name}: shapes x {x_ND.shape}, idx {idx_Nk.shape}, w_gate {w_gate_EDF.shape}, "
                         f"w_up {w_up_EDF.shape}, w_down {w_down_EFD.shape} do not match")
    if not routed_glu_supported(D, F):
        raise ValueError(f"{name}: D = {D} and F = {F} must be powers of two >= 16")
    M = pow2_at_least_16(N)
    x_MD = jnp.pad(x_ND, ((0, M - N), (0, 0)))
    # Each program finds out from the route list whether its expert is used: a marks array built by XLA
    # would be a scatter kernel of its own per layer.
    flat = idx_Nk.reshape(-1).astype(jnp.int32)
    idx_R = jnp.pad(flat, (0, pow2_at_least_16(flat.shape[0]) - flat.shape[0]), constant_values=-1)
    return N, D, E, F, k, x_MD, idx_R, jnp.dtype(x_ND.dtype) == jnp.float32


def check_slots(slots: bool, padded_routes: int) -> bool:
    """``slots``, after checking that the slot grid (`_slot_expert`) can take ``padded_routes`` routes
    (at most SLOT_MAX_ROUTES); ValueError naming the bound otherwise."""
    if slots and padded_routes > SLOT_MAX_ROUTES:
        raise ValueError(f"expert slots take at most {SLOT_MAX_ROUTES} routes, not {padded_routes}")
    return bool(slots)


def _grouped_grid(slots: bool, units: int):
    """(blocks -> grid, by_unit) of a grouped kernel over ``units`` experts or slots and a count of column
    blocks: by expert, grid (E, blocks); by slot, (blocks, S), so that a slot's programs run together and
    the slots past the distinct experts, which return at once, come last. by_unit turns an index map
    (unit, block) -> block indices into the grid's argument order."""
    if slots:
        return (lambda blocks: (blocks, units)), (lambda f: (lambda j, u: f(u, j)))
    return (lambda blocks: (units, blocks)), (lambda f: f)


def _weight_spec(slots: bool, shape, block, index_map):
    """A weight operand's BlockSpec: its expert's block, or with ``slots`` the whole [E, ...] array, which
    the program indexes at its slot's expert (the Triton backend has no data-dependent index maps)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape)) if slots else pl.BlockSpec(block, index_map)


def grouped_glu(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, *, act, block_in: int = 0,
                block_out: int = 0, block_out_down: int = 0, num_warps: int = 8, num_stages: int = 3,
                slots: bool = False, interpret: bool | None = None):
    """y [N, k, D] (x's dtype): token n's gated FFN through expert idx[n, j], each routed expert's weights
    read once for all its routes (see the module docstring).

    x: [N, D]; idx: [N, k] int in [0, E); w_gate, w_up: [E, D, F]; w_down: [E, F, D]; act: (gate, up) fp32
    [..., n] -> [..., n], elementwise; block_in / block_out: a weight tile's rows (the reduction step) and
    columns (one program's outputs); block_in 0: 128 for up to 16 tokens, else 64, so that the pipeline's
    tiles (M x block_in tokens and two block_in x block_out weight tiles per stage) stay inside Hopper's
    227 KiB of shared memory (128 at M = 64 would need 240 KiB with 3 stages, `compile_report`);
    block_out 0: 128 up to 64 tokens, else 64 (at M = 128 the down-projection's [M, 128] fp32 accumulator
    spills at 255 registers for sm_90, `compile_report`; at 64 columns neither kernel spills);
    block_out_down: the down-projection's columns per program (0: block_out). Its grid has D / block_out
    programs per used expert against F / block_out for gate/up, so with D < F fewer columns per program
    keep as many programs streaming weights (at 8 tokens, top-4 of 64 experts, D 512, F 1024: about 84
    working programs at 128 columns for an H100's 132 SMs, 168 at 64); slots: the grid over slots of the
    distinct routed experts, min(N k, E) of them, instead of all E experts (up to SLOT_MAX_ROUTES padded
    routes): at 8 tokens, top-4 of 64, the gate/up kernel's 512 programs, 2 in 3 of which find no route
    and return, become 256, the ones past the distinct experts last. Off by default: on an H100 it
    gained nothing at the default tiles (`bench_moe_decode --kernel_time`, 21 distinct experts: 32.8 us
    against 31.9, and 1.277 against 1.274 ms for the K3 decode step at batch 8), while with 64 columns
    it is the fastest two-kernel form measured (30.4 us against 34.1 by expert).
    """
    N, D, E, F, k, x_MD, idx_R, exact = _grouped_operands("grouped_glu", x_ND, idx_Nk, w_gate_EDF, w_up_EDF,
                                                          w_down_EFD)
    M, routes = x_MD.shape[0], idx_R.shape[0]
    interpret = default_interpret() if interpret is None else interpret
    block_in = block_in or (128 if M <= 16 else 64)
    block_out = block_out or (128 if M <= 64 else 64)
    bf, bd_in = min(block_out, F), min(block_in, D)
    bd, bf_in = min(block_out_down or block_out, D), min(block_in, F)
    slots = check_slots(slots, routes)
    units = min(N * k, E) if slots else E
    grid, by_unit = _grouped_grid(slots, units)
    routes_spec = pl.BlockSpec((routes,), by_unit(lambda u, j: (0,)))
    h = pl.pallas_call(
        functools.partial(_grouped_gate_up_kernel, act=act, block_d=bd_in, D=D, exact=exact, slots=slots),
        grid=grid(F // bf),
        in_specs=[routes_spec, pl.BlockSpec((M, D), by_unit(lambda u, j: (0, 0))),
                  _weight_spec(slots, (E, D, F), (None, D, bf), by_unit(lambda u, j: (u, 0, j))),
                  _weight_spec(slots, (E, D, F), (None, D, bf), by_unit(lambda u, j: (u, 0, j)))],
        out_specs=pl.BlockSpec((None, M, bf), by_unit(lambda u, j: (u, 0, j))),
        out_shape=jax.ShapeDtypeStruct((units, M, F), x_ND.dtype), interpret=interpret,
        compiler_params=triton_params(interpret, num_warps, num_stages), name="moe_decode_grouped_gate_up",
    )(idx_R, x_MD, w_gate_EDF, w_up_EDF)
    # Every expert's programs write their routes' rows of one [routes, D] output, in route order, so the
    # caller reads [N, k, D] without a gather (rows past N k, the padding, are never written).
    y = pl.pallas_call(
        functools.partial(_grouped_down_kernel, block_f=bf_in, F=F, k=k, exact=exact, slots=slots),
        grid=grid(D // bd),
        in_specs=[routes_spec, pl.BlockSpec((None, M, F), by_unit(lambda u, j: (u, 0, 0))),
                  _weight_spec(slots, (E, F, D), (None, F, bd), by_unit(lambda u, j: (u, 0, j)))],
        out_specs=pl.BlockSpec((routes, bd), by_unit(lambda u, j: (0, j))),
        out_shape=jax.ShapeDtypeStruct((routes, D), x_ND.dtype), interpret=interpret,
        compiler_params=triton_params(interpret, num_warps, num_stages), name="moe_decode_grouped_down",
    )(idx_R, h, w_down_EFD)
    return y[: N * k].reshape(N, k, D)


FUSED_MAX_TOKENS = 64  # the most tokens `grouped_glu_fused`'s default tiles take without spilling (sm_90)


def _grouped_fused_kernel(idx_ref, x_ref, wg_ref, wu_ref, wd_ref, y_ref, *, act, block_d, block_f, block_o, D, k,
                          exact, slots):
    M, R = x_ref.shape[0], y_ref.shape[0]
    e, mine, used, j = _program_expert(slots, idx_ref)

    @pl.when(used)
    def _():
        wg, wu = _expert_tiles(slots, e, j, block_f, wg_ref, wu_ref)
        g, u = _gate_up_block(x_ref, wg, wu, block_d=block_d, block_f=block_f, D=D, exact=exact)
        h = act(g, u).astype(x_ref.dtype)  # rounded as the two-kernel form stores it
        token = lax.broadcasted_iota(jnp.int32, (R, M), 0) // k
        pick = (token == lax.broadcasted_iota(jnp.int32, (R, M), 1)).astype(h.dtype)
        # The one-hot product first: [R, bf] routes' rows of h, so each down tile lands in route order.
        h_R = tile_dot(pick, h, ((1,), (0,)), exact).astype(h.dtype)
        mask = jnp.broadcast_to(mine[:, None], (R, block_o))
        h_rows = pl.ds(j * block_f, block_f)

        @pl.loop(0, D // block_o)
        def _(c):
            cols = pl.ds(c * block_o, block_o)
            w = wd_ref[e, h_rows, cols] if slots else wd_ref[:, cols]
            pltriton.store(y_ref.at[:, cols], tile_dot(h_R, w, ((1,), (0,)), exact), mask=mask)


def grouped_glu_fused(x_ND, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, *, act, block_in: int = 0,
                      block_out: int = 64, block_out_down: int = 0, num_warps: int = 0, num_stages: int = 3,
                      slots: bool = False, interpret: bool | None = None):
    """`grouped_glu` as one kernel: y [N, k, D] (x's dtype), each routed expert's three matrices read once.

    Program (e, j) forms h's column block j for expert e's routes (the gate/up walk over D, as
    `grouped_glu`), then multiplies it by W_down[e]'s rows of that block, block_out_down columns at a
    time, and stores the fp32 partial sums of its routes' rows into slice j of a [F / block_out, routes,
    D] array, which an XLA sum over j folds (in `bench_moe_decode` a kernel of its own, 1.5 us). No
    hidden activations go through memory and the down weights stream in the same wave as gate/up's.
    Shapes and dtypes as `grouped_glu`; block_in as there; block_out: h's columns per program (F's block);
    block_out_down: W_down's columns per step (0: 128 up to 16 tokens, 64 up to 32, else 32); num_warps
    0: 4 up to 16 tokens, else 8. At 8 tokens, top-4 of 64 experts, D 512, F 1024 on an H100, 64 columns
    and 4 warps were the fastest of five tilings (`bench_moe_decode --kernel_time`: 26.8 us of kernel
    time against 29.0 at 128 columns, 8 warps). Each program's [routes, block_out_down] product grows
    with the tokens: compiled for sm_90 (`compile_report`), these defaults do not spill up to 64
    tokens, while at 128 every tiling tried spills, so callers take `grouped_glu` above
    `FUSED_MAX_TOKENS`. slots: as `grouped_glu`'s."""
    N, D, E, F, k, x_MD, idx_R, exact = _grouped_operands("grouped_glu_fused", x_ND, idx_Nk, w_gate_EDF,
                                                          w_up_EDF, w_down_EFD)
    M, routes = x_MD.shape[0], idx_R.shape[0]
    interpret = default_interpret() if interpret is None else interpret
    block_in = block_in or (128 if M <= 16 else 64)
    num_warps = num_warps or (4 if M <= 16 else 8)
    block_out_down = block_out_down or (128 if M <= 16 else 64 if M <= 32 else 32)
    bf, bd_in, bo = min(block_out or 64, F), min(block_in, D), min(block_out_down, D)
    slots = check_slots(slots, routes)
    grid, by_unit = _grouped_grid(slots, min(N * k, E) if slots else E)
    parts = pl.pallas_call(
        functools.partial(_grouped_fused_kernel, act=act, block_d=bd_in, block_f=bf, block_o=bo, D=D, k=k,
                          exact=exact, slots=slots),
        grid=grid(F // bf),
        in_specs=[pl.BlockSpec((routes,), by_unit(lambda u, j: (0,))),
                  pl.BlockSpec((M, D), by_unit(lambda u, j: (0, 0))),
                  _weight_spec(slots, (E, D, F), (None, D, bf), by_unit(lambda u, j: (u, 0, j))),
                  _weight_spec(slots, (E, D, F), (None, D, bf), by_unit(lambda u, j: (u, 0, j))),
                  _weight_spec(slots, (E, F, D), (None, bf, D), by_unit(lambda u, j: (u, j, 0)))],
        out_specs=pl.BlockSpec((None, routes, D), by_unit(lambda u, j: (j, 0, 0))),
        out_shape=jax.ShapeDtypeStruct((F // bf, routes, D), jnp.float32), interpret=interpret,
        compiler_params=triton_params(interpret, num_warps, num_stages), name="moe_decode_grouped_fused",
    )(idx_R, x_MD, w_gate_EDF, w_up_EDF, w_down_EFD)
    return jnp.sum(parts[:, : N * k], axis=0).astype(x_ND.dtype).reshape(N, k, D)
