"""Model files are data, never code (issue 19): corrupted and adversarial files are refused with
ModelFileError naming the problem, quickly and without building what a hostile header describes; pickles
are not read. Writes are atomic: a full disk or an unwritable path leaves no partial file, and the
`train` / `quantize` commands say why and exit 2."""

from __future__ import annotations

import copy
import errno
import json
import pickle
import random
import struct
import time
from pathlib import Path

import pytest
import torch

from tinyloop import cli
from tinyloop.config import preset
from tinyloop.model import build_model
from tinyloop.modelfile.loader import ModelFileError, load_model, write_model

SLOW_S = 5.0  # no corrupted file may take longer than this to be refused


@pytest.fixture(scope="module")
def small_file(tmp_path_factory, tokenizer) -> Path:
    cfg = preset("tiny").replace(vocab_size=50304)  # GPT-2 ids fit; the file stays small
    path = tmp_path_factory.mktemp("safety") / "small.tinyloop"
    return write_model(path, build_model(cfg, seed=0), tokenizer=tokenizer, provenance={"tool": "tests"})


def split(path: Path) -> tuple[dict, dict, bytes]:
    """(tinyloop header, safetensors index, data bytes)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    index = json.loads(raw[8:8 + n])
    header = json.loads(index["__metadata__"]["tinyloop"])
    return header, index, raw[8 + n:]


def join(header, index, data: bytes, meta_raw: str | None = None) -> bytes:
    index = dict(index)
    index["__metadata__"] = {"tinyloop": meta_raw if meta_raw is not None else json.dumps(header)}
    blob = json.dumps(index).encode()
    return struct.pack("<Q", len(blob)) + blob + data


def refused(path: Path) -> str:
    """Load `path`: it must be refused with ModelFileError, quickly; returns the message."""
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError) as e:
        load_model(path)
    assert time.perf_counter() - t0 < SLOW_S, f"took {time.perf_counter() - t0:.1f} s to refuse"
    return str(e.value)


def loads_or_refused(path: Path) -> None:
    """A byte flip may leave a valid file (say, inside a provenance string): then it loads. Anything but
    a LoadedModel or ModelFileError is a bug."""
    t0 = time.perf_counter()
    try:
        load_model(path)
    except ModelFileError:
        pass
    assert time.perf_counter() - t0 < SLOW_S


CONFIG_VALUES = [-1, 0, 10**12, 2**63, 1.5, "64", None, [], {}, True]
CONFIG_FIELDS = ["dim", "n_heads", "ffn_dim", "n_prelude", "n_core", "n_coda", "vocab_size", "max_loops",
                 "default_loops", "max_seq_len", "n_kv_heads", "mlp", "injection"]


def adversarial_headers(header: dict, index: dict):
    """(name, header, index, meta_raw) variants a hostile or broken writer could produce."""
    for field in CONFIG_FIELDS:
        for value in CONFIG_VALUES:
            h = copy.deepcopy(header)
            h["config"][field] = value
            yield f"config.{field}={value!r}", h, index, None
    for section in ("config", "weights", "tokenizer"):
        for value in (None, [], "x", 1):
            h = copy.deepcopy(header)
            h[section] = value
            yield f"{section}={value!r}", h, index, None
        h = copy.deepcopy(header)
        del h[section]
        yield f"no {section}", h, index, None
    for key, value in [("dtype", "float8"), ("dtype", None), ("quant", {"method": "gptq", "bits": 3}),
                       ("quant", {"method": "pickle"}), ("quant", "x")]:
        h = copy.deepcopy(header)
        h["weights"][key] = value
        yield f"weights.{key}={value!r}", h, index, None
    for key, value in [("type", "pickle"), ("tensor", "nope"), ("sha256", "0" * 64), ("eos_id", "x")]:
        h = copy.deepcopy(header)
        h["tokenizer"][key] = value
        yield f"tokenizer.{key}={value!r}", h, index, None
    for value in (2, None, "1"):
        h = copy.deepcopy(header)
        h["format_version"] = value
        yield f"format_version={value!r}", h, index, None
    yield "header is a list", header, index, "[1, 2]"
    yield "header is not JSON", header, index, "{not json"
    yield "header nests deeply", header, index, "[" * 100000 + "]" * 100000
    name = next(k for k in index if k.endswith("embed.weight"))
    for key, value in [("shape", [10**9, 10**9]), ("shape", [-1]), ("shape", "x"), ("dtype", "F8"),
                       ("data_offsets", [0, 10**15]), ("data_offsets", [5, 1]), ("data_offsets", None)]:
        ix = copy.deepcopy(index)
        ix[name][key] = value
        yield f"tensor {key}={value!r}", header, ix, None
    ix = copy.deepcopy(index)
    ix[name] = "not a tensor entry"
    yield "tensor entry is a string", header, ix, None
    ix = copy.deepcopy(index)
    del ix[name]
    yield "tensor missing", header, ix, None
    ix = copy.deepcopy(index)
    ix["extra.weight"] = dict(index[name])
    yield "tensor extra", header, ix, None


def test_adversarial_headers_are_refused(small_file, tmp_path):
    header, index, data = split(small_file)
    index = {k: v for k, v in index.items() if k != "__metadata__"}
    seen = 0
    for name, h, ix, meta_raw in adversarial_headers(header, index):
        bad = tmp_path / "bad.tinyloop"
        bad.write_bytes(join(h, ix, data, meta_raw))
        try:
            loads_or_refused(bad)
        except Exception as exc:  # noqa: BLE001 - report which variant escaped
            raise AssertionError(f"{name}: {type(exc).__name__}: {exc}") from exc
        seen += 1
    assert seen > 150


def test_fuzzed_header_bytes_are_refused(small_file, tmp_path):
    """Seeded byte flips in the framing and header, and truncations anywhere."""
    raw = small_file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    rng = random.Random(19)
    bad = tmp_path / "bad.tinyloop"
    for i in range(150):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(0, 8 + n)
            b[pos] = rng.randrange(256)
        bad.write_bytes(bytes(b))
        try:
            loads_or_refused(bad)
        except Exception as exc:  # noqa: BLE001
            raise AssertionError(f"flip #{i}: {type(exc).__name__}: {exc}") from exc
    for cut in sorted(rng.sample(range(0, len(raw) - 1), 40)) + [0, 7, 8, 8 + n - 1, 8 + n]:
        bad.write_bytes(raw[:cut])
        refused(bad)


def test_pickles_are_never_loaded(small_file, tmp_path):
    """A torch.save / pickle file named .tinyloop is refused without unpickling (it would run code)."""
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    p = tmp_path / "evil.tinyloop"
    p.write_bytes(pickle.dumps({"model": Exploit()}))
    assert "not a .tinyloop file" in refused(p)
    torch.save({"w": torch.zeros(3), "x": Exploit()}, tmp_path / "evil2.tinyloop")
    refused(tmp_path / "evil2.tinyloop")
    assert not marker.exists()


# -- atomic writes --------------------------------------------------------------------------------------
def _fill_disk_after(monkeypatch, nbytes: int = 4096):
    """The writer writes part of the file, then the disk is full."""
    from tinyloop.modelfile import writer as modelfile_writer

    class FullDisk:
        def __init__(self, f):
            self.f, self.left = f, nbytes

        def write(self, b):
            n = len(memoryview(b).cast("B"))
            if n > self.left:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.left -= n
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    enter = modelfile_writer.ModelFileWriter.__enter__

    def full_enter(self):
        self._f = None
        w = enter(self)
        w._f = FullDisk(w._f)
        return w

    monkeypatch.setattr(modelfile_writer.ModelFileWriter, "__enter__", full_enter)


def test_full_disk_leaves_no_partial_file(small_file, tmp_path, monkeypatch, tokenizer):
    model = build_model(preset("tiny").replace(vocab_size=50304), seed=1)
    out = tmp_path / "out.tinyloop"
    out.write_bytes(small_file.read_bytes())  # an older file of that name
    before = out.read_bytes()
    _fill_disk_after(monkeypatch)
    with pytest.raises(ModelFileError, match="No space left on device"):
        write_model(out, model, tokenizer=tokenizer)
    assert out.read_bytes() == before  # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.tinyloop"]  # no temporary left behind


def test_quantize_to_a_full_disk_or_bad_path_fails_cleanly(small_file, tmp_path, monkeypatch, capsys):
    bad_parent = tmp_path / "a-file"
    bad_parent.write_text("not a folder")
    target = bad_parent / "q.tinyloop"
    args = ["quantize", str(small_file), str(target), "--bits", "8", "--method", "rtn", "--quiet"]
    assert cli.main(args) == 2
    assert "cannot be written" in capsys.readouterr().err and not target.exists()
    out = tmp_path / "q.tinyloop"
    _fill_disk_after(monkeypatch)
    assert cli.main([*args[:2], str(out), *args[3:]]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_train_refuses_an_unwritable_output_before_training(tmp_path, capsys):
    bad_parent = tmp_path / "a-file"
    bad_parent.write_text("not a folder")
    text = tmp_path / "corpus.txt"
    text.write_text("hello world " * 200)
    t0 = time.perf_counter()
    code = cli.main(["train", str(text), "--out", str(bad_parent / "m.tinyloop"), "--run-dir", str(tmp_path / "run"),
                     "--steps", "1000000", "--preset", "tiny"])
    assert code == 2 and time.perf_counter() - t0 < 10
    assert "cannot be written" in capsys.readouterr().err
    assert not (bad_parent / "m.tinyloop").exists()
