"""One layer through the native library: a weight tensor or a layer module described as the library reads it
(`tensor_desc`, `linear_desc`: pointers to the module's own tensors, no copies) and run alone
(`linear_forward`: QuantLinear's and FP16Linear's "native" kind on the PyTorch path). The executor
(kernels/executor.py) describes whole models from the same descriptors."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading

import torch
import torch.nn as nn

from . import lib as L

_CALL = threading.RLock()  # the library's thread pool serves one call at a time (engine cores share it)
_FLOAT_KINDS = {torch.float32: L.TL_F32, torch.float16: L.TL_F16, torch.bfloat16: L.TL_BF16}
_QUANT_KINDS = {8: L.TL_Q8, 4: L.TL_Q4, 2: L.TL_Q2}


class Unsupported(ValueError):
    """A model (or layer) the native executor does not run; the PyTorch path serves it."""


def q8_activations() -> bool:
    """Whether int8 and int4 layers quantize their activations to int8 for integer dot products (llama.cpp's
    q4 x q8 and q8 x q8; `TINYLOOP_NATIVE_Q8=0` keeps fp32 activations, exact to the dequantized weights)."""
    v = os.environ.get("TINYLOOP_NATIVE_Q8", "1").strip().lower()
    if v not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise ValueError(f"TINYLOOP_NATIVE_Q8 must be 1 or 0, got {v!r}")
    return v in ("1", "true", "yes", "on")


def default_threads() -> int:
    n = os.environ.get("TINYLOOP_NATIVE_THREADS")
    if n:
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"TINYLOOP_NATIVE_THREADS must be a positive integer, got {n!r}")
        return int(n)
    return max(1, torch.get_num_threads())


def _vec(t: torch.Tensor | None, keep: list) -> int | None:
    """A small vector (a norm's weights) as an fp32 copy the library reads (kept alive in `keep`)."""
    if t is None:
        return None
    t = t.detach().float().contiguous()
    keep.append(t)
    return t.data_ptr()


def tensor_desc(w: torch.Tensor, keep: list) -> L.TlLinear:
    """A float weight tensor (n, k) as a layer: the LM head (the embedding when tied)."""
    if w.dtype not in _FLOAT_KINDS or w.device.type != "cpu" or w.dim() != 2:
        raise Unsupported(f"{w.dtype} weights on {w.device}")
    w = w.detach().contiguous()
    keep.append(w)
    d = L.TlLinear()
    d.kind, (d.n, d.k), d.w, d.group = _FLOAT_KINDS[w.dtype], w.shape, w.data_ptr(), 0
    if d.k % 8:
        raise Unsupported(f"{d.k} input features (the kernels need a multiple of 8)")
    return d


def pack_int4(d: L.TlLinear, keep: list) -> bool:
    """Repack an int4 layer's codes for the 16-rows-a-vector kernel (intdot.cpp qq_packed, AVX-512 VNNI builds)
    into a buffer kept in `keep`, and point the descriptor at it; False where this build or layer has no such
    kernel. A copy of the codes: the executor packs the models where it pays (Executor._pack)."""
    buf = packed_int4(d)
    if buf is None:
        return False
    keep.append(buf)
    d.packed = buf.data_ptr()
    return True


def packed_int4(d: L.TlLinear) -> torch.Tensor | None:
    """The layer's codes repacked for the packed kernel (`tl_pack_int4`), in memory of their own (`huge_empty`),
    or None where this build or layer has no such kernel. The descriptor is only read."""
    lib = L.load()
    size = lib.tl_pack_int4_size(d)
    if size <= 0:
        return None
    buf = huge_empty(size)
    return buf if lib.tl_pack_int4(d, buf.data_ptr()) == 0 else None


HUGE = 2 << 20


def huge_empty(nbytes: int) -> torch.Tensor:
    """nbytes of anonymous private memory the kernel is asked to back with transparent huge pages (madvise: a
    weight stream then crosses a TLB entry every 2 MB, not every 4 KB; packed codes read ~10% faster on an
    AVX-512 EPYC); a plain tensor where that is not offered. The mapping lives as long as the tensor."""
    if nbytes < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(m, dtype=torch.uint8)   # (holds m)
    start = -raw.data_ptr() % HUGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % HUGE)
    except OSError:
        pass
    return raw[start:start + nbytes]


def cold(address: int, nbytes: int) -> None:
    """Advise the kernel that these bytes (a layer's mapped codes, once packed) will not be read soon
    (MADV_COLD: their pages are reclaimed first under memory pressure; nothing is dropped, a later read finds
    the same bytes). No-op where the platform has no such advice."""
    page = mmap.PAGESIZE
    lo, hi = -(-address // page) * page, (address + nbytes) // page * page
    if hi <= lo or not hasattr(mmap, "MADV_COLD"):
        return
    libc = _libc()
    if libc is not None:
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_COLD)


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_OWN_TYPES = {"i32": ctypes.c_int32, "f32": ctypes.c_float, "linear": L.TlLinear, "f32[]": ctypes.c_void_p}
_OWN_LAYOUTS: dict[int, tuple] = {}   # block kind -> its struct's fields, as described


def own_linears(b) -> list:
    """The layer descriptors in a block descriptor's own struct (references into it), in its order."""
    if not b.own:
        return []
    layout = _OWN_LAYOUTS[b.own]
    own = own_struct(layout).from_address(b.own_fields)
    return [getattr(own, n) for n, t in layout if t == "linear"]


