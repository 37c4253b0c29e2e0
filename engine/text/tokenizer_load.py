"""Loading a model directory's tokenizer once per process: `load_tokenizer` returns a tokenizer of the caller's own
(each thread that encodes or decodes needs one: a Rust tokenizer used from two threads at once can fail with "Already
borrowed"), but only the first call for a set of tokenizer files reads them with `AutoTokenizer`. Later calls copy
that load: the Python side copied (the vocabulary and merges it was built from shared, they are read only after
construction), the Rust tokenizer rebuilt from its serialized form, which skips transformers' JSON parse in Python
and its conversion (qwen3-tiny: 0.6 s instead of 1.1 s; gemma3-tiny's 262k vocabulary: 1.0 s instead of 3.3 s).
A server start asks for four (the engine's or the grammar compiler's, two prepare lanes, the event loop's)."""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The inputs a tokenizer class builds its Rust tokenizer from (Qwen2Tokenizer, GemmaTokenizer, ...): large, set in
# __init__ and only read after it, so copies share them.
_READ_ONLY = frozenset({"_vocab", "_merges"})
# Loads kept: a test process starts servers of a few models over and over; each entry holds its vocabulary.
_MAX_ENTRIES = 4


@dataclass(frozen=True)
class _Loaded:
    pristine: Any  # the loaded tokenizer's Python side as loaded, without its Rust tokenizer (never handed out)
    serialized: str  # its Rust tokenizer, as loaded


_loads: OrderedDict[tuple, _Loaded] = OrderedDict()
_lock = threading.Lock()


def _files_key(model_dir: Path) -> tuple:
    """What the directory's files are now (name, size, mtime): a file rewritten in place (a rebuilt model) loads
    again."""
    return (str(model_dir.resolve()),) + tuple(sorted(
        (entry.name, stat.st_size, stat.st_mtime_ns)
        for entry in model_dir.iterdir() if entry.is_file() for stat in (entry.stat(),)))


def _python_copy(tokenizer: Any, backend: Any) -> Any:
    """``tokenizer`` with its own copy of every attribute but the read-only ones, and ``backend`` for its Rust
    tokenizer."""
    copied = copy.copy(tokenizer)
    for name, value in vars(tokenizer).items():
        if name not in _READ_ONLY and name != "_tokenizer":
            setattr(copied, name, copy.deepcopy(value))
    copied._tokenizer = backend
    return copied


def _copy_of(loaded: _Loaded) -> Any:
    from tokenizers import Tokenizer

    return _python_copy(loaded.pristine, Tokenizer.from_str(loaded.serialized))


def load_tokenizer(model_dir: str | Path) -> Any:
    """A tokenizer of ``model_dir`` (a local directory) for the caller alone, equal to
    ``AutoTokenizer.from_pretrained(model_dir)``: loaded on the first call for these files, a copy of that load after.
    A tokenizer without a Rust backend (a Python one) is loaded each time."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = Path(model_dir)
    key = _files_key(path)
    with _lock:
        loaded = _loads.get(key)
        if loaded is not None:
            _loads.move_to_end(key)
    if loaded is not None:
        return _copy_of(loaded)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer):
        with _lock:
            _loads[key] = _Loaded(_python_copy(tokenizer, None), tokenizer.backend_tokenizer.to_str())
            while len(_loads) > _MAX_ENTRIES:
                _loads.popitem(last=False)
    return tokenizer
