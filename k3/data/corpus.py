"""Document sources: the embedded standard-library and site-packages corpora, user text/JSONL files,
pre-tokenised files.

A *text corpus* (:class:`TextCorpus`) is an ordered list of documents, each with a stable name (a
relative path, or ``relpath:line`` for JSONL), assigned to the train or validation split by a stable
hash of that name. Texts are read lazily, so listing a corpus only costs a directory walk and one
read of each file ('text_dir' files to skip those that are not UTF-8 text, JSONL files to count
their lines, 'site_packages' files to apply its drop rules and content deduplication).

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

TEXT_SOURCES = ("stdlib", "site_packages", "text_dir", "jsonl")

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


# ---------------------------------------------------------------------------------------------------
# Site-packages: the source and docs of every installed distribution.

SITE_PACKAGES_SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt")
# Named suffix sets of the site-packages corpus (``data.suffixes``). 'code' adds the hand-written
# source of the compiled side of the installed packages (and of extra roots such as /usr/include):
# C, C++ and CUDA sources and headers (.inl/.ipp/.tcc: template implementation headers), Cython,
# Fortran (upper-case suffixes are the preprocessed forms), shell, CMake, protobuf and LLVM TableGen.
# Not data or configuration (.json, .yaml, .csv ...) nor mostly generated text (.inc, .def, .ll, .s).
SITE_SUFFIX_SETS = {
    "python": SITE_PACKAGES_SUFFIXES,
    "code": SITE_PACKAGES_SUFFIXES + (
        ".h", ".hh", ".hpp", ".hxx", ".inl", ".ipp", ".tcc", ".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh",
        ".pyx", ".pxd", ".pxi", ".f", ".for", ".f77", ".f90", ".f95", ".F", ".F90",
        ".sh", ".bash", ".cmake", ".proto", ".td",
    ),
}
SITE_MAX_FILE_BYTES = 1 << 20
SITE_MAX_LINE_CHARS = 1000
SITE_MAX_CONTROL_FRACTION = 0.01
# Drop rules in the order they are tried; a dropped file is counted under the first rule it meets.
SITE_DROP_RULES = ("shadowed", "metadata", "legal", "unreadable", "empty", "too_large", "binary", "long_line",
                   "duplicate")
_SITE_METADATA_DIR_SUFFIXES = (".dist-info", ".egg-info")
_SITE_LEGAL_PREFIXES = ("license", "licence", "copying", "notice", "authors")
# Bytes below 0x20 and DEL, except tab, newline, carriage return and form feed (used as a page break
# in Python sources): a text file has almost none of them.
_CONTROL_BYTES = bytes([*range(0x09), 0x0B, *range(0x0E, 0x20), 0x7F])


class SearchPath(tuple):
    """Several directories read as one corpus root, in the manner of ``sys.path``.

    A tuple of resolved :class:`~pathlib.Path` that also answers the three things a corpus asks of
    its root: ``sp / rel`` is ``rel`` under the first directory that has it, ``is_file()`` is False,
    and ``str(sp)`` joins the directories with ``os.pathsep``.
    """

    def __new__(cls, dirs):
        return super().__new__(cls, (Path(d) for d in dirs))

    def __truediv__(self, rel) -> Path:
        for d in self[:-1]:
            p = d / rel
            if p.exists():
                return p
        # The last directory without a check: a file that has since vanished still raises an error
        # that names a real directory.
        return self[-1] / rel

    def is_file(self) -> bool:
        """Always False: a search path is a set of directories."""
        return False

    def __str__(self) -> str:
        return os.pathsep.join(map(str, self))


def site_packages_roots() -> list[Path]:
    """The running Python's site-packages directories that exist, resolved, deduplicated and sorted.

    The union of ``site.getsitepackages()`` and ``sysconfig``'s ``purelib`` and ``platlib`` paths
    (user site-packages are not included: they depend on the account, not on the environment).
    """
    import site

    candidates = list(site.getsitepackages())
    paths = sysconfig.get_paths()
    candidates += [paths["purelib"], paths["platlib"]]
    return sorted({Path(c).resolve() for c in candidates if Path(c).is_dir()})


def site_suffixes(name: str) -> tuple[str, ...]:
    """The file-name suffixes of the named set of :data:`SITE_SUFFIX_SETS`.

    Args:
      name: a key of :data:`SITE_SUFFIX_SETS` ('python', 'code').
    Returns:
      A tuple of suffixes, each with its leading dot.
    Raises:
      DataError: ``name`` is not a key; the message names it and the valid ones.
    """
    if name not in SITE_SUFFIX_SETS:
        raise DataError(f"unknown site-packages suffix set data.suffixes={name!r}; valid sets are "
                        f"{', '.join(map(repr, SITE_SUFFIX_SETS))}")
    return SITE_SUFFIX_SETS[name]


def _site_candidates(roots: list[Path], suffixes: tuple[str, ...]) -> list[tuple[str, int]]:
    """(relative POSIX path, root index) of every non-hidden file whose name ends in one of
    ``suffixes``, sorted by path then root."""
    others = set(roots)
    out = []
    for ri, root in enumerate(roots):
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            # A root nested in another is walked once, as itself, so its files keep short names.
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"
                           and (here / d) not in others]
            rel_dir = here.relative_to(root)
            for name in filenames:
                if not name.startswith(".") and name.endswith(suffixes):
                    out.append(((rel_dir / name).as_posix(), ri))
    return sorted(out)


def _file_size(path: Path) -> int | None:
    """The size of ``path`` in bytes (links followed), or None when it cannot be read."""
    try:
        return path.stat().st_size
    except OSError:
        return None


def _site_drop_rule(path: Path, rel: str, seen_hashes: set[bytes]) -> tuple[str | None, int]:
    """The first drop rule (:data:`SITE_DROP_RULES`) that ``path`` meets, or None to keep it, and its
    size in bytes. A kept file's content hash is added to ``seen_hashes``."""
    *dirs, name = rel.split("/")
    size = _file_size(path)
    if any(d.endswith(_SITE_METADATA_DIR_SUFFIXES) for d in dirs):
        return "metadata", size or 0
    if name.lower().startswith(_SITE_LEGAL_PREFIXES):
        return "legal", size or 0
    if size is None:
        return "unreadable", 0
    if size == 0:
        return "empty", 0
    if size > SITE_MAX_FILE_BYTES:
        return "too_large", size
    try:
        data = path.read_bytes()
    except OSError:
        return "unreadable", size
    text = _decode_text(data)
    n_control = len(data) - len(data.translate(None, _CONTROL_BYTES))
    if text is None or n_control > SITE_MAX_CONTROL_FRACTION * len(data):
        return "binary", size
    if max(map(len, text.split("\n"))) > SITE_MAX_LINE_CHARS:
        return "long_line", size
    digest = hashlib.sha256(data).digest()
    if digest in seen_hashes:
        return "duplicate", size
    seen_hashes.add(digest)
    return None, size


