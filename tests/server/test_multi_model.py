"""Several models behind one server (issue 56 items 1, 2 and 4; server/models.py): routing by a request's
`model` on every API, the 404 that names the list in each API's own shape, loading on demand, keep_alive 0
and -1, LRU under --max-loaded-models 1 (a request that arrives during a load waits and is answered; a
running request is never cut), a model that fails to load next to ones that serve, /v1/models' states and
`tinyloop ps`. Forced models (conftest.write_forced_model) tell which model answered by their text."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from tinyloop.server.model_specs import ModelSpec, specs_from_args
from tinyloop.server.settings import PINNED, parse_keep_alive, parse_size
from tinyloop.server.settings import Settings

from .conftest import FORCED_TEXT, ServerThread, write_forced_model

B_TEXT = " alpha beta gamma delta epsilon zeta eta theta"
A_PROMPT, A_NEXT = " there", "said"   # a chain token of each model, and the word that follows it
B_PROMPT, B_NEXT = " alpha", "beta"


@pytest.fixture(scope="module")
def paths(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("multi")
    a = write_forced_model(root / "a.tinyloop", tokenizer.encode(FORCED_TEXT), tokenizer, max_seq_len=4096)
    b = write_forced_model(root / "b.tinyloop", tokenizer.encode(B_TEXT), tokenizer, max_seq_len=4096)
    return {"a": a, "b": b, "broken": root / "missing.tinyloop"}


def settings_for(paths, *, names=("a", "b", "broken"), **kw) -> Settings:
    return Settings(models=[ModelSpec(str(paths[n]), [n]) for n in names], **kw)


@pytest.fixture(scope="module")
def multi(paths):
    with ServerThread(settings_for(paths)) as srv:
        yield srv


def complete(srv, model, prompt, max_tokens=6, **extra) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0, **extra}, timeout=120)


def cards(srv) -> dict[str, dict]:
    return {c["id"]: c for c in httpx.get(srv.url + "/v1/models").json()["data"]}


def wait_state(srv, model, state, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        card = cards(srv)[model]
        if card["tinyloop"]["state"] == state:
            return card
        assert time.monotonic() < deadline, (model, state, card)
        time.sleep(0.05)


def metric(srv, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(f"{name}{{{want}}}" if want else name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- parsing --------------------------------------------------------------------------------------
def test_keep_alive_and_sizes_parse():
    assert parse_keep_alive(None) is None
    assert parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0
    assert parse_keep_alive(-1) == PINNED and parse_keep_alive("-1m") == PINNED
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive("300ms") == 0.3
    assert parse_keep_alive(2.5) == 2.5
    for bad in ("soon", "5 minutes", True, [1]):
        with pytest.raises(Exception, match="keep_alive"):
            parse_keep_alive(bad)
    assert parse_size("8G") == 8 << 30 and parse_size("512M") == 512 << 20 and parse_size("1.5GiB") == 3 << 29


def test_models_from_arguments_directory_and_config(tmp_path, paths):
    specs, _ = specs_from_args([str(paths["a"]), f"small={paths['b']}", "tinyloop-16m"])
    assert [(s.source, s.names) for s in specs] == [(str(paths["a"]), []), (str(paths["b"]), ["small"]),
                                                   ("tinyloop-16m", [])]
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "x.tinyloop").write_bytes(b"")
    (folder / "notes.txt").write_text("")
    assert [s.source for s in specs_from_args([str(folder)])[0]] == [str(folder / "x.tinyloop")]
    config = tmp_path / "models.toml"
    config.write_text(f'keep_alive = "10m"\nmax_loaded_models = 2\nloops = 3\n'
                      f'[models.fast]\npath = "{paths["a"]}"\nkv = "int8"\ncontext = 512\nkeep_alive = -1\n'
                      f'[models.other]\npath = "{paths["b"]}"\nnames = ["b2"]\n')
    specs, server = specs_from_args([str(config)])
    assert server == {"max_loaded_models": 2}
    fast, other = specs
    assert (fast.names, fast.kv, fast.context, fast.keep_alive, fast.loops) == (["fast"], "int8", 512, PINNED, 3)
    assert (other.names, other.keep_alive, other.loops) == (["other", "b2"], 600, 3)
    as_json = tmp_path / "models.json"
    as_json.write_text(json.dumps({"models": {"j": {"path": str(paths["a"]), "loops": 2}}}))
    assert specs_from_args([str(as_json)])[0][0].loops == 2
    config.write_text('[models.x]\npath = "a"\nspeed = 3\n')
    with pytest.raises(SystemExit, match="speed"):
        specs_from_args([str(config)])


# -- one server, several models --------------------------------------------------------------------
def test_routes_by_name_on_every_api(multi):
    assert complete(multi, "a", A_PROMPT).json()["choices"][0]["text"].split()[0] == A_NEXT
    r = complete(multi, "b", B_PROMPT)
    assert r.status_code == 200 and r.json()["model"] == "b"
    assert r.json()["choices"][0]["text"].split()[0] == B_NEXT
    assert complete(multi, "b@loops=2", B_PROMPT).json()["choices"][0]["text"].split()[0] == B_NEXT
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0}
    outs = {}
    for model in ("a", "b"):
        body = {**chat, "model": model}
        outs[model] = [
            httpx.post(multi.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
            ["content"],
            httpx.post(multi.url + "/api/v0/chat/completions", json=body, timeout=60).json()["choices"][0]
            ["message"]["content"],
            httpx.post(multi.url + "/v1/messages", json=body, timeout=60).json()["content"][0]["text"],
            httpx.post(multi.url + "/v1/responses", json={"model": model, "input": "x", "max_output_tokens": 4,
                                                          "temperature": 0}, timeout=60).json()["output"][-1]
            ["content"][0]["text"],
        ]
        assert len(set(outs[model])) == 1, outs[model]   # the same model behind every API
    for model, prompt, nxt in (("a", A_PROMPT, A_NEXT), ("b", B_PROMPT, B_NEXT)):   # the text routes tell them apart
        r = httpx.post(multi.url + "/api/v0/completions", json={"model": model, "prompt": prompt, "max_tokens": 3,
                                                               "temperature": 0}, timeout=60)
        assert r.json()["choices"][0]["text"].split()[0] == nxt
        r = httpx.post(multi.url + "/generate", json={"model": model, "prompt": prompt, "max_tokens": 3,
                                                      "temperature": 0}, timeout=60)
        assert r.json()["text"].split()[0] == nxt, r.text
    for model in ("a", "b"):
        r = httpx.post(multi.url + "/v1/embeddings", json={"model": model, "input": "hello"}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == model
    # the README's name is the first model's
    assert complete(multi, "tinyloop", A_PROMPT).json()["choices"][0]["text"].split()[0] == A_NEXT


def test_unknown_model_is_a_404_naming_the_list_in_each_apis_shape(multi):
    chat = {"model": "nope", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for path, body in (("/v1/completions", {"model": "nope", "prompt": "x"}), ("/v1/chat/completions", chat),
                       ("/api/v0/chat/completions", chat), ("/v1/embeddings", {"model": "nope", "input": "x"}),
                       ("/v1/responses", {"model": "nope", "input": "x"})):
        r = httpx.post(multi.url + path, json=body, timeout=30)
        assert r.status_code == 404, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model", (path, err)
        assert "'nope'" in err["message"] and all(f"'{n}'" in err["message"] for n in ("a", "b", "broken"))
    r = httpx.post(multi.url + "/v1/messages", json=chat, timeout=30)   # Anthropic's own shape
    assert r.status_code == 404 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "not_found_error" and "'nope'" in r.json()["error"]["message"]
    r = httpx.get(multi.url + "/v1/models/nope")
    assert r.status_code == 404 and "'a'" in r.json()["error"]["message"]
    assert httpx.get(multi.url + "/v1/models/b").json()["id"] == "b"


def test_a_failing_model_answers_its_requests_and_leaves_the_others_serving(multi):
    for _ in range(2):
        r = complete(multi, "broken", "x")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "model_load_failed" and "'broken'" in err["message"] and "missing" in err["message"]
    r = httpx.post(multi.url + "/v1/messages", json={"model": "broken", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "x"}]}, timeout=30)
    assert r.status_code == 503 and r.json()["type"] == "error"
    assert complete(multi, "a", "x").status_code == 200 and complete(multi, "b", "x").status_code == 200
    card = cards(multi)["broken"]["tinyloop"]
    assert card["state"] == "failed" and "missing" in card["error"]
    assert metric(multi, "tinyloop_model_loads_total", model="broken", outcome="failed") >= 1
    assert httpx.get(multi.url + "/health").json()["status"] == "ok"


def test_models_list_states_memory_and_tinyloop_ps(multi, capsys):
    complete(multi, "a", "x")
    assert complete(multi, "broken", "x").status_code == 503
    listed = cards(multi)
    assert list(listed) == ["a", "b", "broken"]
    a = listed["a"]["tinyloop"]
    assert a["state"] == "loaded" and a["memory_bytes"] > 0 and a["load_seconds"] > 0
    assert {"default_loops", "max_loops", "trained_loops", "owned_by"} <= set(listed["broken"])
    lm = {c["id"]: c for c in httpx.get(multi.url + "/api/v0/models").json()["data"]}
    assert lm["a"]["state"] == "loaded" and lm["broken"]["state"] == "not-loaded"
    from tinyloop.cli import main

    assert main(["ps", "--url", multi.url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["NAME", "STATE", "MEMORY"]
    rows = {line.split()[0]: line for line in out[1:]}
    assert "loaded" in rows["a"] and "MiB" in rows["a"] and rows["broken"].split()[1] == "failed:"
    assert main(["ps", "--url", "http://127.0.0.1:9"]) == 1
    assert metric(multi, "tinyloop_model_loads_total", model="a", outcome="ok") == 1


def test_load_on_demand_and_keep_alive(paths):
    with ServerThread(settings_for(paths, names=("a", "b"))) as srv:
        assert {k: c["tinyloop"]["state"] for k, c in cards(srv).items()} == {"a": "unloaded", "b": "unloaded"}
        assert complete(srv, "b", "x", keep_alive=0).status_code == 200   # 0: unloaded once answered
        wait_state(srv, "b", "unloaded")
        assert metric(srv, "tinyloop_model_unloads_total", model="b", reason="keep_alive") == 1
        assert complete(srv, "a", "x", keep_alive="1s").status_code == 200
        card = cards(srv)["a"]["tinyloop"]
        assert card["state"] == "loaded" and card["expires_in_s"] <= 1
        wait_state(srv, "a", "unloaded", timeout=10)
        assert complete(srv, "a", "x", keep_alive=-1).status_code == 200   # -1: pinned
        assert cards(srv)["a"]["tinyloop"]["pinned"]
        r = complete(srv, "a", "x", keep_alive="soon")
        assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
        assert metric(srv, "tinyloop_model_loads_total", model="a", outcome="ok") == 2


def test_lru_with_one_loaded_model(paths):
    with ServerThread(settings_for(paths, names=("a", "b"), max_loaded_models=1)) as srv:
        order = ["a", "b", "a", "b"]
        for model in order:
            text = complete(srv, model, {"a": A_PROMPT, "b": B_PROMPT}[model]).json()["choices"][0]["text"]
            assert text.split()[0] == {"a": A_NEXT, "b": B_NEXT}[model]
            states = {k: c["tinyloop"]["state"] for k, c in cards(srv).items()}
            assert states[model] == "loaded" and list(states.values()).count("loaded") == 1, states
        assert metric(srv, "tinyloop_model_loads_total", model="a", outcome="ok") == 2
        assert metric(srv, "tinyloop_model_unloads_total", model="a", reason="lru") == 2 - (order[-1] == "a")
        # requests that arrive while a model loads (and while the other one is still running) wait, all answered
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(complete, srv, m, "x", 4) for m in ("a", "b") * 4]
            assert [f.result().status_code for f in futures] == [200] * 8
        # a request's own timeout_s bounds its wait for a load
        r = complete(srv, "a" if cards(srv)["b"]["tinyloop"]["state"] == "loaded" else "b", "x", timeout_s=0.001)
        assert r.status_code in (200, 408), r.text


def test_a_running_request_is_not_cut_by_an_unload(paths):
    with ServerThread(settings_for(paths, names=("a", "b"), max_loaded_models=1)) as srv:
        complete(srv, "a", "x")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            long = pool.submit(complete, srv, "a", A_PROMPT, 3000, ignore_eos=True)
            deadline = time.monotonic() + 10
            while cards(srv)["a"]["tinyloop"]["running"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            other = pool.submit(complete, srv, "b", "x")
            time.sleep(0.2)
            assert cards(srv)["a"]["tinyloop"].get("unloading_when_idle")
            r = long.result()
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
            assert r.json()["usage"]["completion_tokens"] == 3000
            assert other.result().status_code == 200
        assert cards(srv)["b"]["tinyloop"]["state"] == "loaded"


def test_a_pinned_model_is_never_unloaded(paths):
    specs = [ModelSpec(str(paths["a"]), ["a"], keep_alive=PINNED), ModelSpec(str(paths["b"]), ["b"])]
    with ServerThread(Settings(models=specs, max_loaded_models=1)) as srv:
        wait_state(srv, "a", "loaded")   # a pinned model loads at start
        r = complete(srv, "b", "x")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_capacity", r.text
        assert "pinned" in r.json()["error"]["message"]
        assert complete(srv, "a", "x").status_code == 200
        assert cards(srv)["a"]["tinyloop"]["state"] == "loaded"


def test_serve_refuses_the_pool_bounds_on_ray_and_a_missing_file(paths, capsys, monkeypatch):
    import os

    from tinyloop.cli import main

    flags = ("TINYLOOP_MAX_LOADED_MODELS", "TINYLOOP_MAX_MEMORY", "TINYLOOP_KEEP_ALIVE")
    for env in flags:   # (serve sets them in os.environ: monkeypatch puts back what was there before)
        monkeypatch.setenv(env, "")
        monkeypatch.delenv(env)
    for flag, value in (("--max-loaded-models", "1"), ("--max-memory", "1G")):   # on Ray: a deployment each
        assert main(["serve", str(paths["a"]), str(paths["b"]), "--replicas", "2", flag, value]) == 2   # (_fail)
        assert "do not apply on Ray Serve" in capsys.readouterr().err
        for env in flags:
            os.environ.pop(env, None)
    assert main(["serve", str(paths["a"]), "--keep-alive", "5m", "--min-replicas", "1"]) == 2
    assert "--min-replicas keeps some" in capsys.readouterr().err
    for env in flags:
        os.environ.pop(env, None)
    assert main(["serve", str(paths["a"]), str(paths["broken"])]) == 1   # every header checked before the port
    err = capsys.readouterr().err
    assert "cannot load the model" in err and "missing.tinyloop" in err


def test_each_model_keeps_its_own_prompt_cache_on_disk(paths, tmp_path):
    cache = tmp_path / "cache"
    with ServerThread(settings_for(paths, names=("a", "b"), prompt_cache_dir=cache)) as srv:
        for model, prompt in (("a", A_PROMPT), ("b", B_PROMPT)):
            assert complete(srv, model, prompt * 40, max_tokens=2).status_code == 200
        r = httpx.post(srv.url + "/v1/cache/save", json={"name": "conv-b", "model": "b", "prompt": B_PROMPT * 40},
                       timeout=60)
        assert r.status_code == 200 and r.json()["cached_tokens"] >= 32, r.text
        r = httpx.post(srv.url + "/v1/cache/restore", json={"name": "conv-b", "model": "a"}, timeout=60)
        assert r.status_code == 409 and r.json()["error"]["code"] == "cache_mismatch"   # another model's
        assert httpx.post(srv.url + "/v1/cache/restore", json={"name": "conv-b", "model": "b"},
                          timeout=60).status_code == 200
        deadline = time.monotonic() + 20
        while len([d for d in cache.iterdir() if d.is_dir() and d.name != "saved"]) < 2:   # a namespace each
            assert time.monotonic() < deadline, sorted(p.name for p in cache.iterdir())
            time.sleep(0.1)
        assert metric(srv, "tinyloop_prompt_cache_files_written_total") > 0


def test_one_model_unloaded_by_keep_alive_loads_again_on_its_next_request(paths):
    with ServerThread(Settings(model_path=paths["a"])) as srv:
        assert complete(srv, "anything", A_PROMPT, keep_alive=0).status_code == 200
        deadline = time.monotonic() + 20
        while httpx.get(srv.url + "/health").json().get("model_state") != "unloaded":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (card,) = httpx.get(srv.url + "/v1/models").json()["data"]
        assert card["id"] == "a" and card["tinyloop"]["state"] == "unloaded"
        assert httpx.get(srv.url + "/v1/models/a").json()["tinyloop"]["state"] == "unloaded"
        assert httpx.get(srv.url + "/v1/models/zz").status_code == 404
        r = complete(srv, "anything", A_PROMPT)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].split()[0] == A_NEXT
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == ["a"]


def test_per_model_defaults_from_a_config(paths, tmp_path):
    config = tmp_path / "models.toml"
    config.write_text(f'[models.deep]\npath = "{paths["a"]}"\n'
                      f'[models.shallow]\npath = "{paths["a"]}"\nloops = 2\ncontext = 64\nkv = "int8"\n')
    specs, _ = specs_from_args([str(config)])
    with ServerThread(Settings(models=specs)) as srv:
        deep, shallow = complete(srv, "deep", A_PROMPT), complete(srv, "shallow", A_PROMPT)
        assert deep.headers["x-tinyloop-loops"] == "3" and shallow.headers["x-tinyloop-loops"] == "2"   # tiny: 3
        listed = cards(srv)
        assert listed["shallow"]["default_loops"] == 2 and listed["deep"]["default_loops"] == 3
        info = httpx.post(srv.url + "/api/v0/completions", json={"model": "shallow", "prompt": A_PROMPT,
                                                                "max_tokens": 1}, timeout=60).json()["model_info"]
        assert info["max_seq_len"] == 64 and info["kv_cache_mode"] == "int8"
        assert complete(srv, "shallow", A_PROMPT * 70).status_code == 400   # past its own context
