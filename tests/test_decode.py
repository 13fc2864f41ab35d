"""Incremental decoding equals the full forward pass (K2 and K3, AttnRes, scanned layers, ragged prompts)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3 import decode
from k3.backends import platform
from k3.model import Model, served, unrolled
from tests.conftest import tiny_model_cfg

TOL = 1e-4
BF16_REL = 2e-2  # max |decode - forward| over max |forward| of the logits, both in bf16
# The K3 variants of the longer checks compile a 13-layer hybrid several times: CI's slow set.
STYLES_SLOW_K3 = [pytest.param("k3", marks=pytest.mark.slow), "k2"]
STYLES_SLOW = [pytest.param("k3", marks=pytest.mark.slow), pytest.param("k2", marks=pytest.mark.slow)]


def _cfg(style):
    if style == "k3":  # dense first layer, a scanned KDA,KDA,KDA,MLA body (2 repeats), final MLA in the tail
        return tiny_model_cfg(n_layers=13, first_k_dense=1)
    m = tiny_model_cfg(n_layers=5, first_k_dense=1, mixer="mla", residual="plain", activation="swiglu")
    m.mla.update(dict(use_rope=True, output_gate=False))
    m.moe.update(dict(latent_dim=0, balancing="sign"))
    return m


PAD = 48  # forward passes run at one padded length (causal: padding after a token cannot change its logits)


def _forward_rows(forward, rows):
    """Full-forward logits of each token list, [len(row), V] each, at the one padded length."""
    x = np.full((len(rows), PAD), 96, np.int32)
    for i, r in enumerate(rows):
        x[i, :len(r)] = r
    out = np.asarray(forward(jnp.asarray(x)))
    return [out[i, :len(r)] for i, r in enumerate(rows)]


@functools.lru_cache(maxsize=None)
def _model(style):
    model = Model(_cfg(style), rngs=nnx.Rngs(7))
    forward = jax.jit(lambda t: model(t)[0])
    ext = jax.jit(lambda t, c, n: decode.extend(model, t, c, n))
    return model, forward, ext


@pytest.mark.slow
def test_layouts_cover_head_body_tail():
    k3, k2 = _model("k3")[0], _model("k2")[0]
    assert k3.head_idx == (0, 1, 2, 3) and k3.body_repeats == 2 and k3.tail_idx == (12,)
    assert k2.head_idx == (0,) and k2.body_repeats == 4


@pytest.mark.parametrize("style", STYLES_SLOW_K3)
def test_token_by_token_decode_equals_forward(style):
    model, forward, ext = _model(style)
    B, T, P = 2, 19, 6
    toks = jax.random.randint(jax.random.key(11), (B, T), 0, 97)
    want = np.stack(_forward_rows(forward, list(np.asarray(toks))))
    cache = decode.init_cache(model, B, PAD)
    got, cache = ext(toks[:, :P], cache, None)
    outs = [got]
    for i in range(P, T):
        lg, cache = ext(toks[:, i:i + 1], cache, None)
        outs.append(lg)
    got = jnp.concatenate(outs, axis=1)
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL, rtol=TOL)
    assert cache["length"].tolist() == [T, T]


@pytest.mark.slow
@pytest.mark.parametrize("style", ["k3", "k2"])
def test_bf16_decode_tracks_the_bf16_forward(style):
    """bf16 decoding (cache read in bf16, fp32 accumulation) stays within bf16 noise of the forward."""
    cfg = _cfg(style)
    cfg.dtype = "bfloat16"
    model = Model(cfg, rngs=nnx.Rngs(7))
    B, T, P = 2, 21, 5
    toks = jax.random.randint(jax.random.key(12), (B, T), 0, 97)
    want = np.asarray(jax.jit(lambda t: model(t)[0])(toks), np.float32)
    ext = jax.jit(lambda t, c: decode.extend(model, t, c))
    cache = decode.init_cache(model, B, T + 3)
    got, cache = ext(toks[:, :P], cache)
    outs = [got]
    for i in range(P, T):
        lg, cache = ext(toks[:, i:i + 1], cache)
        outs.append(lg)
    got = np.asarray(jnp.concatenate(outs, axis=1), np.float32)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < BF16_REL, err


@pytest.mark.slow
def test_cache_with_kept_inputs_extends_like_a_plain_one():
    """A cache returned with ``keep_inputs`` (KDA inputs alongside the states) can be extended
    directly: the next logits equal those from the plain cache."""
    model, _, ext = _model("k3")
    toks = jax.random.randint(jax.random.key(13), (2, 9), 0, 97)
    kept = jax.jit(lambda t, c: decode.extend(model, t, c, keep_inputs=True))
    _, with_inputs = kept(toks[:, :7], decode.init_cache(model, 2, PAD))
    assert any("inputs" in c for c in with_inputs["layers"]["body"])
    _, plain = ext(toks[:, :7], decode.init_cache(model, 2, PAD), None)
    got, _ = ext(toks[:, 7:], with_inputs, None)
    want, _ = ext(toks[:, 7:], plain, None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("style", STYLES_SLOW)
def test_chunked_prefill_and_single_token_prompt(style):
    """A prompt prefilled in uneven pieces (one longer than KDA's chunk) and a one-token prompt."""
    model, forward, ext = _model(style)
    toks = np.asarray(jax.random.randint(jax.random.key(5), (2, 43), 0, 97))
    want = _forward_rows(forward, list(toks))
    cache = decode.init_cache(model, 2, PAD)
    pieces = []
    for a, b in ((0, 1), (1, 7), (7, 26), (26, 43)):
        lg, cache = ext(jnp.asarray(toks[:, a:b]), cache, None)
        pieces.append(np.asarray(lg))
    np.testing.assert_allclose(np.concatenate(pieces, 1), np.stack(want), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("style", STYLES_SLOW)
def test_ragged_prompts_in_one_batch(style):
    """Right-padded prompts of lengths 1, 4 and 6 share one prefill; decoding continues per row."""
    model, forward, ext = _model(style)
    lengths = [1, 4, 6]
    n_new = 5
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 97, n + n_new) for n in lengths]
    tokens = np.full((3, max(lengths)), 96, np.int32)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        tokens[i, :n] = s[:n]
    cache = decode.init_cache(model, 3, PAD)
    lg, cache = ext(jnp.asarray(tokens), cache, jnp.asarray(lengths))
    got = [[np.asarray(lg[i, :n])] for i, n in enumerate(lengths)]
    for j in range(n_new):
        step = np.array([[s[n + j]] for s, n in zip(seqs, lengths)], np.int32)
        lg, cache = ext(jnp.asarray(step), cache, None)
        for i in range(3):
            got[i].append(np.asarray(lg[i]))
    assert cache["length"].tolist() == [n + n_new for n in lengths]
    for i, want in enumerate(_forward_rows(forward, seqs)):
        np.testing.assert_allclose(np.concatenate(got[i], 0), want, atol=TOL, rtol=TOL)


