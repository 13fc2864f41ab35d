"""Incremental decoding: the per-model cache, prefill/decode (`extend`) and `generate`.

The cache mirrors the model's layer layout ({'head': [per layer], 'body': [per position in the
scanned period, stacked over repeats], 'tail': [per layer]}) plus 'length' [B] int32, the tokens
cached per row:
  KDA layer  'state' [B, H, K, V] fp32 and the short-conv ring 'conv' [B, conv - 1, 3 H*K] (q, k, v):
             a fixed size, whatever the context length;
  MLA layer  'c_kv' [B, S, kv_lora] (the normed latent) and 'k_rope' [B, S, rope]: kv_lora + rope
             values per token (576 in the full K3/K2 shapes), never expanded to per-head keys.
AttnRes mixes over depth only, and MoE routing is per token, so neither needs a cache.

`extend` runs T new tokens per row on top of the cache: T = the prompt for prefill, 1 for a decode
step, k + 1 for speculative verification. Rows may use fewer than T (``n_valid``): prompts of
different lengths share one right-padded prefill.

Each mixer owns its cache: its layout (``init_cache``), running tokens on it (``extend``), and the
KDA replay of a prefix (`k3.kda.layer.replay_kda`) and MLA row writes (`k3.mla.layer.write_rows`).
This module walks the layers with them and holds the loop that is the same for every model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3 import attn_res
from k3.backends import platform
from k3.kda.layer import replay_kda
from k3.mla.layer import write_rows
from k3.model import per_layer, replace_slot, served, walk_layers
from k3.nn import cast


# Rows a decoding step runs, at least, per platform. With one row every projection is a vector-matrix
# product, which XLA's GPU compiler rewrites as a multiply that writes a weight-sized product and a sum
# that reads it back (three passes over each weight, two kernels); with two rows they stay GEMMs. A K3
# 1024x16 step compiled for an H100 has 540 kernels at one row, 396 at two (BENCHMARKS.md). XLA's CPU
# compiler keeps vector-matrix dots as they are.
MIN_DECODE_ROWS = {"gpu": 2}


def decode_rows(batch: int) -> int:
    """Rows to decode ``batch`` sequences with on this platform (`MIN_DECODE_ROWS`): the extra rows
    repeat the first sequence and are dropped from the results."""
    return max(batch, MIN_DECODE_ROWS.get(platform(), 1))


def init_cache(model, batch: int, max_len: int, dtype=None) -> dict:
    """An empty cache for ``batch`` rows of up to ``max_len`` tokens (MLA latents in ``dtype``,
    default the model's compute dtype; KDA state always fp32), laid out like the layers
    (`k3.model.per_layer`)."""
    dtype = jnp.dtype(dtype or model.dtype)
    layers = per_layer(model, lambda layer: layer.mixer.init_cache(batch, max_len, dtype))
    return {"layers": layers, "length": jnp.zeros((batch,), jnp.int32)}


def cache_max_len(cache: dict) -> int | None:
    """The token capacity of a cache's MLA layers (None when the model has none)."""
    for c in jax.tree.leaves(cache["layers"], is_leaf=lambda x: isinstance(x, dict) and "c_kv" in x):
        if isinstance(c, dict) and "c_kv" in c:
            return c["c_kv"].shape[-2]
    return None


def extend(model, tokens_BT: jax.Array, cache: dict, n_valid_B: jax.Array | None = None,
           keep_inputs: bool = False):
    """Runs T new tokens per row after the cached ones: (logits [B, T, V] fp32, new cache).

    tokens: int [B, T]; n_valid: int [B] real tokens per row (default all T); the logits of a row's
    padding positions are meaningless. The MLA caches must hold length + T tokens.
    ``keep_inputs``: KDA layers also return the tokens' projected inputs (see `rollback`).
    """
    B, T = tokens_BT.shape
    n_valid = jnp.full((B,), T, jnp.int32) if n_valid_B is None else jnp.asarray(n_valid_B, jnp.int32)
    start = cache["length"]
    emb = jnp.take(model.embed[...], tokens_BT, axis=0).astype(model.dtype)
    stream = attn_res.init_stream(emb, model.residual, model.n_slots)

    def write(c, upd, r):
        """The layer cache ``c`` after its layer's update (``r``: the repeat, for stacked caches)."""
        if "c_kv" in c:  # MLA: scatter only the new rows, in place
            return {k: write_rows(c[k], upd[k], start, r) for k in c}
        return replace_slot(c, upd, r)

    def step(layer, idx, stream, c):
        stream, upd = layer.extend(stream, c, idx, start, n_valid, keep_inputs)
        return stream, {k: v for k, v in upd.items() if k != "inputs"}, upd.get("inputs")

    # Inputs kept by an earlier ``keep_inputs`` call are not part of the state.
    caches = jax.tree.map(lambda c: {k: v for k, v in c.items() if k != "inputs"}, cache["layers"],
                          is_leaf=lambda x: isinstance(x, dict) and ("c_kv" in x or "state" in x))
    stream, new, kept = walk_layers(model, stream, step, caches, write)
    new = jax.tree.map(lambda c, k: c if k is None else {**c, "inputs": k}, new, kept,
                       is_leaf=lambda x: x is None or (isinstance(x, dict) and ("c_kv" in x or "state" in x)))
    h = attn_res.read(stream, model.out_mix, model.out_bank_count(), model.final_norm)
    logits = jnp.einsum("btd,dv->btv", h, cast(model.lm_head, model.dtype)).astype(jnp.float32)
    return logits, {"layers": new, "length": start + n_valid}


def sample_logits(logits_BV: jax.Array, key, temperature: float, top_k: int = 0) -> jax.Array:
    """Next tokens [B] int32: argmax when temperature <= 0, else a draw from softmax(logits / t),
    restricted to the top_k logits when 0 < top_k < V (a larger top_k keeps them all)."""
    if temperature <= 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = logits_BV / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def prefill(model, tokens_BP: jax.Array, lengths_B: jax.Array, cache: dict, chunk: int = 0):
    """Prefills right-padded prompts: (logits [B, V] after each row's last token, cache).

    tokens: int [B, P]; lengths: int [B] (>= 1). ``chunk`` > 0 runs the prompt in pieces of that
    many tokens (P must be a multiple of it), which bounds the MLA score buffer [B, H, chunk, S].
    """
    B, P = tokens_BP.shape
    rows = jnp.arange(B)
    if chunk <= 0 or chunk >= P:
        logits, cache = extend(model, tokens_BP, cache, lengths_B)
        return logits[rows, lengths_B - 1], cache
    if P % chunk:
        raise ValueError(f"prompt width {P} is not a multiple of the prefill chunk {chunk}")

    def piece(carry, c):
        cache, last = carry
        toks = jax.lax.dynamic_slice_in_dim(tokens_BP, c * chunk, chunk, axis=1)
        n = jnp.clip(lengths_B - c * chunk, 0, chunk)
        logits, cache = extend(model, toks, cache, n)
        mine = (n > 0) & (lengths_B <= (c + 1) * chunk)  # the row's last token is in this piece
        last = jnp.where(mine[:, None], logits[rows, jnp.maximum(n - 1, 0)], last)
        return (cache, last), None

    V = model.lm_head.shape[-1]
    (cache, last), _ = jax.lax.scan(piece, (cache, jnp.zeros((B, V), jnp.float32)), jnp.arange(P // chunk))
    return last, cache


@functools.lru_cache(maxsize=16)
def _generate_fn(graphdef, max_new: int, max_len: int, temperature: float, top_k: int, pad_id: int,
                 prefill_chunk: int, unroll_layers: bool):
    @jax.jit
    def run(params, rest, tokens_BP, lengths_B, stop_ids, key):
        model = nnx.merge(graphdef, params, rest)
        if unroll_layers:  # once, before the loop: no per-token copy or concatenation of weights
            model = served(model)
        B = tokens_BP.shape[0]
        cache = init_cache(model, B, max_len)
        last, cache = prefill(model, tokens_BP, lengths_B, cache, prefill_chunk)

        def step(carry, _):
            cache, last, key, done = carry
            key, sub = jax.random.split(key)
            tok = jnp.where(done, pad_id, sample_logits(last, sub, temperature, top_k))
            done = done | jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
            logits, cache = extend(model, tok[:, None], cache)
            return (cache, logits[:, 0], key, done), tok

        _, toks = jax.lax.scan(step, (cache, last, key, jnp.zeros((B,), bool)), None, length=max_new)
        return toks.T  # [B, max_new]

    return run


def generate(graphdef, params, rest, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, stop_tokens: Sequence[int] = (), seed: int = 0,
             pad_id: int = 0, prefill_chunk: int = 512, unroll_layers: bool = True) -> list[list[int]]:
    """Continues each prompt (a batch of different lengths) by up to ``max_new_tokens`` tokens.

    One jitted program: a right-padded prefill of all prompts, then a scan of decode steps. A row
    stops after emitting one of ``stop_tokens`` (included in its output). Greedy when
    ``temperature`` <= 0. ``graphdef, params, rest``: the model as `nnx.split(model, nnx.Param, ...)`.
    Prompts longer than ``prefill_chunk`` are prefilled in pieces of that many tokens.
    ``unroll_layers`` decodes through `k3.model.served` (each layer's weights split out of the
    scanned stack and its input projections fused, once per call, so the token loop reads them in
    place; compile time grows with depth); False keeps the scanned training layout. A single prompt on a
    GPU decodes beside a copy of itself (`decode_rows`).
    Returns the new tokens of each row.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    P = max(len(p) for p in prompts)
    if prefill_chunk > 0 and P > prefill_chunk:
        P = -(-P // prefill_chunk) * prefill_chunk
    rows = list(prompts) + [prompts[0]] * (decode_rows(len(prompts)) - len(prompts))
    tokens = np.full((len(rows), P), pad_id, np.int32)
    for i, p in enumerate(rows):
        tokens[i, :len(p)] = p
    lengths = np.array([len(p) for p in rows], np.int32)
    # Capacity rounded up so that nearby prompt lengths reuse one compiled program.
    max_len = -(-(P + max_new_tokens) // 64) * 64
    fn = _generate_fn(graphdef, max_new_tokens, max_len, float(temperature), int(top_k), int(pad_id),
                      int(prefill_chunk) if P > prefill_chunk > 0 else 0, bool(unroll_layers))
    stop_ids = jnp.asarray(list(stop_tokens) or [-1], jnp.int32)
    out = np.asarray(fn(params, rest, jnp.asarray(tokens), jnp.asarray(lengths), stop_ids,
                        jax.random.key(seed)))[:len(prompts)]
    stops = set(int(s) for s in stop_tokens)
    result = []
    for row in out.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        result.append(row[:cut])
    return result


# ---------------------------------------------------------------------------------------------
# Speculative decoding: verify k drafts in one pass, roll the KDA states back without per-token states


def rollback(before: dict, after: dict, n_B: jax.Array) -> dict:
    """The cache after only the first ``n_B[b]`` tokens of an `extend(..., keep_inputs=True)` that
    took ``before`` to ``after``: KDA layers replayed (`k3.kda.layer.replay_kda`), MLA layers keep
    their written latents (those past the new length are never read and get overwritten)."""
    def layer(b, a, stacked):
        if "state" not in b:
            return a
        if stacked:
            return jax.vmap(replay_kda, in_axes=(0, 0, None))(b, a["inputs"], n_B)
        return replay_kda(b, a["inputs"], n_B)

    lb, la = before["layers"], after["layers"]
    layers = {"head": [layer(b, a, False) for b, a in zip(lb["head"], la["head"])],
              "body": [layer(b, a, True) for b, a in zip(lb["body"], la["body"])],
              "tail": [layer(b, a, False) for b, a in zip(lb["tail"], la["tail"])]}
    return {"layers": layers, "length": before["length"] + n_B}


def speculative_step(model, cache: dict, pending_B: jax.Array, drafts_BK: jax.Array):
    """One greedy speculative step: verifies k draft tokens per row in one forward pass.

    pending: [B] the token chosen last and not yet in the cache; drafts: [B, k] proposed next
    tokens. Feeds [pending, drafts] (k + 1 tokens), accepts each row's longest draft prefix that
    greedy decoding would have produced, and takes the model's token after it. Returns
    (emitted [B, k + 1] with the row's first n_emit valid, n_emit [B] in 1..k+1, the new pending
    token [B] (the last emitted), the cache holding pending + accepted drafts). Equal to n_emit
    steps of plain greedy decoding for any drafts.
    """
    B, K = drafts_BK.shape
    tokens = jnp.concatenate([pending_B[:, None], drafts_BK], axis=1)
    logits, after = extend(model, tokens, cache, keep_inputs=True)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, k + 1]: the token after each position
    matches = greedy[:, :K] == drafts_BK
    n_acc = jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=1), axis=1)  # accepted drafts
    bonus = jnp.take_along_axis(greedy, n_acc[:, None], axis=1)[:, 0]
    emitted = jnp.where(jnp.arange(K + 1)[None, :] < n_acc[:, None],
                        jnp.concatenate([drafts_BK, jnp.zeros((B, 1), jnp.int32)], axis=1), 0)
    emitted = jnp.where(jnp.arange(K + 1)[None, :] == n_acc[:, None], bonus[:, None], emitted)
    return emitted, n_acc + 1, bonus, rollback(cache, after, n_acc + 1)


def ngram_drafts(history_BL: jax.Array, length_B: jax.Array, k: int, n: int = 2) -> jax.Array:
    """Prompt-lookup drafts [B, k] int32: for each row, the k tokens that followed the latest
    earlier occurrence of its last ``n`` tokens in its own history; a row without one proposes its
    last token k times (a wrong draft costs a verification slot, never a wrong output).

    history: int [B, L], row b's tokens in [0, length_B[b]) (prompt, then everything emitted,
    ending with the pending token); length: int [B] >= 1.
    """
    B, L = history_BL.shape
    length = jnp.asarray(length_B, jnp.int32)
    rows = jnp.arange(B)[:, None]
    suffix = jnp.take_along_axis(history_BL, jnp.clip(length[:, None] - n + jnp.arange(n)[None, :], 0, L - 1), 1)
    P = max(L - n + 1, 1)
    match = jnp.ones((B, P), bool)
    for i in range(n):  # window p holds tokens p .. p + n - 1
        match &= history_BL[:, i:i + P] == suffix[:, i:i + 1]
    p = jnp.arange(P)[None, :]
    # An earlier occurrence: its continuation p + n must be a known token before the suffix itself.
    match &= (p + n < length[:, None]) & (length[:, None] >= n + 1)
    best = jnp.max(jnp.where(match, p, -1), axis=1)  # [B], -1: no match
    idx = jnp.clip(best[:, None] + n + jnp.arange(k)[None, :], 0, length[:, None] - 1)
    drafts = history_BL[rows, idx]
    last = history_BL[jnp.arange(B), length - 1]
    return jnp.where(best[:, None] >= 0, drafts, last[:, None]).astype(jnp.int32)


@functools.lru_cache(maxsize=16)
def _speculative_fns(graphdef, k: int, n: int, unroll_layers: bool):
    def model_of(params, rest):
        model = nnx.merge(graphdef, params, rest)
        return served(model) if unroll_layers else model

    @functools.partial(jax.jit, static_argnums=(4,))
    def start(params, rest, tokens_BP, lengths_B, max_len):
        model = model_of(params, rest)
        cache = init_cache(model, tokens_BP.shape[0], max_len)
        last, cache = prefill(model, tokens_BP, lengths_B, cache)
        return jnp.argmax(last, axis=-1).astype(jnp.int32), cache

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(params, rest, cache, pending_B, history_BL, length_B):
        drafts = ngram_drafts(history_BL, length_B, k, n)
        emitted, n_emit, pending, cache = speculative_step(model_of(params, rest), cache, pending_B, drafts)
        return emitted, n_emit, pending, cache

    return start, step


def speculative_generate(graphdef, params, rest, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                         k: int = 4, n: int = 2, unroll_layers: bool = True) -> tuple[list[list[int]], dict]:
    """Greedy continuation of each prompt by ``max_new_tokens`` tokens through `speculative_step`
    with prompt-lookup drafts (`ngram_drafts`: k tokens after the latest earlier match of the last n).
    The tokens equal `generate`'s greedy ones; fewer forward passes when drafts are accepted.

    Returns (new tokens per row, {'steps': verification passes, 'tokens': tokens the passes emitted
    over all rows (the prefill's first token not counted), 'mean_accepted': those per row and pass}).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if k < 1 or n < 1:
        raise ValueError(f"speculative_generate: k and n must be >= 1; got k={k}, n={n}")
    B, P = len(prompts), max(len(p) for p in prompts)
    L = P + max_new_tokens + k + 1
    max_len = -(-L // 64) * 64
    tokens = np.zeros((B, P), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    start, step = _speculative_fns(graphdef, int(k), int(n), bool(unroll_layers))
    pending, cache = start(params, rest, jnp.asarray(tokens), jnp.asarray(lengths), max_len)
    history = np.zeros((B, max_len), np.int32)
    history[:, :P] = tokens
    hist_len = lengths.copy()
    out = [[] for _ in range(B)]
    pend = np.asarray(pending)
    for b in range(B):
        history[b, hist_len[b]] = pend[b]
        out[b].append(int(pend[b]))
    hist_len += 1
    steps = emitted_total = 0
    while min(len(o) for o in out) < max_new_tokens:
        emitted, n_emit, pending, cache = step(params, rest, cache, pending, jnp.asarray(history),
                                               jnp.asarray(hist_len))
        emitted, n_emit = np.asarray(emitted), np.asarray(n_emit)
        steps += 1
        for b in range(B):
            new = emitted[b, :n_emit[b]].tolist()
            history[b, hist_len[b]:hist_len[b] + len(new)] = new
            hist_len[b] += len(new)
            out[b].extend(new)
            emitted_total += len(new)
    stats = {"steps": steps, "tokens": emitted_total, "mean_accepted": emitted_total / max(steps * B, 1)}
    return [o[:max_new_tokens] for o in out], stats
