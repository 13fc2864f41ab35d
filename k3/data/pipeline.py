"""Token streams, packing into fixed-length rows, and checkpointable train / fixed validation batches.

Entry point: :func:`build_datasets` ``(cfg, workdir) -> (train_iter, val_source, tokenizer)``.

Preparation (once per workdir, then cached):
  text sources ('stdlib', 'site_packages', 'text_dir', 'jsonl'): every document is tokenised,
  followed by EOS, and the train and validation streams are written to
  ``<workdir>/data_cache/{train,val}.npy`` (uint16, or uint32 for vocabularies over 65536) with
  per-document lengths in ``{train,val}_doc_len.npy``.
  'tokens': the user's files stay where they are (memory-mapped); only the document index is cached
  (``tokens_index.npz``). ``meta.json`` records a fingerprint of the source files (path, size,
  mtime), the split settings, the site-packages suffix set and extra roots (when not at their
  defaults) and the tokenizer; any change rebuilds the cache.

Batches (numpy, one dict per step), B = ``data.batch_size``, T = ``data.seq_len``::

    inputs      int32   [B, T]  row[:-1] of a packed row of T+1 tokens
    targets     int32   [B, T]  row[1:]
    segment_ids int32   [B, T]  1, 2, ... numbering the documents of each row (of the inputs)
    loss_mask   float32 [B, T]  0 where the target starts a new document (the token after an EOS)

Train order: each epoch concatenates the documents in an order shuffled by ``(seed, epoch)``, cuts the
stream into rows of T+1 tokens (the last partial row is dropped) and visits the rows in an order also
shuffled by ``(seed, epoch)``; a batch may span two epochs. The state is ``{"epoch", "row"}`` plus
the seed and the row count as a consistency check.

Validation: the validation documents in corpus order, cut into rows of T+1 tokens from the start,
wrapping around when the split is shorter than what is asked for; ``val_batches(n)`` is therefore the
same list on every call and every run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from k3.data import corpus as corpus_lib
from k3.data.corpus import DataError
from k3.data.tokenizer import Tokenizer, load_or_train_tokenizer, tokenizer_file

log = logging.getLogger(__name__)

CACHE_VERSION = 1
CACHE_DIR = "data_cache"


# ---------------------------------------------------------------------------------------------------
# Streams and packing.


@dataclasses.dataclass
class TokenStream:
    """Documents as slices of 1-D integer arrays (in-memory or memory-mapped).

    Attributes:
      arrays: the backing 1-D integer arrays.
      doc_array: int32 [D], index into ``arrays`` of each document.
      doc_start: int64 [D], offset of each document's first token in its array.
      doc_len: int64 [D], number of tokens of each document (all > 0; for text sources this
        includes the trailing EOS).
    """

    arrays: list[np.ndarray]
    doc_array: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray

    @classmethod
    def from_docs(cls, docs: list) -> TokenStream:
        """A stream over ``docs`` (sequences of ints, each non-empty) held in one int32 array."""
        lens = np.array([len(d) for d in docs], np.int64)
        if len(lens) == 0 or (lens <= 0).any():
            raise DataError("a token stream needs at least one document and no empty documents")
        flat = np.concatenate([np.asarray(d, np.int32) for d in docs])
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        return cls([flat], np.zeros(len(docs), np.int32), starts, lens)

    @property
    def num_docs(self) -> int:
        """D, the number of documents."""
        return len(self.doc_len)

    @property
    def num_tokens(self) -> int:
        """Total tokens over all documents."""
        return int(self.doc_len.sum())

    def doc(self, i: int) -> np.ndarray:
        """The tokens of document ``i`` (a view), in stored order."""
        s = int(self.doc_start[i])
        return self.arrays[int(self.doc_array[i])][s : s + int(self.doc_len[i])]

    def cumulative(self, order: np.ndarray) -> np.ndarray:
        """int64 [D+1]: start offset of each document when concatenated in ``order``, then the total."""
        return np.concatenate([[0], np.cumsum(self.doc_len[order])]).astype(np.int64)

    def read(self, order: np.ndarray, cum: np.ndarray, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``length`` tokens from position ``start`` of the documents concatenated in ``order``.

        Args:
          order: int [D], a permutation of the document indices.
          cum: ``self.cumulative(order)``.
          start: position in the concatenation; positions past the end wrap around to the start.
        Returns:
          tokens int32 [length] and doc_labels int64 [length]: a number that differs between any two
          consecutive documents (``cycle * D + k`` for the k-th document of wrap-around ``cycle``).
        """
        n_docs, total = len(order), int(cum[-1])
        cycle, pos = divmod(int(start), total)
        k = int(np.searchsorted(cum, pos, side="right")) - 1
        off = pos - int(cum[k])
        tokens = np.empty(length, np.int32)
        labels = np.empty(length, np.int64)
        filled = 0
        while filled < length:
            d = int(order[k])
            n = min(int(self.doc_len[d]) - off, length - filled)
            s = int(self.doc_start[d]) + off
            tokens[filled : filled + n] = self.arrays[int(self.doc_array[d])][s : s + n]
            labels[filled : filled + n] = cycle * n_docs + k
            filled += n
            off = 0
            k += 1
            if k == n_docs:
                k, cycle = 0, cycle + 1
        return tokens, labels


