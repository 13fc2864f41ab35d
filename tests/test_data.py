"""Tests of k3.data: corpora, tokenizers, packing, determinism, checkpointing, user data, errors."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest

from k3.config import default_config
from k3.data import (
    BPETokenizer,
    ByteTokenizer,
    DataError,
    TokenStream,
    TrainIterator,
    ValSource,
    build_datasets,
    doc_labels_from_eos,
    list_stdlib_files,
    load_or_train_tokenizer,
    load_text_corpus,
    pack_batch,
    prepare_data,
)
from k3.data.corpus import _unit_hash

# Module-level state (fixtures, references) is shared: keep this file on one test worker.
pytestmark = pytest.mark.xdist_group("data")

# Small but real: the first 40 stdlib files are ~0.6 MB of text, enough for a 384-token BPE.
SMALL_DOCS = 40
SMALL_VOCAB = 384


def make_cfg(source="stdlib", path="", *, vocab=SMALL_VOCAB, tokenizer="bpe", seq_len=32, batch_size=4,
             max_docs=SMALL_DOCS, val_fraction=0.1, seed=0, **extra):
    cfg = default_config()
    cfg.seed = seed
    cfg.model.vocab_size = vocab
    d = cfg.data
    d.source, d.path, d.tokenizer = source, str(path), tokenizer
    d.seq_len, d.batch_size, d.max_docs, d.val_fraction = seq_len, batch_size, max_docs, val_fraction
    for k, v in extra.items():
        d[k] = v
    return cfg


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def batches_differ(a, b):
    return any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The small stdlib corpus prepared once: (cfg, workdir, PreparedData)."""
    wd = tmp_path_factory.mktemp("small")
    cfg = make_cfg()
    return cfg, wd, prepare_data(cfg, wd)


# ---------------------------------------------------------------------------------------------------
# Default corpus and split.


def test_stdlib_listing_is_sorted_and_excludes_tests():
    files = list_stdlib_files()
    assert files == sorted(files) and len(files) > 300
    assert all(f.endswith(".py") for f in files)
    parts = {p for f in files for p in f.split("/")[:-1]}
    assert not parts & {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    assert not any(f.rsplit("/", 1)[-1].startswith("_sysconfigdata") for f in files)
    assert "os.py" in files and "json/decoder.py" in files
    assert list_stdlib_files() == files


def test_split_is_disjoint_stable_and_hash_defined():
    c = load_text_corpus("stdlib", val_fraction=0.1, max_docs=200)
    train, val = c.doc_names("train"), c.doc_names("val")
    assert c.num_docs == 200 and not set(train) & set(val)
    assert sorted(train + val) == c.doc_names() == list_stdlib_files()[:200]
    assert 5 <= len(val) <= 40
    assert val == [n for n in c.doc_names() if _unit_hash(n) < 0.1]
    again = load_text_corpus("stdlib", val_fraction=0.1, max_docs=200)
    assert again.doc_names("val") == val
    # max_docs takes a prefix before splitting, so a document's split never depends on the cap.
    fewer = load_text_corpus("stdlib", val_fraction=0.1, max_docs=100)
    assert set(fewer.doc_names("val")) == set(val) & set(fewer.doc_names())


def test_tiny_corpus_gets_both_splits(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document {i}")
    c = load_text_corpus("text_dir", tmp_path, val_fraction=0.001)
    assert len(c.doc_names("val")) == 1 and len(c.doc_names("train")) == 2


def test_val_stream_is_the_val_documents(small):
    cfg, _, data = small
    c = load_text_corpus("stdlib", val_fraction=cfg.data.val_fraction, max_docs=SMALL_DOCS)
    tok = data.tokenizer
    texts = list(c.iter_texts("val"))
    assert data.val.num_docs == len(texts) > 0
    assert data.train.num_docs + data.val.num_docs == SMALL_DOCS
    for i, text in enumerate(texts):
        ids = data.val.doc(i)
        assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
        assert tok.decode(ids[:-1]) == text


# ---------------------------------------------------------------------------------------------------
# Packing.


def test_pack_batch_hand_built_stream():
    eos = 0
    rows = np.array([[5, 6, eos, 7, eos, 8, 9, 10, eos], [3, 4, eos, eos, 2, 2, 2, 2, 2]])
    b = pack_batch(rows, doc_labels_from_eos(rows, eos))
    np.testing.assert_array_equal(b["inputs"], rows[:, :-1])
    np.testing.assert_array_equal(b["targets"], rows[:, 1:])
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 2, 2, 3, 3, 3], [1, 1, 1, 2, 3, 3, 3, 3]])
    np.testing.assert_array_equal(b["loss_mask"], [[1, 1, 0, 1, 0, 1, 1, 1], [1, 1, 0, 0, 1, 1, 1, 1]])
    assert {k: v.dtype for k, v in b.items()} == {
        "inputs": np.int32, "targets": np.int32, "segment_ids": np.int32, "loss_mask": np.float32}


