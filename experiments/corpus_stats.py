"""Size of an embedded text corpus on this machine, as JSON.

    python -m experiments.corpus_stats [--source=site_packages] [--path=DIR[:DIR...]] [--val_fraction=0.02]

For 'site_packages' (the default here): the directories scanned, files seen and kept, bytes seen and
kept, files and bytes dropped per rule (`k3.data.corpus.scan_site_packages`) and duplicates, and
``other_source_bytes``: files and bytes per suffix of the source and config text the corpus does not
read (C/C++/CUDA sources and headers, Cython, JSON/YAML/TOML, shell), before any drop rule, which
sizes what a wider suffix list could add; for
'stdlib': files and bytes. Both add the train/validation split (files and bytes) that training with
``data.val_fraction`` would use. The site-packages corpus depends on what is installed, so its
numbers are per machine and environment.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from k3.config import default_config
from k3.data import corpus as corpus_lib


# Source and config text outside `k3.data.corpus.SITE_PACKAGES_SUFFIXES` (sized, not read).
OTHER_SOURCE_SUFFIXES = (".h", ".hpp", ".hh", ".cuh", ".c", ".cc", ".cpp", ".cu", ".pyx", ".pxd", ".json",
                         ".yaml", ".yml", ".toml", ".cfg", ".sh")


def other_source_bytes(roots) -> dict:
    """{suffix: [files, bytes]} of the `OTHER_SOURCE_SUFFIXES` files under ``roots`` (sorted by bytes)."""
    found = {suf: [0, 0] for suf in OTHER_SOURCE_SUFFIXES}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                suf = os.path.splitext(name)[1].lower()
                if suf in found and not name.startswith("."):
                    try:
                        size = os.path.getsize(os.path.join(dirpath, name))
                    except OSError:
                        continue
                    found[suf][0] += 1
                    found[suf][1] += size
    return dict(sorted(((k, v) for k, v in found.items() if v[0]), key=lambda kv: -kv[1][1]))


def corpus_stats(source: str = "site_packages", path: str = "", val_fraction: float | None = None) -> dict:
    """Stats of a text source (JSON-ready dict).

    Args:
      source: 'site_packages' or 'stdlib'.
      path: for 'site_packages', ``os.pathsep``-separated directories to scan instead of this
        Python's site-packages ('' for those).
      val_fraction: held-out fraction, None for the default ``data.val_fraction``.
    Returns:
      ``{"source", "val_fraction", "seconds", "roots", "files_kept", "bytes_kept", "train_files",
      "train_bytes", "val_files", "val_bytes"}`` (ints, except the root list and floats), plus for
      'site_packages' the rest of :func:`~k3.data.corpus.scan_site_packages`'s stats.
    """
    if val_fraction is None:
        val_fraction = float(default_config().data.val_fraction)
    t0 = time.perf_counter()
    if source == "site_packages":
        dirs = [p for p in path.split(os.pathsep) if p] or None
        root, files, stats = corpus_lib.scan_site_packages(dirs)
    elif source == "stdlib":
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
        out["other_source_bytes"] = other_source_bytes(stats["roots"])
    return out


def main(argv=None):
    """Command line: prints :func:`corpus_stats` as indented JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="site_packages", choices=("site_packages", "stdlib"))
    p.add_argument("--path", default="")
    p.add_argument("--val_fraction", type=float, default=None)
    a = p.parse_args(argv)
    print(json.dumps(corpus_stats(a.source, a.path, a.val_fraction), indent=2))


if __name__ == "__main__":
    main()
