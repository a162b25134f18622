"""Several models on Ray Serve (issue 56 item 4): `tinyloop serve models.toml --replicas 1` on a loopback Ray
cluster, a deployment per model. Model `a` (a varied float64 model: greedy choices cannot depend on the batch)
keeps its replica from the start; model `b` (a forced model: its text says it answered) has a keep_alive of
2 s, so its deployment starts at zero replicas, its first request waits for one, and it goes back to zero when
idle. Both write to one shared prompt-cache directory. Every answer must be a single-process server's of the
same model; errors (unknown model) the single-process multi-model server's. One cluster for the module, one
replica per model (2 CPUs: the dev machine's)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("ray.serve", reason="needs tinyloop[ray]")

from tinyloop.config import preset  # noqa: E402
from tinyloop.modelfile.loader import write_model  # noqa: E402
from tinyloop.server.model_specs import ModelSpec  # noqa: E402
from tinyloop.server.settings import Settings  # noqa: E402

from .conftest import ServerThread, sse_events, write_forced_model  # noqa: E402
from .test_scaleout import AUTH, KEY, Cluster, post, without_request_id  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
B_TEXT = " alpha beta gamma delta epsilon zeta eta theta"


@pytest.fixture(scope="module")
def paths(tmp_path_factory, tokenizer) -> dict[str, Path]:
    from conftest import varied_model

    root = tmp_path_factory.mktemp("raymodels")
    model = varied_model(preset("tiny").replace(max_seq_len=512), seed=1, dtype=torch.float64)
    a = write_model(root / "a64.tinyloop", model, tokenizer=tokenizer,
                    provenance={"tool": "tests/server/test_scaleout_models.py"})
    b = write_forced_model(root / "b.tinyloop", tokenizer.encode(B_TEXT), tokenizer, max_seq_len=1024)
    config = root / "models.toml"
    config.write_text(f'[models.a]\npath = "{a}"\n[models.b]\npath = "{b}"\nkeep_alive = "2s"\n')
    return {"a": a, "b": b, "config": config, "cache": root / "cache"}


@pytest.fixture(scope="module")
def singles(paths):
    """A single-process server of each model, and one of both (its errors are the cluster's)."""
    with ServerThread(Settings(model_path=paths["a"], api_key=KEY)) as a, \
            ServerThread(Settings(model_path=paths["b"], api_key=KEY)) as b, \
            ServerThread(Settings(models=[ModelSpec(str(paths["a"]), ["a"]), ModelSpec(str(paths["b"]), ["b"])],
                                  api_key=KEY)) as both:
        yield {"a": a.url, "b": b.url, "both": both.url}


def cards(url: str) -> dict[str, dict]:
    return {c["id"]: c for c in httpx.get(url + "/v1/models", headers=AUTH, timeout=30).json()["data"]}


def wait_state(url: str, model: str, state: str, timeout_s: float) -> float:
    began = time.monotonic()
    while cards(url)[model]["tinyloop"]["state"] != state:
        assert time.monotonic() - began < timeout_s, (model, state, cards(url)[model])
        time.sleep(0.25)
    return time.monotonic() - began


@pytest.fixture(scope="module")
def cluster(paths):
    c = Cluster(None, args=(str(paths["config"]), "--replicas", "1"),
                env={"TINYLOOP_PROMPT_CACHE_DIR": str(paths["cache"])})
    try:
        deadline = time.monotonic() + 240
        while True:   # several models: /health is ok at once; a's replica is ready when /v1/models says loaded
            assert c.proc.poll() is None, c.tail()
            try:
                a = cards(c.url)["a"]["tinyloop"]
                if a["state"] == "loaded" and a["memory_bytes"] > 0:   # (loaded, and its replica has reported)
                    break
            except (httpx.TransportError, KeyError, json.JSONDecodeError):
                pass
            assert time.monotonic() < deadline, c.tail()
            time.sleep(0.25)
        print(f"\nmodel a loaded {time.monotonic() - c.started:.1f} s after start")  # noqa: T201
        yield c
    finally:
        code = c.stop()
        assert code == 0, f"tinyloop serve MODELS --replicas did not stop cleanly ({code}): {c.tail()}"


def metric(url: str, name: str, **labels) -> float:
    """The sum of the samples of `name` that have these labels (and any others)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", headers=AUTH).text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def greedy(url: str, model: str, prompt: str, **extra) -> list:
    r = post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def chat_stream_text(url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 20,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=180) as r:
        assert r.status_code == 200, r.read()
        raw = r.read()
    frames = [json.loads(f[len(b"data: "):]) for f in sse_events(raw) if f != b"data: [DONE]"]
    return "".join(c["delta"].get("content") or "" for f in frames for c in f["choices"])


def test_models_listed_with_their_state(cluster):
    listed = cards(cluster.url)
    assert list(listed) == ["a", "b"], list(listed)
    a, b = listed["a"]["tinyloop"], listed["b"]["tinyloop"]
    assert a["state"] == "loaded" and a["pinned"] and a["replicas"]["ready"] == 1 and a["memory_bytes"] > 0, a
    assert b["state"] == "unloaded" and not b["pinned"] and b["keep_alive"] == "2s", b   # at zero: on demand
    assert b["replicas"] == {"deployment": "TinyLoopEngine-b", "ready": 0, "min": 0, "max": 1}
    health = httpx.get(cluster.url + "/health").json()
    assert health["status"] == "ok" and set(health["models"]) >= {"a", "b"}


def test_each_model_answers_as_its_single_process_server(cluster, singles):
    for prompt, loops in (("The king said", 3), ("Once upon a time", 8)):
        assert greedy(cluster.url, "a", prompt, loops=loops) == greedy(singles["a"], "a", prompt, loops=loops)
    assert chat_stream_text(cluster.url, "a") == chat_stream_text(singles["a"], "a")
    began = time.monotonic()   # b is at zero replicas: this request waits for one
    got = greedy(cluster.url, "b", " alpha")
    waited = time.monotonic() - began
    assert got == greedy(singles["b"], "b", " alpha") and got[0]["text"].split()[0] == "beta"
    print(f"\nb's first request (its replica loaded from zero) answered in {waited:.1f} s")  # noqa: T201
    assert chat_stream_text(cluster.url, "b") == chat_stream_text(singles["b"], "b")
    assert cards(cluster.url)["b"]["tinyloop"]["state"] == "loaded"


def test_unknown_model_is_the_single_process_404(cluster, singles):
    chat = {"model": "nope", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for path, body in (("/v1/completions", {"model": "nope", "prompt": "x"}), ("/v1/chat/completions", chat),
                       ("/v1/messages", chat), ("/v1/responses", {"model": "nope", "input": "x"})):
        ours, theirs = post(cluster.url, path, body), post(singles["both"], path, body)
        assert ours.status_code == theirs.status_code == 404, (path, ours.text)
        if path == "/v1/messages":   # Anthropic's shape: its request id at the top
            assert {k: v for k, v in ours.json().items() if k != "request_id"} == \
                {k: v for k, v in theirs.json().items() if k != "request_id"}
        else:
            assert without_request_id(ours.json()) == without_request_id(theirs.json()), path
    r = httpx.get(cluster.url + "/v1/models/nope", headers=AUTH)
    assert r.status_code == 404 and "'a'" in r.json()["error"]["message"]


def test_metrics_per_model_and_a_shared_prompt_cache(cluster, paths):
    for model, prompt in (("a", "The king said to the queen " * 12), ("b", " alpha" * 80)):
        assert greedy(cluster.url, model, prompt, max_tokens=2)
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(cluster.url + "/metrics", headers=AUTH).text
        written = {m: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("tinyloop_prompt_cache_files_written_total{") and f'model="{m}"' in line)
                   for m in ("a", "b")}
        if all(written.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(written.values()), written
    assert 'tinyloop_replicas{model="a",state="ready"} 1.0' in text
    assert metric(cluster.url, "tinyloop_model_loads_total", model="a", outcome="ok") == 1
    deadline = time.monotonic() + 10   # (the ingress counts a replica once it has reported, within a second or two)
    while metric(cluster.url, "tinyloop_model_loads_total", model="b", outcome="ok") < 1:   # (>1: its 2 s ran out)
        assert time.monotonic() < deadline
        time.sleep(0.25)
    assert metric(cluster.url, "tinyloop_model_load_seconds_count", model="b") >= 1
    assert 'tinyloop_prompt_cache_disk_bytes{model="a",replica=' in text
    namespaces = [d for d in paths["cache"].iterdir() if d.is_dir() and d.name != "saved"]
    assert len(namespaces) == 2, namespaces   # one directory, a namespace per model


def test_ps_against_the_cluster(cluster, monkeypatch, capsys):
    from tinyloop.cli import main

    monkeypatch.setenv("TINYLOOP_API_KEY", KEY)
    assert main(["ps", "--url", cluster.url]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "loaded" in rows["a"] and "forever" in rows["a"]
    assert rows["b"].split()[1] in ("loaded", "unloaded", "loading")


def test_an_idle_keep_alive_model_scales_to_zero_and_loads_again(cluster, singles):
    assert greedy(cluster.url, "a", "x", keep_alive=0)   # a request's keep_alive: ignored on Ray (a stays)
    waited = wait_state(cluster.url, "b", "unloaded", 120)
    print(f"\nb at zero replicas {waited:.1f} s after the previous test")  # noqa: T201
    unloads = metric(cluster.url, "tinyloop_model_unloads_total", model="b")
    loads = metric(cluster.url, "tinyloop_model_loads_total", model="b")
    assert unloads >= 1 and loads == unloads, (loads, unloads)
    assert metric(cluster.url, "tinyloop_model_unloads_total", model="a") == 0
    assert cards(cluster.url)["a"]["tinyloop"]["state"] == "loaded"   # no keep_alive: its replica stays
    assert httpx.get(cluster.url + "/metrics", headers=AUTH).text.count("tinyloop_models_loaded 1.0") == 1
    r = post(cluster.url, "/v1/completions", {"model": "b", "prompt": " gamma", "max_tokens": 2, "timeout_s": 0.5})
    err = r.json()["error"]   # its wait for a replica is bounded by its timeout_s, as a load's is in one process
    assert r.status_code == 408 and (err["code"], err["param"]) == ("timeout", "timeout_s"), r.text
    assert "model 'b' was not loaded within 0.5 s" in err["message"], err
    began = time.monotonic()
    assert greedy(cluster.url, "b", " gamma") == greedy(singles["b"], "b", " gamma")
    print(f"b loaded again and answered in {time.monotonic() - began:.1f} s")  # noqa: T201
    deadline = time.monotonic() + 10
    while metric(cluster.url, "tinyloop_model_loads_total", model="b") != loads + 1:
        assert time.monotonic() < deadline
        time.sleep(0.25)


def test_each_model_its_deployment_and_sizing(paths, monkeypatch):   # (no cluster: what build_app deploys)
    from tinyloop.scaleout import refusal
    from tinyloop.scaleout.app import ScaleOut, app_builder, plan_models
    from tinyloop.server.model_specs import specs_from_args

    specs, _ = specs_from_args([str(paths["config"])])
    models = plan_models(Settings(models=specs), ScaleOut(replicas=2))
    assert [m.deployment for m in models] == ["TinyLoopEngine-a", "TinyLoopEngine-b"]
    assert models[0].sizing == {"num_replicas": 2} and models[0].target == 2 and not models[0].to_zero
    auto = models[1].sizing["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["initial_replicas"], auto["downscale_to_zero_delay_s"]) \
        == (0, 2, 0, 2.0) and models[1].to_zero and not models[1].warm
    (one,) = plan_models(Settings(model_path=paths["b"], keep_alive=30.0), ScaleOut(replicas=2))
    assert one.deployment == "TinyLoopEngine" and one.sizing["autoscaling_config"]["initial_replicas"] == 2
    assert "do not apply on Ray Serve" in refusal(Settings(models=specs, max_memory=1 << 30))
    assert refusal(Settings(keep_alive=60.0), min_replicas=1) and refusal(Settings(keep_alive=60.0)) is None
    assert app_builder({"models": [str(paths["config"])], "replicas": 1}) is not None   # a Serve config file's
    monkeypatch.setenv("TINYLOOP_MAX_MEMORY", "1G")
    with pytest.raises(ValueError, match="do not apply on Ray Serve"):
        app_builder({"models": [str(paths["config"])], "replicas": 1})
