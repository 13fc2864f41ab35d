"""Data and sampling faults: a failed build leaves the workdir as it found it, binary files in a text
directory are skipped and reported, and launch.sample rejects bad numeric flags before loading."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3 import decode
from k3.config import default_config
from k3.data import DataError, prepare_data
from k3.data import pipeline as pipeline_lib
from k3.data.corpus import _unit_hash

ROOT = Path(__file__).resolve().parents[1]

# Leftovers of an interrupted write: the stream's raw file, the .npy copy, atomic-write temporaries.
TEMP_GLOBS = ("*.raw", "*.npytmp", "*.tmp", "*.tmp.npz")

# A binary file that is valid ASCII apart from its NUL bytes, and one that is not UTF-8 at all.
NUL_BYTES = b"PK\x03\x04\x00\x00header\x00" * 40
NOT_UTF8 = bytes(range(128, 256)) * 4


def _cli(module: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _snapshot(path: Path) -> dict:
    """Every file and directory under ``path`` with the size and mtime of the files."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


def _temporaries(path: Path) -> list[str]:
    return sorted(str(p) for g in TEMP_GLOBS for p in path.rglob(g))


def _workdir(tmp_path: Path) -> Path:
    """A workdir that already holds a user file, which no failed attempt may touch."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("kept\n")
    return workdir


def _cfg(source: str, path, tokenizer: str = "byte", vocab: int = 512):
    cfg = default_config()
    cfg.model.vocab_size = vocab
    d = cfg.data
    d.source, d.path, d.tokenizer = source, str(path), tokenizer
    d.seq_len, d.batch_size, d.max_docs, d.val_fraction = 16, 2, 0, 0.2
    return cfg


def _jsonl_bad_in_val(path: Path, min_lines: int = 20) -> int:
    """Writes a JSONL file of good lines whose last line, a validation document, lacks "text".

    The train split is read (and the tokenizer trained, and train.npy written) before that line is
    reached, so the failure comes late in the build. Returns the number of the bad line.
    """
    bad = next(i for i in range(min_lines, 1000) if _unit_hash(f"{path.name}:{i}") < 0.2)
    good = [json.dumps({"text": f"document {i}: alpha beta gamma delta " * 20}) for i in range(1, bad)]
    path.write_text("\n".join(good + [json.dumps({"body": "no text here"})]) + "\n")
    return bad


def _fix_jsonl(path: Path) -> None:
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1] + [json.dumps({"text": "fixed"})]) + "\n")


def _text_dir(root: Path, n: int = 8) -> Path:
    root.mkdir()
    for i in range(n):
        (root / f"doc{i}.txt").write_text(f"plain text document {i}, with words repeated.\n" * 30)
    return root


# ---------------------------------------------------------------------------------------------------
# 1. A failed build leaves no data_cache/ it created.


@pytest.mark.parametrize("fresh", [True, False], ids=["new_workdir", "existing_workdir"])
def test_missing_text_dir_exits_2_and_leaves_no_cache(tmp_path, fresh):
    workdir = tmp_path / "run" if fresh else _workdir(tmp_path)
    before = {} if fresh else _snapshot(workdir)
    missing = tmp_path / "nonexistent"
    out = _cli("launch.train", f"--workdir={workdir}", "--config.data.source=text_dir",
               f"--config.data.path={missing}")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error:") and str(missing) in out.stderr and "does not exist" in out.stderr
    if fresh:
        assert not workdir.exists()
    else:
        assert _snapshot(workdir) == before


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_jsonl_without_text_field_exits_2_and_leaves_no_cache(tmp_path, tokenizer):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (data / name).write_text("".join(json.dumps({"body": f"line {i}"}) + "\n" for i in range(5)))
    workdir = _workdir(tmp_path)
    before = _snapshot(workdir)
    out = _cli("launch.train", f"--workdir={workdir}", "--config.data.source=jsonl", f"--config.data.path={data}",
               f"--config.data.tokenizer={tokenizer}")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error:") and "no field 'text'" in out.stderr and "a.jsonl:1" in out.stderr
    assert _snapshot(workdir) == before


def test_failure_keeps_a_data_cache_that_was_already_there(tmp_path):
    workdir = _workdir(tmp_path)
    (workdir / "data_cache").mkdir()
    (workdir / "data_cache" / "README").write_text("the user's own file\n")
    before = _snapshot(workdir)
    data = tmp_path / "d.jsonl"
    _jsonl_bad_in_val(data)
    with pytest.raises(DataError, match="no field 'text'"):
        prepare_data(_cfg("jsonl", data), workdir)
    # The build wrote train.npy before failing on the validation line; the user's files are intact.
    after = _snapshot(workdir)
    assert {k: v for k, v in after.items() if k in before} == before
    assert set(after) - set(before) <= {"data_cache/train.npy", "data_cache/train_doc_len.npy"}
    assert not _temporaries(tmp_path)


# ---------------------------------------------------------------------------------------------------
# 2. Temporary files of a failed tokenisation are removed; a retry on fixed input works.


def test_failed_jsonl_retries_leave_no_temporary_files_then_fixed_input_builds(tmp_path):
    workdir = _workdir(tmp_path)
    (workdir / "data_cache").mkdir()  # kept across attempts, so only per-file cleanup can pass this
    data = tmp_path / "d.jsonl"
    bad = _jsonl_bad_in_val(data)
    for _ in range(3):
        with pytest.raises(DataError, match=f"d.jsonl:{bad}: JSON object has no field 'text'"):
            prepare_data(_cfg("jsonl", data), workdir)
        assert not _temporaries(tmp_path)
    _fix_jsonl(data)
    prepared = prepare_data(_cfg("jsonl", data), workdir)
    assert prepared.train.num_docs > 0 and prepared.val.num_docs > 0 and not prepared.meta["cache_hit"]
    assert not _temporaries(tmp_path)
    assert prepare_data(_cfg("jsonl", data), workdir).meta["cache_hit"]


def test_a_tokenizer_trained_by_a_failed_build_is_removed(tmp_path):
    data = tmp_path / "d.jsonl"
    _jsonl_bad_in_val(data, min_lines=40)
    cfg = _cfg("jsonl", data, tokenizer="bpe", vocab=280)
    workdir = tmp_path / "run"
    with pytest.raises(DataError, match="no field 'text'"):
        prepare_data(cfg, workdir)
    assert not workdir.exists()  # tokenizer.json trained on the train split went with the rest
    _fix_jsonl(data)
    prepared = prepare_data(cfg, workdir)
    assert prepared.tokenizer.trained and (workdir / "tokenizer.json").exists()

    # A tokenizer file that was there before a failed attempt is kept as it was.
    tok_before = _snapshot(workdir)["tokenizer.json"]
    data.write_text(data.read_text() + json.dumps({"body": 1}) + "\n")
    with pytest.raises(DataError, match="no field 'text'"):
        prepare_data(cfg, workdir)
    assert _snapshot(workdir)["tokenizer.json"] == tok_before


def test_stream_writer_failure_removes_its_temporary_files(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("No space left on device")

    # The .npy copy's header is written by then: the failure strikes with both temporaries on disk.
    monkeypatch.setattr(np, "memmap", fail)
    writer = pipeline_lib._StreamWriter(tmp_path / "train.npy", np.uint16)
    writer.write(np.arange(100))
    with pytest.raises(OSError, match="No space left"):
        writer.finish()
    assert list(tmp_path.iterdir()) == []
    writer = pipeline_lib._StreamWriter(tmp_path / "val.npy", np.uint16)
    writer.write(np.arange(10))
    writer.abort()
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------
# 3. Binary files in a text_dir corpus are skipped, counted and reported once.


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_binary_txt_files_are_skipped_with_one_warning(tmp_path, capsys, tokenizer):
    root = _text_dir(tmp_path / "texts")
    (root / "a_random.txt").write_bytes(NOT_UTF8)
    (root / "sub").mkdir()
    (root / "sub" / "archive.md").write_bytes(NUL_BYTES)
    capsys.readouterr()
    prepared = prepare_data(_cfg("text_dir", root, tokenizer, vocab=280 if tokenizer == "bpe" else 512),
                            tmp_path / "run")
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "skipped 2 file(s)" in err and "'a_random.txt'" in err, err
    assert prepared.train.num_docs + prepared.val.num_docs == 8
    tok = prepared.tokenizer
    for stream in (prepared.train, prepared.val):
        text = "".join(tok.decode(stream.doc(i)) for i in range(stream.num_docs))
        assert "\ufffd" not in text and "\x00" not in text and "plain text document" in text
    # A second run loads the cache without reading (or reporting) the files again.
    assert prepare_data(_cfg("text_dir", root, tokenizer, vocab=prepared.tokenizer.vocab_size),
                        tmp_path / "run").meta["cache_hit"]
    assert "warning:" not in capsys.readouterr().err


def test_a_text_dir_of_only_binary_files_exits_2_naming_the_path(tmp_path):
    root = tmp_path / "blobs"
    root.mkdir()
    (root / "x.txt").write_bytes(NUL_BYTES)
    (root / "y.txt").write_bytes(NOT_UTF8)
    workdir = _workdir(tmp_path)
    before = _snapshot(workdir)
    out = _cli("launch.train", f"--workdir={workdir}", "--config.data.source=text_dir",
               f"--config.data.path={root}", "--config.data.tokenizer=byte")
    assert out.returncode == 2, out.stderr
    assert "warning: skipped 2 file(s)" in out.stderr
    error = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(error) == 1 and str(root) in error[0] and "no text documents" in error[0]
    assert _snapshot(workdir) == before


# ---------------------------------------------------------------------------------------------------
# 4. launch.sample checks its numeric flags before loading anything.


@pytest.mark.parametrize("flag", ["--tokens=-1", "--tokens=0", "--temperature=-0.5", "--temperature=nan",
                                  "--temperature=inf", "--top_k=-1", f"--seed={2**64}"])
def test_sample_rejects_bad_numeric_flags(tmp_path, flag):
    workdir = _workdir(tmp_path)
    before = _snapshot(workdir)
    t0 = time.time()
    out = _cli("launch.sample", f"--workdir={workdir}", flag)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: flag {flag}:"), out.stderr
    assert "run.json" not in out.stderr  # rejected before the workdir was looked at
    assert out.stdout == "" and time.time() - t0 < 60
    assert _snapshot(workdir) == before


def test_top_k_at_least_the_vocab_size_samples_from_all_tokens():
    logits = jnp.array([[0.0, 1.0, 2.0, 3.0, 4.0]])
    for seed in range(5):
        key = jax.random.key(seed)
        everything = int(decode.sample_logits(logits, key, 1.0, top_k=0)[0])
        assert int(decode.sample_logits(logits, key, 1.0, top_k=5)[0]) == everything
        assert int(decode.sample_logits(logits, key, 1.0, top_k=1000)[0]) == everything