@pytest.mark.slow
def test_padding_rows_leave_state_untouched():
    """Padding tokens (past n_valid) change neither the KDA state, the conv rings nor the length."""
    model, _, ext = _model("k3")
    toks = np.asarray(jax.random.randint(jax.random.key(2), (2, 6), 0, 97))
    other = toks.copy()
    other[:, 3:] = (other[:, 3:] + 50) % 97
    c0 = decode.init_cache(model, 2, PAD)
    _, c_a = ext(jnp.asarray(toks), c0, jnp.asarray([3, 3]))
    _, c_b = ext(jnp.asarray(other), c0, jnp.asarray([3, 3]))
    c_ref = c0
    for i in range(3):  # the three real tokens one at a time
        _, c_ref = ext(jnp.asarray(toks[:, i:i + 1]), c_ref, None)
    assert c_a["length"].tolist() == c_b["length"].tolist() == [3, 3]
    n_kda = 0
    for x, y, r in zip(jax.tree.leaves(c_a["layers"], is_leaf=lambda d: isinstance(d, dict) and "state" in d),
                       jax.tree.leaves(c_b["layers"], is_leaf=lambda d: isinstance(d, dict) and "state" in d),
                       jax.tree.leaves(c_ref["layers"], is_leaf=lambda d: isinstance(d, dict) and "state" in d)):
        if isinstance(x, dict):
            n_kda += 1
            for key in x:
                np.testing.assert_array_equal(np.asarray(x[key]), np.asarray(y[key]))
                np.testing.assert_allclose(np.asarray(x[key]), np.asarray(r[key]), atol=1e-5)
    assert n_kda == 6  # 3 KDA layers in the head, 3 KDA positions of the scanned body (stacked)