def _as_dir_list(dirs) -> list:
    """A str or path-like as a one-item list, any other iterable of them as a list."""
    return [dirs] if isinstance(dirs, (str, os.PathLike)) else list(dirs)


def scan_site_packages(roots=None, suffixes: str = "python", extra_roots=()) -> tuple[SearchPath, list[str], dict]:
    """Lists the site-packages corpus and counts what its drop rules removed.

    Every file under the roots whose name ends in one of the suffixes of the set ``suffixes`` (see
    :data:`SITE_SUFFIX_SETS`) is *seen* (hidden files and directories and ``__pycache__`` are not
    walked). Suffixes match case-sensitively: on the file systems these trees live on the case is
    part of the name and can carry meaning (Fortran's ``.F`` is preprocessed, ``.f`` is not), so a
    set lists each case it wants. Files are visited in sorted relative path order (then root order),
    and the first rule that matches drops a file:

    - ``shadowed``: a later root holds the same relative path again (only the first copy is read,
      as ``import`` would);
    - ``metadata``: it lies in a ``*.dist-info`` or ``*.egg-info`` directory;
    - ``legal``: its name starts with LICENSE, LICENCE, COPYING, NOTICE or AUTHORS (any case);
    - ``unreadable``: it cannot be read (a broken link, no permission);
    - ``empty``: it has no bytes;
    - ``too_large``: it has more than :data:`SITE_MAX_FILE_BYTES` (1 MiB) bytes;
    - ``binary``: it has a NUL byte, is not valid UTF-8 (as `_is_text`), or more than 1% of its
      bytes are control characters other than tab, newline, carriage return and form feed;
    - ``long_line``: a line has more than :data:`SITE_MAX_LINE_CHARS` (1,000) characters
      (generated or minified);
    - ``duplicate``: its bytes have the same SHA-256 as a file kept earlier, so of identical files
      the one first in sorted order is kept.

    Args:
      roots: directories to scan (str or path-like), or None for :func:`site_packages_roots`.
      suffixes: the name of a suffix set of :data:`SITE_SUFFIX_SETS`: 'python' (source, stubs and
        docs) or 'code' (also C/C++/CUDA, Cython, Fortran, shell, CMake ... sources).
      extra_roots: directories (str or path-like) scanned in addition to ``roots`` (or to the
        site-packages directories), e.g. ``/usr/include``. All roots together are resolved,
        deduplicated and sorted, so the result does not depend on their order; a root inside
        another is walked once, as itself (its files are named relative to it).
    Returns:
      ``(root, files, stats)``: a :class:`SearchPath` of the roots; the kept relative POSIX paths,
      sorted; and a JSON-ready dict with ``roots`` (list of str), ``files_seen``, ``files_kept``,
      ``bytes_seen``, ``bytes_kept``, ``duplicates`` (int), and ``dropped`` / ``dropped_bytes``
      (rule -> int, every rule of :data:`SITE_DROP_RULES` present).
    Raises:
      DataError: an unknown suffix set, a given root or extra root that is not a directory, or no
        root at all.
    """
    names = site_suffixes(suffixes)
    if roots is None:
        dirs = site_packages_roots()
        if not dirs:
            raise DataError("no site-packages directory found for this Python (site.getsitepackages(), "
                            "sysconfig purelib/platlib)")
    else:
        roots = _as_dir_list(roots)
        if not roots:
            raise DataError("data.source='site_packages' was given an empty list of directories")
        for r in roots:
            if not Path(r).expanduser().is_dir():
                raise DataError(f"site-packages directory {str(r)!r} does not exist or is not a directory "
                                "(data.source='site_packages')")
        dirs = [Path(r).expanduser().resolve() for r in roots]
    extra = [r for r in _as_dir_list(extra_roots) if str(r)]  # '' is the unset config value, not '.'
    for r in extra:
        if not Path(r).expanduser().is_dir():
            raise DataError(f"extra root {str(r)!r} does not exist or is not a directory (data.extra_roots, "
                            "data.source='site_packages')")
    dirs = sorted({*dirs, *(Path(r).expanduser().resolve() for r in extra)})
    dropped = dict.fromkeys(SITE_DROP_RULES, 0)
    dropped_bytes = dict.fromkeys(SITE_DROP_RULES, 0)
    kept, seen_hashes, bytes_seen, bytes_kept, previous = [], set(), 0, 0, None
    candidates = _site_candidates(dirs, names)
    for rel, ri in candidates:
        if rel == previous:
            rule, size = "shadowed", _file_size(dirs[ri] / rel) or 0
        else:
            rule, size = _site_drop_rule(dirs[ri] / rel, rel, seen_hashes)
        previous = rel
        bytes_seen += size
        if rule is None:
            kept.append(rel)
            bytes_kept += size
        else:
            dropped[rule] += 1
            dropped_bytes[rule] += size
    stats = {
        "roots": [str(d) for d in dirs], "files_seen": len(candidates), "files_kept": len(kept),
        "bytes_seen": bytes_seen, "bytes_kept": bytes_kept, "duplicates": dropped["duplicate"],
        "dropped": dropped, "dropped_bytes": dropped_bytes,
    }
    return SearchPath(dirs), kept, stats


