"""Tokenizers with one small interface: byte-level BPE trained locally, raw bytes, or bare ids.

* :class:`BPETokenizer`: byte-level BPE (GPT-2 style pre-tokenisation, no normaliser, so every
  string round-trips exactly), trained with the ``tokenizers`` library on the TRAIN documents only and
  cached as a JSON file. Training reads at most ``data.tokenizer_train_bytes`` (default
  :data:`TRAIN_TEXT_BYTES`, 4 MiB) of text, sampled across the training split: on the
  default corpus that takes about a second and gives nearly the same merges as the full text.
* :class:`ByteTokenizer`: ids 0..255 are the UTF-8 bytes, 256 is EOS, 257 is PAD.
* :class:`IdTokenizer`: for pre-tokenised data without a tokenizer file; it only knows the vocab size.

All share ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``encode_batch(texts)``,
``eos_id``, ``pad_id``, ``vocab_size`` and ``fingerprint()``. The special tokens are
``<|endoftext|>`` (EOS, appended after every document) and ``<|pad|>``; text that happens to contain
those strings is encoded as ordinary text, so documents cannot inject a separator.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from k3.data.corpus import DataError

EOS = "<|endoftext|>"
PAD = "<|pad|>"
TRAIN_TEXT_BYTES = 4 * 2**20  # cap on the text the BPE trainer reads, for speed
BYTE_VOCAB_SIZE = 258  # 256 bytes + EOS + PAD


class Tokenizer:
    """Common interface. ``vocab_size`` counts every id the tokenizer can produce."""

    kind: str = ""
    vocab_size: int
    eos_id: int | None
    pad_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOS added)."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; PAD ids are dropped and EOS is rendered as ``<|endoftext|>``."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text as an int64 [n_i] array (no EOS added)."""
        return [np.asarray(self.encode(t), np.int64) for t in texts]

    def fingerprint(self) -> str:
        """A short string that changes whenever the text -> ids mapping may change."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eos_id={self.eos_id}, pad_id={self.pad_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then EOS = 256 and PAD = 257 (``vocab_size`` 258)."""

    kind = "byte"

    def __init__(self):
        self.vocab_size = BYTE_VOCAB_SIZE
        self.eos_id = 256
        self.pad_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                run.append(i)
            elif i == self.eos_id:
                out.append(run.decode("utf-8", errors="replace"))
                out.append(EOS)
                run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def fingerprint(self) -> str:
        return "byte-v1"


class IdTokenizer(Tokenizer):
    """Stand-in for pre-tokenised data without a tokenizer file: no EOS, no text encoding."""

    kind = "ids"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_id = None
        self.pad_id = None

    def encode(self, text: str) -> list[int]:
        raise DataError("pre-tokenised data without a tokenizer file cannot encode text; set data.tokenizer_path")

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def fingerprint(self) -> str:
        return f"ids-{self.vocab_size}"


class BPETokenizer(Tokenizer):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``<|endoftext|>`` and ``<|pad|>``.

    Attributes:
      path: the JSON file it was loaded from or saved to (None when built in memory).
      trained: True when this object was trained in this process rather than loaded.
    """

    kind = "bpe"

    def __init__(self, tok, path: Path | None = None, trained: bool = False):
        self._tok = tok
        # Literal "<|endoftext|>" inside a document must stay text, or it would fake a boundary.
        self._tok.encode_special_tokens = True
        self.path = path
        self.trained = trained
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = tok.token_to_id(EOS)
        self.pad_id = tok.token_to_id(PAD)
        if self.eos_id is None or self.pad_id is None:
            where = f" {str(path)!r}" if path else ""
            raise DataError(f"tokenizer{where} lacks the special tokens {EOS!r} and {PAD!r}")
        self._fingerprint = hashlib.sha1(tok.to_str().encode()).hexdigest()[:16]

    @classmethod
    def load(cls, path: str | os.PathLike) -> BPETokenizer:
        """Loads a ``tokenizers`` JSON file."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise DataError(f"cannot read tokenizer file {str(path)!r}: {e}") from None
        return cls(tok, path)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the JSON file atomically, so a crash never leaves a truncated cache behind."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        os.close(fd)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a cache should be readable like any file
        try:
            self._tok.save(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self.path = path

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_batch_fast skips offset tracking and runs the batch on all cores.
        encs = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int64) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids if int(i) != self.pad_id]
        return self._tok.decode(ids, skip_special_tokens=False)

    def fingerprint(self) -> str:
        return f"bpe-{self._fingerprint}"


def _capped(texts: Iterable[str], max_bytes: int):
    total = 0
    for t in texts:
        if total >= max_bytes:
            return
        if not t:
            continue
        # Cutting by characters can overshoot the byte cap by up to 4x on this last document only.
        t = t[: max_bytes - total]
        total += len(t.encode("utf-8"))
        yield t