@pytest.mark.parametrize("style", STYLES_SLOW)
def test_generate_greedy_equals_recompute_and_stops(style):
    model, forward, _ = _model(style)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    prompts = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7, 8], [42]]
    got = decode.generate(graphdef, params, rest, prompts, 6)
    for p, out in zip(prompts, got):
        ids = list(p)
        for _ in range(6):
            ids.append(int(np.argmax(np.asarray(forward(jnp.asarray([ids])))[0, -1])))
        assert out == ids[len(p):]
    # Prefilling in pieces of 3 tokens (rows end in different pieces) changes nothing.
    assert decode.generate(graphdef, params, rest, prompts, 6, prefill_chunk=3) == got
    # Stop tokens end a row (the stop token is kept); other rows run on.
    stop = got[1][2]
    cut = decode.generate(graphdef, params, rest, prompts, 6, stop_tokens=[stop])
    for full, short in zip(got, cut):
        k = full.index(stop) + 1 if stop in full else len(full)
        assert short == full[:k]


def test_a_single_prompt_decodes_beside_a_copy_where_the_platform_asks(monkeypatch):
    """Where `MIN_DECODE_ROWS` asks for two rows (a GPU's), one prompt runs beside a copy of itself: the
    same greedy tokens, one result, and the jitted program sees two rows."""
    model, _, _ = _model("k2")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    alone = decode.generate(graphdef, params, rest, [[5, 9, 13]], 6)
    assert decode.decode_rows(1) == 1  # this platform (a CPU) decodes one row as one row
    monkeypatch.setitem(decode.MIN_DECODE_ROWS, platform(), 2)
    assert [decode.decode_rows(b) for b in (1, 2, 3)] == [2, 2, 3]
    seen = []
    real = decode._generate_fn

    def spy(*args):
        fn = real(*args)
        return lambda params, rest, tokens, *more: seen.append(tokens.shape) or fn(params, rest, tokens, *more)

    monkeypatch.setattr(decode, "_generate_fn", spy)
    assert decode.generate(graphdef, params, rest, [[5, 9, 13]], 6) == alone
    assert seen == [(2, 3)]
    a = decode.generate(graphdef, params, rest, [[3, 4]], 5, temperature=1.0, seed=2)
    assert len(a) == 1 and a == decode.generate(graphdef, params, rest, [[3, 4]], 5, temperature=1.0, seed=2)


def test_sampling_is_seeded_and_top_k_restricts():
    model, _, _ = _model("k2")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    a = decode.generate(graphdef, params, rest, [[3, 4]], 8, temperature=1.0, seed=1)
    b = decode.generate(graphdef, params, rest, [[3, 4]], 8, temperature=1.0, seed=1)
    assert a == b
    logits = jnp.asarray([[0.0, 5.0, 4.0, -1.0, 3.0]])
    draws = {int(decode.sample_logits(logits, jax.random.key(s), 1.0, top_k=2)[0]) for s in range(40)}
    assert draws == {1, 2}
    assert int(decode.sample_logits(logits, None, 0.0)[0]) == 1
    with pytest.raises(ValueError, match="at least one token"):
        decode.generate(graphdef, params, rest, [[]], 3)
    import k3

    assert k3.generate is decode.generate


def test_cache_bytes_match_the_layer_formula():
    from experiments.cache_size import cache_bytes
    from k3.config import layer_kinds

    m = _cfg("k3")
    kinds = layer_kinds(m)
    n_mla = sum(k == "mla" for k, _ in kinds)
    n_kda = len(kinds) - n_mla
    H, K, W = m.kda.n_heads, m.kda.head_dim, m.kda.conv_size
    got = cache_bytes(m, context=100, batch=3)
    assert got["per_token"] == n_mla * (m.mla.kv_lora_rank + m.mla.qk_rope_dim) * 4  # fp32 compute dtype
    assert got["fixed"] == 3 * n_kda * (H * K * K + 3 * (W - 1) * H * K) * 4 + 3 * 4  # + the int32 lengths
    assert got["total"] == got["fixed"] + 100 * 3 * got["per_token"]


