"""Data faults: failed builds leave nothing behind, binary files are skipped and counted."""

from __future__ import annotations

import json

import pytest

from k3.config import default_config
from k3.data import DataError, prepare_data
from k3.data.corpus import load_text_corpus


def _cfg(source, path, tokenizer="byte", vocab=512):
    cfg = default_config()
    cfg.model.vocab_size = vocab
    d = cfg.data
    d.source, d.path, d.tokenizer = source, str(path), tokenizer
    d.seq_len, d.batch_size, d.max_docs, d.val_fraction = 16, 2, 0, 0.2
    return cfg


def _text_dir(root, n=6):
    root.mkdir()
    for i in range(n):
        (root / f"doc{i}.txt").write_text(f"document number {i}\n" * 20)
    return root


def test_missing_path_leaves_no_workdir_or_cache(tmp_path):
    workdir = tmp_path / "run"
    with pytest.raises(DataError, match="nope"):
        prepare_data(_cfg("text_dir", tmp_path / "nope"), workdir)
    assert not workdir.exists()
    # In an existing workdir, its files stay and only the cache this attempt made goes.
    workdir.mkdir()
    (workdir / "keep.txt").write_text("mine")
    with pytest.raises(DataError):
        prepare_data(_cfg("text_dir", tmp_path / "nope"), workdir)
    assert sorted(p.name for p in workdir.iterdir()) == ["keep.txt"]


def test_bad_jsonl_leaves_no_temporary_files_and_a_fixed_file_then_works(tmp_path):
    data = tmp_path / "data.jsonl"
    good = [json.dumps({"text": f"line {i} " * 30}) for i in range(12)]
    data.write_text("\n".join(good + ['{"text": 3}'] + good) + "\n")
    workdir = tmp_path / "run"
    for _ in range(2):  # a retry with the file unchanged fails the same way, leaving nothing either
        with pytest.raises(DataError, match="must be a string"):
            prepare_data(_cfg("jsonl", data), workdir)
        assert not (workdir / "data_cache").exists()
        assert not list(tmp_path.rglob("*.raw"))
    data.write_text("\n".join(good + good) + "\n")
    prepared = prepare_data(_cfg("jsonl", data), workdir)
    assert prepared.train.num_docs > 0 and not list(tmp_path.rglob("*.raw"))


@pytest.mark.parametrize("blob", [b"\x00\x01\x02binary\x00" * 50, b"\xff\xfe\xfa not utf-8 \xc3\x28" * 20])
def test_binary_files_in_a_text_dir_are_skipped_and_counted(tmp_path, capsys, blob):
    root = _text_dir(tmp_path / "texts", n=4)
    (root / "image.txt").write_bytes(blob)
    (root / "sub").mkdir()
    (root / "sub" / "other.md").write_bytes(blob)
    corpus = load_text_corpus("text_dir", str(root))
    assert corpus.num_docs == 4
    assert all("image" not in n and "other" not in n for n in corpus.doc_names())
    err = capsys.readouterr().err
    assert "skipped 2 file(s)" in err and "not UTF-8 text" in err


def test_a_text_dir_of_only_binary_files_is_an_error(tmp_path):
    root = tmp_path / "bin"
    root.mkdir()
    (root / "a.txt").write_bytes(b"\x00" * 100)
    with pytest.raises(DataError, match="no text documents: 1 file"):
        load_text_corpus("text_dir", str(root))
