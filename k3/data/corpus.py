"""Document sources: the embedded standard-library corpus, user text/JSONL files, pre-tokenised files.

A *text corpus* (:class:`TextCorpus`) is an ordered list of documents, each with a stable name (a
relative path, or ``relpath:line`` for JSONL), assigned to the train or validation split by a stable
hash of that name. Texts are read lazily, so listing a corpus only costs a directory walk and one
read of each file ('text_dir' files to skip those that are not UTF-8 text, JSONL files to count
their lines).

A *token corpus* (:class:`TokenCorpus`) is a set of memory-mapped 1-D integer arrays (``.bin`` or
``.npy`` files) cut into documents: each file is a document, further cut after every EOS id when the
tokenizer defines one. A single boundary-free document is split into train and validation by its
tail instead, since there is no document to hold out.

Every problem with the user's data raises :class:`DataError` with a message that names the path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text", ".py")
JSONL_SUFFIXES = (".jsonl",)
TOKEN_SUFFIXES = (".bin", ".npy")

# Directories of the standard library that are not "library text": test suites (their data files
# are deliberately malformed), installed third-party packages, build leftovers and compiled modules.
_STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload"}
)


class DataError(ValueError):
    """The data source is missing, empty or malformed; the message names the offending path."""


def _unit_hash(key: str) -> float:
    """A number in [0, 1) from ``key`` that is identical on every machine and Python process."""
    # Python's hash() is salted per process, so a split built on it would change between runs.
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _u64_mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised: a stable pseudo-random uint64 per input uint64."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def assign_validation(hashes: np.ndarray, val_fraction: float) -> np.ndarray:
    """Which documents go to validation.

    Args:
      hashes: float64 [D] in [0, 1), a stable hash per document.
      val_fraction: the expected fraction of documents held out, in [0, 1).
    Returns:
      bool [D], True for validation documents: ``hash < val_fraction``. When that leaves one split
      empty but there are at least two documents (small corpora), the document with the smallest
      (largest) hash is moved, so both splits are non-empty and the choice is still stable.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    is_val = hashes < val_fraction
    if val_fraction > 0 and len(hashes) >= 2:
        if not is_val.any():
            is_val[int(np.argmin(hashes))] = True
        if is_val.all():
            is_val[int(np.argmax(hashes))] = False
    return is_val


def _require_path(path: str | os.PathLike, what: str) -> Path:
    if not str(path):
        raise DataError(f"data.path must be set for data.source={what!r}")
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data path {str(p)!r} does not exist (data.source={what!r})")
    return p.resolve()


def _walk_files(root: Path, suffixes: tuple[str, ...], skip_dirs=frozenset(), skip=None) -> list[str]:
    """Sorted relative POSIX paths of the files under ``root`` whose suffix is in ``suffixes``."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending; sorting is only needed once, at the end.
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        if skip is not None:
            dirnames[:] = [d for d in dirnames if not skip(d, True)]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.startswith(".") or not name.endswith(suffixes):
                continue
            if skip is not None and skip(name, False):
                continue
            out.append((rel_dir / name).as_posix())
    return sorted(out)


def _stdlib_skip(name: str, is_dir: bool) -> bool:
    if is_dir:
        return name.startswith("config-")  # build config of this machine (python-config.py)
    return name.startswith("_sysconfigdata")  # machine-specific build paths, not library code


def stdlib_root() -> Path:
    """The directory of the running Python's standard library (``sysconfig`` ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def list_stdlib_files(root: str | os.PathLike | None = None) -> list[str]:
    """Sorted relative POSIX paths of the standard library's non-empty ``*.py`` files.

    Test suites (``test/``, ``tests/``, ``idlelib/idle_test`` ...), ``site-packages``, compiled
    modules and machine-specific build files are excluded, so the list depends only on the Python
    version, not on the machine or on what is installed.
    """
    root = stdlib_root() if root is None else Path(root)
    files = _walk_files(root, (".py",), _STDLIB_SKIP_DIRS, _stdlib_skip)
    # Empty files (many __init__.py) would become documents made of a lone EOS.
    return [f for f in files if (root / f).stat().st_size > 0]