def test_stream_read_labels_match_eos_labels():
    eos = 99
    docs = [[1, 2, eos], [3, eos], [4, 5, 6, 7, eos], [8, eos]]
    s = TokenStream.from_docs(docs)
    order = np.array([2, 0, 3, 1])
    cum = s.cumulative(order)
    flat = np.concatenate([docs[i] for i in order])
    for start in range(0, 2 * len(flat)):  # also past the end: wraps around
        toks, labels = s.read(order, cum, start, 6)
        expected = np.take(flat, np.arange(start, start + 6), mode="wrap")
        np.testing.assert_array_equal(toks, expected)
        ref = doc_labels_from_eos(toks, eos)
        # Same partition into documents (labels may differ by a constant).
        np.testing.assert_array_equal(np.diff(labels) != 0, np.diff(ref) != 0)


def test_train_batches_packing_invariants(small):
    cfg, _, data = small
    eos = data.tokenizer.eos_id
    it = TrainIterator(data.train, cfg.data.seq_len, cfg.data.batch_size, seed=0)
    for b in take(it, 20):
        assert b["inputs"].shape == (cfg.data.batch_size, cfg.data.seq_len)
        np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
        # BPE never produces EOS inside text, so EOS marks exactly the document ends.
        np.testing.assert_array_equal(b["loss_mask"], (b["inputs"] != eos).astype(np.float32))
        seg = 1 + np.concatenate([np.zeros((len(b["inputs"]), 1), int),
                                  np.cumsum(b["inputs"][:, :-1] == eos, axis=1)], axis=1)
        np.testing.assert_array_equal(b["segment_ids"], seg)


# ---------------------------------------------------------------------------------------------------
# Determinism and checkpointing.


def test_same_seed_same_batches_different_seed_different(small, tmp_path):
    cfg, _, data = small
    a = take(TrainIterator(data.train, 32, 4, seed=0), 5)
    b = take(TrainIterator(data.train, 32, 4, seed=0), 5)
    c = take(TrainIterator(data.train, 32, 4, seed=1), 5)
    assert_batches_equal(a, b)
    assert batches_differ(a, c)
    # The whole path (BPE training, tokenisation, cache) is deterministic too.
    train_iter, val, _ = build_datasets(cfg, tmp_path)
    assert_batches_equal(a, take(train_iter, 5))


def _tiny_stream():
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(2, 50, size=n), 1) for n in rng.integers(1, 12, size=9)]
    return TokenStream.from_docs(docs)


