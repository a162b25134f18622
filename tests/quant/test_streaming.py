"""`tinyloop quantize` streamed (quant.streamed, tools.quantize): the same codes as quantizing the model in
memory in fp32, from a file of either format version, written as they are made, atomically."""

from __future__ import annotations

import pytest
import torch
from conftest import varied_model, write_legacy

from tinyloop.config import preset
from tinyloop.model.fused import split_projections
from tinyloop.modelfile.loader import fuse_tensors, load_model, make_header, map_tensors, read_header, write_model
from tinyloop.tools.gptq import QuantSpec, quantize_model
from tinyloop.tools.quantize import quantize_file, read_calibration

CFG = preset("tiny")  # the GPT-2 vocabulary: calibration text is tokenized
CALIB = {"calib_tokens": 256, "calib_seq_len": 32}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tokenizer):
    """A bf16 model as a version 2 file and as a version 1 file, and a calibration text."""
    d = tmp_path_factory.mktemp("stream")
    model = varied_model(CFG, seed=0, dtype=torch.bfloat16)
    new = write_model(d / "new.tinyloop", model, tokenizer=tokenizer)
    old = d / "old.tinyloop"
    write_legacy(old, model.state_dict(), make_header(CFG, torch.bfloat16, tokenizer, {}), tokenizer)
    text = d / "calib.txt"
    text.write_text(" ".join(f"The {w} sat on mat number {i}." for i, w in enumerate(["cat", "dog", "owl"] * 300)))
    return new, old, text


def file_tensors(path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in map_tensors(path, read_header(path)[1]).items() if k != "tokenizer.bpe_ranks"}


def in_memory(path, spec, text, tokenizer) -> dict[str, torch.Tensor]:
    """What quantizing the loaded model in fp32, all in memory, gives (the tensors a file would hold)."""
    model = load_model(path).model
    split_projections(model)
    calib = read_calibration(text, tokenizer, CALIB["calib_tokens"], CALIB["calib_seq_len"]) \
        if spec.method == "gptq" else None
    tensors, quant, _ = quantize_model(model.float(), spec, calib, progress=False)
    tensors = {k: v.to(torch.bfloat16) if k in quant["high_precision"] else v for k, v in tensors.items()}
    return fuse_tensors(tensors, CFG)


@pytest.mark.parametrize("method", ["gptq", "rtn"])
def test_streamed_equals_in_memory_from_either_format(sources, tokenizer, tmp_path, method):
    new, old, text = sources
    spec = dict(bits=4, group_size=32, method=method)
    ref = in_memory(new, QuantSpec(**spec), text, tokenizer)
    for src in (new, old):
        out = tmp_path / f"{src.stem}-q.tinyloop"
        report = quantize_file(src, out, QuantSpec(**spec), calib=text if method == "gptq" else None,
                               progress=False, **CALIB)
        got = file_tensors(out)
        assert set(got) == set(ref)
        assert [k for k in ref if not torch.equal(got[k], ref[k])] == []  # same codes, scales, zeros, floats
        assert report["seconds"] >= 0 and report["total_seconds"] >= report["seconds"]
        assert read_header(out)[0]["weights"]["quant"]["method"] == method


def test_progress_is_one_line_per_block_in_a_log(sources, tmp_path, capfd):
    new, _, text = sources
    quantize_file(new, tmp_path / "q.tinyloop", QuantSpec(bits=4, group_size=32, method="gptq"), calib=text,
                  progress=True, **CALIB)
    lines = capfd.readouterr().err.strip().splitlines()
    steps = CFG.n_prelude + CFG.n_core + CFG.n_coda
    assert len(lines) == steps and lines[0].startswith(f"gptq int4: step 1/{steps} (prelude.0) done at")


def test_a_failure_midway_leaves_no_file(sources, tmp_path, monkeypatch):
    import tinyloop.tools.gptq as gptq

    new, _, text = sources
    real, calls = gptq.gptq_quantize, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("interrupted")
        return real(*args, **kw)

    monkeypatch.setattr(gptq, "gptq_quantize", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        quantize_file(new, tmp_path / "q.tinyloop", QuantSpec(bits=4, group_size=32, method="gptq"), calib=text,
                      progress=False, **CALIB)
    assert list(tmp_path.iterdir()) == []
