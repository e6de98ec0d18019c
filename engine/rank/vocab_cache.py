"""Rank 0's guided-decoding vocabulary kept on disk: each token's bytes and their trie.

Decoding tokenizer.json's vocabulary and laying out its trie takes about a second (1.1 s on
the H200's host), which a server's first guided request waited for; read back from here it
takes a tenth of that. A file is keyed by the SHA-256 of tokenizer.json's bytes and a format
version, written beside and renamed into place (servers sharing the folder never see half a
file), and one that does not load as expected is built again. The folder is
$XDG_CACHE_HOME/deltaserve/vocab (~/.cache when unset); when it cannot be written, the trie
is built each time, as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from deltaserve.engine.rank.token_bytes import read_token_bytes
from deltaserve.engine.rank.token_trie import TokenTrie

FORMAT_VERSION = 1
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deltaserve" / "vocab"


def load_trie(model_dir: str | Path) -> TokenTrie:
    """The model's vocabulary trie: from the cache, else built (and cached)."""
    digest = hashlib.sha256((Path(model_dir) / "tokenizer.json").read_bytes()).hexdigest()
    path = cache_dir() / f"{digest[:32]}-v{FORMAT_VERSION}.npz"
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    except (
        OSError,
        ValueError,
        KeyError,
        EOFError,
        zipfile.BadZipFile,
    ) as exc:  # damaged: built again, replaced
        log.warning("vocabulary cache %s unreadable (%s): building it again", path, exc)
    trie = TokenTrie(read_token_bytes(model_dir))
    try:
        _write(path, trie)
    except OSError as exc:
        log.info("vocabulary cache not written (%s): the next server builds it again", exc)
    return trie


def _read(path: Path) -> TokenTrie:
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    blob, ends, present = (
        arrays.pop("token_blob").tobytes(),
        arrays.pop("token_ends"),
        arrays.pop("token_present"),
    )
    starts = np.concatenate([[0], ends[:-1]]).tolist() if ends.size else []
    token_bytes = [
        blob[a:b] if ok else None
        for a, b, ok in zip(starts, ends.tolist(), present.tolist(), strict=True)
    ]
    trie = TokenTrie(token_bytes, arrays)
    if trie.byte.shape != trie.token.shape or trie.level_start[-1] != trie.byte.shape[0]:
        raise ValueError("arrays of different lengths")
    return trie


def _write(path: Path, trie: TokenTrie) -> None:
    spelled = [b or b"" for b in trie.token_bytes]
    ends = np.cumsum([len(b) for b in spelled], dtype=np.int64)
    present = np.array([b is not None for b in trie.token_bytes], dtype=bool)
    blob = np.frombuffer(b"".join(spelled), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
        try:
            small = {
                name: a.astype(np.int32) for name, a in trie.to_arrays().items()
            }  # ids < 2**31: half the file
            np.savez(tmp, token_blob=blob, token_ends=ends, token_present=present, **small)
        except BaseException:
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, path)


__all__ = ["FORMAT_VERSION", "cache_dir", "load_trie"]