def test_epoch_covers_every_row_once_and_reshuffles():
    stream = _tiny_stream()
    it = TrainIterator(stream, seq_len=7, batch_size=1, seed=3)
    r = it.rows_per_epoch
    assert r == stream.num_tokens // 8 >= 4
    rows0 = np.stack([np.append(b["inputs"][0], b["targets"][0, -1]) for b in take(it, r)])
    assert it.get_state()["epoch"] == 0 and it.get_state()["row"] == r
    rows1 = np.stack([np.append(b["inputs"][0], b["targets"][0, -1]) for b in take(it, r)])
    assert it.get_state()["epoch"] == 1
    doc_order, _, row_order = it._order(0)
    flat = np.concatenate([stream.doc(i) for i in doc_order])[: r * 8].reshape(r, 8)
    np.testing.assert_array_equal(rows0, flat[row_order])
    assert not np.array_equal(rows0, rows1)


@pytest.mark.parametrize("stop", [1, 3, 5, 6, 11])
def test_restore_reproduces_following_batches(stop):
    stream = _tiny_stream()
    make = lambda: TrainIterator(stream, seq_len=7, batch_size=3, seed=5)  # noqa: E731
    assert make().rows_per_epoch < 3 * 6  # so the checked window crosses epoch boundaries
    reference = take(make(), stop + 8)
    it = make()
    take(it, stop)
    state = json.loads(json.dumps(it.get_state()))
    restored = make()
    restored.set_state(state)
    assert_batches_equal(take(restored, 8), reference[stop:])
    assert_batches_equal(take(it, 8), reference[stop:])


def test_restore_mid_epoch_on_real_data(small):
    cfg, _, data = small
    make = lambda: TrainIterator(data.train, 32, 4, seed=0)  # noqa: E731
    ref = take(make(), 10)
    it = make()
    take(it, 4)
    state = it.get_state()
    assert state["epoch"] == 0 and state["row"] == 16
    fresh = make()
    fresh.set_state(state)
    assert_batches_equal(take(fresh, 6), ref[4:])
    with pytest.raises(DataError, match="seed"):
        TrainIterator(data.train, 32, 4, seed=1).set_state(state)
    with pytest.raises(DataError, match="rows per epoch"):
        TrainIterator(data.train, 64, 4, seed=0).set_state(state)


def test_val_batches_fixed_and_wrap_around():
    stream = _tiny_stream()
    v = ValSource(stream, seq_len=7, batch_size=2)
    n = 2 * math.ceil(stream.num_tokens / 16)  # two passes over the split
    first = v.val_batches(n)
    assert_batches_equal(first, v.val_batches(n))
    assert_batches_equal(first, ValSource(stream, 7, 2).val_batches(n))
    flat = np.concatenate([stream.doc(i) for i in range(stream.num_docs)])
    for i, b in enumerate(first):
        for r in range(2):
            start = (2 * i + r) * 8
            np.testing.assert_array_equal(b["inputs"][r], np.take(flat, np.arange(start, start + 7), mode="wrap"))
            # Documents end in EOS (=1), so the seam of the wrap-around is a document boundary too.
            np.testing.assert_array_equal(b["loss_mask"][r], b["inputs"][r] != 1)
    assert len(list(v)) == v.batches_per_pass


# ---------------------------------------------------------------------------------------------------
# Tokenizers.