@pytest.mark.slow
def test_full_k3_cache_grows_a_quarter_of_all_mla():
    from experiments.cache_size import _configs, cache_bytes

    (_, k3), (_, all_mla), (_, k2) = _configs()
    a, b = cache_bytes(k3, 8192), cache_bytes(all_mla, 8192)
    assert a["per_token"] / b["per_token"] == pytest.approx(24 / 93)
    assert a["per_token"] == 24 * 576 * 2 and cache_bytes(k2, 8192)["per_token"] == 61 * 576 * 2
    assert a["fixed"] == 69 * (96 * 128 * 128 * 4 + 3 * 3 * 96 * 128 * 4) + 4  # fp32 states, conv rings, length


@pytest.mark.parametrize("style", STYLES_SLOW)
def test_speculative_decoding_equals_greedy_for_any_acceptance(style):
    """Drafts taken from the true greedy continuation and corrupted at a random place per row and
    step (including all-right and all-wrong): the emitted tokens equal plain greedy decoding, and the
    rolled-back cache equals a cache that only ever saw the accepted tokens."""
    model, _, ext = _model(style)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    prompts = [[5, 9, 13, 2], [1, 2, 3, 4, 5, 6], [42]]
    n_new, K = 14, 3
    ref = decode.generate(graphdef, params, rest, prompts, n_new + 2 * K + 1)
    spec = jax.jit(lambda c, p, d: decode.speculative_step(model, c, p, d))
    rng = np.random.default_rng(0)
    lengths = [len(p) for p in prompts]
    tokens = np.zeros((3, 6), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    cache = decode.init_cache(model, 3, PAD)
    logits, cache = ext(jnp.asarray(tokens), cache, jnp.asarray(lengths))
    pending = np.argmax(np.asarray(logits)[np.arange(3), np.array(lengths) - 1], axis=-1).astype(np.int32)
    out = [[int(pending[i])] for i in range(3)]
    assert [o[0] for o in out] == [r[0] for r in ref]
    accepted_seen = set()
    while min(len(o) for o in out) < n_new:
        drafts = np.zeros((3, K), np.int32)
        cut = rng.integers(0, K + 1, 3)  # how many drafts are right in each row
        for i in range(3):
            if len(out[i]) >= n_new:  # done: step with a wrong first draft until the others catch up
                cut[i] = 0
            true = ref[i][len(out[i]):len(out[i]) + K]
            drafts[i] = true
            if cut[i] < K:
                drafts[i, cut[i]] = (true[cut[i]] + 1 + rng.integers(0, 95)) % 97
        emitted, n_emit, pending, cache = spec(cache, jnp.asarray(pending), jnp.asarray(drafts))
        emitted, n_emit, pending = np.asarray(emitted), np.asarray(n_emit), np.asarray(pending)
        for i in range(3):
            assert n_emit[i] == cut[i] + 1
            accepted_seen.add(int(cut[i]))
            out[i] += emitted[i, :n_emit[i]].tolist()
            assert int(pending[i]) == out[i][-1]
    for i in range(3):
        assert out[i] == ref[i][:len(out[i])]
    assert accepted_seen == set(range(K + 1))
    # The cache holds exactly prompt + emitted tokens but the pending one: rebuild it plainly.
    plain = decode.init_cache(model, 3, PAD)
    for i in range(3):
        assert int(cache["length"][i]) == lengths[i] + len(out[i]) - 1
    n_max = max(int(x) for x in cache["length"])
    seqs = np.zeros((3, n_max), np.int32)
    for i, p in enumerate(prompts):
        full = p + out[i][:-1]
        seqs[i, :len(full)] = full
    _, plain = jax.jit(lambda t, c, n: decode.extend(model, t, c, n))(jnp.asarray(seqs), plain, cache["length"])
    is_kda = lambda d: isinstance(d, dict) and "state" in d  # noqa: E731
    for a, b in zip(jax.tree.leaves(cache["layers"], is_leaf=is_kda), jax.tree.leaves(plain["layers"], is_leaf=is_kda)):
        if isinstance(a, dict):
            for key in a:
                np.testing.assert_allclose(np.asarray(a[key]), np.asarray(b[key]), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("style", STYLES_SLOW)
def test_prefix_cache_hits_equal_scratch(style):
    from k3.prefix_cache import PrefixCache, page_hashes

    model, forward, ext = _model(style)
    pc = PrefixCache(model, max_len=PAD, page_tokens=4, state_every=2, block_pages=2, max_pages=6)
    rng = np.random.default_rng(4)
    a = rng.integers(0, 97, 23).tolist()
    b = a[:19] + rng.integers(0, 97, 6).tolist()
    c = a[:16]
    reqs = [(a, 0), (b, 16), (a, 16), (c, 8), (b, 16)]  # (prompt, tokens expected from the cache)
    for prompt, reused in reqs:
        before = pc.stats["reused_tokens"]
        logits, cache = pc.prefill(prompt)
        assert pc.stats["reused_tokens"] - before == reused, (len(prompt), reused)
        want = _forward_rows(forward, [prompt])[0]
        np.testing.assert_allclose(np.asarray(logits), want[-1], atol=TOL, rtol=TOL)
        # Decoding continues from the restored cache exactly as from scratch.
        nxt = int(np.argmax(want[-1]))
        lg, cache = ext(jnp.asarray([[nxt]]), cache, None)
        np.testing.assert_allclose(np.asarray(lg[0, 0]), _forward_rows(forward, [prompt + [nxt]])[0][-1],
                                   atol=TOL, rtol=TOL)
    assert pc.stats["evicted_pages"] > 0  # 6 pages of room for 5 + 1 + ... distinct pages
    assert page_hashes(b, 4)[:4] == page_hashes(a, 4)[:4] and page_hashes(b, 4)[4] != page_hashes(a, 4)[4]


def test_bench_decode_kernel_stats_sum_device_kernels_and_their_span():
    """Host events are ignored; two kernels of 30 and 10 us over a 100 us span: 40% busy."""
    from experiments.bench_decode import kernel_stats

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "name": "gemm", "ts": 1000.0, "dur": 30.0},
              {"ph": "X", "pid": 1, "name": "reduce", "ts": 1090.0, "dur": 10.0},
              {"ph": "X", "pid": 2, "name": "host_work", "ts": 0.0, "dur": 5000.0}]
    got = kernel_stats(events, top=1)
    assert got["top"] == [("gemm", 0.75)] and got["launches"] == 2 and got["families"] == [("gemm", 0.75, 1)]
    np.testing.assert_allclose([got["kernel_ms"], got["span_ms"]], [0.04, 0.1])
    assert kernel_stats(events[1:2] + events[4:], top=3) == {}


