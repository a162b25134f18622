"""The run-time layout in the file (format version 2): q/k/v and gate/up stored fused, bound as views of
the mapped file; version 1 files fused at load with a notice; `tinyloop upgrade`."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import edit_header, varied_model, write_legacy

from tinyloop.cli import main
from tinyloop.config import preset
from tinyloop.engine import Engine
from tinyloop.engine.knobs import SamplingParams
from tinyloop.model.fused import split_projections
from tinyloop.modelfile.loader import FORMAT_VERSION, ModelFileError, load_model, make_header, map_tensors, read_header, \
    write_model
from tinyloop.modelfile.layout import fused_modules

CFG = preset("tiny").replace(vocab_size=512, eos_token_id=511)  # GQA: q 64 rows, k and v 32 each
X = torch.randint(0, CFG.vocab_size, (1, 11), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    """(model in memory, the same model as a version 2 file and as a version 1 file)."""
    d = tmp_path_factory.mktemp("layout")
    model = varied_model(CFG, seed=0).eval()
    new = write_model(d / "new.tinyloop", model, tokenizer=tokenizer)
    old = d / "old.tinyloop"
    write_legacy(old, model.state_dict(), make_header(CFG, torch.float32, tokenizer, {"tool": "tests"}), tokenizer)
    return model, new, old


def mapped_ranges(path) -> list[tuple[int, int]]:
    """Address ranges at which this process maps `path` (/proc/self/maps)."""
    ino = os.stat(path).st_ino
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and int(fields[4]) == ino and fields[5] == str(path):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi))
    return out


def test_writer_stores_projections_fused(files):
    model, new, _ = files
    header, index = read_header(new)
    assert header["format_version"] == FORMAT_VERSION == 2
    fused = fused_modules(CFG)
    for name, parts in fused.items():
        assert index[f"{name}.weight"]["shape"][0] == sum(rows for _, rows in parts)
        assert not any(f"{part}.weight" in index for part, _ in parts)
    # rows in order: q, k, v of the model's own projections
    t = map_tensors(new, index)
    attn = model.core[1].attn
    assert torch.equal(t["core.1.attn.wqkv.weight"], torch.cat([attn.wq.weight, attn.wk.weight, attn.wv.weight]))


def test_loaded_tensors_are_views_of_the_mapping(files):
    _, new, _ = files
    lm = load_model(new)
    ranges = mapped_ranges(new)
    assert ranges, "the file is not mapped"
    state = lm.model.state_dict()
    assert "core.0.attn.wqkv.weight" in state and "core.0.mlp.w_gate_up.weight" in state
    outside = [k for k, v in state.items() if not any(lo <= v.data_ptr() < hi for lo, hi in ranges)]
    assert outside == []  # every weight, fused projections included, lies in the mapped file: no copy


def test_fused_file_computes_what_the_separate_one_does(files):
    model, new, old = files
    a, b = load_model(new).model, load_model(old).model
    with torch.inference_mode():
        ref = model(X, loops=3)
        assert torch.equal(a(X, loops=3), ref) and torch.equal(b(X, loops=3), ref)
    params = SamplingParams(max_tokens=12, loops=2, ignore_eos=True)
    prompt = X[0].tolist()
    tokens = [Engine.load(p).generate(prompt, params).token_ids for p in (new, old)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 12


def test_old_file_is_fused_at_load_with_a_one_line_notice(files, capfd):
    _, _, old = files
    capfd.readouterr()
    lm = load_model(old)
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "older TinyLoop (version 1)" in err and f"tinyloop upgrade {old}" in err
    assert lm.model.core[0].attn.wqkv is not None and not hasattr(lm.model.core[0].attn, "wq")


def test_split_projections_gives_the_definitions_modules_as_views(files):
    model, new, _ = files
    lm = load_model(new)
    fused = lm.model.core[0].attn.wqkv.weight
    assert split_projections(lm.model) == (CFG.n_prelude + CFG.n_core + CFG.n_coda) * 2
    attn = lm.model.core[0].attn
    assert attn.wqkv is None and attn.wq.weight.data_ptr() == fused.data_ptr()
    assert attn.wk.weight.data_ptr() == fused[CFG.n_heads * CFG.head_dim:].data_ptr()
    assert set(lm.model.state_dict()) == set(model.state_dict())
    with torch.inference_mode():
        assert torch.equal(lm.model(X, loops=2), model(X, loops=2))


# -- tinyloop upgrade ----------------------------------------------------------------------------
def test_upgrade_in_place_and_to_another_file(files, tmp_path, capfd):
    model, new, old = files
    src = tmp_path / "m.tinyloop"
    src.write_bytes(old.read_bytes())
    out = tmp_path / "out.tinyloop"
    assert main(["upgrade", str(src), "-o", str(out)]) == 0
    assert src.read_bytes() == old.read_bytes()  # -o leaves the input alone
    assert main(["upgrade", str(src)]) == 0
    for path in (src, out):
        header, index = read_header(path)
        assert header["format_version"] == FORMAT_VERSION
        assert header["provenance"]["upgraded"]["from_format_version"] == 1
        assert header["config"] == read_header(new)[0]["config"]
        new_t, got = map_tensors(new, read_header(new)[1]), map_tensors(path, index)
        assert set(got) == set(new_t) and all(torch.equal(got[k], new_t[k]) for k in new_t)
    capfd.readouterr()
    with torch.inference_mode():
        assert torch.equal(load_model(src).model(X, loops=2), model(X, loops=2))
    assert capfd.readouterr().err == ""  # no notice any more
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.tinyloop", "out.tinyloop"]  # no temporary left


def test_upgrade_of_a_quantized_file(tmp_path, tokenizer):
    from tinyloop.tools.gptq import QuantSpec, quantize_model

    model = varied_model(CFG, seed=1)
    tensors, quant, _ = quantize_model(model, QuantSpec(bits=4, group_size=32, method="rtn"), progress=False)
    header = make_header(CFG, torch.float32, tokenizer, {"tool": "tests"}, quant=quant)
    old = tmp_path / "q.tinyloop"
    write_legacy(old, tensors, header, tokenizer)
    before = load_model(old).model
    assert main(["upgrade", str(old)]) == 0
    after = load_model(old).model
    rows = (CFG.n_heads + 2 * CFG.n_kv_heads) * CFG.head_dim  # q, k, v
    assert read_header(old)[1]["core.0.attn.wqkv.qweight"]["shape"][0] == rows
    with torch.inference_mode():
        assert torch.equal(after(X, loops=2), before(X, loops=2))


def test_upgrade_failing_midway_leaves_the_file_as_it_was(files, tmp_path, monkeypatch):
    from tinyloop.modelfile.writer import ModelFileWriter

    _, _, old = files
    src = tmp_path / "m.tinyloop"
    src.write_bytes(old.read_bytes())
    real_add, calls = ModelFileWriter.add, []

    def add(self, name, t):
        calls.append(name)
        if len(calls) == 5:
            raise ModelFileError(self.path, "cannot write the model file: No space left on device")
        real_add(self, name, t)

    monkeypatch.setattr(ModelFileWriter, "add", add)
    assert main(["upgrade", str(src)]) == 2
    assert src.read_bytes() == old.read_bytes() and [p.name for p in tmp_path.iterdir()] == ["m.tinyloop"]


def test_upgrade_refuses_bad_input(files, tmp_path, capfd):
    _, new, old = files
    not_model = tmp_path / "notes.tinyloop"
    not_model.write_text("hello " * 1000)
    truncated = tmp_path / "cut.tinyloop"
    truncated.write_bytes(old.read_bytes()[:-100])
    future = tmp_path / "future.tinyloop"
    future.write_bytes(new.read_bytes())
    edit_header(future, lambda h: h.update(format_version=99))
    for path, message in [(tmp_path / "missing.tinyloop", "no such file"),
                          (new, "already has the current layout (format version 2): nothing to upgrade"),
                          (not_model, "not a .tinyloop file"),
                          (truncated, "truncated: tensor"),
                          (future, "unknown format version 99")]:
        before = path.read_bytes() if path.exists() else None
        assert main(["upgrade", str(path)]) == 2
        err = capfd.readouterr().err
        assert err.startswith("tinyloop: error:") and message in err, err
        assert (path.read_bytes() if path.exists() else None) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.tinyloop", "future.tinyloop", "notes.tinyloop"]
