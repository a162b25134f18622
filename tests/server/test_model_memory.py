"""A served model's memory before its first load (server/model_memory.py `estimate_bytes`): the native executor's
packed copy of an int4 file's block layers is counted (kernels/executor.py `_pack` makes it at load or in the
background after it), so that `--max-memory` does not admit a large int4 model on its file's size alone."""

from __future__ import annotations

from tinyloop.modelfile.header import packaged_model_path
from tinyloop.server.model_memory import packed_copy_bytes


def _int4_layer_bytes(in_cache: bool) -> int:
    """The shipped int4 model's block layers as the packed kernel holds them: per layer n x k / 2 bytes of codes
    and, per group and row, a 16-bit scale and an 8-bit zero point (or a 16-bit minimum), or for a model that
    stays in cache an fp32 scale and its fp32 s z' (`packed_f32`): what the executor's `copy_bytes` counts
    (`tl_pack_int4_size`), computed here from the model's own layers."""
    from tinyloop.engine import Engine
    from tinyloop.quant.linear import QuantLinear

    engine = Engine.load(packaged_model_path("tinyloop-16m-int4.tinyloop"), executor="torch")
    total = 0
    for name, mod in engine.model.named_modules():
        if isinstance(mod, QuantLinear) and mod.bits == 4 and not name.startswith("head"):
            n, k, g = mod.out_features, mod.in_features, mod.group_size
            total += n * k // 2 + n * (k // g) * (8 if in_cache else 4 if getattr(mod, "mins", None) is not None else 3)
    return total


def test_the_packed_copy_is_counted_before_the_first_load(monkeypatch):
    monkeypatch.delenv("TINYLOOP_EXECUTOR", raising=False)
    monkeypatch.delenv("TINYLOOP_NATIVE_PACK", raising=False)
    int4, fp16 = packaged_model_path("tinyloop-16m-int4.tinyloop"), packaged_model_path("tinyloop-16m.tinyloop")
    expected = _int4_layer_bytes(in_cache=True)
    assert expected > 0 and packed_copy_bytes(int4) == expected
    monkeypatch.setattr("tinyloop.kernels.executor.STREAMED_BYTES", 1 << 20)   # as if read from memory every token
    assert packed_copy_bytes(int4) == _int4_layer_bytes(in_cache=False) < expected
    monkeypatch.undo()
    monkeypatch.delenv("TINYLOOP_EXECUTOR", raising=False)
    monkeypatch.delenv("TINYLOOP_NATIVE_PACK", raising=False)
    assert packed_copy_bytes(fp16) == 0   # (no int4 layers)
    monkeypatch.setenv("TINYLOOP_NATIVE_PACK", "0")   # the mapped codes only
    assert packed_copy_bytes(int4) == 0
    monkeypatch.setenv("TINYLOOP_NATIVE_PACK", "1")
    monkeypatch.setenv("TINYLOOP_EXECUTOR", "torch")   # no native executor, no copy
    assert packed_copy_bytes(int4) == 0


def test_the_estimate_is_the_copy_the_executor_makes(monkeypatch):
    """Where the build has the packed kernel (AVX-512 VNNI), the shipped int4 model's copy as loaded
    (`engine.native.copy_bytes`) is what `packed_copy_bytes` estimated from the file's header: both choose the
    in-cache fp32 strips by the same cut (kernels/executor.py STREAMED_BYTES)."""
    import pytest

    from tinyloop.engine import Engine, native

    monkeypatch.delenv("TINYLOOP_EXECUTOR", raising=False)
    monkeypatch.delenv("TINYLOOP_NATIVE_PACK", raising=False)
    path = packaged_model_path("tinyloop-16m-int4.tinyloop")
    engine = Engine.load(path)
    if not native.runs_natively(engine.model) or native.copy_bytes(engine.model) == 0:
        pytest.skip("no native executor or no packed int4 kernel in this build")
    assert native.copy_bytes(engine.model) == packed_copy_bytes(path)