def list_site_packages_files(roots=None, suffixes: str = "python", extra_roots=()) -> tuple[SearchPath, list[str]]:
    """The site-packages corpus: ``(root, files)`` of :func:`scan_site_packages`, without the stats.

    Reads every candidate file once (drop rules, content hashes); the list depends on what is
    installed, so it differs between machines, but a file keeps its name, and so its split, on all.

    Args:
      roots, suffixes, extra_roots: as for :func:`scan_site_packages`.
    Returns:
      ``(root, files)``: a :class:`SearchPath` of the roots and the kept relative POSIX paths, sorted.
    """
    root, files, _ = scan_site_packages(roots, suffixes, extra_roots)
    return root, files


@dataclasses.dataclass
class TextCorpus:
    """An ordered list of text documents with a stable train/validation assignment.

    Attributes:
      source: one of :data:`TEXT_SOURCES`.
      root: the directory (or single file, or :class:`SearchPath` of directories) the relative paths
        in ``files`` refer to.
      files: sorted relative POSIX paths of the source files.
      doc_file: int32 [D], index into ``files`` of each document.
      doc_line: int64 [D], 1-based line number of each JSONL document (0 for whole-file documents).
      is_val: bool [D], True for validation documents.
      text_field: the JSON key that holds the text (JSONL only).
    """

    source: str
    root: Path | SearchPath
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


