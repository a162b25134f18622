import json

import pytest
import torch
from conftest import edit_header

from tinyloop.cli import main
from tinyloop.config import preset
from tinyloop.model import build_model
from tinyloop.modelfile.loader import ModelFileError, load_model, make_header, model_info, read_header, write_model
from tinyloop.quant.linear import QuantLinear
from tinyloop.quant.packing import QuantError
from tinyloop.tools.gptq import QuantSpec, quantize_model
from tinyloop.tools.quantize import quantized_model

CFG = preset("tiny").replace(vocab_size=512, eos_token_id=511)


def calib(n=8, T=32, seed=0):
    return torch.randint(0, CFG.vocab_size, (n, T), generator=torch.Generator().manual_seed(seed))


def logits_error(model, ref_model, x):
    with torch.inference_mode():
        a, b = model(x, 3), ref_model(x, 3)
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("method,bits", [("rtn", 4), ("gptq", 4), ("gptq", 2), ("rtn", 8)])
def test_quantized_file_round_trips(tmp_path, tokenizer, method, bits):
    ref = build_model(CFG, seed=0)
    model = build_model(CFG, seed=0)
    spec = QuantSpec(bits=bits, group_size=None if bits == 8 else 32, method=method)
    tensors, quant, report = quantize_model(model, spec, calib() if method == "gptq" else None, progress=False)
    header = make_header(CFG, torch.float32, tokenizer, {"tool": "tests"}, quant=quant)
    path = write_model(tmp_path / "q.tinyloop", None, tokenizer=tokenizer, tensors=tensors, header=header)

    h, index = read_header(path)
    q = h["weights"]["quant"]
    assert (q["method"], q["bits"], q["group_size"]) == (method, bits, None if bits == 8 else 32)
    assert "embed.weight" in q["high_precision"] and "core.0.attn.wq.weight" not in q["high_precision"]
    info = model_info(h, index)
    assert info["quant"] == f"int{bits}" and info["quant_method"] == method
    assert info["params"] == sum(p.numel() for p in ref.parameters())   # (its codes counted as their matrices)

    loaded = load_model(path)
    lin = loaded.model.core[0].attn.wqkv  # the file stores q/k/v fused, as the engine computes them
    assert isinstance(lin, QuantLinear) and lin.bits == bits
    assert loaded.model.embed.weight.dtype == torch.float32
    # the file's model computes what the in-memory fake-quantized model computes (bf16 activations aside)
    x = calib(1, 24, seed=5)
    assert logits_error(loaded.model, model, x) < 2e-2
    mem = quantized_model(CFG, tensors, quant, torch.float32)
    assert logits_error(mem, loaded.model, x) < 1e-5
    # and it stays close to the float model (looser at 2 bits)
    assert logits_error(loaded.model, ref, x) < {8: 0.02, 4: 0.15, 2: 0.6}[bits]


def test_gptq_report_compares_loop_hessians():
    model = build_model(CFG, seed=0)
    _, quant, report = quantize_model(model, QuantSpec(bits=4, group_size=32), calib(), progress=False)
    assert quant["calibration"]["hessian"] == "sum over all loops" and quant["calibration"]["loops"] == 3
    core = [r for r in report["layers"] if r["name"].startswith("core.")]
    assert core and all("err_loop1_hessian" in r for r in core)
    assert report["core_hessian"]["mean_err_all_loops"] <= report["core_hessian"]["mean_err_loop1"] * 1.05
    assert all(r["err_gptq"] < r["err_rtn"] for r in report["layers"])


def test_bad_requests_fail_clearly(tmp_path, tokenizer):
    model = build_model(CFG, seed=0)
    with pytest.raises(QuantError, match="bits must be one of"):
        quantize_model(model, QuantSpec(bits=3, group_size=32, method="rtn"), progress=False)
    with pytest.raises(QuantError, match="group size 128 does not divide the 64 input features"):
        quantize_model(model, QuantSpec(bits=4, group_size=128, method="rtn"), progress=False)
    with pytest.raises(QuantError, match="needs calibration"):
        quantize_model(model, QuantSpec(bits=4, group_size=32, method="gptq"), None, progress=False)
    # a header claiming 3 bits is a model-file error naming the problem
    tensors, quant, _ = quantize_model(model, QuantSpec(bits=4, group_size=32, method="rtn"), progress=False)
    header = make_header(CFG, torch.float32, tokenizer, {}, quant={**quant, "bits": 3})
    with pytest.raises(ModelFileError, match="bits must be one of"):  # refused before writing anything
        write_model(tmp_path / "bad.tinyloop", None, tokenizer=tokenizer, tensors=tensors, header=header)
    assert list(tmp_path.iterdir()) == []
    path = write_model(tmp_path / "q.tinyloop", None, tokenizer=tokenizer, tensors=tensors,
                       header=make_header(CFG, torch.float32, tokenizer, {}, quant=quant))
    edit_header(path, lambda h: h["weights"]["quant"].update(bits=3))
    with pytest.raises(ModelFileError, match="bits must be one of"):
        load_model(path)