@functools.cache
def own_struct(fields: tuple[tuple[str, str], ...]) -> type[ctypes.Structure]:
    """The ctypes struct of a family's own block fields, laid out as the family's module declares them
    ((name, type) in the order of its C++ struct; types: i32, f32, linear (a layer), f32[] (an fp32 vector))."""
    bad = [t for _, t in fields if t not in _OWN_TYPES]
    if bad:
        raise ValueError(f"own block field types {bad}: not among {sorted(_OWN_TYPES)}")
    return type("TlOwnFields", (ctypes.Structure,), {"_fields_": [(n, _OWN_TYPES[t]) for n, t in fields]})


def describe(struct, fields: dict, keep: list) -> None:
    """Fill a descriptor (`TlBlock`) from what a model module says the library reads of it (`native_fields`: a
    family's own layer, e.g. an nGPT block's; the block-level counterpart of
    `native_weights`): a module -> its layer descriptor (`linear_desc`); a list of modules -> the array field's
    first entries and `n_<name>` their count; a tensor -> an fp32 copy (`_vec`); a number -> as it is; and
    "own": ((kind name, its struct's fields), values) -> the block kind the library registered under that name
    (`tl_block_kind`; Unsupported where this library has none) and that struct, filled by the same rules."""
    for name, v in fields.items():
        if name == "own":
            (kind, layout), values = v
            b = L.load().tl_block_kind(kind.encode())
            if b == 0:
                raise Unsupported(f"{kind!r} blocks (this build of the native library has no such block kind)")
            own = own_struct(tuple(layout))()
            _OWN_LAYOUTS[b] = tuple(layout)
            describe(own, values, keep)
            keep.append(own)
            struct.own, struct.own_fields = b, ctypes.addressof(own)
        elif isinstance(v, nn.Module):
            setattr(struct, name, linear_desc(v, keep))
        elif isinstance(v, (list, tuple)):
            arr = getattr(struct, name)
            for i, mod in enumerate(v):
                arr[i] = linear_desc(mod, keep)
            setattr(struct, f"n_{name}", len(v))
        elif isinstance(v, torch.Tensor):
            setattr(struct, name, _vec(v, keep))
        else:
            setattr(struct, name, v)


def linear_desc(mod: nn.Module, keep: list) -> L.TlLinear:
    """A layer's weights as the library reads them (the module's own tensors): an `nn.Linear`, or a module
    that says what to read through `native_weights()` (quant.fp16.FP16Linear: its 16-bit weight tensor;
    quant.linear.QuantLinear of kind "native": bits, group size and the portable codes, scales, and zeros or,
    int4's min form (GGUF Q4_1, quant/packing.py `dequantize_min`), mins)."""
    if type(mod) is nn.Linear:
        if mod.bias is not None:
            raise Unsupported("a linear layer with a bias")
        return tensor_desc(mod.weight, keep)
    native = getattr(mod, "native_weights", None)
    w = native() if native is not None else None
    if isinstance(w, torch.Tensor):
        return tensor_desc(w, keep)
    if not isinstance(w, dict):
        raise Unsupported(f"a {type(mod).__name__} layer ({getattr(mod, 'kind', '')})")
    d = L.TlLinear()
    d.kind, d.group = _QUANT_KINDS[w["bits"]], w["group_size"]
    d.n, d.k = w["qweight"].shape[0], w["qweight"].shape[1] * 8 // w["bits"]
    d.w, d.scales = w["qweight"].data_ptr(), w["scales"].data_ptr()
    if w.get("mins") is not None:   # w = q * scale + min: every int4 kernel path takes it (csrc/intdot.h group_sz)
        if w["bits"] != 4:
            raise Unsupported(f"int{w['bits']} weights with float minimums (only int4 has the min form)")
        d.mins = w["mins"].data_ptr()
    else:
        d.zeros = w["zeros"].data_ptr()
    # int4 and int8 weights take int8 activations (integer dot products, scaled per group or 256 columns)
    # where the rows are whole 64s and the groups whole 32s (int8 in groups of 32: a GGUF's Q8_0 head), or
    # (int4 in groups that are not whole 64s: activation blocks of 32) whole 32s; intdot.h says why
    q4 = d.kind == L.TL_Q4 and d.group % 32 == 0 and (d.k % 64 == 0 or d.k % 32 == 0 and d.group % 64 != 0)
    q8 = d.kind == L.TL_Q8 and d.group % 32 == 0 and d.k % 64 == 0
    d.act_q8 = int((q4 or q8) and q8_activations())
    keep.append(w)
    if d.k % 8:
        raise Unsupported(f"{d.k} input features (the kernels need a multiple of 8)")
    return d


def _forward(d: L.TlLinear, x: torch.Tensor, threads: int) -> torch.Tensor:
    lib = L.load()
    x2 = x.reshape(-1, d.k).float().contiguous()
    M = x2.shape[0]
    y = torch.empty(M, d.n, dtype=torch.float32)
    scratch = torch.empty(M * d.k + M * (d.k // 8) + 16 if d.kind >= L.TL_Q8 else 16, dtype=torch.float32)
    with _CALL:
        lib.tl_set_threads(threads)
        rc = lib.tl_linear_forward(d, x2.data_ptr(), M, y.data_ptr(), scratch.data_ptr())
    if rc != 0:
        raise RuntimeError(f"native linear failed (code {rc})")
    return y.reshape(*x.shape[:-1], d.n)


def linear_forward(mod, x: torch.Tensor) -> torch.Tensor:
    """x (..., k) -> (..., n) fp32 through the library (QuantLinear's "native" kind)."""
    d = getattr(mod, "_tl_desc", None)
    if d is None:
        d = linear_desc(mod, [])
        if isinstance(mod, nn.Module):
            mod._tl_desc = d      # the buffers it points at live as long as the module
    return _forward(d, x, default_threads())