def test_bpe_tokenizer_trained_cached_and_checked(small, tmp_path):
    cfg, wd, data = small
    tok = data.tokenizer
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == SMALL_VOCAB
    assert (tok.eos_id, tok.pad_id) == (0, 1)
    for text in ["def f(x):\n    return x + 1\n", "héllo wörld ✓ 日本 \t\n", "literal <|endoftext|> stays text"]:
        ids = tok.encode(text)
        assert tok.eos_id not in ids and max(ids) < SMALL_VOCAB
        assert tok.decode(ids) == text
    assert tok.decode([tok.eos_id, tok.pad_id]) == "<|endoftext|>"

    path = wd / "tokenizer.json"
    mtime = path.stat().st_mtime_ns

    def must_not_be_read():
        raise AssertionError("the cached tokenizer was retrained")
        yield ""

    again = load_or_train_tokenizer(cfg, wd, must_not_be_read())
    assert not again.trained and again.fingerprint() == tok.fingerprint()
    assert path.stat().st_mtime_ns == mtime

    bad = make_cfg(vocab=SMALL_VOCAB + 16)
    with pytest.raises(DataError, match=rf"{SMALL_VOCAB}.*{SMALL_VOCAB + 16}"):
        load_or_train_tokenizer(bad, wd, None)

    # data.tokenizer_path: trained there when missing, then reused.
    custom = make_cfg(tokenizer_path=str(tmp_path / "sub" / "tok.json"))
    t1 = load_or_train_tokenizer(custom, None, iter([open(os.__file__, encoding="utf-8").read()]))
    assert t1.trained and (tmp_path / "sub" / "tok.json").exists()
    t2 = load_or_train_tokenizer(custom, None, must_not_be_read())
    assert not t2.trained and t2.encode("more words") == t1.encode("more words")


def test_bpe_with_too_little_text_errors():
    with pytest.raises(DataError, match="2048"):
        load_or_train_tokenizer(make_cfg(vocab=2048), None, iter(["tiny"]))


def test_bpe_reads_only_tokenizer_train_bytes():
    """data.tokenizer_train_bytes caps the text the trainer reads: a vocabulary that the whole text
    reaches is out of reach of a small cap, and the error names how much text was read."""
    text = open(os.__file__, encoding="utf-8").read()
    capped = make_cfg(vocab=1024)
    capped.data.tokenizer_train_bytes = 3000
    with pytest.raises(DataError, match="BPE training on 3000 characters reached only"):
        load_or_train_tokenizer(capped, None, iter([text]))
    capped.data.tokenizer_train_bytes = 4 * 2**20
    assert load_or_train_tokenizer(capped, None, iter([text])).vocab_size == 1024


def test_byte_tokenizer():
    tok = load_or_train_tokenizer(make_cfg(tokenizer="byte", vocab=300), None, None)
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 256, 257)
    text = "héllo ✓ 日本\n"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("a") + [256, 257] + tok.encode("b")) == "a<|endoftext|>b"
    with pytest.raises(DataError, match="258"):
        load_or_train_tokenizer(make_cfg(tokenizer="byte", vocab=200), None, None)


# ---------------------------------------------------------------------------------------------------
# Caches and user data.


def test_cache_reused_and_rebuilt_when_stale(tmp_path):
    data_dir = tmp_path / "texts"
    (data_dir / "sub").mkdir(parents=True)
    texts = {"a.txt": "alpha " * 40, "sub/b.md": "# bravo\n" * 30, "c.py": "print('c')\n" * 20}
    for name, text in texts.items():
        (data_dir / name).write_text(text)
    (data_dir / "skip.bin").write_bytes(b"\x00\x01")
    (data_dir / "empty.txt").write_text("")
    cfg = make_cfg("text_dir", data_dir, tokenizer="byte", vocab=260, seq_len=16, max_docs=0, val_fraction=0.3)
    wd = tmp_path / "wd"
    d1 = prepare_data(cfg, wd)
    assert not d1.meta["cache_hit"]
    assert set(d1.meta["phases"]) == {"listing", "tokenizer", "encoding", "tokens"}
    assert all(v >= 0 for v in d1.meta["phases"].values())
    assert sum(d1.meta["phases"].values()) == pytest.approx(d1.meta["seconds"], abs=0.01)
    assert prepare_data(cfg, wd).meta["cache_hit"]
    c = load_text_corpus("text_dir", data_dir, val_fraction=0.3)
    assert c.doc_names() == ["a.txt", "c.py", "sub/b.md"]
    got = [bytes(d1.train.doc(i)[:-1].astype(np.uint8)).decode() for i in range(d1.train.num_docs)]
    got += [bytes(d1.val.doc(i)[:-1].astype(np.uint8)).decode() for i in range(d1.val.num_docs)]
    assert sorted(got) == sorted(texts.values())
    (wd / "data_cache" / "train.npy").unlink()  # a damaged cache is rebuilt, not trusted
    assert not prepare_data(cfg, wd).meta["cache_hit"]
    (data_dir / "a.txt").write_text("changed " * 40)
    d3 = prepare_data(cfg, wd)
    assert not d3.meta["cache_hit"]
    assert d3.train.num_tokens + d3.val.num_tokens == sum(len(t) + 1 for t in texts.values()) + 2 * 40
    # Byte tokenizer: one byte per token, so bits/byte equals bits/token.
    _, val, _ = build_datasets(cfg, wd)
    assert val.bytes_per_token == 1.0
    assert val.bits_per_byte(math.log(2)) == pytest.approx(1.0)