@dataclasses.dataclass
class TextCorpus:
    """An ordered list of text documents with a stable train/validation assignment.

    Attributes:
      source: 'stdlib', 'text_dir' or 'jsonl'.
      root: the directory (or single file) the relative paths in ``files`` refer to.
      files: sorted relative POSIX paths of the source files.
      doc_file: int32 [D], index into ``files`` of each document.
      doc_line: int64 [D], 1-based line number of each JSONL document (0 for whole-file documents).
      is_val: bool [D], True for validation documents.
      text_field: the JSON key that holds the text (JSONL only).
    """

    source: str
    root: Path
    files: list[str]
    doc_file: np.ndarray
    doc_line: np.ndarray
    is_val: np.ndarray
    text_field: str = "text"

    @property
    def num_docs(self) -> int:
        """The number of documents in both splits."""
        return len(self.doc_file)

    def doc_names(self, split: str | None = None) -> list[str]:
        """Stable names of the documents of ``split`` ('train', 'val' or None for all), in order."""
        names = []
        for i in self._indices(split):
            f = self.files[self.doc_file[i]]
            names.append(f"{f}:{self.doc_line[i]}" if self.doc_line[i] else f)
        return names

    def _indices(self, split: str | None) -> np.ndarray:
        if split is None:
            return np.arange(self.num_docs)
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return np.flatnonzero(self.is_val if split == "val" else ~self.is_val)

    def _path(self, file_index: int) -> Path:
        return self.root if self.root.is_file() else self.root / self.files[file_index]

    def iter_texts(self, split: str | None = None, order: np.ndarray | None = None) -> Iterator[str]:
        """Yields the text (str) of each document of ``split`` in corpus order.

        ``order`` (int [K], document indices) overrides the order and selection; it is only
        supported for whole-file documents (reading a JSONL line needs the file scanned in order).
        """
        indices = self._indices(split) if order is None else np.asarray(order)
        if self.source != "jsonl":
            for i in indices:
                yield self._path(self.doc_file[i]).read_bytes().decode("utf-8", errors="replace")
            return
        if order is not None:
            raise ValueError("JSONL documents can only be read in corpus order")
        wanted = np.zeros(self.num_docs, bool)
        wanted[indices] = True
        yield from self._iter_jsonl(wanted)

    def _iter_jsonl(self, wanted: np.ndarray) -> Iterator[str]:
        # Documents are numbered in the same scan order as in load_text_corpus, so index i here is
        # the document i there; lines past max_docs are never reached because wanted ends first.
        if not wanted.any():
            return
        last = int(np.flatnonzero(wanted)[-1])
        i = 0
        for fi, rel in enumerate(self.files):
            path = self._path(fi)
            with open(path, "rb") as fh:
                for lineno, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue
                    if wanted[i]:
                        yield _parse_jsonl_line(line, path, lineno, self.text_field)
                    i += 1
                    if i > last:
                        return

    def tokenizer_sample_order(self) -> np.ndarray | None:
        """Train document indices in a stable pseudo-random order (None: use corpus order).

        Used to pick the capped tokenizer-training text from all over the corpus rather than from the
        alphabetically first files; JSONL is read in file order, as it cannot be read out of order.
        """
        if self.source == "jsonl":
            return None
        train = self._indices("train")
        names = self.doc_names("train")
        keys = np.array([_unit_hash("tokenizer-sample:" + n) for n in names])
        return train[np.argsort(keys, kind="stable")]


def _parse_jsonl_line(line: bytes, path: Path, lineno: int, field: str) -> str:
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}:{lineno}: line is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    if field not in obj:
        keys = ", ".join(sorted(map(str, obj))[:10])
        raise DataError(f"{path}:{lineno}: JSON object has no field {field!r} (data.text_field); keys: {keys}")
    text = obj[field]
    if not isinstance(text, str):
        raise DataError(f"{path}:{lineno}: field {field!r} must be a string, got {type(text).__name__}")
    return text


def list_text_files(source: str, path: str = "") -> tuple[Path, list[str]]:
    """The resolved root and sorted relative POSIX paths of a text source's files (no reading).

    Args:
      source: 'stdlib' (``path`` ignored), 'text_dir' or 'jsonl'; see :func:`load_text_corpus`.
    Raises:
      DataError: missing path, empty single file, or a directory without matching files.
    """
    if source == "stdlib":
        root = stdlib_root()
        files = list_stdlib_files(root)
        if not files:
            raise DataError(f"no Python source files found in the standard library at {root}")
        return root, files
    if source not in ("text_dir", "jsonl"):
        raise DataError(f"not a text source: data.source={source!r}")
    root = _require_path(path, source)
    suffixes = TEXT_SUFFIXES if source == "text_dir" else JSONL_SUFFIXES
    if root.is_file():
        if root.stat().st_size == 0:
            raise DataError(f"data file {str(root)!r} is empty")
        return root, [root.name]
    files = _walk_files(root, suffixes)
    if not files:
        raise DataError(f"data directory {str(root)!r} contains no {'/'.join(suffixes)} files")
    return root, files