def list_text_files(source: str, path: str = "", *, suffixes: str = "python",
                    extra_roots: str = "") -> tuple[Path | SearchPath, list[str]]:
    """The resolved root and sorted relative POSIX paths of a text source's files.

    Only 'site_packages' reads the files (its drop rules); the other sources only walk directories.

    Args:
      source: one of :data:`TEXT_SOURCES`; see :func:`load_text_corpus`. 'stdlib' ignores ``path``;
        'site_packages' reads it as an ``os.pathsep``-separated list of directories to scan instead
        of the running Python's site-packages ('' for those).
      suffixes: 'site_packages' only (``data.suffixes``): the name of the suffix set of
        :data:`SITE_SUFFIX_SETS` to read.
      extra_roots: 'site_packages' only (``data.extra_roots``): ``os.pathsep``-separated directories
        scanned in addition to the site-packages directories (or to ``path``); '' for none.
    Returns:
      ``(root, files)``: the file, directory or :class:`SearchPath` the names are relative to, and
      the sorted relative POSIX paths.
    Raises:
      DataError: unknown source or suffix set, missing path or extra root, empty single file, no
        matching files, or ``suffixes``/``extra_roots`` given with a source other than 'site_packages'.
    """
    if source != "site_packages" and (suffixes != "python" or extra_roots):
        raise DataError(f"data.suffixes={suffixes!r} and data.extra_roots={extra_roots!r} only apply to "
                        f"data.source='site_packages', not {source!r}")
    if source == "stdlib":
        root = stdlib_root()
        files = list_stdlib_files(root)
        if not files:
            raise DataError(f"no Python source files found in the standard library at {root}")
        return root, files
    if source == "site_packages":
        dirs = [p for p in str(path).split(os.pathsep) if p] if str(path) else None
        extra = [p for p in str(extra_roots).split(os.pathsep) if p]
        root, files = list_site_packages_files(dirs, suffixes, extra)
        if not files:
            raise DataError(f"no text files left in the site-packages directories {str(root)!r} after the "
                            "drop rules (k3.data.corpus.scan_site_packages)")
        return root, files
    if source not in ("text_dir", "jsonl"):
        raise DataError(f"not a text source: data.source={source!r}; text sources are "
                        f"{', '.join(map(repr, TEXT_SOURCES))} ('tokens' is read by load_token_corpus)")
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
    return _decode_text(path.read_bytes()) is not None


def _decode_text(data: bytes) -> str | None:
    """``data`` decoded as UTF-8, or None when it has a NUL byte or is not valid UTF-8."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def load_text_corpus(source: str, path: str = "", *, text_field: str = "text", val_fraction: float = 0.02,
                     max_docs: int = 0, listing: tuple[Path | SearchPath, list[str]] | None = None,
                     suffixes: str = "python", extra_roots: str = "") -> TextCorpus:
    """Lists the documents of a text source and assigns each to train or validation.

    Args:
      source: 'stdlib' (``path`` ignored; the running Python's standard library), 'site_packages'
        (the source and docs of every installed distribution after the drop rules of
        :func:`scan_site_packages`, with ``suffixes`` naming which files are read; ``path``
        optionally lists the directories, ``os.pathsep``-separated, and ``extra_roots`` adds more;
        each file is one document), 'text_dir' (a directory searched recursively for
        ``TEXT_SUFFIXES`` files, or a single text file; each file is one document) or 'jsonl' (a
        ``.jsonl`` file or a directory of them; each non-blank line is a JSON object and one
        document, its text under ``text_field``).
      val_fraction: expected fraction of documents held out (by a SHA-1 hash of the name).
      max_docs: when > 0, only the first ``max_docs`` documents (in sorted order) are used, before
        splitting.
      listing: the result of :func:`list_text_files` when the caller already has it.
      suffixes, extra_roots: 'site_packages' only (``data.suffixes``, ``data.extra_roots``): the
        suffix set and the ``os.pathsep``-separated extra directories; see :func:`list_text_files`.
    Returns:
      A :class:`TextCorpus`. Empty files and blank JSONL lines are skipped, not counted; 'text_dir'
      files that are not UTF-8 text (`_is_text`) are skipped and counted in a warning on stderr.
    Raises:
      DataError: missing path, no documents, or (JSONL) a line that is not a JSON object.
    """
    root, files = listing if listing is not None else list_text_files(source, path, suffixes=suffixes,
                                                                      extra_roots=extra_roots)
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