def test_bench_decode_kernel_families_sum_xla_fusions_across_layers():
    """XLA's per-instance fusion names fold into one family; a Pallas kernel's name is its family."""
    from experiments.bench_decode import kernel_family, kernel_stats

    assert [kernel_family(n) for n in ("gemm_fusion_dot_95", "loop_add_fusion.3", "gemm_fusion_dot",
                                       "moe_decode_grouped_gate_up", "fusion_12_3", "copy_1")] == [
        "gemm_fusion_dot", "loop_add_fusion", "gemm_fusion_dot", "moe_decode_grouped_gate_up", "fusion", "copy"]
    names = ["gemm_fusion_dot_1", "gemm_fusion_dot_2", "moe_decode_grouped_down", "moe_decode_grouped_down",
             "loop_add_fusion.7"]
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}]
    events += [{"ph": "X", "pid": 1, "name": n, "ts": 10.0 * i, "dur": d}
               for i, (n, d) in enumerate(zip(names, [1.0, 3.0, 2.5, 2.5, 1.0]))]
    got = kernel_stats(events, top=2)
    assert got["families"] == [("moe_decode_grouped_down", 0.5, 2), ("gemm_fusion_dot", 0.4, 2)]
    assert got["top"][0] == ("moe_decode_grouped_down", 0.5)