def files_fingerprint(root: Path, files: list[str]) -> str:
    """SHA-1 over (relative path, size, mtime) of each file: changes whenever a file may have changed."""
    h = hashlib.sha1()
    for rel in files:
        st = (root if root.is_file() else root / rel).stat()
        h.update(f"{rel}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _is_text(path: Path) -> bool:
    """Whether a file reads as text: valid UTF-8 with no NUL byte (binary files decode to U+FFFD
    noise that the byte tokenizer would otherwise train on)."""
    data = path.read_bytes()
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def load_text_corpus(source: str, path: str = "", *, text_field: str = "text", val_fraction: float = 0.02,
                     max_docs: int = 0, listing: tuple[Path, list[str]] | None = None) -> TextCorpus:
    """Lists the documents of a text source and assigns each to train or validation.

    Args:
      source: 'stdlib' (``path`` ignored; the running Python's standard library), 'text_dir' (a
        directory searched recursively for ``TEXT_SUFFIXES`` files, or a single text file; each file
        is one document) or 'jsonl' (a ``.jsonl`` file or a directory of them; each non-blank line is
        a JSON object and one document, its text under ``text_field``).
      val_fraction: expected fraction of documents held out (by a SHA-1 hash of the name).
      max_docs: when > 0, only the first ``max_docs`` documents (in sorted order) are used, before
        splitting.
      listing: the result of :func:`list_text_files` when the caller already has it.
    Returns:
      A :class:`TextCorpus`. Empty files and blank JSONL lines are skipped, not counted; 'text_dir'
      files that are not UTF-8 text (`_is_text`) are skipped and counted in a warning on stderr.
    Raises:
      DataError: missing path, no documents, or (JSONL) a line that is not a JSON object.
    """
    root, files = listing if listing is not None else list_text_files(source, path)
    limit = max_docs if max_docs > 0 else None
    doc_file, doc_line, names = [], [], []
    if source == "jsonl":
        for fi, rel in enumerate(files):
            if limit is not None and len(doc_file) >= limit:
                break
            p = root if root.is_file() else root / rel
            with open(p, "rb") as fh:
                for lineno, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue
                    doc_file.append(fi)
                    doc_line.append(lineno)
                    names.append(f"{rel}:{lineno}")
                    if limit is not None and len(doc_file) >= limit:
                        break
    else:
        binary = []
        for fi, rel in enumerate(files):
            p = root if root.is_file() else root / rel
            if p.stat().st_size == 0:
                continue
            if source == "text_dir" and not _is_text(p):
                binary.append(rel)
                continue
            doc_file.append(fi)
            doc_line.append(0)
            names.append(rel)
            if limit is not None and len(doc_file) >= limit:
                break
        if binary:
            print(f"warning: skipped {len(binary)} file(s) of {str(root)!r} that are not UTF-8 text "
                  f"(NUL bytes or invalid UTF-8), e.g. {binary[0]!r}", file=sys.stderr)
        if not doc_file and binary:
            raise DataError(f"data path {str(root)!r} contains no text documents: {len(binary)} file(s) are "
                            "binary (NUL bytes or invalid UTF-8), the rest empty")
    if not doc_file:
        raise DataError(f"data path {str(root)!r} contains no documents (all files are empty)")
    hashes = np.array([_unit_hash(n) for n in names], dtype=np.float64)
    return TextCorpus(
        source=source,
        root=root,
        files=files,
        doc_file=np.asarray(doc_file, np.int32),
        doc_line=np.asarray(doc_line, np.int64),
        is_val=assign_validation(hashes, val_fraction),
        text_field=text_field,
    )


# ---------------------------------------------------------------------------------------------------
# Pre-tokenised data.


@dataclasses.dataclass
class TokenCorpus:
    """Documents as slices of memory-mapped token arrays.

    Attributes:
      root: the file or directory given as ``data.path``.
      files: sorted relative POSIX paths (``[name]`` for a single file).
      arrays: one read-only 1-D integer array (``np.memmap``) per file.
      doc_array: int32 [D], which array each document lies in.
      doc_start: int64 [D], its first token's index in that array.
      doc_len: int64 [D], its number of tokens (> 0).
      is_val: bool [D], True for validation documents.
    """

    root: Path
    files: list[str]
    arrays: list[np.ndarray]
    doc_array: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray
    is_val: np.ndarray


def list_token_files(path: str) -> tuple[Path, list[str]]:
    """The resolved ``data.path`` and the sorted relative paths of its ``.bin``/``.npy`` files."""
    root = _require_path(path, "tokens")
    if root.is_file():
        if not root.name.endswith(TOKEN_SUFFIXES):
            raise DataError(f"token file {str(root)!r} must end in .bin (raw) or .npy")
        return root, [root.name]
    files = _walk_files(root, TOKEN_SUFFIXES)
    if not files:
        raise DataError(f"data directory {str(root)!r} contains no .bin/.npy token files")
    return root, files


def open_token_file(path: Path, dtype: str = "uint16") -> np.ndarray:
    """Memory-maps one token file as a read-only 1-D integer array.

    ``.npy`` files keep their own (integer) dtype and are flattened; ``.bin`` files are raw
    little-endian ``dtype`` ('uint16' or 'uint32') values with no header.
    """
    if path.stat().st_size == 0:
        raise DataError(f"token file {str(path)!r} is empty")
    if path.name.endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise DataError(f"token file {str(path)!r} is not a readable .npy array ({e})") from None
        if not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"token file {str(path)!r} has dtype {arr.dtype}; token ids must be integers")
        return arr.reshape(-1)
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"data.tokens_dtype must be 'uint16' or 'uint32', got {dtype!r}")
    dt = np.dtype(dtype).newbyteorder("<")
    size = path.stat().st_size
    if size % dt.itemsize:
        raise DataError(f"token file {str(path)!r} has {size} bytes, not a multiple of {dtype} ({dt.itemsize} bytes)")
    return np.memmap(path, dtype=dt, mode="r")