def test_cli_quantize_then_info(tmp_path, tiny_model_path, capsys):
    out = tmp_path / "tiny-int4.tinyloop"
    assert main(["quantize", str(tiny_model_path), str(out), "--bits", "4", "--group-size", "32",
                 "--method", "rtn", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["quant"] == "int4" and info["quant_method"] == "rtn" and info["quant_group_size"] == 32
    assert info["file_bytes"] < tiny_model_path.stat().st_size
    assert main(["quantize", str(tiny_model_path), str(out), "--bits", "3", "--method", "rtn", "--quiet"]) == 2
    assert "bits must be one of" in capsys.readouterr().err


def test_calibration_spreads_over_files_and_skips_their_validation_split(tmp_path, tokenizer):
    from tinyloop.tools.quantize import read_calibration

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("alpha beta gamma delta\n" * 60 + "HELDOUT HELDOUT HELDOUT\n" * 3)
    b.write_text("one two three four\n" * 60)
    win = read_calibration([a, b], tokenizer, n_tokens=8 * 16, seq_len=16, val_fraction=0.05)
    assert win.shape == (8, 16)
    texts = [tokenizer.decode(w.tolist()) for w in win]
    assert sum("alpha" in t for t in texts) == 4 and sum("one" in t for t in texts) == 4
    assert not any("HELD" in t for t in texts)  # the last 5% of a.txt is its validation split
    with pytest.raises(QuantError, match="does not exist"):
        read_calibration([a, tmp_path / "none.txt"], tokenizer, 64, 16)
    # held_out=True reads only that last part (the draft-exit trainer's evaluation windows)
    c = tmp_path / "c.txt"
    c.write_text("alpha beta gamma delta\n" * 60 + "HELDOUT zeta\n" * 30)
    held = read_calibration([c], tokenizer, n_tokens=4 * 16, seq_len=16, val_fraction=0.2, held_out=True)
    texts = [tokenizer.decode(w.tolist()) for w in held]
    assert held.shape == (4, 16) and all("HELDOUT" in t and "alpha" not in t for t in texts)
    with pytest.raises(QuantError, match="> 0 for held-out"):
        read_calibration([c], tokenizer, 64, 16, held_out=True)


def test_cli_quantize_gptq_records_calibration(tmp_path, tiny_model_path, capsys):
    text = tmp_path / "c.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 80)
    out = tmp_path / "tiny-gptq.tinyloop"
    assert main(["quantize", str(tiny_model_path), str(out), "--method", "gptq", "--calib", str(text), str(text),
                 "--calib-tokens", "256", "--calib-seq-len", "32", "--calib-val-fraction", "0.01", "--quiet"]) == 0
    cal = read_header(out)[0]["weights"]["quant"]["calibration"]
    assert cal["files"] == ["c.txt", "c.txt"] and "training split" in cal["split"]
    capsys.readouterr()
    assert main(["quantize", str(tiny_model_path), str(out), "--method", "gptq", "--quiet"]) == 2
    assert "calibration" in capsys.readouterr().err


@pytest.mark.parametrize("head_bits,tol", [(8, 0.01), (4, 0.1)])
def test_cli_quantize_the_head(tmp_path, tiny_model_path, capsys, head_bits, tol):
    """--head-bits quantizes the LM head beside the float embedding; the file loads with it as `head_linear`
    and the logits stay near the float head's; a bad value is refused before any work."""
    out = tmp_path / f"tiny-h{head_bits}.tinyloop"
    assert main(["quantize", str(tiny_model_path), str(out), "--bits", "4", "--method", "rtn",
                 "--head-bits", str(head_bits), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["quant"] == "int4" and info["quant_head"] == f"int{head_bits}"
    h, _ = read_header(out)
    assert h["weights"]["quant"]["head"] == {"method": "rtn", "bits": head_bits,
                                             "group_size": None if head_bits == 8 else 32}
    model = load_model(out).model
    assert isinstance(model.head_linear, QuantLinear) and model.head_linear.bits == head_bits
    x = torch.randn(3, model.cfg.dim, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = model.logits(x)
        want = torch.nn.functional.linear(model.final_norm(x), model.head_weight.float())
    assert float((got - want).norm() / want.norm()) < tol
    with pytest.raises(SystemExit) as exc:
        main(["quantize", str(tiny_model_path), str(out), "--method", "rtn", "--head-bits", "3"])
    assert exc.value.code == 2
    assert "--head-bits" in capsys.readouterr().err


def test_a_bad_quantized_head_in_a_header_is_refused(tmp_path, tokenizer):
    model = build_model(CFG, seed=0)
    tensors, quant, _ = quantize_model(model, QuantSpec(bits=4, group_size=32, method="rtn"), progress=False)
    header = make_header(CFG, torch.float32, tokenizer, {}, quant={**quant, "head": {"bits": 3}})
    with pytest.raises(ModelFileError, match="bad quantized head"):   # the writer checks the header it writes
        write_model(tmp_path / "bad-head.tinyloop", None, tokenizer=tokenizer, tensors=tensors, header=header)
    assert not (tmp_path / "bad-head.tinyloop").exists()