@pytest.mark.slow
def test_bench_decode_runs_and_reports_both_models():
    from experiments import bench_decode

    rows = bench_decode.main(["--contexts=24", "--batch=2", "--steps=3", "--d_model=64", "--n_layers=4",
                              "--dtype=bfloat16", "--hbm_bytes_per_s=1e12", "--speculative=2"])
    assert [r["model"] for r in rows] == ["k3", "all_mla", "k3_speculative"]
    k3, mla, spec = rows
    assert spec["same_tokens"] and spec["speculative_tokens_per_s"] > 0 and spec["steps"] >= 1
    rows = rows[:2]
    assert k3["floor_bytes"]["kda_state"] > 0 and mla["floor_bytes"]["kda_state"] == 0
    assert k3["floor_bytes"]["mla_cache"] < mla["floor_bytes"]["mla_cache"]
    for r in rows:
        assert r["layers"] == "served" and r["floor_bytes"]["weights"] > 0
        assert r["floor_ms"] == pytest.approx(sum(r["floor_bytes"].values()) / 1e12 * 1e3)
        assert r["x_floor"] == pytest.approx(r["ms_per_step"] / r["floor_ms"])
    assert all(r["weights_dtype"] == "bfloat16" for r in rows)
    assert all(r["tokens_per_s"] > 0 and r["cache_bytes"] > 0 for r in rows)
    host = bench_decode.bench("k3", 64, 4, 24, 2, 3, "bfloat16", "bfloat16", loop="host")
    assert host["loop"] == "host" and host["tokens_per_s"] > 0 and host["temp_bytes"] is not None
    only = bench_decode.main(["--contexts=24", "--batch=2", "--steps=3", "--d_model=64", "--n_layers=4",
                              "--models=k3", "--xla_option=xla_gpu_enable_command_buffer=FUSION,WHILE",
                              "--xla_option=xla_gpu_enable_triton_gemm=false", "--speculative=2"])
    assert [r["model"] for r in only] == ["k3", "k3_speculative"]
    assert only[0]["xla_options"] == {"xla_gpu_enable_command_buffer": "FUSION,WHILE",
                                      "xla_gpu_enable_triton_gemm": False} and k3["xla_options"] == {}
    with pytest.raises(SystemExit):
        bench_decode.main(["--models=k3,mla"])
    with pytest.raises(SystemExit, match="unknown decode model 'k2'"):  # `aot_report --decode`'s way in
        bench_decode.model_config("k2", 64, 4, "float32")
    with pytest.raises(SystemExit):
        bench_decode.main(["--models=k3", "--xla_option=no_value"])
    mixed = bench_decode.bench("k3", 64, 4, 24, 2, 3, "bfloat16", "bfloat16", sets=["model.attn_res_impl=xla"])
    assert mixed["sets"] == ["model.attn_res_impl=xla"] and mixed["tokens_per_s"] > 0
    assert bench_decode.model_config("k3", 64, 4, "float32", sets=["model.kda.decode_impl=pallas"]).kda.decode_impl \
        == "pallas"
    with pytest.raises(SystemExit, match="unknown config key model.kda.no_such"):
        bench_decode.model_config("k3", 64, 4, "float32", sets=["model.kda.no_such=1"])
    with pytest.raises(SystemExit, match="model settings"):
        bench_decode.model_config("k3", 64, 4, "float32", sets=["data.batch_size=2"])