def train_bpe(texts: Iterable[str], vocab_size: int, max_bytes: int = TRAIN_TEXT_BYTES) -> BPETokenizer:
    """Trains a byte-level BPE with exactly ``vocab_size`` ids on the first ``max_bytes`` of ``texts``.

    Args:
      texts: documents (str); consumed lazily and only up to ``max_bytes`` UTF-8 bytes.
      vocab_size: total size including the 256 byte tokens and the 2 special tokens (>= 258).
    Raises:
      DataError: ``vocab_size`` < 258, no text, or too little text to learn enough merges.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < BYTE_VOCAB_SIZE:
        raise DataError(f"model.vocab_size={vocab_size} is too small for byte-level BPE (needs >= {BYTE_VOCAB_SIZE})")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, seen or not
        min_frequency=2,
        show_progress=False,
    )
    seen = [0]

    def counted():
        for t in _capped(texts, max_bytes):
            seen[0] += len(t)
            yield t

    tok.train_from_iterator(counted(), trainer)
    if seen[0] == 0:
        raise DataError("cannot train the BPE tokenizer: the training split has no text")
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise DataError(
            f"BPE training on {seen[0]} characters reached only {got} tokens, not model.vocab_size={vocab_size}: "
            "use more data, a smaller model.vocab_size, or data.tokenizer='byte'"
        )
    return BPETokenizer(tok, trained=True)


def tokenizer_file(cfg, workdir: str | os.PathLike | None) -> Path | None:
    """Where the BPE tokenizer is cached: ``data.tokenizer_path``, else ``<workdir>/tokenizer.json``."""
    if cfg.data.tokenizer_path:
        return Path(cfg.data.tokenizer_path).expanduser()
    return None if workdir is None else Path(workdir) / "tokenizer.json"


def check_vocab(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """Raises :class:`DataError` naming both sizes unless ``tok`` fits ``model.vocab_size``.

    A BPE tokenizer must match exactly (its vocab *is* the model's); the byte tokenizer only needs to
    fit, since a larger embedding just has unused rows.
    """
    if tok.kind == "bpe" and tok.vocab_size != vocab_size:
        raise DataError(
            f"tokenizer {str(tok.path)!r} has vocab size {tok.vocab_size} but model.vocab_size is {vocab_size}; "
            "delete the file to retrain, or set model.vocab_size to match"
        )
    if tok.vocab_size > vocab_size:
        raise DataError(f"{tok.kind} tokenizer needs vocab size {tok.vocab_size} but model.vocab_size is {vocab_size}")
    return tok


def load_or_train_tokenizer(cfg, workdir: str | os.PathLike | None, documents: Iterable[str] | None) -> Tokenizer:
    """The tokenizer for ``cfg``: loaded from its cache file, else trained and cached.

    Args:
      cfg: the full config (uses ``data.tokenizer``, ``data.tokenizer_path``, ``model.vocab_size``).
      workdir: run directory; the BPE cache defaults to ``<workdir>/tokenizer.json``.
      documents: TRAIN-split texts (str), consumed lazily, only when training is needed and only up to
        ``data.tokenizer_train_bytes`` (default :data:`TRAIN_TEXT_BYTES`). None means training is impossible (pre-tokenised data): then a
        missing cache file gives an :class:`IdTokenizer`, or an error if ``data.tokenizer_path`` was set.
    Returns:
      A :class:`Tokenizer`; ``BPETokenizer.trained`` tells whether it was trained by this call.
      A cache file is reused as is, even if the data changed since it was trained: delete it to
      retrain (the token cache notices the new tokenizer and is rebuilt).
    Raises:
      DataError: vocab size mismatch (both numbers named), unreadable file, too little text.
    """
    vocab_size = cfg.model.vocab_size
    if cfg.data.tokenizer == "byte":
        return check_vocab(ByteTokenizer(), vocab_size)
    if cfg.data.tokenizer != "bpe":
        raise DataError(f"data.tokenizer must be 'bpe' or 'byte', got {cfg.data.tokenizer!r}")
    path = tokenizer_file(cfg, workdir)
    if path is not None and path.exists():
        return check_vocab(BPETokenizer.load(path), vocab_size)
    if documents is None:
        if cfg.data.tokenizer_path:
            raise DataError(f"tokenizer file {str(path)!r} (data.tokenizer_path) does not exist")
        return IdTokenizer(vocab_size)
    tok = train_bpe(documents, vocab_size, int(cfg.data.tokenizer_train_bytes))
    if path is not None:
        tok.save(path)
    return tok
