"""Corpus embedding: a file of texts streamed into a ``.npy`` (:mod:`.index`), and the same on a Dask cluster (:mod:`.cluster`)."""

from .index import Index, embed_file, encode_lines, iter_texts

__all__ = ["Index", "embed_file", "encode_lines", "iter_texts"]
