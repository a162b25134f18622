"""Building and choosing the executor: the cached build, no compiler, the settings, what the engine reports."""

from __future__ import annotations

import pytest

from tinyloop.kernels import build, lib


def test_build_is_cached_by_content(tmp_path, monkeypatch):
    if build.compiler() is None:
        pytest.skip("no C++ compiler here")
    monkeypatch.setenv("TINYLOOP_KERNEL_CACHE", str(tmp_path))
    first = build.library_path("portable")
    assert first.parent == tmp_path and first.exists()
    stamp = first.stat().st_mtime_ns
    run = build.subprocess.run

    def no_compile(cmd, *a, **kw):
        assert "-shared" not in cmd, "a cached library was compiled again"
        return run(cmd, *a, **kw)

    monkeypatch.setattr(build.subprocess, "run", no_compile)
    assert build.library_path("portable") == first and first.stat().st_mtime_ns == stamp   # cached
    assert not list(tmp_path.glob("*.tmp"))                  # written atomically


def test_without_a_compiler_the_pytorch_path_serves(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TINYLOOP_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setattr(lib, "_libs", {})
    monkeypatch.setattr(lib, "_said", False)
    monkeypatch.delenv("TINYLOOP_EXECUTOR", raising=False)
    assert lib.native_wanted() is False and lib.native_wanted() is False
    assert capsys.readouterr().err.count("native executor unavailable (no C++ compiler") == 1   # said once
    assert lib.describe().startswith("torch (no C++ compiler")
    monkeypatch.setenv("TINYLOOP_EXECUTOR", "native")             # forced where it cannot build: an error
    with pytest.raises(build.NativeBuildError, match="no C\\+\\+ compiler"):
        lib.native_wanted()


def test_settings(monkeypatch):
    monkeypatch.setenv("TINYLOOP_EXECUTOR", "fast")
    with pytest.raises(ValueError, match="TINYLOOP_EXECUTOR must be one of"):
        lib.executor_setting()
    monkeypatch.setenv("TINYLOOP_EXECUTOR", "torch")
    assert lib.native_wanted() is False and lib.describe() == "torch (TINYLOOP_EXECUTOR=torch)"
    with lib.choose("native"):
        assert lib.executor_setting() == "native"
    assert lib.executor_setting() == "torch"
    from tinyloop.kernels.executor import default_threads
    monkeypatch.setenv("TINYLOOP_NATIVE_THREADS", "0")
    with pytest.raises(ValueError, match="TINYLOOP_NATIVE_THREADS"):
        default_threads()


def test_engine_names_its_executor(tiny_model_path, monkeypatch):
    from tinyloop.engine import Engine

    monkeypatch.setenv("TINYLOOP_EXECUTOR", "torch")
    e = Engine.load(tiny_model_path)
    assert e.model.executor is None and e.model_info()["executor"] == "torch"
    try:
        lib.load()
    except build.NativeBuildError:
        pytest.skip("no native library here")
    e = Engine.load(tiny_model_path, executor="native")
    assert e.model.executor is not None and e.model_info()["executor"].startswith("native (")