def _check_ids(arr: np.ndarray, path: Path, vocab_size: int, chunk: int = 1 << 24) -> None:
    # Chunked, so a file larger than memory is scanned without being read in all at once.
    for lo in range(0, len(arr), chunk):
        part = arr[lo : lo + chunk]
        hi, low = int(part.max()), int(part.min())
        if hi >= vocab_size or low < 0:
            bad = hi if hi >= vocab_size else low
            pos = lo + int(np.flatnonzero(part == bad)[0])
            raise DataError(
                f"token file {str(path)!r} holds id {bad} at index {pos}, outside [0, model.vocab_size="
                f"{vocab_size}); wrong data.tokens_dtype or model.vocab_size?"
            )


def load_token_corpus(path: str, *, dtype: str = "uint16", vocab_size: int, eos_id: int | None,
                      val_fraction: float = 0.02, max_docs: int = 0) -> TokenCorpus:
    """Memory-maps pre-tokenised files and cuts them into documents.

    Args:
      path: a ``.bin``/``.npy`` file or a directory of them (searched recursively, sorted).
      dtype: element type of ``.bin`` files, 'uint16' or 'uint32'.
      vocab_size: every id must be in ``[0, vocab_size)``.
      eos_id: when not None, a document ends after each occurrence of this id (the EOS stays with the
        document it ends); when None, each file is one document.
      val_fraction: expected fraction of documents held out, by a stable hash of (file, index). When
        there is a single document, its last ``val_fraction`` of tokens is held out instead.
      max_docs: when > 0, only the first ``max_docs`` documents are used, before splitting.
    Returns:
      A :class:`TokenCorpus`; reads the files once (id range check, EOS positions).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    root, files = list_token_files(path)
    arrays, d_arr, d_start, d_len, d_hash = [], [], [], [], []
    for fi, rel in enumerate(files):
        p = root if root.is_file() else root / rel
        arr = open_token_file(p, dtype)
        _check_ids(arr, p, vocab_size)
        arrays.append(arr)
        if eos_id is not None:
            ends = np.flatnonzero(arr == eos_id) + 1
            if len(ends) == 0 or ends[-1] != len(arr):
                ends = np.append(ends, len(arr))
        else:
            ends = np.array([len(arr)])
        starts = np.concatenate([[0], ends[:-1]])
        d_arr.append(np.full(len(ends), fi, np.int32))
        d_start.append(starts.astype(np.int64))
        d_len.append((ends - starts).astype(np.int64))
        seed = np.uint64(int.from_bytes(hashlib.sha1(rel.encode()).digest()[:8], "big"))
        with np.errstate(over="ignore"):
            keys = _u64_mix(np.arange(len(ends), dtype=np.uint64) + seed)
        d_hash.append((keys >> np.uint64(11)).astype(np.float64) / 2.0**53)
    doc_array, doc_start = np.concatenate(d_arr), np.concatenate(d_start)
    doc_len, hashes = np.concatenate(d_len), np.concatenate(d_hash)
    if max_docs > 0:
        doc_array, doc_start, doc_len, hashes = (a[:max_docs] for a in (doc_array, doc_start, doc_len, hashes))
    if len(doc_len) == 1 and val_fraction > 0 and doc_len[0] >= 2:
        # One boundary-free stream: hold out its tail, the only split that keeps both contiguous.
        n = int(doc_len[0])
        n_val = min(n - 1, max(1, int(round(n * val_fraction))))
        doc_array = np.repeat(doc_array, 2)
        doc_start = np.array([doc_start[0], doc_start[0] + n - n_val], np.int64)
        doc_len = np.array([n - n_val, n_val], np.int64)
        is_val = np.array([False, True])
    else:
        is_val = assign_validation(hashes, val_fraction)
    return TokenCorpus(root, files, arrays, doc_array, doc_start, doc_len, is_val)
