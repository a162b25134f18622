import json

import numpy as np
import pytest
import torch

from tinyloop.modelfile.loader import load_model
from tinyloop.train.data import split_text
from tinyloop.train.trainer import TrainConfig, Trainer, sample_loops

TEXT = "\n".join(f"Line {i}: the king said to the queen that the day was long and the night was short."
                 for i in range(400))


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text(TEXT)
    return p


def config(tmp_path, corpus, run, **kw):
    base = dict(files=[str(corpus)], out=str(tmp_path / f"{run}.tinyloop"), run_dir=str(tmp_path / run),
                preset="tiny", steps=6, batch=2, seq=32, warmup=2, ckpt_every=100, eval_every=3,
                eval_batches=1, bf16=False, max_train_loops=4, backprop_loops=2)
    base.update(kw)
    return TrainConfig(**base)


def test_split_is_last_fraction_at_line_break():
    train, val = split_text(TEXT, 0.01)
    assert train + val == TEXT and train.endswith("\n") and 0 < len(val) <= 0.011 * len(TEXT)


def test_depth_distribution_covers_every_depth():
    rng = np.random.default_rng(0)
    draws = [sample_loops(rng, 8, 12, 0.15) for _ in range(5000)]
    counts = np.bincount(draws, minlength=13)
    assert counts[0] == 0 and all(counts[1:13] > 0)
    assert abs(counts[1:9].sum() / 5000 - 0.85) < 0.03  # body: 1..default_loops


def test_interrupted_run_resumes_to_the_same_model(tmp_path, corpus):
    straight = Trainer(config(tmp_path, corpus, "a"))
    straight.train()

    tc = config(tmp_path, corpus, "b")
    first = Trainer(tc)
    orig_log = first._log

    def stop_after_three(row):
        orig_log(row)
        if row.get("step") == 3 and "loss" in row:
            first._stop = True  # what SIGINT/SIGTERM does
    first._log = stop_after_three
    assert first.train().name == "checkpoint.safetensors"
    resumed = Trainer(tc)
    assert resumed.step == 3
    resumed.train()

    a = load_model(tmp_path / "a.tinyloop")
    b = load_model(tmp_path / "b.tinyloop")
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)
    prov = b.header["provenance"]
    assert prov["steps"] == 6 and prov["tokens_seen"] == 6 * 2 * 32
    assert prov["data"]["val_fraction"] == 0.01 and prov["data"]["train_tokens"] > 0
    log = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "val_loss" in r] == [3, 6]


def test_checkpoint_for_another_config_is_refused(tmp_path, corpus):
    tc = config(tmp_path, corpus, "c", steps=1)
    Trainer(tc).train()
    with pytest.raises(SystemExit, match="different model config"):
        Trainer(config(tmp_path, corpus, "c", steps=1, overrides={"ffn_dim": 96}))


def test_checkpoint_is_safetensors_with_json_state(tmp_path, corpus):
    from safetensors import safe_open

    tc = config(tmp_path, corpus, "d", steps=2)
    Trainer(tc).train()
    path = tmp_path / "d" / "checkpoint.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["tinyloop_checkpoint"])
        keys = set(f.keys())
    assert meta["state"]["step"] == 2 and meta["optimizer"]["param_groups"]
    assert any(k.startswith("opt.") and k.endswith(".exp_avg_sq") for k in keys)
    assert any(k.startswith("model.") for k in keys)
    assert not list((tmp_path / "d").glob("*.tmp")) and not list((tmp_path / "d").glob(".*.tmp"))


def test_pickled_checkpoint_is_refused_and_never_unpickled(tmp_path, corpus):
    from tinyloop.train.checkpoint import CheckpointError

    run = tmp_path / "e"
    run.mkdir()
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    torch.save({"x": Evil()}, run / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="pickled torch.save checkpoint.*unpickling runs code"):
        Trainer(config(tmp_path, corpus, "e"))
    assert not marker.exists()


def test_corrupt_checkpoint_is_refused_with_a_message(tmp_path, corpus):
    from tinyloop.train.checkpoint import CheckpointError

    tc = config(tmp_path, corpus, "f", steps=1)
    Trainer(tc).train()
    path = tmp_path / "f" / "checkpoint.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="unreadable checkpoint"):
        Trainer(tc)
