"""Data pipeline: corpora, tokenizers, packed checkpointable batches.

Main entry point: :func:`build_datasets` ``(cfg, workdir) -> (train_iter, val_source, tokenizer)``;
see :mod:`k3.data.pipeline` for the batch format and the iterator state.
"""

from k3.data.corpus import DataError, list_stdlib_files, load_text_corpus, load_token_corpus
from k3.data.pipeline import (
    PreparedData,
    TokenStream,
    TrainIterator,
    ValSource,
    build_datasets,
    doc_labels_from_eos,
    pack_batch,
    prepare_data,
)
from k3.data.tokenizer import BPETokenizer, ByteTokenizer, IdTokenizer, Tokenizer, load_or_train_tokenizer

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "DataError",
    "IdTokenizer",
    "PreparedData",
    "TokenStream",
    "Tokenizer",
    "TrainIterator",
    "ValSource",
    "build_datasets",
    "doc_labels_from_eos",
    "list_stdlib_files",
    "load_or_train_tokenizer",
    "load_text_corpus",
    "load_token_corpus",
    "pack_batch",
    "prepare_data",
]
