"""Decode attention for CPUs that reads the KV pages where they are: the C kernel in ``cpu_attention.c``, compiled on
first use with the machine's C compiler and called through ctypes.

Why native code: on a CPU a decode row's attention is bound by reading its context, and pure torch can only read
scattered pages by gathering them into a copy first (kernels/reference/__init__.py), then reading the copy again in SDPA. On
the project's two-core machine that was about half of a SmolLM2 decode step at batch 64; the kernel reads each key
and value row once, from its page.

The library is built once per source, compiler flags and CPU into ``$KVSERVE_CACHE_DIR/kernels`` (default
~/.cache/kvserve/kernels), written to a temporary file and renamed into place so concurrent processes never race.
No compiler, a failed build, or ``KVSERVE_CPU_KERNELS=0``: `available()` is False and the torch reference runs
(logged once).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels import reference

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention.c")
# The parts of -ffast-math the loops need (reassociated, vectorized sums; no errno), not -ffast-math itself: a shared
# library linked with it sets the CPU to flush denormals to zero in the whole process that loads it (crtfastmath),
# changing every other float operation there (torch's, hypothesis').
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
         "-freciprocal-math", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
PAGE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # fp16 / fp8 pages: the reference
# A sequence with up to this many query rows after its cached context (speculative drafts being verified) is read in
# place a row at a time, not gathered into a copy for SDPA as a prefill chunk is.
MAX_DECODE_ROWS = 16


class _Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "n", "hq", "hkv", "dk", "dv", "block_size", "bt_stride", "k_page", "k_token", "k_head", "v_page", "v_token",
        "v_head", "window")] + [("scale", ctypes.c_float), ("threads", ctypes.c_int)]


def _cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve"
    return Path(root).expanduser() / "kernels"


def _cpu_fingerprint() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (a cache shared by machines with other
    CPUs must not hand one a library with instructions it lacks)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("flags", "model name", "Features"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor() or platform.machine()


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, *FLAGS, _cpu_fingerprint()]).encode()).hexdigest()
    target = _cache_dir() / f"cpu_attention-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{compiler} failed: {exc.stderr.strip()[:500]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError) as exc:
        log.warning("CPU decode-attention kernel unavailable (%s); using the pure-torch reference", exc)
        return None
    lib.paged_decode_attention.restype = None
    return lib


def available() -> bool:
    """Whether the native kernel is built and loadable here."""
    return _library() is not None


def supports(cache: torch.Tensor) -> bool:
    return cache.device.type == "cpu" and cache.dtype in PAGE_DTYPES and cache.is_contiguous()


def paged_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    row_lens: torch.Tensor, seqs: torch.Tensor, scale: float, value_dim: int | None = None, window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query rows over their sequences' first tokens: ``query`` ``[n, Hq, Dk]``, row i attending to the
    first ``row_lens[i]`` tokens of sequence ``seqs[i]`` (int32, indexing ``block_tables``; with ``window``, to the
    last ``window`` of them, and only their pages are read), over pages
    ``[num_blocks, block_size, Hkv, D]`` -> ``[n, Hq, Dv]`` in the query's dtype. One row per decoding sequence, or
    a few rows of one sequence (drafts being verified), each a token longer than the one before. ``sinks`` ``[Hq]``:
    per-head attention sinks (`kernels.reference.paged_attention`). ``value_dim``: MLA,
    where ``v_cache`` is ``k_cache`` and the value is the first ``value_dim`` entries of each row. Callers check
    `available()` and `supports()` first."""
    num_blocks, block_size, num_kv_heads, dk = k_cache.shape
    dv = value_dim if value_dim is not None else v_cache.shape[-1]
    n, num_heads = query.shape[0], query.shape[1]
    q = query.float().contiguous()
    out = torch.empty(n, num_heads, dv, dtype=torch.float32)
    tables = block_tables if block_tables.dtype == torch.int32 and block_tables.is_contiguous() else \
        block_tables.to(torch.int32).contiguous()
    lens = row_lens.to(torch.int32).contiguous()
    seqs = seqs.to(torch.int32).contiguous()
    sinks = None if sinks is None else sinks.float().contiguous()
    k_strides, v_strides = k_cache.stride(), v_cache.stride()
    shape = _Shape(n, num_heads, num_kv_heads, dk, dv, block_size, tables.stride(0), k_strides[0], k_strides[1],
                   k_strides[2], v_strides[0], v_strides[1], v_strides[2], window or 0, scale,
                   torch.get_num_threads())
    _library().paged_decode_attention(
        ctypes.c_int(PAGE_DTYPES[k_cache.dtype]), ctypes.byref(shape), ctypes.c_void_p(q.data_ptr()),
        ctypes.c_void_p(k_cache.data_ptr()), ctypes.c_void_p(v_cache.data_ptr()), ctypes.c_void_p(tables.data_ptr()),
        ctypes.c_void_p(lens.data_ptr()), ctypes.c_void_p(seqs.data_ptr()),
        ctypes.c_void_p(None if sinks is None else sinks.data_ptr()), ctypes.c_void_p(out.data_ptr()))
    return out.to(query.dtype)


# ---- the "cpu" op set's attention ops: the reference, with decode rows read in place where the kernel can ---------
def paged_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *, window: int | None = None,
    sinks: torch.Tensor | None = None, **launch_hints,
) -> torch.Tensor:
    """`kernels.reference.paged_attention`, its decode rows attended by the native kernel (which reads only the pages
    of a sliding ``window``, and takes the heads' ``sinks``)."""
    if not (available() and supports(k_cache) and supports(v_cache)):
        return reference.paged_attention(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                         window=window, sinks=sinks)
    return reference.attend(
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
        lambda q, plan: paged_decode(q, k_cache, v_cache, block_tables, plan.decode_row_lens, plan.decode_seq_ids,
                                     scale, window=window, sinks=sinks),
        max_decode_rows=MAX_DECODE_ROWS, window=window, sinks=sinks)


def mla_decode(
    query: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    scale: float, kv_lora_rank: int, **launch_hints,
) -> torch.Tensor:
    """`kernels.reference.mla_decode` by the native kernel: one KV head whose whole latent row is the key and whose
    first ``kv_lora_rank`` values are the value."""
    if not (available() and supports(latent_cache)) or query.shape[0] == 0:
        return reference.mla_decode(query, latent_cache, block_tables, context_lens, scale, kv_lora_rank)
    seqs = torch.arange(query.shape[0], dtype=torch.int32)
    return paged_decode(query, latent_cache, latent_cache, block_tables, context_lens, seqs, scale, kv_lora_rank)
