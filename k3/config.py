"""Configuration schema: every knob with its default, and validation.

A config file under ``experiments/configs/`` defines ``get_config()`` that starts from
:func:`default_config` and changes values. The returned ``ConfigDict`` is locked, so setting a key
that the schema does not have raises, and :func:`validate` rejects unknown keys, wrong types and
inconsistent values with a message that names the key.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections

ConfigDict = ml_collections.ConfigDict


def default_config() -> ConfigDict:
    """The full schema with the defaults of the tiny K3 model (trains on a CPU in minutes)."""
    c = ConfigDict()
    c.name = "k3_tiny"
    c.seed = 0
    c.steps = 150  # optimizer steps

    m = c.model = ConfigDict()
    m.vocab_size = 2048
    m.d_model = 128
    m.n_layers = 8
    m.mixer = "hybrid"  # 'hybrid': KDA except MLA where (l+1) % mla_period == 0 or l is last; 'mla'
    m.mla_period = 4
    m.first_k_dense = 0  # K3 has 1; 0 lets the tiny model scan all its layers (half the compile time)
    m.dense_ffn_dim = 384
    m.activation = "situ"  # 'situ' (SiTU-GLU) or 'swiglu'
    m.situ_beta_gate = 4.0
    m.situ_beta_up = 25.0
    m.residual = "attn_res"  # 'attn_res' (Block Attention Residuals) or 'plain'
    m.attn_res_block_size = 4
    # k3.attn_res.MIX_BACKENDS: 'xla' (jnp), 'pallas' (kernels), 'pallas_norm' (the norm in them too);
    # 'auto': pallas_norm on a GPU
    m.attn_res_impl = "auto"
    m.norm_eps = 1e-5
    m.init_std = 0.02
    m.dtype = "float32"  # compute dtype of activations and matmuls; parameters and optimizer state stay float32
    m.remat = False  # rematerialise each scanned layer group in the backward pass
    # k3.model.REMAT_POLICIES: what remat keeps: 'full' (inputs only), 'dots' (projections), 'dots_kernels',
    # 'dots_kernels_glu', 'dots_kernels_glu_inputs', 'dots_kernels_glu_experts', 'matmuls_kernels'
    m.remat_policy = "full"
    m.ce_chunk = 0  # > 0: the loss over chunks of this many positions of every row, never forming the
    # [B, T, V] logits (k3.model.linear_cross_entropy); 0: the whole logits array
    m.ce_impl = "custom_vjp"  # k3.model.CROSS_ENTROPY, the whole-logits loss: 'custom_vjp' (two passes over the
    # logits, BENCHMARKS.md) or 'autodiff' (autodiff of the fp32 log-softmax, kept for comparisons)
    m.layer_loop = "auto"  # k3.model.LAYER_LOOPS: 'scan' (repeated layer groups as one lax.scan: compile time
    # flat in depth) or 'unroll' (faster steps, less memory on one H200: BENCHMARKS.md); 'auto': unroll on a GPU.
    # It decides the parameter tree: a run saves the resolved value. The full-size configs name 'scan'.

    a = m.mla = ConfigDict()
    a.n_heads = 4
    a.q_lora_rank = 64
    a.kv_lora_rank = 32
    a.qk_nope_dim = 32
    a.qk_rope_dim = 16
    a.v_head_dim = 32
    a.use_rope = False  # K2: decoupled RoPE on the qk_rope_dim part; K3: NoPE
    a.rope_theta = 50000.0
    a.output_gate = True  # K3: sigmoid full-rank output gate
    a.norm_eps = 1e-6  # q_a / kv_a norms
    a.attention_impl = "auto"  # k3.mla.ATTENTION: 'auto' ('flash' on GPU, 'xla' elsewhere), 'xla', 'cudnn',
    # 'pallas', 'flash' (document-skipping Pallas kernel)
    a.decode_impl = "auto"  # k3.mla.DECODE_ATTENTION over the latent cache: 'auto' ('pallas' on GPU, 'xla'
    # elsewhere), 'xla', 'pallas', 'pallas_merged' (a decode step's split merge in a kernel too)

    k = m.kda = ConfigDict()
    k.n_heads = 4
    k.head_dim = 32
    k.conv_size = 4
    k.gate = "bounded"  # 'bounded': lower_bound*sigmoid(exp(A_log)*z); 'softplus': -exp(A_log)*softplus(z)
    k.gate_lower_bound = -5.0
    k.chunk_size = 16
    k.impl = "auto"  # k3.kda.ops.KDA_CORES: 'auto' (Pallas on GPU, 'chunk' elsewhere), 'chunk' = 'reference'
    # (jnp chunked), 'recurrent' (token scan), 'pallas'
    k.conv_impl = "auto"  # k3.kda.layer.CONV_BACKENDS: conv+SiLU(+L2) branches, 'xla' (jnp) or 'pallas' (kernels);
    # 'auto': pallas on a GPU
    k.decode_impl = "auto"  # k3.kda.layer.DECODE_STEPS, one-token decode steps: 'xla' (the layer's own ops) or
    # 'pallas' (one kernel from projections to gated norm, cache updated in place); 'auto': pallas on a GPU

    e = m.moe = ConfigDict()
    e.n_experts = 8
    e.top_k = 2
    e.expert_dim = 64
    e.latent_dim = 64  # 0: experts at full width (K2); >0: LatentMoE (K3)
    e.shared_dim = 128  # width of the (single, merged) shared-expert MLP; 0 for none
    e.routed_scaling = 1.0
    e.balancing = "quantile_hist"  # k3.moe.balancing.BALANCERS: 'quantile_hist', 'quantile', 'sign', 'none'
    e.sign_rate = 1e-3
    e.hist_bins = 1000
    e.capacity_factor = 0.0  # expert-parallel all-to-all: 0 = dropless; c > 0 caps each device at c N k / P routes
    e.ep_dispatch = "auto"  # 'auto' (ragged on GPU/TPU, padded on CPU), 'padded', 'ragged'
    e.expert_impl = "auto"  # k3.moe.EXPERT_BACKENDS: 'auto' (capacity on GPU, ragged elsewhere), 'ragged'
    # (dropless), 'capacity' (expert_capacity x mean rows per expert, batched dense matmuls), 'dense'
    e.expert_capacity = 1.25  # 'capacity': rows per expert / (N k / E); routes past it are dropped
    e.decode_impl = "auto"  # k3.moe.DECODE_EXPERTS, decoding with fewer routes than experts: 'auto'
    # ('grouped' on GPU, else 'train': the training backend), 'gather' (routed weights gathered), 'pallas'
    # (each route reads its expert's weights in place; pallas_kernels.moe_decode), 'grouped' (routes grouped
    # by expert, each expert read once for all its routes), 'grouped_fused' (the same in one kernel)
    e.decode_route_impl = "auto"  # k3.moe.DECODE_ROUTERS, those decoding calls' routing: 'auto' ('pallas'
    # on GPU, else 'xla'), 'xla' (MoE.route's ops) or 'pallas' (XLA's router GEMM, then
    # pallas_kernels.moe_route's one kernel for the top-k and the weights)

    o = c.optim = ConfigDict()
    o.name = "muon"  # 'muon' (Muon for 2-D matrices, AdamW for the rest) or 'adamw'
    o.lr = 3e-3
    o.adam_lr = 3e-3
    o.schedule = "cosine"  # 'cosine' (warmup + cosine), 'wsd' (warmup, stable, 1-sqrt cooldown) or
    # 'external' (the rate is the state's 'lr' scalar, set by the caller at each step)
    o.warmup_frac = 0.01
    o.warmup_steps = -1  # >= 0 overrides warmup_frac
    o.decay_frac = 0.2  # WSD cooldown fraction
    o.min_lr_ratio = 0.1
    o.weight_decay = 0.1
    o.b1 = 0.9
    o.b2 = 0.95
    o.eps = 1e-8
    o.momentum = 0.95
    o.clip_norm = 1.0
    o.grad_accum = 1
    o.qk_clip = False
    o.qk_clip_tau = 100.0
    o.per_head_muon = False
    o.mu_dtype = "float32"  # first moments (Muon, Adam); 'bfloat16' also runs Newton-Schulz in bf16
    o.newton_schulz = "grouped"  # Muon's iteration: 'grouped' (k3.muon's folded form, small same-shape
    # matrices of several leaves in one batch: fewer launches), 'folded' (one chain per leaf) or 'optax'
    # (reference)

    h = c.mesh = ConfigDict()  # device mesh sizes (k3.sharding); -1 fills the rest; all 1: one device
    h.data = 1
    h.fsdp = 1
    h.expert = 1
    h.context = 1
    h.tensor = 1
    h.rule_overrides = ""  # 'logical=axis+axis,...' on top of k3.sharding.DEFAULT_RULES

    d = c.data = ConfigDict()
    # 'stdlib' (embedded default corpus), 'site_packages' (larger embedded corpus: installed
    # distributions' source and docs, for single-epoch scaling runs), 'text_dir', 'jsonl', 'tokens'
    d.source = "stdlib"
    d.path = ""
    d.suffixes = "python"  # site_packages: k3.data.corpus.SITE_SUFFIX_SETS, 'python' (.py/.pyi/.md/.rst/.txt)
    # or 'code' (also C/C++/CUDA headers and sources, Cython, Fortran, shell, CMake, ...)
    d.extra_roots = ""  # site_packages: os.pathsep-separated directories scanned as well, e.g. '/usr/include'
    # (directories inside site-packages, such as torch/include, are already scanned)
    d.text_field = "text"
    d.tokens_dtype = "uint16"
    d.tokenizer = "bpe"  # 'bpe' (trained locally, cached) or 'byte'
    d.tokenizer_path = ""  # '' = cache under the workdir
    d.tokenizer_train_bytes = 4 * 2**20  # text the BPE trainer reads, sampled across the training split
    d.seq_len = 128
    d.batch_size = 8
    d.val_fraction = 0.02
    d.max_docs = 0  # 0 = all

    t = c.train = ConfigDict()
    t.log_every = 10
    t.eval_every = 100
    t.eval_batches = 8
    t.ckpt_every = 100
    t.keep_ckpts = 3
    t.keep_period = 0  # keep every checkpoint whose step is a multiple of this (0 = none)
    t.async_ckpt = True
    t.peak_flops = 0.0  # device peak FLOP/s for MFU; 0 = look up from the device kind
    t.progress = True
    return c


_CHOICES = {
    "model.mixer": ("hybrid", "mla"),
    "model.activation": ("situ", "swiglu"),
    "model.residual": ("attn_res", "plain"),
    "model.dtype": ("float32", "bfloat16"),
    "model.kda.gate": ("bounded", "softplus"),
    "model.moe.ep_dispatch": ("auto", "padded", "ragged", "ragged_emulated"),
    "optim.name": ("muon", "adamw"),
    "optim.schedule": ("cosine", "wsd", "external"),
    "optim.mu_dtype": ("float32", "bfloat16"),
    "data.source": ("stdlib", "site_packages", "text_dir", "jsonl", "tokens"),
    "data.tokenizer": ("bpe", "byte"),
    "data.tokens_dtype": ("uint16", "uint32"),
}


# Renamed keys, named in the unknown-key error; their old values still read (recorded benchmark
# commands, saved run configs): old key -> (key, {old value: new value}).
RENAMED_VALUES = {"model.scan_layers": ("model.layer_loop", {True: "scan", False: "unroll"})}


def renamed_setting(key: str, value):
    """(key, value) as the schema names them now: a `RENAMED_VALUES` key is translated, others pass."""
    if key in RENAMED_VALUES:
        new, values = RENAMED_VALUES[key]
        if value not in values:
            raise ConfigError(f"{key}={value!r}: {key} is now {new}, and only {sorted(values, key=str)} translate")
        return new, values[value]
    return key, value


def renamed_hint(key: str) -> str:
    """' (old.key is now ...)' when ``key`` (dotted, or its last part alone) was renamed, else ''."""
    return "".join(f" ({old} is now {new} ({', '.join(f'{v!r} for {k}' for k, v in values.items())}))"
                   for old, (new, values) in RENAMED_VALUES.items() if key in (old, old.split(".")[-1]))


# Keys whose values name an entry of an implementation table (`k3.backends.Table`, or a dict keyed
# by the allowed values): the table is the one list of allowed values. (module, attribute) pairs,
# imported when a config is validated.
_TABLES = {
    "model.kda.impl": ("k3.kda.ops", "KDA_CORES"),
    "model.kda.conv_impl": ("k3.kda.layer", "CONV_BACKENDS"),
    "model.kda.decode_impl": ("k3.kda.layer", "DECODE_STEPS"),
    "model.moe.expert_impl": ("k3.moe.layer", "EXPERT_BACKENDS"),
    "model.moe.decode_impl": ("k3.moe.layer", "DECODE_EXPERTS"),
    "model.moe.decode_route_impl": ("k3.moe.layer", "DECODE_ROUTERS"),
    "model.mla.attention_impl": ("k3.mla.layer", "ATTENTION"),
    "model.mla.decode_impl": ("k3.mla.layer", "DECODE_ATTENTION"),
    "model.remat_policy": ("k3.model", "REMAT_POLICIES"),
    "model.layer_loop": ("k3.model", "LAYER_LOOPS"),
    "model.ce_impl": ("k3.model", "CROSS_ENTROPY"),
    "model.attn_res_impl": ("k3.attn_res", "MIX_BACKENDS"),
    "model.moe.balancing": ("k3.moe.balancing", "BALANCERS"),
    "optim.newton_schulz": ("k3.optim", "NEWTON_SCHULZ"),
    "data.suffixes": ("k3.data.corpus", "SITE_SUFFIX_SETS"),
}


def _choices_table(key: str):
    import importlib

    module, name = _TABLES[key]
    return getattr(importlib.import_module(module), name)


def _choices(key: str):
    if key in _CHOICES:
        return _CHOICES[key]
    if key in _TABLES:
        table = _choices_table(key)
        return tuple(table) if isinstance(table, dict) else table.choices()
    return None


# Numeric ranges as (low, low excluded?, high, high excluded?), None = unbounded; every float knob
# must also be finite. Checked before anything is built or written, so a bad value never gets as far
# as a first step (or a run.json).
_POS = (0, True, None, False)
_NONNEG = (0, False, None, False)
_FRACTION = (0, False, 1, False)
_DECAY = (0, False, 1, True)  # momenta and betas: [0, 1)
_RANGES = {
    "steps": _POS, "seed": _NONNEG,
    "model.vocab_size": _POS, "model.ce_chunk": _NONNEG, "model.d_model": _POS, "model.n_layers": _POS,
    "model.dense_ffn_dim": _POS,
    "model.mla_period": _POS, "model.attn_res_block_size": _POS, "model.norm_eps": _POS,
    "model.init_std": _POS, "model.situ_beta_gate": _POS, "model.situ_beta_up": _POS,
    "model.mla.n_heads": _POS, "model.mla.q_lora_rank": _NONNEG, "model.mla.kv_lora_rank": _POS,
    "model.mla.qk_nope_dim": _POS, "model.mla.qk_rope_dim": _NONNEG, "model.mla.v_head_dim": _POS,
    "model.mla.rope_theta": _POS, "model.mla.norm_eps": _POS,
    "model.kda.n_heads": _POS, "model.kda.head_dim": _POS, "model.kda.conv_size": _POS, "model.kda.chunk_size": _POS,
    "model.moe.n_experts": _POS, "model.moe.expert_dim": _POS, "model.moe.latent_dim": _NONNEG,
    "model.moe.shared_dim": _NONNEG, "model.moe.routed_scaling": _POS, "model.moe.sign_rate": _NONNEG,
    "model.moe.hist_bins": _POS, "model.moe.expert_capacity": _POS, "model.moe.capacity_factor": _NONNEG,
    "optim.lr": _POS, "optim.adam_lr": _POS, "optim.warmup_frac": _FRACTION,
    "optim.warmup_steps": (-1, False, None, False),
    "optim.decay_frac": _FRACTION, "optim.min_lr_ratio": _FRACTION, "optim.weight_decay": _NONNEG,
    "optim.b1": _DECAY, "optim.b2": _DECAY, "optim.eps": _POS, "optim.momentum": _DECAY,
    "optim.clip_norm": _NONNEG, "optim.grad_accum": _POS, "optim.qk_clip_tau": _POS,
    "data.seq_len": _POS, "data.batch_size": _POS, "data.val_fraction": (0, False, 1, True), "data.max_docs": _NONNEG,
    "data.tokenizer_train_bytes": _POS,
    "train.log_every": _POS, "train.eval_every": _POS, "train.eval_batches": _POS, "train.ckpt_every": _POS,
    "train.keep_ckpts": _POS, "train.keep_period": _NONNEG, "train.peak_flops": _NONNEG,
}
# Chunk sizes the Pallas KDA kernel compiles (16-token strips); the jnp cores take any.
PALLAS_KDA_CHUNKS = (16, 32, 64)


def _check_range(key: str, val) -> None:
    if isinstance(val, float) and not math.isfinite(val):
        raise ConfigError(f"config key {key} must be a finite number, got {val!r}")
    if key not in _RANGES:
        return
    lo, lo_open, hi, hi_open = _RANGES[key]
    bad = ((lo is not None and (val <= lo if lo_open else val < lo))
           or (hi is not None and (val >= hi if hi_open else val > hi)))
    if bad:
        span = (f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, "
                f"{'inf' if hi is None else hi}{')' if hi_open or hi is None else ']'}")
        raise ConfigError(f"config key {key} must be in {span}, got {val!r}")


class ConfigError(ValueError):
    """A config key is unknown, missing, of the wrong type or inconsistent with others."""


def _flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, val in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(val, (ConfigDict, dict)):
            out.update(_flatten(val, name + "."))
        else:
            out[name] = val
    return out


def validate(cfg: ConfigDict) -> ConfigDict:
    """Checks ``cfg`` against the schema; returns it, or raises :class:`ConfigError` naming the key."""
    schema = _flatten(default_config())
    given = _flatten(cfg)
    unknown = sorted(set(given) - set(schema))
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}" + "".join(map(renamed_hint, unknown)))
    missing = sorted(set(schema) - set(given))
    if missing:
        raise ConfigError(f"missing config key(s): {', '.join(missing)}")
    for key, default in schema.items():
        val = given[key]
        if isinstance(default, bool):
            ok = isinstance(val, bool)
        elif isinstance(default, int):
            ok = isinstance(val, int) and not isinstance(val, bool)
        elif isinstance(default, float):
            ok = isinstance(val, (int, float)) and not isinstance(val, bool)
        else:
            ok = isinstance(val, type(default))
        if not ok:
            raise ConfigError(f"config key {key} must be {type(default).__name__}, got {val!r}")
        choices = _choices(key)
        if choices is not None and val not in choices:
            raise ConfigError(f"config key {key} must be one of {choices}, got {val!r}")
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            _check_range(key, val)
    m = cfg.model
    positive = ["vocab_size", "d_model", "n_layers", "dense_ffn_dim", "mla_period", "attn_res_block_size"]
    for key in positive:
        if m[key] <= 0:
            raise ConfigError(f"config key model.{key} must be > 0, got {m[key]}")
    if not 0 <= m.first_k_dense <= m.n_layers:
        raise ConfigError(f"model.first_k_dense must be in [0, n_layers], got {m.first_k_dense}")
    if not -5.0 <= m.kda.gate_lower_bound < 0:
        # Below -5 a 16-token tile's cumulative decay leaves the fp32 range the kernels rely on.
        raise ConfigError(f"model.kda.gate_lower_bound must be in [-5, 0), got {m.kda.gate_lower_bound}")
    if (m.kda.chunk_size not in PALLAS_KDA_CHUNKS and m.kda.gate == "bounded"
            and _choices_table("model.kda.impl").resolve(m.kda.impl) == "pallas"):
        raise ConfigError(f"model.kda.chunk_size must be one of {PALLAS_KDA_CHUNKS} for the Pallas KDA kernel "
                          f"(model.kda.impl={m.kda.impl!r} runs it here), got {m.kda.chunk_size}")
    if m.kda.impl == "jla":
        from k3.kda.ops import JLA_HEAD_DIMS

        width = m.kda.n_heads * m.kda.head_dim
        if m.dtype != "bfloat16" or m.kda.head_dim not in JLA_HEAD_DIMS or width % 128:
            raise ConfigError(f"model.kda.impl='jla' (jax-linear-attention's kernels) needs model.dtype='bfloat16', "
                              f"model.kda.head_dim in {JLA_HEAD_DIMS} and n_heads * head_dim a multiple of 128; got "
                              f"dtype={m.dtype!r}, head_dim={m.kda.head_dim}, n_heads * head_dim={width}")
    if m.moe.top_k > m.moe.n_experts or m.moe.top_k <= 0:
        raise ConfigError(f"model.moe.top_k must be in [1, n_experts], got {m.moe.top_k}")
    extra = _choices_table("model.moe.balancing").get(m.moe.balancing).extra_routes
    if m.moe.top_k + extra > m.moe.n_experts:
        raise ConfigError(f"model.moe.balancing={m.moe.balancing!r} ranks top-(k+{extra}) experts: needs "
                          f"top_k + {extra} <= n_experts, got top_k={m.moe.top_k}, n_experts={m.moe.n_experts}")
    if m.mla.use_rope and m.mla.qk_rope_dim % 2:
        raise ConfigError(f"model.mla.qk_rope_dim must be even for RoPE, got {m.mla.qk_rope_dim}")
    for key, unset in (("suffixes", "python"), ("extra_roots", "")):
        # The other sources have their own file rules; a knob they would ignore is a config mistake.
        if cfg.data[key] != unset and cfg.data.source != "site_packages":
            raise ConfigError(f"data.{key}={cfg.data[key]!r} only applies to data.source='site_packages', "
                              f"got data.source={cfg.data.source!r}")
    if cfg.data.seq_len <= 0 or cfg.data.batch_size <= 0:
        raise ConfigError("data.seq_len and data.batch_size must be > 0")
    if cfg.optim.grad_accum <= 0 or cfg.data.batch_size % cfg.optim.grad_accum:
        raise ConfigError("optim.grad_accum must be > 0 and divide data.batch_size")
    for axis in ("data", "fsdp", "expert", "context", "tensor"):
        if cfg.mesh[axis] == 0 or cfg.mesh[axis] < -1:
            raise ConfigError(f"config key mesh.{axis} must be a positive size or -1, got {cfg.mesh[axis]}")
    if sum(cfg.mesh[a] == -1 for a in ("data", "fsdp", "expert", "context", "tensor")) > 1:
        raise ConfigError("at most one mesh axis may be -1")
    return cfg


def layer_kinds(m: ConfigDict) -> list[tuple[str, str]]:
    """Per layer (0-indexed), the (mixer, ffn) kinds: mixer in {'kda','mla'}, ffn in {'dense','moe'}."""
    kinds = []
    for layer in range(m.n_layers):
        if m.mixer == "mla":
            mixer = "mla"
        else:
            is_mla = (layer + 1) % m.mla_period == 0 or layer == m.n_layers - 1
            mixer = "mla" if is_mla else "kda"
        ffn = "dense" if layer < m.first_k_dense else "moe"
        kinds.append((mixer, ffn))
    return kinds
