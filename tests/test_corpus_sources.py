"""Tests of the 'site_packages' corpus: drop rules, content deduplication, determinism, split, errors,
suffix sets and extra roots.

All but the slow test scan synthetic site-packages trees built under ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from experiments.corpus_stats import OTHER_SOURCE_SUFFIXES, corpus_stats, other_source_bytes
from k3.config import ConfigError, default_config, validate
from k3.data import DataError, prepare_data
from k3.data import corpus as corpus_lib
from k3.data.corpus import (
    SITE_DROP_RULES,
    SITE_MAX_FILE_BYTES,
    SITE_MAX_LINE_CHARS,
    SITE_PACKAGES_SUFFIXES,
    SITE_SUFFIX_SETS,
    SearchPath,
    list_site_packages_files,
    list_text_files,
    load_text_corpus,
    scan_site_packages,
    site_packages_roots,
    site_suffixes,
)

# Kept by every rule: short lines, printable UTF-8, small, unique content.
KEPT = {
    "pkg/__init__.py": "from pkg.core import run\n",
    "pkg/core.py": "def run():\n    return 'ok'\n" * 20,
    "pkg/core.pyi": "def run() -> str: ...\n",
    "pkg/README.md": "# pkg\n\nA package. Ünïcode is fine.\n",
    "pkg/docs/guide.rst": "Guide\n=====\n\nUse it.\n\f\nPage two.\n",
    "pkg/tests/data/notes.txt": "test data that reads as text is kept\n",
    "other/mod.py": "x = 1\n" + "y" * SITE_MAX_LINE_CHARS + "\n",  # a line at the limit
    "other/licensing_helper.py": "# a module whose name only contains 'licens'\n",
}

# relative path -> (content, the rule that drops it)
DROPPED = {
    "pkg-1.0.dist-info/RECORD.txt": ("pkg/__init__.py,sha256=x,10\n", "metadata"),
    "pkg-1.0.dist-info/licenses/NOTES.md": ("metadata, not code\n", "metadata"),
    "old.egg-info/SOURCES.txt": ("pkg/core.py\n", "metadata"),
    "pkg/LICENSE.txt": ("MIT License\n", "legal"),
    "pkg/licence.md": ("Licence text\n", "legal"),
    "pkg/COPYING.rst": ("GPL\n", "legal"),
    "pkg/Notice.txt": ("Notice text\n", "legal"),
    "pkg/authors.md": ("A. Author\n", "legal"),
    "pkg/empty.py": ("", "empty"),
    "pkg/minified.py": ("x = '" + "a" * SITE_MAX_LINE_CHARS + "'\n", "long_line"),
    "pkg/nul.txt": (b"text\x00with a NUL byte\n", "binary"),
    "pkg/latin1.txt": (b"caf\xe9 is not UTF-8\n", "binary"),
    "pkg/control.txt": (b"\x1b" * 2 + b"a" * 98, "binary"),  # 2% control bytes
    "pkg/huge.txt": (("z" * 99 + "\n") * (SITE_MAX_FILE_BYTES // 100 + 1), "too_large"),
    "pkg/zz_copy.py": ("def run():\n    return 'ok'\n" * 20, "duplicate"),  # same bytes as pkg/core.py
}

# Never seen: wrong suffix, hidden, compiled.
UNSEEN = {
    "pkg/core.cpython-311.so": b"\x7fELF\x00",
    "pkg/data.json": b"{}",
    "pkg/.hidden.py": b"x = 1\n",
    ".cache/mod.py": b"x = 1\n",
    "pkg/__pycache__/core.py": b"x = 1\n",
}


def _write(root, files, order=None):
    for rel in order or files:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        data = files[rel]
        if isinstance(data, tuple):
            data = data[0]
        p.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))


def make_site(root, order=None):
    """A fake site-packages tree under ``root`` with every file of KEPT, DROPPED and UNSEEN."""
    files = {**KEPT, **DROPPED, **UNSEEN}
    _write(root, files, order)
    return root


@pytest.fixture
def site(tmp_path):
    return make_site(tmp_path / "site-packages")


def test_keeps_text_and_drops_by_rule(site):
    root, files, stats = scan_site_packages([site])
    assert isinstance(root, SearchPath) and list(root) == [site.resolve()]
    assert files == sorted(KEPT)
    expected = dict.fromkeys(SITE_DROP_RULES, 0)
    for _, rule in DROPPED.values():
        expected[rule] += 1
    assert stats["dropped"] == expected
    assert stats["files_seen"] == len(KEPT) + len(DROPPED)
    assert stats["files_kept"] == len(files)
    assert stats["duplicates"] == 1
    kept_bytes = sum(len(t.encode("utf-8")) for t in KEPT.values())
    assert stats["bytes_kept"] == kept_bytes
    assert stats["bytes_seen"] == kept_bytes + sum(stats["dropped_bytes"].values())
    assert stats["dropped_bytes"]["too_large"] == len(DROPPED["pkg/huge.txt"][0])
    json.dumps(stats)  # JSON-ready


def test_size_limit_is_inclusive(tmp_path):
    body = ("z" * 99 + "\n") * (SITE_MAX_FILE_BYTES // 100)
    body += "z" * (SITE_MAX_FILE_BYTES - len(body))
    _write(tmp_path, {"at_limit.txt": body, "over.txt": body + "z"})
    _, files, stats = scan_site_packages(tmp_path)
    assert files == ["at_limit.txt"] and stats["dropped"]["too_large"] == 1


def test_control_bytes_up_to_one_percent_are_kept(tmp_path):
    _write(tmp_path, {"ansi.txt": b"\x1b" + b"a" * 99, "tabs.py": b"\tx = 1\r\n\f\n"})
    assert list_site_packages_files(tmp_path)[1] == ["ansi.txt", "tabs.py"]


def test_duplicates_keep_the_sorted_first_path(tmp_path):
    same = "def f():\n    return 42\n"
    files = {"b/mod.py": same, "a/z.py": same, "a/y.txt": same, "c.py": "other\n"}
    _write(tmp_path, files, order=["b/mod.py", "a/z.py", "c.py", "a/y.txt"])
    _, files, stats = scan_site_packages(tmp_path)
    assert files == ["a/y.txt", "c.py"]
    assert stats["duplicates"] == stats["dropped"]["duplicate"] == 2


def test_listing_is_deterministic_and_independent_of_creation_order(tmp_path):
    a = make_site(tmp_path / "a")
    order = sorted({**KEPT, **DROPPED, **UNSEEN}, reverse=True)
    b = make_site(tmp_path / "b", order=order)
    first = scan_site_packages(a)
    assert scan_site_packages(a)[1:] == first[1:]
    assert scan_site_packages(b)[1] == first[1]
    assert {k: v for k, v in scan_site_packages(b)[2].items() if k != "roots"} == \
        {k: v for k, v in first[2].items() if k != "roots"}


def test_several_roots_sorted_deduplicated_and_shadowed(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _write(one, {"pkg/mod.py": "from one\n", "only_one.py": "1\n"})
    _write(two, {"pkg/mod.py": "from two\n", "only_two.py": "2\n", "z_dup.py": "1\n"})
    root, files, stats = scan_site_packages([two, one, str(one)])
    assert list(root) == [one.resolve(), two.resolve()]
    assert root == scan_site_packages([one, two])[0]
    assert files == ["only_one.py", "only_two.py", "pkg/mod.py"]
    assert stats["dropped"]["shadowed"] == 1 and stats["dropped"]["duplicate"] == 1
    # Reading resolves a name against the roots in order, as the listing chose it.
    c = load_text_corpus("site_packages", listing=(root, files), val_fraction=0.0)
    assert list(c.iter_texts()) == ["1\n", "2\n", "from one\n"]
    assert str(root) == os.pathsep.join([str(one.resolve()), str(two.resolve())])
    # The same directories through data.path.
    assert list_text_files("site_packages", str(root)) == (root, files)


def test_split_is_stable_disjoint_and_machine_independent(site, tmp_path):
    c = load_text_corpus("site_packages", str(site), val_fraction=0.3)
    train, val = c.doc_names("train"), c.doc_names("val")
    assert train and val and not set(train) & set(val)
    assert sorted(train + val) == sorted(KEPT)
    again = load_text_corpus("site_packages", str(site), val_fraction=0.3)
    np.testing.assert_array_equal(again.is_val, c.is_val)
    # Names are relative to the site-packages directory, so the split is the same wherever it is.
    moved = tmp_path / "elsewhere" / "lib" / "site-packages"
    shutil.copytree(site, moved)
    assert load_text_corpus("site_packages", str(moved), val_fraction=0.3).doc_names("val") == val


def test_errors_name_the_problem(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="nope.*does not exist"):
        scan_site_packages([missing])
    with pytest.raises(DataError, match="nope"):
        load_text_corpus("site_packages", str(missing))
    with pytest.raises(DataError, match="empty list"):
        scan_site_packages([])
    _write(tmp_path / "bare", {"LICENSE.txt": "MIT\n", "empty.py": ""})
    with pytest.raises(DataError, match="no text files left"):
        list_text_files("site_packages", str(tmp_path / "bare"))
    with pytest.raises(DataError, match="not a text source.*'site_packages'"):
        list_text_files("site-packages")
    with pytest.raises(DataError, match="not a text source"):
        load_text_corpus("bogus")


def test_config_accepts_site_packages_and_keeps_stdlib_default():
    cfg = default_config()
    assert cfg.data.source == "stdlib"
    cfg.data.source = "site_packages"
    validate(cfg)
    cfg.data.source = "sitepackages"
    with pytest.raises(ConfigError, match="data.source"):
        validate(cfg)


def _byte_site_cfg(path, val_fraction):
    """A config reading the site-packages corpus at ``path`` with byte tokens, 16-token rows of 2."""
    cfg = default_config()
    cfg.model.vocab_size = 260
    d = cfg.data
    d.source, d.path, d.tokenizer, d.val_fraction, d.seq_len, d.batch_size = \
        "site_packages", str(path), "byte", val_fraction, 16, 2
    return cfg


def test_prepare_data_builds_and_reuses_the_cache(site, tmp_path):
    cfg = _byte_site_cfg(site, 0.3)
    wd = tmp_path / "wd"
    first = prepare_data(cfg, wd)
    assert not first.meta["cache_hit"]
    assert first.meta["fingerprint"]["root"] == str(site.resolve())
    n_bytes = sum(len(t.encode("utf-8")) for t in KEPT.values())
    assert first.train.num_tokens + first.val.num_tokens == n_bytes + len(KEPT)  # bytes + one EOS each
    assert prepare_data(cfg, wd).meta["cache_hit"]


def test_corpus_stats_cli_numbers(site):
    out = corpus_stats("site_packages", str(site), val_fraction=0.3)
    assert out["files_kept"] == len(KEPT) == out["train_files"] + out["val_files"]
    assert out["bytes_kept"] == out["train_bytes"] + out["val_bytes"]
    assert out["val_files"] == len(load_text_corpus("site_packages", str(site), val_fraction=0.3).doc_names("val"))
    assert out["dropped"]["legal"] == 5
    assert "other_source_bytes" in out and all(suf in OTHER_SOURCE_SUFFIXES for suf in out["other_source_bytes"])


def test_corpus_stats_sizes_other_source_files(tmp_path):
    root = tmp_path / "site-packages"
    kernel = "__global__ void k() {}\n"
    _write(root, {"pkg/__init__.py": "x = 1\n", "pkg/include/a.h": "int a;\n", "pkg/include/b.h": "int bb;\n",
                  "pkg/k.cu": kernel, "pkg/.hidden/c.h": "int c;\n", "pkg/data.bin": "zz"})
    found = other_source_bytes([str(root)])
    assert found == {".cu": [1, len(kernel)], ".h": [2, len("int a;\n") + len("int bb;\n")]}
    assert list(found) == [".cu", ".h"]  # largest first


def _fresh(kind: str) -> str:
    """Source text unique to this call, so no two files of a test are content duplicates by chance."""
    tag = os.urandom(8).hex()
    if kind == "c":
        return f"/* {tag} */\nstatic int f_{tag}(int x) {{\n    return x + 1;\n}}\n"
    return f"# {tag}\ndef f_{tag}(x):\n    return x + 1\n"


# One file per family of the 'code' set that 'python' does not read, and files neither set reads.
CODE_ONLY = ("pkg/include/pkg/api.h", "pkg/csrc/kernel.cu", "pkg/csrc/ops.cpp", "pkg/csrc/ops.cuh",
             "pkg/_fast.pyx", "pkg/solver.F90", "pkg/build.sh", "pkg/cmake/pkgConfig.cmake")
NEITHER = ("pkg/data.json", "pkg/conf.yaml", "pkg/table.csv", "pkg/include/UPPER.HPP")


@pytest.fixture
def code_site(tmp_path):
    root = tmp_path / "site-packages"
    _write(root, {rel: _fresh("c" if not rel.endswith(".py") else "py")
                  for rel in ("pkg/__init__.py", *CODE_ONLY, *NEITHER)})
    return root


def test_suffix_sets_table():
    assert SITE_SUFFIX_SETS["python"] == SITE_PACKAGES_SUFFIXES == site_suffixes("python")
    code = site_suffixes("code")
    assert set(SITE_PACKAGES_SUFFIXES) < set(code) and len(set(code)) == len(code)
    assert {".h", ".hpp", ".cu", ".cuh", ".cpp", ".c", ".pyx", ".pxd", ".f90", ".sh", ".cmake", ".td"} <= set(code)
    assert not {".json", ".yaml", ".yml", ".csv", ".toml"} & set(code)


def test_code_set_reads_sources_the_python_set_ignores(code_site):
    _, py_files, py_stats = scan_site_packages(code_site)
    assert py_files == ["pkg/__init__.py"] and py_stats["files_seen"] == 1
    _, code_files, code_stats = scan_site_packages(code_site, "code")
    assert code_files == sorted(["pkg/__init__.py", *CODE_ONLY])  # case-sensitive: UPPER.HPP is not read
    assert code_stats["files_seen"] == code_stats["files_kept"] == len(code_files)
    # The default stays 'python', through list_text_files and load_text_corpus as well.
    assert list_text_files("site_packages", str(code_site))[1] == py_files
    c = load_text_corpus("site_packages", str(code_site), suffixes="code", val_fraction=0.0)
    assert c.doc_names() == code_files
    assert next(iter(c.iter_texts())).startswith("# ")


def test_code_files_meet_the_drop_rules_and_dedup_across_extra_roots(tmp_path, monkeypatch):
    site, extra = tmp_path / "site-packages", tmp_path / "usr-include"
    header = _fresh("c")
    _write(site, {
        "pkg/include/common.h": header,  # same bytes as the extra root's common.h, sorted after it
        "pkg/include/shared.h": _fresh("c"),  # same path in the extra root: shadowed there
        "pkg/include/min.h": "int a[] = {" + "1," * SITE_MAX_LINE_CHARS + "};\n",
        "pkg/LICENSE.cuh": _fresh("c"),
        "pkg/empty.cc": "",
        "pkg/blob.c": b"\x00\x01binary\x02",
        "pkg/mod.py": _fresh("py"),
    })
    _write(extra, {"common.h": header, "pkg/include/shared.h": _fresh("c"), "zlib.h": _fresh("c")})
    # The site-packages directory of this Python, so extra_roots are added to the default roots.
    monkeypatch.setattr(corpus_lib, "site_packages_roots", lambda: [site.resolve()])
    root, files, stats = scan_site_packages(suffixes="code", extra_roots=[extra])
    assert list(root) == sorted([site.resolve(), extra.resolve()])
    assert files == ["common.h", "pkg/include/shared.h", "pkg/mod.py", "zlib.h"]
    expected = dict.fromkeys(SITE_DROP_RULES, 0)
    expected.update(duplicate=1, shadowed=1, long_line=1, legal=1, empty=1, binary=1)
    assert stats["dropped"] == expected
    first = sorted([site.resolve(), extra.resolve()])[0]
    c = load_text_corpus("site_packages", listing=(root, files), val_fraction=0.0)
    texts = dict(zip(c.doc_names(), c.iter_texts()))
    assert texts["common.h"] == header
    assert texts["pkg/include/shared.h"] == (first / "pkg/include/shared.h").read_text()
    # The same scan through the config-level string form.
    assert list_text_files("site_packages", suffixes="code", extra_roots=str(extra)) == (root, files)
    assert list_text_files("site_packages", suffixes="code", extra_roots=f"{extra}{os.pathsep}") == (root, files)


def test_code_scan_is_deterministic_and_splits_stay_put(tmp_path):
    site, extra = tmp_path / "site", tmp_path / "extra"
    _write(site, {f"pkg/src/f{i:02d}.{suf}": _fresh("c") for i in range(12) for suf in ("h", "cpp")})
    _write(extra, {f"lib/g{i:02d}.h": _fresh("c") for i in range(12)})
    first = scan_site_packages(site, "code", [extra])
    assert scan_site_packages(site, "code", [extra]) == first
    assert scan_site_packages([site], "code", [str(extra), extra]) == first
    before = load_text_corpus("site_packages", listing=first[:2], val_fraction=0.4)
    # More files, in a new root and beside the old ones: every earlier file keeps its split.
    _write(tmp_path / "more", {f"more/h{i:02d}.cuh": _fresh("c") for i in range(12)})
    _write(site, {f"pkg/src/a{i:02d}.cc": _fresh("c") for i in range(6)})
    after_scan = scan_site_packages(site, "code", [extra, tmp_path / "more"])
    after = load_text_corpus("site_packages", listing=after_scan[:2], val_fraction=0.4)
    split_after = dict(zip(after.doc_names(), after.is_val))
    assert before.is_val.any() and not before.is_val.all()
    assert {n: split_after[n] for n in before.doc_names()} == dict(zip(before.doc_names(), before.is_val))


def test_suffix_set_and_extra_root_errors(tmp_path, code_site):
    with pytest.raises(DataError, match=r"data.suffixes='cpp'.*'python', 'code'"):
        scan_site_packages(code_site, "cpp")
    with pytest.raises(DataError, match="data.suffixes='Code'"):
        list_text_files("site_packages", str(code_site), suffixes="Code")
    missing = tmp_path / "no-such-include"
    with pytest.raises(DataError, match="no-such-include.*data.extra_roots"):
        scan_site_packages(code_site, "code", [missing])
    with pytest.raises(DataError, match="no-such-include"):
        list_text_files("site_packages", str(code_site), extra_roots=f"{code_site}{os.pathsep}{missing}")
    with pytest.raises(DataError, match="data.extra_roots.*'site_packages', not 'text_dir'"):
        list_text_files("text_dir", str(code_site), extra_roots=str(code_site))
    with pytest.raises(DataError, match="data.suffixes='code'.*not 'stdlib'"):
        load_text_corpus("stdlib", suffixes="code")


def test_config_validates_suffixes_and_extra_roots():
    cfg = default_config()
    assert cfg.data.suffixes == "python" and cfg.data.extra_roots == ""
    cfg.data.source, cfg.data.suffixes, cfg.data.extra_roots = "site_packages", "code", "/usr/include"
    validate(cfg)
    cfg.data.suffixes = "cpp"
    with pytest.raises(ConfigError, match=r"data.suffixes must be one of \('python', 'code'\)"):
        validate(cfg)
    cfg.data.suffixes = "code"
    cfg.data.source = "text_dir"
    with pytest.raises(ConfigError, match="data.suffixes='code'.*data.source='text_dir'"):
        validate(cfg)
    cfg.data.suffixes = "python"
    with pytest.raises(ConfigError, match="data.extra_roots='/usr/include'.*data.source='text_dir'"):
        validate(cfg)


def test_prepare_data_rebuilds_the_cache_when_suffixes_or_extra_roots_change(code_site, tmp_path):
    cfg = _byte_site_cfg(code_site, 0.0)
    d = cfg.data
    wd = tmp_path / "wd"

    def tokens(prep):
        return prep.train.num_tokens + prep.val.num_tokens

    py = prepare_data(cfg, wd)
    # A default fingerprint has neither key, so caches written before the knobs existed still match.
    assert not py.meta["cache_hit"] and not {"suffixes", "extra_roots"} & set(py.meta["fingerprint"])
    assert tokens(py) == len((code_site / "pkg/__init__.py").read_bytes()) + 1
    d.suffixes = "code"
    code = prepare_data(cfg, wd)
    assert not code.meta["cache_hit"] and code.meta["fingerprint"]["suffixes"] == "code"
    assert tokens(code) == sum(len((code_site / r).read_bytes()) + 1 for r in ("pkg/__init__.py", *CODE_ONLY))
    assert prepare_data(cfg, wd).meta["cache_hit"]
    extra = tmp_path / "extra"
    _write(extra, {"x.h": _fresh("c")})
    d.extra_roots = str(extra)
    assert not prepare_data(cfg, wd).meta["cache_hit"]
    assert prepare_data(cfg, wd).meta["cache_hit"]
    d.suffixes, d.extra_roots = "python", ""
    back = prepare_data(cfg, wd)
    assert not back.meta["cache_hit"] and tokens(back) == tokens(py)


def test_corpus_stats_by_suffix_with_code_set(code_site, tmp_path):
    extra = tmp_path / "extra"
    _write(extra, {"big.h": _fresh("c") * 10})
    out = corpus_stats("site_packages", str(code_site), 0.0, "code", str(extra))
    assert out["suffixes"] == "code" and len(out["roots"]) == 2
    by = out["kept_by_suffix"]
    assert sum(n for n, _ in by.values()) == out["files_kept"] == len(CODE_ONLY) + 2
    assert sum(b for _, b in by.values()) == out["bytes_kept"]
    assert list(by)[0] == ".h" and by[".h"][0] == 2
    assert [b for _, b in by.values()] == sorted((b for _, b in by.values()), reverse=True)
    # Sized only where the chosen set does not read: the data files, not the sources it kept.
    assert set(out["other_source_bytes"]) == {".json", ".yaml"}
    assert ".h" in corpus_stats("site_packages", str(code_site), 0.0)["other_source_bytes"]


def test_site_packages_roots_of_this_python():
    roots = site_packages_roots()
    assert roots == sorted(set(roots)) and all(r.is_dir() and r.is_absolute() for r in roots)
    assert any((r / "numpy" / "__init__.py").exists() for r in roots)


@pytest.mark.slow
def test_real_site_packages_scan():
    _, files, stats = scan_site_packages()
    assert files == sorted(files) and len(files) == stats["files_kept"] > 100
    assert "numpy/__init__.py" in files
    assert not any(".dist-info/" in f for f in files)


def test_corpus_stats_cli_bad_root_exits_2(tmp_path, capsys):
    from experiments.corpus_stats import main

    missing = tmp_path / "no_such_dir"
    assert main([f"--path={tmp_path}", f"--extra_roots={missing}"]) == 2
    err = capsys.readouterr().err
    assert "extra root" in err and str(missing) in err
    assert not missing.exists()
