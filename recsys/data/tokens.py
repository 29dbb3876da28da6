"""String tokens of split fields → int64 ids: a 64-bit hash (SplitMix64) of each token's bytes."""

from __future__ import annotations

import numpy as np

from embedding_store.hashing import mix64 as _mix
from recsys.data.fields import Fields, column_matrix

__all__ = ["hash_strings", "hash_tokens"]

_SALT = np.uint64(0x7F4A7C159E3779B9)


def _hash_matrix(mat: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """64-bit hash of each row's first ``lens`` bytes → int64 ids in [0, 2**63).

    Depends only on the bytes and the length, never on the matrix width: words past a row's end are not
    mixed in.
    """
    n, w = mat.shape
    words = -(-w // 8)
    padded = np.zeros((n, words * 8), dtype=np.uint8)
    padded[:, :w] = mat
    as_words = padded.view("<u8")  # (N, words)
    with np.errstate(over="ignore"):
        h = _mix(lens.astype(np.uint64) ^ _SALT)
        for k in range(words):
            h = np.where(lens > 8 * k, _mix(h ^ as_words[:, k]), h)
    return (h >> np.uint64(1)).astype(np.int64)


def hash_strings(tokens: list[str] | list[bytes]) -> np.ndarray:
    """The ids :func:`hash_tokens` gives these tokens (for tests and lookups)."""
    raw = [t.encode() if isinstance(t, str) else t for t in tokens]
    width = max((len(t) for t in raw), default=1) or 1
    mat = np.zeros((len(raw), width), dtype=np.uint8)
    for i, t in enumerate(raw):
        mat[i, : len(t)] = np.frombuffer(t, dtype=np.uint8)
    return _hash_matrix(mat, np.array([len(t) for t in raw], dtype=np.int64))


def hash_tokens(
    f: Fields, col: int, *, separator: bytes = b"", prefix: int = 0, max_length: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """String tokens → hashed ids as (values (nnz,) int64, lengths (N,) int64).

    Without ``separator`` every non-empty field is one token (an empty field has no id). With it, a field
    is a list of tokens (multi-hot), at most ``max_length`` kept (0: all). ``prefix`` keeps only the first
    ``prefix`` bytes of each token (e.g. a zip code's region).
    """
    starts = f.starts[:, col]
    ends = f.ends[:, col]
    if separator:
        # Every byte position of the column's fields, flattened; split at separator bytes.
        lens = ends - starts
        total = int(lens.sum())
        row_of = np.repeat(np.arange(starts.shape[0]), lens)
        pos = np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
        is_sep = f.buf[pos] == separator[0]
        # A token starts at a field start or after a separator, and ends before a separator or field end.
        begin = np.ones(total, dtype=bool)
        begin[1:] = (row_of[1:] != row_of[:-1]) | is_sep[:-1]
        begin &= ~is_sep
        end = np.ones(total, dtype=bool)
        end[:-1] = (row_of[1:] != row_of[:-1]) | is_sep[1:]
        end &= ~is_sep
        tok_start = pos[begin]
        tok_end = pos[end] + 1
        tok_row = row_of[begin]
        lengths = np.bincount(tok_row, minlength=starts.shape[0]).astype(np.int64)
        if max_length:
            rank = np.arange(tok_row.shape[0]) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            keep = rank < max_length
            tok_start, tok_end = tok_start[keep], tok_end[keep]
            lengths = np.minimum(lengths, max_length)
    else:
        tok_start, tok_end = starts, ends
        lengths = (ends > starts).astype(np.int64)
        keep = lengths.astype(bool)
        tok_start, tok_end = tok_start[keep], tok_end[keep]
    if prefix:
        tok_end = np.minimum(tok_end, tok_start + prefix)
    token_fields = f.columns(tok_start[:, None], tok_end[:, None], np.zeros(tok_start.shape[0], np.int64))
    mat, tlens = column_matrix(token_fields, 0)
    return _hash_matrix(mat, tlens), lengths