def test_jsonl_source_and_errors(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"text": f"record number {i} " * 5, "id": i} for i in range(12)]
    path.write_text("\n".join(json.dumps(r) for r in rows[:6]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[6:]))
    cfg = make_cfg("jsonl", path, tokenizer="byte", vocab=258, seq_len=16, max_docs=0, val_fraction=0.2)
    data = prepare_data(cfg, tmp_path / "wd")
    got = [bytes(d.doc(i)[:-1].astype(np.uint8)).decode() for d in (data.train, data.val) for i in range(d.num_docs)]
    assert sorted(got) == sorted(r["text"] for r in rows)
    names = load_text_corpus("jsonl", path).doc_names()
    assert names[5:7] == ["data.jsonl:6", "data.jsonl:8"]  # the blank line 7 is skipped, not counted

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jsonl").write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"x\.jsonl:3.*not valid JSON"):
        prepare_data(make_cfg("jsonl", bad, tokenizer="byte", vocab=258, max_docs=0, val_fraction=0.0),
                     tmp_path / "wd2")
    (bad / "x.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"x\.jsonl:2.*'text'"):
        prepare_data(make_cfg("jsonl", bad, tokenizer="byte", vocab=258, max_docs=0, val_fraction=0.0),
                     tmp_path / "wd3")


def test_tokens_bin_uint16_memory_mapped(tmp_path):
    rng = np.random.default_rng(0)
    eos = 256
    docs = [np.append(rng.integers(0, 256, size=n), eos) for n in rng.integers(5, 40, size=30)]
    flat = np.concatenate(docs).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    flat.tofile(path)
    cfg = make_cfg("tokens", path, tokenizer="byte", vocab=300, seq_len=16, max_docs=0, val_fraction=0.2)
    data = prepare_data(cfg, tmp_path / "wd")
    assert isinstance(data.train.arrays[0], np.memmap)
    assert data.train.num_docs + data.val.num_docs == len(docs)
    got = sorted(tuple(s.doc(i)) for s in (data.train, data.val) for i in range(s.num_docs))
    assert got == sorted(tuple(d) for d in docs)
    assert prepare_data(cfg, tmp_path / "wd").meta["cache_hit"]
    train_iter, val, tok = build_datasets(cfg, tmp_path / "wd")
    b = next(train_iter)
    np.testing.assert_array_equal(b["loss_mask"], (b["inputs"] != eos).astype(np.float32))
    assert val.bytes_per_token == 1.0

    wide = tmp_path / "wide.bin"
    flat.astype(np.uint32).tofile(wide)
    cfg32 = make_cfg("tokens", wide, tokenizer="byte", vocab=300, seq_len=16, max_docs=0, val_fraction=0.2,
                     tokens_dtype="uint32")
    d32 = prepare_data(cfg32, tmp_path / "wd32")
    assert d32.train.arrays[0].dtype == np.uint32 and d32.train.num_tokens + d32.val.num_tokens == len(flat)

    flat[7] = 300  # == model.vocab_size: out of range
    flat.tofile(path)
    with pytest.raises(DataError, match=r"tokens\.bin.*300"):
        prepare_data(cfg, tmp_path / "wd")


def test_tokens_npy_and_directory_of_files(tmp_path):
    arr = np.arange(1000, dtype=np.uint32) % 500
    np.save(tmp_path / "one.npy", arr)
    cfg = make_cfg("tokens", tmp_path / "one.npy", vocab=512, seq_len=16, max_docs=0, val_fraction=0.1,
                   tokens_dtype="uint32")
    train_iter, val, tok = build_datasets(cfg, tmp_path / "wd")
    assert tok.eos_id is None and tok.vocab_size == 512
    assert isinstance(train_iter.stream.arrays[0], np.memmap)
    # One boundary-free stream: the validation split is its tail.
    assert (train_iter.stream.num_tokens, val.num_tokens) == (900, 100)
    np.testing.assert_array_equal(val.stream.doc(0), arr[900:])
    assert val.bytes_per_token is None
    b = next(train_iter)
    assert (b["segment_ids"] == 1).all() and (b["loss_mask"] == 1).all()

    d = tmp_path / "dir"
    d.mkdir()
    for i in range(6):
        (np.full(50, i, np.uint16)).tofile(d / f"part{i}.bin")
    data = prepare_data(make_cfg("tokens", d, vocab=512, seq_len=16, max_docs=0, val_fraction=0.2), tmp_path / "w2")
    assert data.train.num_docs + data.val.num_docs == 6 and data.val.num_docs >= 1
    toks, labels = data.train.read(np.arange(data.train.num_docs), data.train.cumulative(
        np.arange(data.train.num_docs)), 40, 17)
    b = pack_batch(toks[None], labels[None])
    # Each file is a document: the boundary 10 tokens in gets a new segment and a masked target.
    np.testing.assert_array_equal(b["segment_ids"][0], [1] * 10 + [2] * 6)
    assert b["loss_mask"][0].tolist() == [1.0] * 9 + [0.0] + [1.0] * 6


def test_missing_and_empty_paths(tmp_path):
    for source in ("text_dir", "jsonl", "tokens"):
        missing = tmp_path / f"nope_{source}"
        with pytest.raises(DataError, match=re.escape(str(missing))):
            prepare_data(make_cfg(source, missing, tokenizer="byte", vocab=300), tmp_path / "wd")
    empty = tmp_path / "empty"
    empty.mkdir()
    for source in ("text_dir", "jsonl", "tokens"):
        with pytest.raises(DataError, match=re.escape(str(empty))):
            prepare_data(make_cfg(source, empty, tokenizer="byte", vocab=300), tmp_path / "wd")
    (empty / "blank.txt").write_text("")
    with pytest.raises(DataError, match="no documents"):
        prepare_data(make_cfg("text_dir", empty, tokenizer="byte", vocab=300), tmp_path / "wd")
    with pytest.raises(DataError, match="data.path"):
        prepare_data(make_cfg("text_dir", "", tokenizer="byte", vocab=300), tmp_path / "wd")
    assert isinstance(DataError("x"), ValueError)


def test_too_short_for_one_row(tmp_path):
    (tmp_path / "a.txt").write_text("short")
    with pytest.raises(DataError, match="seq_len"):
        build_datasets(make_cfg("text_dir", tmp_path, tokenizer="byte", vocab=300, seq_len=64, val_fraction=0.0),
                       tmp_path / "wd")


def test_val_fraction_zero_gives_no_val_source(tmp_path):
    for i in range(4):
        (tmp_path / f"{i}.txt").write_text("words " * 30)
    _, val, _ = build_datasets(make_cfg("text_dir", tmp_path, tokenizer="byte", vocab=300, val_fraction=0.0),
                               tmp_path / "wd")
    assert val is None
    assert not os.path.exists(tmp_path / "wd" / "tokenizer.json")  # the byte tokenizer needs no file
