"""`tinyloop pull` against a local Hub (tests/store/fake_hub.py, HF_ENDPOINT) serving the reference
fixtures: pull, convert, serve, greedy tokens equal to the reference code's; every error path answers with
its message and leaves no model file; a download cut halfway resumes on the next pull; list and rm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .fake_hub import FakeHub, Repo

FIXTURES = Path(__file__).parents[1] / "fixtures" / "reference"
OURO = "ByteDance/Ouro-tiny"


@pytest.fixture
def hub(tmp_path):
    with FakeHub() as h:
        h.repos[OURO] = Repo(FIXTURES / "ouro-tiny")
        h.env = {"HF_ENDPOINT": h.url, "HF_HOME": str(tmp_path / "hf"), "TINYLOOP_HOME": str(tmp_path / "tl"),
                 "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1"}
        h.store = tmp_path / "tl" / "models"
        yield h


def tinyloop(hub, *args, env=None, timeout=180):
    e = {**os.environ, **hub.env, **(env or {})}
    for k in ("HF_TOKEN", "HF_HUB_OFFLINE", "TINYLOOP_MODEL_PATH"):
        if k not in (env or {}):
            e.pop(k, None)
    return subprocess.run([sys.executable, "-m", "tinyloop", *args], capture_output=True, text=True, env=e,
                          timeout=timeout)


def store_files(hub) -> list[str]:
    return sorted(p.name for p in hub.store.iterdir()) if hub.store.exists() else []


def test_pull_serve_greedy_equals_the_reference_then_list_and_rm(hub):
    r = tinyloop(hub, "pull", OURO, "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert store_files(hub) == ["ByteDance--Ouro-tiny.tinyloop"]
    info = json.loads(tinyloop(hub, "info", f"hf:{OURO}", "--json").stdout)
    hubprov = info["provenance"]["hub"]
    assert hubprov["repo_id"] == OURO and hubprov["commit"] == hub.repos[OURO].sha
    assert info["provenance"]["converter_version"] and info["family"] == "ouro"
    # nothing but what convert reads was downloaded, and config.json came before any weight
    gets = [p.rsplit("/", 1)[-1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
    assert gets[0] == "config.json" and "reference.json" not in gets

    ref = json.loads((FIXTURES / "ouro-tiny" / "reference.json").read_text())
    port = _free_port()
    env = {**os.environ, **hub.env}
    env.pop("TINYLOOP_MODEL_PATH", None)
    proc = subprocess.Popen([sys.executable, "-m", "tinyloop", "serve", "--port", str(port), "--model",
                             f"hf:{OURO}", "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_health(url, proc)
        for k in (1, 4):
            want = ref["runs"][str(k)]["greedy_ids"]
            body = {"prompt": ref["prompt"]["ids"], "max_tokens": len(want), "loops": k, "temperature": 0}
            got = httpx.post(url + "/generate", json=body, timeout=60).json()
            assert got["tokens"] == want, (k, got)
    finally:
        proc.terminate()
        proc.wait(20)

    listed = json.loads(tinyloop(hub, "list", "--json").stdout)
    assert [(e["name"], e["family"], e["quant"]) for e in listed] == [(f"hf:{OURO}", "ouro", "fp32")]
    assert listed[0]["source"] == f"{OURO}@{hub.repos[OURO].sha}"
    r = tinyloop(hub, "rm", f"hf:{OURO}")
    assert r.returncode == 0 and store_files(hub) == []
    r = tinyloop(hub, "rm", f"hf:{OURO}")
    assert r.returncode == 2 and "is not in the store" in r.stderr


def test_a_model_path_pulls_on_first_use_and_int4_quantizes(hub, tmp_path, monkeypatch):
    hub.repos[OURO] = Repo(_ouro_with_ffn(tmp_path / "ouro192", 192))  # int4 groups need widths of 32k
    r = tinyloop(hub, "generate", "hello", "--model", f"hf:{OURO}:int4", "--max-tokens", "3", "--loops", "2")
    assert r.returncode == 0, r.stderr
    assert "is not in the store; pulling it" in r.stderr
    assert store_files(hub) == ["ByteDance--Ouro-tiny--int4.tinyloop"]  # the float intermediate is gone
    info = json.loads(tinyloop(hub, "info", f"hf:{OURO}:int4", "--json").stdout)
    assert info["quant"] == "int4" and info["family"] == "ouro"
    n = len(hub.requests)
    r = tinyloop(hub, "generate", "hello", "--model", f"hf:{OURO}:int4", "--max-tokens", "2", "--loops", "2")
    assert r.returncode == 0 and len(hub.requests) == n  # held in the store: no network at all
    # the Python API takes the same name, through the same resolution
    from tinyloop import Engine, SamplingParams

    monkeypatch.setenv("TINYLOOP_HOME", hub.env["TINYLOOP_HOME"])
    engine = Engine.load(f"hf:{OURO}:int4", draft_exit=False)
    assert len(engine.generate([5, 6, 7], SamplingParams(max_tokens=2, loops=2, ignore_eos=True)).token_ids) == 2
    assert len(hub.requests) == n


@pytest.mark.parametrize("case", ["no-repo", "no-revision", "gated", "unauthorised", "unsupported", "network",
                                  "offline", "no-weights", "bad-name"])
def test_error_paths_say_what_to_do_and_leave_no_model_file(hub, case):
    args, env, want = [OURO], {}, ""
    if case == "no-repo":
        args, want = ["someone/missing"], "repository someone/missing was not found"
    elif case == "no-revision":
        args, want = [OURO + "@v9"], "revision 'v9' of ByteDance/Ouro-tiny was not found"
    elif case == "gated":
        hub.repos[OURO].gated = True
        want = "is gated"
    elif case == "unauthorised":
        hub.require_token = "hf_right"
        env, want = {"HF_TOKEN": "hf_wrong"}, "HF_TOKEN"
    elif case == "unsupported":
        cfg = json.loads((FIXTURES / "ouro-tiny" / "config.json").read_text())
        hub.repos[OURO].files["config.json"] = json.dumps({**cfg, "model_type": "llama"}).encode()
        want = "model_type 'llama' is not a looped family"
    elif case == "network":
        hub.env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens there
        want = "cannot reach http://127.0.0.1:9"
    elif case == "offline":
        env, want = {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set and config.json of ByteDance/Ouro-tiny"
    elif case == "no-weights":
        hub.repos["x/no-weights"] = Repo(FIXTURES / "ouro-tiny", files={})
        hub.repos["x/no-weights"].folder = _copy_without(FIXTURES / "ouro-tiny", "model.safetensors",
                                                         hub.store.parents[1] / "noweights")
        args, want = ["x/no-weights"], "no model.safetensors"
    elif case == "bad-name":
        args, want = ["not-a-name"], "give ORG/NAME[@REVISION][:int4]"
    r = tinyloop(hub, "pull", *args, env=env, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert want in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert [f for f in store_files(hub) if not f.startswith(".")] == [] and not list(hub.store.glob(".*tmp")) \
        if hub.store.exists() else True
    if case == "unsupported":  # refused from config.json alone: no weight was requested
        assert not any("safetensors" in p for _, p, _ in hub.requests)


def test_a_download_cut_halfway_resumes_where_it_stopped(hub, tmp_path):
    # huggingface_hub writes 10 MiB chunks and reconnects with a Range request for the rest after a cut
    hub.repos[OURO] = Repo(_ouro_with_ffn(tmp_path / "ouro-big", 16384))  # a 25 MB weights file
    size = (tmp_path / "ouro-big" / "model.safetensors").stat().st_size
    hub.cut_file = "model.safetensors"   # the first GET stops after half the bytes, the connection closes
    r = tinyloop(hub, "pull", OURO)
    assert r.returncode == 0, r.stderr
    ranges = [rng for m, p, rng in hub.requests if m == "GET" and p.endswith("/model.safetensors")]
    assert ranges[0] is None and len(ranges) == 2 and ranges[1] == f"bytes={10 * 2**20}-", (ranges, size)
    assert store_files(hub) == ["ByteDance--Ouro-tiny.tinyloop"]


def test_pull_and_serve_nanbeige_over_http(hub):
    """Nanbeige4.2's tiny snapshot (chat_template.jinja as its own file, as the Hub repository has it) pulled
    and served: greedy tokens at every recorded depth equal the reference code's, and a chat request's
    prompt is the reference's rendering of its template (thinking on: the template's default)."""
    repo = "Nanbeige/Nanbeige4.2-tiny"
    hub.repos[repo] = Repo(FIXTURES / "nanbeige-tiny")
    r = tinyloop(hub, "pull", repo, "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    gets = [p.rsplit("/", 1)[-1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
    assert "chat_template.jinja" in gets
    ref = json.loads((FIXTURES / "nanbeige-tiny" / "reference.json").read_text())
    port = _free_port()
    env = {**os.environ, **hub.env}
    env.pop("TINYLOOP_MODEL_PATH", None)
    proc = subprocess.Popen([sys.executable, "-m", "tinyloop", "serve", "--port", str(port), "--model",
                             f"hf:{repo}", "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_health(url, proc)
        stop = set(ref["eos"]["stop_on"])
        for k in ref["loops"]:  # at 3 and 4 loops the greedy tokens reach <|im_end|>: served, they stop there
            want = ref["runs"][str(k)]["greedy_ids"]
            cut = next((i for i, t in enumerate(want) if t in stop), len(want))
            body = {"prompt": ref["prompt"]["ids"], "max_tokens": len(want), "loops": k, "temperature": 0}
            got = httpx.post(url + "/generate", json=body, timeout=60).json()
            assert got.get("tokens") == want[:cut], (k, got)
            assert got["finish_reason"] == ("stop" if cut < len(want) else "length")
        case = next(c for c in ref["chat_template"]["cases"] if not c["template_kwargs"])
        got = httpx.post(url + "/tokenize", json={"messages": case["messages"]}, timeout=60).json()
        assert got["tokens"] == case["ids"]
        chat = httpx.post(url + "/v1/chat/completions", json={"model": "tinyloop", "messages": case["messages"],
                                                              "max_tokens": 4, "temperature": 0}, timeout=60).json()
        assert chat.get("usage", {}).get("prompt_tokens") == len(case["ids"]), chat
    finally:
        proc.terminate()
        proc.wait(20)


def test_pull_parcae_fetches_its_pickle_and_its_tokenizer_repository(hub):
    """Parcae's snapshot is a pickle and no tokenizer: the pull fetches `pytorch_model.bin` (for this family
    only), then the tokenizer's own repository (SandyResearch/parcae-tokenizer), names both in the provenance,
    and the pulled model's greedy tokens equal the reference code's."""
    from tinyloop.engine import Engine, SamplingParams

    repo, tok_repo = "SandyResearch/parcae-tiny", "SandyResearch/parcae-tokenizer"
    hub.repos[repo] = Repo(FIXTURES / "parcae-tiny")
    hub.repos[tok_repo] = Repo(FIXTURES / "parcae-tiny-tokenizer", sha="fedcba9876543210fedcba9876543210fedcba98")
    r = tinyloop(hub, "pull", repo, "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    gets = [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
    assert any(p.endswith("/pytorch_model.bin") for p in gets)
    assert any(tok_repo in p and p.endswith("/tokenizer.json") for p in gets)
    info = json.loads(tinyloop(hub, "info", f"hf:{repo}", "--json").stdout)
    assert info["provenance"]["tokenizer"] == {"repo_id": tok_repo, "commit": hub.repos[tok_repo].sha}
    ref = json.loads((FIXTURES / "parcae-tiny" / "reference.json").read_text())
    k = ref["default_loops"]
    engine = Engine.load(str(hub.store / "SandyResearch--parcae-tiny.tinyloop"))
    out = engine.generate(ref["prompt"]["ids"], SamplingParams(max_tokens=len(ref["runs"][str(k)]["greedy_ids"]),
                                                              loops=k, temperature=0, ignore_eos=True))
    assert out.token_ids == ref["runs"][str(k)]["greedy_ids"]
    # another family's repository holding a pickle beside its safetensors: the pickle is not fetched
    hub.repos[OURO].files["pytorch_model.bin"] = b"not fetched"
    assert tinyloop(hub, "pull", OURO, "--dtype", "float32").returncode == 0
    assert not any(p.endswith("/pytorch_model.bin") and OURO in p for m, p, _ in hub.requests if m == "GET")


def test_an_interrupted_pull_resumes_on_the_next_one(hub):
    # a pull that fails part way (the Hub goes away) leaves no model file; the next one fetches only what
    # the Hugging Face cache does not hold yet (the completed shard is kept)
    repo = "tiny/huginn"
    hub.repos[repo] = Repo(FIXTURES / "huginn-tiny")
    hub.cut_file, hub.fail_after_cut = "model-00002-of-00002.safetensors", True
    r = tinyloop(hub, "pull", repo)
    assert r.returncode == 2 and "rerun tinyloop pull to resume" in r.stderr, r.stderr
    assert store_files(hub) == []
    hub.fail_after_cut = False
    hub.requests.clear()
    r = tinyloop(hub, "pull", repo)
    assert r.returncode == 0, r.stderr
    weights = [p.rsplit("/", 1)[-1] for m, p, _ in hub.requests if m == "GET" and p.endswith(".safetensors")]
    assert weights == ["model-00002-of-00002.safetensors"], weights
    assert store_files(hub) == ["tiny--huginn.tinyloop"]


def test_a_full_disk_while_downloading_says_so(hub, tmp_path, monkeypatch):
    import errno

    import huggingface_hub

    from tinyloop.store import pull as pull_mod
    from tinyloop.store.refs import parse_ref

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    for k, v in hub.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", full)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(pull_mod.PullError, match="disk full while downloading the weights.*resumes"):
        pull_mod.pull(parse_ref(OURO), progress=False)
    assert store_files(hub) == []


# -- helpers --------------------------------------------------------------------------------------------
def _ouro_with_ffn(dst: Path, ffn: int) -> Path:
    """The Ouro fixture with random MLP weights of another width (the fixture's 176 has no int4 group)."""
    import torch
    from safetensors.torch import load_file, save_file

    _copy_without(FIXTURES / "ouro-tiny", "model.safetensors", dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["intermediate_size"] = ffn
    (dst / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for k, v in load_file(str(FIXTURES / "ouro-tiny" / "model.safetensors")).items():
        if ".mlp." in k:
            shape = (v.shape[0], ffn) if "down_proj" in k else (ffn, v.shape[1])
            v = torch.randn(shape, generator=g) * 0.05
        tensors[k] = v.contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _copy_without(src: Path, name: str, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name != name:
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("server never became healthy")