def doc_labels_from_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Document labels of an EOS-separated stream: a new document starts after each EOS.

    Args:
      tokens: int [..., L].
    Returns:
      int64 [..., L], 0 for the first document, incremented at the token after each EOS (the EOS
      itself belongs to the document it ends).
    """
    after_eos = np.asarray(tokens)[..., :-1] == eos_id
    zeros = np.zeros(after_eos.shape[:-1] + (1,), np.int64)
    return np.concatenate([zeros, np.cumsum(after_eos, axis=-1, dtype=np.int64)], axis=-1)


def pack_batch(rows: np.ndarray, doc_labels: np.ndarray) -> dict[str, np.ndarray]:
    """Turns rows of T+1 tokens into a training batch.

    Args:
      rows: int [B, T+1] tokens.
      doc_labels: int [B, T+1], any labels that change exactly where a new document starts.
    Returns:
      dict(inputs=int32 [B,T], targets=int32 [B,T], segment_ids=int32 [B,T] (1-based document
      number within the row, of each input token), loss_mask=float32 [B,T] (0 where the target is
      in a different document than the input, i.e. the first token of a document, else 1)).
    """
    rows = np.asarray(rows)
    doc_labels = np.asarray(doc_labels)
    starts_new = doc_labels[:, 1:] != doc_labels[:, :-1]  # [B, T]: target i begins a new document
    seg = np.ones(starts_new.shape, np.int32)
    seg[:, 1:] += np.cumsum(starts_new[:, :-1], axis=1, dtype=np.int32)
    return {
        "inputs": rows[:, :-1].astype(np.int32),
        "targets": rows[:, 1:].astype(np.int32),
        "segment_ids": seg,
        "loss_mask": (~starts_new).astype(np.float32),
    }


def _epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    # SeedSequence of the pair, not seed+epoch: (seed=0, epoch=1) must not replay (seed=1, epoch=0).
    return np.random.default_rng(np.random.SeedSequence([int(seed) % 2**64, int(epoch)]))


class TrainIterator:
    """Infinite, deterministic, checkpointable iterator of packed training batches.

    ``next(it)`` returns the batch dict described in the module docstring. ``get_state()`` returns
    ``{"epoch": int, "row": int, "seed": int, "rows_per_epoch": int}`` (JSON-serialisable);
    ``set_state(state)`` resumes so that the following batches equal those of an uninterrupted run.
    """

    def __init__(self, stream: TokenStream, seq_len: int, batch_size: int, seed: int):
        self.stream = stream
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.row_len = self.seq_len + 1
        self.rows_per_epoch = stream.num_tokens // self.row_len
        if self.rows_per_epoch == 0:
            raise DataError(
                f"the training split has {stream.num_tokens} tokens, fewer than data.seq_len + 1 = {self.row_len}; "
                "use more data or a shorter data.seq_len"
            )
        self.epoch = 0
        self.row = 0
        self._order_epoch = None

    @property
    def batches_per_epoch(self) -> float:
        """Rows per epoch / batch size (batches may straddle epochs, hence a float)."""
        return self.rows_per_epoch / self.batch_size

    def _order(self, epoch: int):
        if self._order_epoch != epoch:
            rng = _epoch_rng(self.seed, epoch)
            doc_order = rng.permutation(self.stream.num_docs)
            # Rows are visited in shuffled order too, so a long document does not fill a whole batch.
            row_order = rng.permutation(self.rows_per_epoch)
            self._order_cache = (doc_order, self.stream.cumulative(doc_order), row_order)
            self._order_epoch = epoch
        return self._order_cache

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        """The next batch: dict(inputs, targets, segment_ids: int32 [B, T]; loss_mask: float32 [B, T])."""
        rows = np.empty((self.batch_size, self.row_len), np.int32)
        labels = np.empty((self.batch_size, self.row_len), np.int64)
        for b in range(self.batch_size):
            if self.row >= self.rows_per_epoch:
                self.epoch, self.row = self.epoch + 1, 0
            doc_order, cum, row_order = self._order(self.epoch)
            start = int(row_order[self.row]) * self.row_len
            rows[b], labels[b] = self.stream.read(doc_order, cum, start, self.row_len)
            self.row += 1
        return pack_batch(rows, labels)

    def get_state(self) -> dict:
        """The position: ``{"epoch", "row", "seed", "rows_per_epoch"}`` (ints, JSON-serialisable)."""
        return {"epoch": self.epoch, "row": self.row, "seed": self.seed, "rows_per_epoch": self.rows_per_epoch}

    def set_state(self, state: dict) -> None:
        """Resumes from :meth:`get_state` output; the data, seed and seq_len must be unchanged."""
        if state.get("seed", self.seed) != self.seed:
            raise DataError(f"data iterator state is for seed {state['seed']}, this run uses seed {self.seed}")
        if state.get("rows_per_epoch", self.rows_per_epoch) != self.rows_per_epoch:
            raise DataError(
                f"data iterator state has {state['rows_per_epoch']} rows per epoch, this data has "
                f"{self.rows_per_epoch}: the data or data.seq_len changed since the checkpoint"
            )
        epoch, row = int(state["epoch"]), int(state["row"])
        if epoch < 0 or not 0 <= row <= self.rows_per_epoch:
            raise DataError(f"invalid data iterator state {state!r}")
        self.epoch, self.row = epoch, row


class ValSource:
    """A fixed, deterministic sequence of validation batches (same format as training).

    Attributes:
      num_tokens: tokens in the validation split (including EOS).
      num_bytes: UTF-8 bytes of its text, or None when unknown (pre-tokenised data without tokenizer).
      num_text_tokens: its tokens other than EOS/PAD.
      batches_per_pass: batches needed to cover the split once.
    """

    def __init__(self, stream: TokenStream, seq_len: int, batch_size: int, num_bytes: int | None = None,
                 num_text_tokens: int | None = None):
        self.stream = stream
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.row_len = self.seq_len + 1
        self.num_tokens = stream.num_tokens
        self.num_bytes = num_bytes
        self.num_text_tokens = num_text_tokens
        self._order = np.arange(stream.num_docs)
        self._cum = stream.cumulative(self._order)
        self.batches_per_pass = max(1, math.ceil(self.num_tokens / (self.row_len * self.batch_size)))

    def batch(self, i: int) -> dict[str, np.ndarray]:
        """Batch ``i`` (>= 0) of the fixed sequence: rows ``i*B .. i*B+B-1`` of the split, wrapping."""
        rows = np.empty((self.batch_size, self.row_len), np.int32)
        labels = np.empty((self.batch_size, self.row_len), np.int64)
        for b in range(self.batch_size):
            start = (i * self.batch_size + b) * self.row_len
            rows[b], labels[b] = self.stream.read(self._order, self._cum, start, self.row_len)
        return pack_batch(rows, labels)

    def val_batches(self, n: int) -> list[dict[str, np.ndarray]]:
        """The first ``n`` batches; identical on every call (each a dict as in the module docstring)."""
        return [self.batch(i) for i in range(n)]

    def __iter__(self):
        """One pass over the split (``batches_per_pass`` batches; the last one wraps around)."""
        return (self.batch(i) for i in range(self.batches_per_pass))

    @property
    def bytes_per_token(self) -> float | None:
        """UTF-8 bytes per predicted (non-EOS) token of the validation text, or None if unknown."""
        if not self.num_bytes or not self.num_text_tokens:
            return None
        return self.num_bytes / self.num_text_tokens

    def bits_per_byte(self, nats_per_token: float) -> float | None:
        """Mean loss (nats per masked-in target) converted to bits per UTF-8 byte, or None.

        Each document contributes (tokens - 1) predicted text tokens plus its EOS to the mean loss,
        i.e. as many targets as it has text tokens, which is why the ratio uses text tokens.
        """
        bpt = self.bytes_per_token
        return None if bpt is None else nats_per_token / math.log(2) / bpt


# ---------------------------------------------------------------------------------------------------
# Cache.


def _mkstemp(path: Path, suffix: str) -> tuple[int, str]:
    """A temporary file next to ``path`` (same filesystem, so os.replace is atomic), mode 0644."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=suffix)
    os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; cache files should read like any other file
    return fd, tmp


