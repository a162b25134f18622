"""`tinyloop train-gate`: an exit gate for a model without one, its file, and the gate criterion on it."""

from __future__ import annotations

import pytest
import torch

from tinyloop.cli import main as cli_main
from tinyloop.config import preset
from tinyloop.engine import Engine, SamplingParams
from tinyloop.errors import ModelFileError, ValidationError
from tinyloop.model import build_model
from tinyloop.modelfile.loader import write_model
from tinyloop.tokenizer import Tokenizer
from tinyloop.model.gate import read_gate, write_gate

TEXT = "The king said to his people that the harvest was good and the river ran clear. " * 400


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    cfg = preset("tiny").replace(default_loops=4)
    model = build_model(cfg, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(6.0)   # varied outputs, so the loops disagree sometimes
    return write_model(tmp_path_factory.mktemp("gate") / "m.tinyloop", model, tokenizer=Tokenizer.gpt2())


def test_train_gate_then_use_it(model_path, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    assert cli_main(["train-gate", str(model_path), str(text), "--tokens", "1024", "--seq", "64", "--steps", "50",
                     "--val-fraction", "0.2"]) == 0
    assert "held-out accuracy" in capsys.readouterr().out
    gate_file = model_path.with_name("m.gate.safetensors")
    assert gate_file.exists()
    engine = Engine.load(model_path)              # the gate beside the model is attached
    assert engine.model.exit_gate is not None
    out = engine.generate("The king", SamplingParams(max_tokens=12, loops="auto", exit_criterion="gate",
                                                     exit_threshold=0.5, ignore_eos=True))
    assert len(out.token_ids) == 12 and sum(out.stats["loops_histogram"].values()) == 12
    with pytest.raises(ValidationError, match="exit gate"):
        Engine.load(model_path, gate=False).plan([1, 2], SamplingParams(loops="auto", exit_criterion="gate"))
    wrong = tmp_path / "wrong.gate.safetensors"
    write_gate(wrong, torch.nn.Linear(32, 1), {"dim": 32})
    with pytest.raises(ModelFileError, match="does not fit a model of dim 64"):
        read_gate(wrong, 64)
    with pytest.raises(ModelFileError, match="not a gate file"):
        Engine.load(model_path, gate=text)
