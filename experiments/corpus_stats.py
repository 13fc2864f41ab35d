"""Size of an embedded text corpus on this machine, as JSON.

    python -m experiments.corpus_stats [--source=site_packages] [--path=DIR[:DIR...]]
        [--suffixes=python|code] [--extra_roots=DIR[:DIR...]] [--val_fraction=0.02]

For 'site_packages' (the default here): the directories scanned, the suffix set read
(``data.suffixes``), files seen and kept, bytes seen and kept, files and bytes dropped per rule
(`k3.data.corpus.scan_site_packages`) and duplicates, ``kept_by_suffix``: files and bytes kept per
suffix, and ``other_source_bytes``: files and bytes per suffix of the source and config text the
chosen set does not read (C/C++/CUDA sources and headers, Cython, JSON/YAML/TOML, shell ... less
those in the set), before any drop rule, which sizes what a wider suffix set could add; for
'stdlib': files and bytes. Both add the train/validation split (files and bytes) that training with
``data.val_fraction`` would use. The site-packages corpus depends on what is installed, so its
numbers are per machine and environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from k3.config import default_config
from k3.data import corpus as corpus_lib


# Source and config text that a suffix set may leave out (sized, not read): the suffixes of every
# set of `k3.data.corpus.SITE_SUFFIX_SETS`, then data and configuration formats no set reads.
OTHER_SOURCE_SUFFIXES = tuple(dict.fromkeys(
    [s for names in corpus_lib.SITE_SUFFIX_SETS.values() for s in names]
    + [".json", ".yaml", ".yml", ".toml", ".cfg"]))


def other_source_bytes(roots, exclude=corpus_lib.SITE_PACKAGES_SUFFIXES) -> dict:
    """Files and bytes of the source text under ``roots`` that a suffix set does not read.

    Args:
      roots: directories (str or path-like) walked; hidden files and directories are skipped.
      exclude: the suffixes the corpus reads (its set of `k3.data.corpus.SITE_SUFFIX_SETS`).
    Returns:
      ``{suffix: [files, bytes]}`` of the `OTHER_SOURCE_SUFFIXES` files not in ``exclude``, before
      any drop rule, largest first; suffixes match case-sensitively, as the corpus does.
    """
    found = {suf: [0, 0] for suf in OTHER_SOURCE_SUFFIXES if suf not in exclude}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                suf = os.path.splitext(name)[1]
                if suf in found and not name.startswith("."):
                    try:
                        size = os.path.getsize(os.path.join(dirpath, name))
                    except OSError:
                        continue
                    found[suf][0] += 1
                    found[suf][1] += size
    return dict(sorted(((k, v) for k, v in found.items() if v[0]), key=lambda kv: -kv[1][1]))


def kept_by_suffix(files: list[str], sizes) -> dict:
    """``{suffix: [files, bytes]}`` of kept files (relative paths ``files``, byte sizes ``sizes``),
    largest first; the suffix is the name's last extension, as the suffix sets list them."""
    found = {}
    for rel, size in zip(files, sizes):
        entry = found.setdefault(os.path.splitext(rel)[1], [0, 0])
        entry[0] += 1
        entry[1] += int(size)
    return dict(sorted(found.items(), key=lambda kv: (-kv[1][1], kv[0])))


def corpus_stats(source: str = "site_packages", path: str = "", val_fraction: float | None = None,
                 suffixes: str = "python", extra_roots: str = "") -> dict:
    """Stats of a text source (JSON-ready dict).

    Args:
      source: 'site_packages' or 'stdlib'.
      path: for 'site_packages', ``os.pathsep``-separated directories to scan instead of this
        Python's site-packages ('' for those).
      val_fraction: held-out fraction, None for the default ``data.val_fraction``.
      suffixes: for 'site_packages', the suffix set (``data.suffixes``: 'python' or 'code').
      extra_roots: for 'site_packages', ``os.pathsep``-separated directories scanned as well
        (``data.extra_roots``).
    Returns:
      ``{"source", "val_fraction", "seconds", "roots", "files_kept", "bytes_kept", "train_files",
      "train_bytes", "val_files", "val_bytes"}`` (ints, except the root list and floats), plus for
      'site_packages' ``suffixes``, ``kept_by_suffix`` and ``other_source_bytes`` (suffix ->
      [files, bytes], largest first) and the rest of
      :func:`~k3.data.corpus.scan_site_packages`'s stats.
    """
    if val_fraction is None:
        val_fraction = float(default_config().data.val_fraction)
    t0 = time.perf_counter()
    if source == "site_packages":
        dirs = [p for p in path.split(os.pathsep) if p] or None
        extra = [p for p in extra_roots.split(os.pathsep) if p]
        root, files, stats = corpus_lib.scan_site_packages(dirs, suffixes, extra)
        stats = {"suffixes": suffixes, **stats}
    elif source == "stdlib":
        if suffixes != "python" or extra_roots:
            raise corpus_lib.DataError("--suffixes and --extra_roots only apply to --source=site_packages")
        root, files = corpus_lib.stdlib_root(), corpus_lib.list_stdlib_files()
        stats = {"roots": [str(root)], "files_kept": len(files)}
    else:
        raise corpus_lib.DataError(f"corpus_stats covers the embedded sources 'site_packages' and 'stdlib', "
                                   f"not {source!r}")
    seconds = time.perf_counter() - t0
    corpus = corpus_lib.load_text_corpus(source, val_fraction=val_fraction, listing=(root, files))
    sizes = np.array([(root / files[i]).stat().st_size for i in corpus.doc_file], np.int64)
    is_val = corpus.is_val
    out = {"source": source, "val_fraction": val_fraction, "seconds": round(seconds, 2), **stats}
    out.update(
        bytes_kept=int(sizes.sum()),
        train_files=int((~is_val).sum()), train_bytes=int(sizes[~is_val].sum()),
        val_files=int(is_val.sum()), val_bytes=int(sizes[is_val].sum()),
    )
    if source == "site_packages":
        out["kept_by_suffix"] = kept_by_suffix([files[i] for i in corpus.doc_file], sizes)
        out["other_source_bytes"] = other_source_bytes(stats["roots"], corpus_lib.site_suffixes(suffixes))
    return out


def main(argv=None):
    """Command line: prints :func:`corpus_stats` as indented JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="site_packages", choices=("site_packages", "stdlib"))
    p.add_argument("--path", default="")
    p.add_argument("--suffixes", default="python", choices=tuple(corpus_lib.SITE_SUFFIX_SETS))
    p.add_argument("--extra_roots", default="")
    p.add_argument("--val_fraction", type=float, default=None)
    a = p.parse_args(argv)
    try:
        stats = corpus_stats(a.source, a.path, a.val_fraction, a.suffixes, a.extra_roots)
    except corpus_lib.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
