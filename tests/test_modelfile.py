import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from tinyloop.config import preset
from tinyloop.model import build_model
from tinyloop.modelfile.loader import FORMAT_VERSION, ModelFileError, load_model, write_model


@pytest.fixture
def model_file(tmp_path, tokenizer):
    path = tmp_path / "m.tinyloop"
    model = build_model(preset("tiny"), seed=3)
    write_model(path, model, tokenizer=tokenizer, provenance={"tool": "test", "steps": 0})
    return path, model


def test_roundtrip(model_file):
    path, model = model_file
    lm = load_model(path)
    x = torch.randint(0, 50257, (1, 9))
    torch.testing.assert_close(lm.model(x, loops=2), model(x, loops=2), rtol=0, atol=0)
    assert lm.config == model.cfg
    h = lm.header
    assert h["format_version"] == FORMAT_VERSION and h["weights"]["dtype"] == "float32"
    assert h["provenance"]["tool"] == "test" and "created" in h["provenance"]
    assert lm.tokenizer.encode("Hello world") == [15496, 995]


def _rewrite_header(path, mutate):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    index = json.loads(raw[8:8 + n])
    mutate(index)
    new = json.dumps(index).encode()
    new += b" " * ((8 - len(new) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_truncated(model_file):
    path, _ = model_file
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelFileError, match="truncated"):
        load_model(path)


def test_not_a_tinyloop_file(tmp_path):
    p = tmp_path / "x.tinyloop"
    p.write_bytes(b"hello, I am a text file and not a model at all" * 10)
    with pytest.raises(ModelFileError, match="not a .tinyloop file"):
        load_model(p)
    q = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(q))
    with pytest.raises(ModelFileError, match="without a TinyLoop header"):
        load_model(q)
    with pytest.raises(ModelFileError, match="no such file"):
        load_model(tmp_path / "missing.tinyloop")


def _header_edit(path, fn):
    def mutate(index):
        h = json.loads(index["__metadata__"]["tinyloop"])
        fn(h)
        index["__metadata__"]["tinyloop"] = json.dumps(h)
    _rewrite_header(path, mutate)


def test_unknown_version(model_file):
    path, _ = model_file
    _header_edit(path, lambda h: h.update(format_version=99))
    with pytest.raises(ModelFileError, match="unknown format version 99"):
        load_model(path)


def test_wrong_shape(model_file):
    path, _ = model_file
    _header_edit(path, lambda h: h["config"].update(ffn_dim=96))
    with pytest.raises(ModelFileError, match=r"tensor '.*mlp.w_.*' has shape \[\d+, \d+\], config needs \[\d+, \d+\]"):
        load_model(path)


def test_missing_tensor(model_file):
    path, _ = model_file
    _rewrite_header(path, lambda index: index.pop("core.1.mlp.w_down.weight"))
    with pytest.raises(ModelFileError, match="missing tensor 'core.1.mlp.w_down.weight'"):
        load_model(path)


def test_wrong_dtype(model_file):
    path, _ = model_file
    _header_edit(path, lambda h: h["weights"].update(dtype="float16"))
    with pytest.raises(ModelFileError, match="is float32, header says float16"):
        load_model(path)


def test_error_names_the_file(model_file):
    path, _ = model_file
    _header_edit(path, lambda h: h["config"].update(n_core=0))
    with pytest.raises(ModelFileError) as exc:
        load_model(path)
    assert str(path) in str(exc.value) and "n_core" in str(exc.value)


def test_float_weights_are_views_of_one_mapping_of_the_file(model_file):
    """Zero-copy loading: every weight lies where the file puts it, in one mapping (no read, no copy)."""
    path, _ = model_file
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    index = json.loads(raw[8:8 + n])
    lm = load_model(path)
    params = dict(lm.model.named_parameters())
    first = min(params, key=lambda k: index[k]["data_offsets"][0])
    for name, p in params.items():
        gap = index[name]["data_offsets"][0] - index[first]["data_offsets"][0]
        assert p.data_ptr() - params[first].data_ptr() == gap, name
    # copy-on-write: a write to a loaded weight never reaches the file
    with torch.no_grad():
        params[first].add_(1.0)
    assert path.read_bytes() == raw


def test_truncated_or_corrupt_files_name_the_tensor(model_file):
    path, _ = model_file
    raw = path.read_bytes()
    path.write_bytes(raw[:-1000])
    with pytest.raises(ModelFileError, match=r"truncated: tensor '.+' ends at byte \d+ but the file has"):
        load_model(path)
    path.write_bytes(raw)

    def shrink(index):
        name = next(k for k in index if k.endswith("wqkv.weight"))
        index[name]["data_offsets"][1] -= 4
    _rewrite_header(path, shrink)
    with pytest.raises(ModelFileError, match=r"tensor '.*wqkv.weight' holds \d+ bytes but its shape"):
        load_model(path)