@pytest.mark.parametrize("style", STYLES_SLOW_K3)
def test_unrolled_model_decodes_like_the_scanned_one(style):
    """`unrolled` splits the scanned body into one module per layer over the same numbers: every
    layer unrolled, each weight the matching slice of its stack (logical axes without 'layers'),
    the same logits, and the same tokens from `generate` with and without it."""
    model, forward, _ = _model(style)
    flat = unrolled(model)
    assert flat.body is None and flat.head_idx == tuple(range(len(flat.head_layers))) and not flat.tail_layers
    start, period = model.body_start, model.body_period
    body0 = nnx.state(model.body.layers[0], nnx.Param)
    layer = nnx.state(flat.head_layers[start + period], nnx.Param)  # repeat 1, position 0
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(body0),
                                 jax.tree_util.tree_leaves_with_path(layer)):
        np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b), err_msg=str(path))
    for var in jax.tree.leaves(nnx.state(flat, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        axes = var.get_metadata()["out_sharding"]
        assert "layers" not in axes and len(axes) == var.ndim
    toks = jax.random.randint(jax.random.key(2), (2, 11), 0, 97)
    np.testing.assert_allclose(np.asarray(flat(toks)[0]), np.asarray(forward(toks)), atol=TOL, rtol=TOL)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    prompts = [[5, 9, 13], [42]]
    assert (decode.generate(graphdef, params, rest, prompts, 5)
            == decode.generate(graphdef, params, rest, prompts, 5, unroll_layers=False))


def _exact_decode_logits(model, toks_BT, lengths_B, max_len: int, ends) -> list:
    """Logits of a ragged prefill of toks[:, :ends[0]] (``lengths_B`` valid per row), then of each
    extend by toks[:, ends[i-1]:ends[i]], with full-precision matmuls."""
    with jax.default_matmul_precision("highest"):
        cache = decode.init_cache(model, toks_BT.shape[0], max_len)
        out, start, n = [], 0, lengths_B
        for end in ends:
            lg, cache = decode.extend(model, toks_BT[:, start:end], cache, n)
            out.append(lg)
            start, n = end, None
    return out


@pytest.mark.parametrize("overrides", [{}, {"mixer": "mla", "mla.q_lora_rank": 0, "mla.output_gate": False}])
def test_served_model_fuses_the_input_projections_and_decodes_the_same(overrides):
    """`served` = `unrolled` + each mixer's input projections as one [D, N] matrix (and each MLA's
    kv up-projection as its key and value halves, each latent MoE's two output projections as one
    [L + F_s, D] matrix and its input projections with the router as one [D, E + L + 2 F_s]): the original
    weights are gone from the served layers (and kept by the model it came from), the fused matrix
    holds them side by side, and the logits of a forward pass and of a ragged prefill plus a decode
    step equal the unfused model's (full-precision matmuls; K3's KDA and gated MLA with a query
    latent, and MLA with neither)."""
    model = Model(tiny_model_cfg(n_layers=4, **overrides), rngs=nnx.Rngs(3))
    flat, fused = unrolled(model), served(model)
    for layer, ref in zip(fused.head_layers, flat.head_layers):
        mixer = layer.mixer
        names = [n for n, _ in mixer.fused_shapes]
        assert all(getattr(mixer, n) is None for n in names) and getattr(ref.mixer, names[0]) is not None
        cols = np.concatenate([np.asarray(getattr(ref.mixer, n)[...]).reshape(mixer.w_in.shape[0], -1)
                               for n in names], axis=1)
        np.testing.assert_array_equal(np.asarray(mixer.w_in[...]), cols)
    assert {n for n, _ in fused.head_layers[0].mixer.fused_shapes} >= (
        {"w_q", "w_k", "w_v", "w_fa", "w_beta", "w_gate"} if not overrides else {"q_b", "kv_a"})
    # Each latent MoE's output projections, stacked: [latent up-projection; shared experts' down].
    n_moe = 0
    for layer, ref in zip(fused.head_layers, flat.head_layers):
        if getattr(ref.ffn, "w_up_latent", None) is None:
            continue
        n_moe += 1
        assert layer.ffn.w_up_latent is None and layer.ffn.shared.w_down is None
        want = np.concatenate([np.asarray(ref.ffn.w_up_latent[...]), np.asarray(ref.ffn.shared.w_down[...])])
        np.testing.assert_array_equal(np.asarray(layer.ffn.w_out[...]), want)
        # ... and its input matrices: [router | latent down | shared gate | shared up].
        assert layer.ffn.router is None and layer.ffn.w_down_latent is None
        want = np.concatenate([np.asarray(w[...]) for w in (ref.ffn.router, ref.ffn.w_down_latent,
                                                             ref.ffn.shared.w_gate, ref.ffn.shared.w_up)], axis=1)
        np.testing.assert_array_equal(np.asarray(layer.ffn.w_in[...]), want)
    assert n_moe >= 2
    # Each MLA's kv up-projection as the key and value halves its decode step reads.
    n_mla = 0
    for layer, ref in zip(fused.head_layers, flat.head_layers):
        if not hasattr(ref.mixer, "kv_b"):
            continue
        n_mla += 1
        kv_b, nope = np.asarray(ref.mixer.kv_b[...]), ref.mixer.nope
        assert layer.mixer.kv_b is None
        np.testing.assert_array_equal(np.asarray(layer.mixer.kv_b_k[...]), kv_b[..., :nope])
        np.testing.assert_array_equal(np.asarray(layer.mixer.kv_b_v[...]), kv_b[..., nope:])
    assert n_mla >= 1
    toks = jax.random.randint(jax.random.key(5), (2, 9), 0, 97)
    lengths = jnp.asarray([6, 2])
    outs = [[m(toks)[0]] + _exact_decode_logits(m, toks, lengths, 16, (6, 7)) for m in (flat, fused)]
    for a, b in zip(*outs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=TOL)


def test_fuse_inputs_refuses_weights_of_another_input_width():
    """Only weights that all read x [.., D] can share one matrix: a mismatch names the shapes."""
    from k3.nn import fuse_inputs

    mixer = Model(tiny_model_cfg(n_layers=4), rngs=nnx.Rngs(0)).head_layers[0].mixer
    with pytest.raises(ValueError, match="must all be"):
        fuse_inputs(mixer, ("w_q", "w_o"))
    assert mixer.w_q is not None  # nothing was replaced


@pytest.mark.parametrize("impl", ["pallas", pytest.param("pallas_merged", marks=pytest.mark.slow)])
def test_pallas_latent_decode_attention_equals_the_xla_form(impl):
    """`model.mla.decode_impl='pallas'` (the split-S kernel over the cached latents, interpreted on a
    CPU, compiled on a GPU; 'pallas_merged' with the single-token steps' merge kernel) gives the XLA
    form's logits: a ragged prefill, single-token steps and a 3-token extend. Full-precision matmuls
    throughout: the kernel's fp32 dots are exact, while XLA's fp32 einsums would run as TF32 on a GPU
    (1.7e-5 apart on these logits, measured on an H200)."""
    cfg = tiny_model_cfg(**{"mla.decode_impl": impl})
    kernel = Model(cfg, rngs=nnx.Rngs(4))
    cfg.mla.decode_impl = "xla"
    ref = Model(cfg, rngs=nnx.Rngs(4))
    toks = jax.random.randint(jax.random.key(9), (3, 12), 0, cfg.vocab_size)
    lengths = jnp.asarray([5, 1, 7])
    outs = [_exact_decode_logits(model, toks, lengths, 64, (7, 8, 11)) for model in (kernel, ref)]
    for a, b in zip(*outs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def _ngram_reference(hist, k, n):
    """Python form of `decode.ngram_drafts` for one row's token list."""
    suffix = hist[len(hist) - n:]
    for p in range(len(hist) - n - 1, -1, -1):
        if len(hist) >= n + 1 and hist[p:p + n] == suffix:
            follow = hist[p + n:p + n + k]
            return follow + [hist[-1]] * (k - len(follow))
    return [hist[-1]] * k


def test_ngram_drafts_match_a_python_reference():
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist() for _ in range(40)]
    rows += [[7], [1, 2], [1, 2, 1, 2, 1, 2], [5, 5, 5], [1, 2, 3, 1, 2]]
    L = max(len(r) for r in rows) + 3
    hist = np.full((len(rows), L), 9, np.int32)
    for i, r in enumerate(rows):
        hist[i, :len(r)] = r
    lengths = jnp.asarray([len(r) for r in rows])
    for k, n in ((3, 2), (1, 1), (4, 3)):
        got = np.asarray(decode.ngram_drafts(jnp.asarray(hist), lengths, k, n)).tolist()
        assert got == [_ngram_reference(r, k, n) for r in rows], (k, n)


@pytest.mark.parametrize("style", STYLES_SLOW_K3)
def test_speculative_generate_equals_greedy_generate(style):
    """Prompt-lookup speculative decoding emits exactly `generate`'s greedy tokens, in fewer
    verification passes than tokens when drafts are accepted (a repetitive prompt)."""
    # Run serially after this file's other tests, XLA:CPU (jaxlib 0.10.2) crashed compiling these
    # programs (three runs of three; also with the disk cache off and a 256 MB stack); with the
    # in-memory compiled programs dropped first the file passed (two runs of two).
    jax.clear_caches()
    model, _, _ = _model(style)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [1, 2, 3, 4], [42]]
    want = decode.generate(graphdef, params, rest, prompts, 12)
    got, stats = decode.speculative_generate(graphdef, params, rest, prompts, 12, k=3, n=2)
    assert got == want
    assert stats["steps"] <= 11 and stats["tokens"] >= 3 * 11
    assert stats["mean_accepted"] == pytest.approx(stats["tokens"] / (3 * stats["steps"]))
