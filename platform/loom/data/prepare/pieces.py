"""A long document tokenized in pieces, with the tokens of one call.

Why by hand: the tokenizers library's memory for one call grows faster than the text (measured
here with a byte-level BPE: 1 MB of text takes 49 MB, 4 MB 470 MB; one 12.7 MB document took a
worker to 3.55 GB), so a corpus with a few huge documents set every worker's memory. A document
longer than PIECE_CHARS is cut near every PIECE_CHARS, preferably after a newline or a space,
only where the cut is checked to change no token: the text around the cut (WINDOW characters each
side) encodes to the same ids whole as in two halves. Tokenizers split text into words before
merging (a regex or whitespace pre-tokenizer), so a cut between words that passes this check
gives the ids of the one call; `tests/test_data_prepare.py` compares them on whole documents.

A tokenizer that looks across every cut (sentencepiece-style ones add a prefix space to each
piece) passes no check: its long documents are tokenized whole up to --max-doc-mb and refused,
naming the document, above it. The library has no call for this (its `encode` has no offset or
stride for input, only for output windows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

PIECE_CHARS = 1 << 20  # ~50 MB of tokenizer memory per call (the figure above)
WINDOW = 4096
TRIES = 16  # candidate cuts tried per separator before the next kind
DEFAULT_MAX_DOC_MB = 8.0

Encode = Callable[[str], list[int]]


class Uncuttable(Exception):
    """A document above the whole-call limit with no place found to cut it."""


def cut_is_safe(encode: Encode, text: str, cut: int, window: int = WINDOW) -> bool:
    """Whether cutting `text` at `cut` leaves the ids around it unchanged."""
    left, right = text[max(0, cut - window):cut], text[cut:cut + window]
    return bool(left) and bool(right) and encode(left) + encode(right) == encode(left + right)


def _candidates(text: str, lo: int, hi: int) -> list[int]:
    """Cut positions in (lo, hi], best first: after newlines, after spaces, then evenly spaced."""
    found: list[int] = []
    for sep in ("\n", " "):
        pos = hi
        for _ in range(TRIES):
            k = text.rfind(sep, lo, pos)
            if k < 0:
                break
            found.append(k + 1)
            pos = k
    step = max(1, (hi - lo) // TRIES)
    return found + list(range(hi, lo, -step))


def find_cut(encode: Encode, text: str, start: int, piece: int = PIECE_CHARS) -> int | None:
    """A checked cut in the second half of the piece starting at `start`, or None."""
    lo, hi = start + piece // 2, start + piece
    return next((c for c in _candidates(text, lo, hi) if cut_is_safe(encode, text, c)), None)


def encode_pieces(encode: Encode, text: str, max_whole_chars: int, piece: int = PIECE_CHARS) -> Iterator[list[int]]:
    """`encode(text)`'s ids, piece after piece (concatenated, they are the one call's), cut where
    checked cuts are found; a rest of more than `max_whole_chars` with no cut raises Uncuttable.
    A generator, so a caller keeps each piece compactly (a list of Python ints is ~36 bytes a token)."""
    start = 0
    while len(text) - start > piece:
        cut = find_cut(encode, text, start, piece)
        if cut is None:
            break
        yield encode(text[start:cut])
        start = cut
    if len(text) - start > max(piece, max_whole_chars):
        raise Uncuttable(f"no place to cut it into pieces of {piece / 1e6:.1f} M characters that keeps its "
                         f"tokens was found near character {start:,}")
    yield encode(text[start:])


def encode_long(encode: Encode, text: str, max_whole_chars: int, piece: int = PIECE_CHARS) -> list[int]:
    """encode_pieces joined into one list (tests compare it with one call)."""
    return [i for ids in encode_pieces(encode, text, max_whole_chars, piece) for i in ids]