def _write_npy_atomic(path: Path, arr: np.ndarray) -> None:
    fd, tmp = _mkstemp(path, ".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, arr, allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_json_atomic(path: Path, obj) -> None:
    fd, tmp = _mkstemp(path, ".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class _StreamWriter:
    """Appends token arrays to a raw temporary file, then turns it into an .npy: O(chunk) memory."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        fd, self.tmp = _mkstemp(path, ".raw")
        self.fh = os.fdopen(fd, "wb")
        self.count = 0

    def write(self, arr: np.ndarray) -> None:
        self.fh.write(np.ascontiguousarray(arr, self.dtype).tobytes())
        self.count += len(arr)

    def abort(self) -> None:
        """Closes and removes the temporary file of a write that will not finish."""
        self.fh.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)

    def finish(self) -> None:
        self.fh.close()
        if self.count == 0:
            os.unlink(self.tmp)
            _write_npy_atomic(self.path, np.zeros(0, self.dtype))
            return
        out_tmp = str(self.path) + ".npytmp"
        try:
            out = np.lib.format.open_memmap(out_tmp, mode="w+", dtype=self.dtype, shape=(self.count,))
            src = np.memmap(self.tmp, dtype=self.dtype, mode="r", shape=(self.count,))
            for lo in range(0, self.count, 1 << 24):
                out[lo : lo + (1 << 24)] = src[lo : lo + (1 << 24)]
            del src
            out.flush()
            del out
            os.replace(out_tmp, self.path)
        finally:
            os.unlink(self.tmp)
            if os.path.exists(out_tmp):  # a copy that failed (disk full, interrupt) half-way
                os.unlink(out_tmp)


def _read_meta(cache: Path) -> dict | None:
    try:
        return json.loads((cache / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _build_text_cache(corpus: corpus_lib.TextCorpus, tok: Tokenizer, cache: Path, fingerprint: dict,
                      phases: dict | None = None) -> dict:
    """Tokenises both splits into ``cache``; its metadata. ``phases['encoding']``: the seconds spent in
    the tokenizer's batch encoding (the rest is reading the texts and writing the cache)."""
    dtype = _token_dtype(tok.vocab_size)
    eos = np.array([tok.eos_id])
    meta = {"version": CACHE_VERSION, "fingerprint": fingerprint, "dtype": dtype}
    encoding = 0.0
    for split in ("train", "val"):
        writer = _StreamWriter(cache / f"{split}.npy", dtype)
        lens, n_bytes, batch, batch_chars = [], 0, [], 0

        def flush():
            nonlocal encoding
            t0 = time.perf_counter()
            encoded = tok.encode_batch(batch)
            encoding += time.perf_counter() - t0
            for ids in encoded:
                writer.write(ids)
                writer.write(eos)
                lens.append(len(ids) + 1)
            batch.clear()

        try:
            for text in corpus.iter_texts(split):
                if not text:
                    continue  # an empty document would be a lone EOS: nothing to learn, skip it
                if split == "val":
                    n_bytes += len(text.encode("utf-8"))
                batch.append(text)
                batch_chars += len(text)
                # ~4 MB per encode_batch call: enough to keep every core busy, bounded memory.
                if batch_chars >= 4_000_000:
                    flush()
                    batch_chars = 0
            flush()
        except BaseException:
            writer.abort()  # a bad line or an interrupt must not leave a .raw file per attempt
            raise
        writer.finish()
        _write_npy_atomic(cache / f"{split}_doc_len.npy", np.asarray(lens, np.int64))
        meta[split] = {"num_docs": len(lens), "num_tokens": int(sum(lens))}
        if split == "val":
            meta[split].update(num_bytes=n_bytes, num_text_tokens=int(sum(lens)) - len(lens))
    if meta["train"]["num_docs"] == 0:
        raise DataError(f"data source {str(corpus.root)!r} has no text in its training split")
    if phases is not None:
        phases["encoding"] = encoding
    return meta


def _load_text_streams(cache: Path, meta: dict) -> tuple[TokenStream, TokenStream]:
    out = []
    for split in ("train", "val"):
        # numpy cannot memory-map a zero-length array (an empty validation split).
        mmap = "r" if meta[split]["num_tokens"] else None
        tokens = np.load(cache / f"{split}.npy", mmap_mode=mmap)
        lens = np.load(cache / f"{split}_doc_len.npy")
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if len(lens) else lens
        out.append(TokenStream([tokens], np.zeros(len(lens), np.int32), starts, lens))
    return out[0], out[1]


def _split_streams(tc: corpus_lib.TokenCorpus) -> tuple[TokenStream, TokenStream]:
    def sub(mask):
        return TokenStream(tc.arrays, tc.doc_array[mask], tc.doc_start[mask], tc.doc_len[mask])

    return sub(~tc.is_val), sub(tc.is_val)


def _val_text_stats(val: TokenStream, tok: Tokenizer) -> dict:
    """UTF-8 bytes and non-special tokens of a pre-tokenised validation split (bytes None if unknown)."""
    if val.num_docs == 0:
        return {"num_bytes": None, "num_text_tokens": 0}
    ids = np.concatenate([val.doc(i) for i in range(val.num_docs)])
    specials = [i for i in (tok.eos_id, tok.pad_id) if i is not None]
    ids = ids[~np.isin(ids, specials)] if specials else ids
    if tok.kind == "ids":
        return {"num_bytes": None, "num_text_tokens": len(ids)}
    if tok.kind == "byte":
        return {"num_bytes": len(ids), "num_text_tokens": len(ids)}
    # Chunked decode bounds memory; a character cut at a chunk edge miscounts by a few bytes at most.
    chunk = 1 << 20
    n_bytes = sum(len(tok.decode(ids[lo : lo + chunk].tolist()).encode("utf-8")) for lo in range(0, len(ids), chunk))
    return {"num_bytes": n_bytes, "num_text_tokens": len(ids)}


# ---------------------------------------------------------------------------------------------------
# Entry point.


@dataclasses.dataclass
class PreparedData:
    """Output of :func:`prepare_data`: the two streams, the tokenizer and the cache metadata."""

    train: TokenStream
    val: TokenStream
    tokenizer: Tokenizer
    meta: dict


def prepare_data(cfg, workdir: str | os.PathLike) -> PreparedData:
    """Loads (or builds) the tokenised streams: see `_prepare_data`. A failed attempt removes what
    it created itself (``data_cache/``, a BPE tokenizer file it trained, and the workdir when it
    made it and left it empty); files that were there before are never touched."""
    workdir = Path(workdir)
    made_workdir, made_cache = not workdir.exists(), not (workdir / CACHE_DIR).exists()
    tok_file = tokenizer_file(cfg, workdir) if cfg.data.tokenizer == "bpe" else None
    made_tok = tok_file is not None and not tok_file.exists()
    try:
        return _prepare_data(cfg, workdir)
    except BaseException:
        if made_cache:
            shutil.rmtree(workdir / CACHE_DIR, ignore_errors=True)
        if made_tok:
            # Trained on data that then failed to build: a retry on fixed data must retrain, since
            # a cached tokenizer file is reused as is.
            tok_file.unlink(missing_ok=True)
        if made_workdir and workdir.is_dir() and not any(workdir.iterdir()):
            workdir.rmdir()
        raise


def _prepare_data(cfg, workdir: str | os.PathLike) -> PreparedData:
    """Loads (or builds, then caches under ``<workdir>/data_cache``) the tokenised train/val streams.

    Args:
      cfg: the full config (``data.*``, ``model.vocab_size``).
      workdir: run directory; created if missing.
    Returns:
      :class:`PreparedData`. ``meta["cache_hit"]`` tells whether the cache was reused.
    Raises:
      DataError: any problem with the data or the tokenizer, naming the path.
    """
    t0 = time.perf_counter()
    d = cfg.data
    workdir = Path(workdir)
    cache = workdir / CACHE_DIR
    cache.mkdir(parents=True, exist_ok=True)
    settings = {"val_fraction": float(d.val_fraction), "max_docs": int(d.max_docs)}
    # Seconds per phase of a text source: listing the files; reading the corpus and training the BPE
    # tokenizer when it is not cached; when the token cache is built, the tokenizer's batch encoding
    # ('encoding'), and the rest ('tokens': reading the texts and writing the cache, or loading it).
    phases = {}

    if d.source == "tokens":
        root, files = corpus_lib.list_token_files(d.path)
        tok = load_or_train_tokenizer(cfg, workdir, None)
        fingerprint = {
            "version": CACHE_VERSION, "source": "tokens", "root": str(root),
            "files_sha1": corpus_lib.files_fingerprint(root, files), "tokens_dtype": d.tokens_dtype,
            "vocab_size": int(cfg.model.vocab_size), "tokenizer": tok.fingerprint(), **settings,
        }
        meta = _read_meta(cache)
        hit = meta is not None and meta.get("fingerprint") == fingerprint
        if hit:
            # The ids were range-checked and cut into documents when the index was built.
            arrays = [corpus_lib.open_token_file(root if root.is_file() else root / f, d.tokens_dtype) for f in files]
            try:
                with np.load(cache / "tokens_index.npz") as idx:
                    index = [idx[k] for k in ("doc_array", "doc_start", "doc_len", "is_val")]
            except (OSError, ValueError, KeyError):
                hit = False  # index deleted or damaged by hand: rebuild it
        if hit:
            train, val = _split_streams(corpus_lib.TokenCorpus(root, files, arrays, *index))
        else:
            (cache / "meta.json").unlink(missing_ok=True)
            tc = corpus_lib.load_token_corpus(d.path, dtype=d.tokens_dtype, vocab_size=cfg.model.vocab_size,
                                              eos_id=tok.eos_id, val_fraction=d.val_fraction, max_docs=d.max_docs)
            fd, tmp = _mkstemp(cache / "tokens_index.npz", ".tmp.npz")
            os.close(fd)
            try:
                np.savez(tmp, doc_array=tc.doc_array, doc_start=tc.doc_start, doc_len=tc.doc_len, is_val=tc.is_val)
                os.replace(tmp, cache / "tokens_index.npz")
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            train, val = _split_streams(tc)
            meta = {"version": CACHE_VERSION, "fingerprint": fingerprint, "dtype": str(tc.arrays[0].dtype),
                    "train": {"num_docs": train.num_docs, "num_tokens": train.num_tokens},
                    "val": {"num_docs": val.num_docs, "num_tokens": val.num_tokens, **_val_text_stats(val, tok)}}
            _write_json_atomic(cache / "meta.json", meta)
    else:
        listing = corpus_lib.list_text_files(d.source, d.path, suffixes=d.suffixes, extra_roots=d.extra_roots)
        phases["listing"] = time.perf_counter() - t0
        corpus_box = []

        def get_corpus():
            if not corpus_box:
                corpus_box.append(corpus_lib.load_text_corpus(
                    d.source, d.path, text_field=d.text_field, val_fraction=d.val_fraction,
                    max_docs=d.max_docs, listing=listing, suffixes=d.suffixes, extra_roots=d.extra_roots))
            return corpus_box[0]

        def train_texts():
            c = get_corpus()
            order = c.tokenizer_sample_order()
            yield from (c.iter_texts("train") if order is None else c.iter_texts(order=order))

        tok = load_or_train_tokenizer(cfg, workdir, train_texts())
        phases["tokenizer"] = time.perf_counter() - t0 - phases["listing"]
        root, files = listing
        fingerprint = {
            "version": CACHE_VERSION, "source": d.source, "root": str(root),
            "files_sha1": corpus_lib.files_fingerprint(root, files),
            "text_field": d.text_field if d.source == "jsonl" else None,
            "tokenizer": tok.fingerprint(), **settings,
        }
        # Recorded only when not at their defaults, so caches built before these knobs existed stay
        # valid; any other value gives a fingerprint no default-built cache can match.
        if d.suffixes != "python":
            fingerprint["suffixes"] = d.suffixes
        if d.extra_roots:
            fingerprint["extra_roots"] = d.extra_roots
        meta = _read_meta(cache)
        hit = meta is not None and meta.get("fingerprint") == fingerprint
        if hit:
            try:
                train, val = _load_text_streams(cache, meta)
            except (OSError, ValueError, KeyError):
                hit = False  # cache files deleted or damaged by hand: rebuild them
        if not hit:
            (cache / "meta.json").unlink(missing_ok=True)  # a half-rebuilt cache must never look valid
            meta = _build_text_cache(get_corpus(), tok, cache, fingerprint, phases)
            _write_json_atomic(cache / "meta.json", meta)
            train, val = _load_text_streams(cache, meta)

    seconds = time.perf_counter() - t0
    if phases:
        phases["tokens"] = seconds - sum(phases.values())
    meta = dict(meta, cache_hit=hit, seconds=round(seconds, 3), phases={k: round(v, 3) for k, v in phases.items()})
    log.info(
        "data: %s, %d train docs / %d tokens, %d val docs / %d tokens, tokenizer %r, %s in %.2fs",
        d.source, train.num_docs, train.num_tokens, val.num_docs, val.num_tokens, tok,
        "cache loaded" if hit else "cache built", meta["seconds"],
    )
    if train.num_docs == 0:
        raise DataError(f"data source {d.source!r} ({d.path or d.source}) has no training documents")
    return PreparedData(train, val, tok, meta)


def build_datasets(cfg, workdir: str | os.PathLike) -> tuple[TrainIterator, ValSource | None, Tokenizer]:
    """The data of a run: ``(train_iter, val_source, tokenizer)``.

    Args:
      cfg: the full config; uses ``data.*``, ``model.vocab_size`` and ``seed``.
      workdir: run directory; the tokenizer (``tokenizer.json``) and token cache (``data_cache/``)
        live there unless ``data.tokenizer_path`` says otherwise.
    Returns:
      train_iter: :class:`TrainIterator`, infinite; ``next()`` gives dict(inputs, targets,
        segment_ids: int32 [B, T]; loss_mask: float32 [B, T]); ``get_state()``/``set_state()``.
      val_source: :class:`ValSource` (``val_batches(n)``, ``bits_per_byte(loss)``), or None when
        the validation split is empty (``data.val_fraction == 0``).
      tokenizer: :class:`~k3.data.tokenizer.Tokenizer` (``encode``, ``decode``, ``eos_id``, ...).
    """
    data = prepare_data(cfg, workdir)
    d = cfg.data
    train_iter = TrainIterator(data.train, d.seq_len, d.batch_size, cfg.seed)
    val_source = None
    if data.val.num_docs:
        v = data.meta["val"]
        val_source = ValSource(data.val, d.seq_len, d.batch_size, v.get("num_bytes"), v.get("num_text_tokens"))
    return train_iter, val_source, data.tokenizer
