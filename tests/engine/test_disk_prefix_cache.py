"""The prompt cache on disk (issue 56, item 3; engine/disk_cache.py): the prefix cache's blocks in files that
outlive the engine core, read back by a new core ("a restart") exactly as a warm cache serves them; bad files
(corrupted, truncated, another model's, a write cut short) are never read, each ignored and removed with one
log line; the directory stays within its byte bound."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import varied_model
from tinyloop.config import preset
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.cache_dir import SUFFIX, CacheNameError, check_name, file_hash, read_manifest
from tinyloop.engine.disk_cache import open_prompt_cache
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.modelfile.loader import write_model

PROMPT = [(37 * i + 11) % 500 + 3 for i in range(100)]   # 6 full 16-token blocks + 4
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LOG = "tinyloop.engine"


def _model_file(path: Path, tokenizer, seed: int = 0) -> Path:
    write_model(path, varied_model(preset("tiny"), seed=seed), tokenizer=tokenizer)
    return path


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tokenizer):
    return _model_file(tmp_path_factory.mktemp("dc") / "a.tinyloop", tokenizer)


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine.load(model_path)


def core(engine, directory=None, **kw):
    """A fresh engine core (an empty pool: what a restarted server starts with), on `directory` if given."""
    batch = BatchEngine(engine, max_num_seqs=4, kv_pool_bytes=kw.pop("pool", None))
    disk = open_prompt_cache(batch, engine, directory, **kw) if directory is not None else None
    if disk is not None:
        disk.flush(10)   # (its first scan)
    return batch, disk


def run(batch, prompt=PROMPT, params=PARAMS):
    events = run_to_completion(batch, [(prompt, params)])[0]
    return [t for e in events for t in e.token_ids], events[-1].stats.get("prompt_tokens_cached", 0)


def files(disk) -> list[Path]:
    return sorted(disk.dir.glob("*" + SUFFIX))


def block_paths(disk, prompt=PROMPT):
    """The files of the prompt's full blocks, in chain order."""
    from tinyloop.engine.prefix_cache import block_name

    salt, names, parent = ("loops", 3, "window", 0), [], None
    for b in range(len(prompt) // 16):
        parent = block_name(parent, prompt[b * 16:(b + 1) * 16], salt)
        names.append(disk.path(parent))
    return names


@pytest.fixture(scope="module")
def cold(engine):
    return run(core(engine)[0])[0]


def written(engine, directory):
    """A first server's life: the prompt computed (cold), its blocks written, then a clean shutdown."""
    batch, disk = core(engine, directory)
    ids, cached = run(batch)
    assert cached == 0
    disk.close(batch.sched.prefix)
    return ids


def test_a_restart_reuses_the_blocks_with_the_same_greedy_tokens(engine, tmp_path, cold):
    assert written(engine, tmp_path) == cold
    batch, disk = core(engine, tmp_path)
    assert len(files(disk)) >= 6
    ids, cached = run(batch)
    assert ids == cold and cached == 96            # every full block of the prompt, read from disk
    assert disk.hits == 6 and disk.hit_tokens == 96 and disk.ignored == 0
    ids, cached = run(batch)                      # then from memory, as a warm cache
    assert ids == cold and cached == 96 and disk.hits == 6
    disk.close(batch.sched.prefix)


def test_a_longer_prompt_reads_the_shared_prefix_and_computes_the_rest(engine, tmp_path, cold):
    written(engine, tmp_path)
    batch, disk = core(engine, tmp_path)
    longer = PROMPT + [7, 8, 9] * 10
    ids, cached = run(batch, longer)
    assert cached == 96
    assert ids == run(core(engine)[0], longer)[0]
    disk.close(batch.sched.prefix)


def test_idle_preload_puts_the_recent_blocks_in_memory(engine, tmp_path, cold):
    written(engine, tmp_path)
    batch, disk = core(engine, tmp_path)
    while disk.preload(batch.sched.prefix):
        pass
    assert disk.preloaded >= 6 and len(batch.sched.prefix) >= 6
    ids, cached = run(batch)
    assert ids == cold and cached == 96 and disk.hits == 0   # found in memory: nothing read at admission
    disk.close(batch.sched.prefix)


def test_a_warm_start_reads_and_replays_the_last_conversation(engine, tmp_path, cold):
    batch, disk = core(engine, tmp_path)
    run(batch, [5] + PROMPT[1:])                  # an older conversation
    run(batch)                                    # the last one
    disk.close(batch.sched.prefix)
    batch, disk = core(engine, tmp_path)
    assert disk.warm_start(batch) == 96           # its 6 full blocks read back, then replayed once
    assert batch.steps == 0 and not batch.has_work
    ids, cached = run(batch)
    assert ids == cold and cached == 96 and disk.hits == 0
    disk.close(batch.sched.prefix)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_a_damaged_file_is_ignored_removed_and_logged_once(engine, tmp_path, cold, caplog, damage):
    written(engine, tmp_path)
    batch, disk = core(engine, tmp_path)
    bad = block_paths(disk)[2]
    raw = bytearray(bad.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:len(raw) - 100]
    elif damage == "empty":
        raw = bytearray()
    else:
        raw = bytearray(b"not a block" * 50)
    bad.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger=LOG):
        ids, cached = run(batch)
    assert ids == cold                            # blocks 2.. computed, never read from the bad file
    assert cached == 32                           # blocks 0 and 1 came from disk
    assert disk.ignored == 1
    lines = [r for r in caplog.records if "prompt cache" in r.getMessage()]
    assert len(lines) == 1 and str(bad) in lines[0].getMessage(), [r.getMessage() for r in lines]
    disk.close(batch.sched.prefix)
    assert bad.read_bytes() != bytes(raw)         # removed, then written again from the block just computed
    batch, disk = core(engine, tmp_path)
    assert run(batch) == (cold, 96) and disk.ignored == 0
    disk.close(batch.sched.prefix)


def test_another_models_file_is_foreign(engine, tmp_path, tokenizer, cold, caplog):
    other = Engine.load(_model_file(tmp_path / "b.tinyloop", tokenizer, seed=1))
    written(engine, tmp_path / "cache")
    ob, od = core(other, tmp_path / "cache")
    run(ob)
    od.close(ob.sched.prefix)
    assert od.identity["model"] != file_hash(engine.loaded.path)
    batch, disk = core(engine, tmp_path / "cache")
    mine, theirs = block_paths(disk)[0], block_paths(od)[0]
    assert mine.name == theirs.name and mine != theirs   # same tokens, another namespace
    mine.write_bytes(theirs.read_bytes())         # (as if copied in by hand, or a hash collision)
    with caplog.at_level(logging.WARNING, logger=LOG):
        ids, cached = run(batch)
    assert ids == cold and cached == 0 and disk.ignored == 1
    (line,) = [r.getMessage() for r in caplog.records if "prompt cache" in r.getMessage()]
    assert "another model" in line
    disk.close(batch.sched.prefix)


def test_another_kv_format_is_another_namespace(engine, tmp_path):
    written(engine, tmp_path)
    int8 = Engine(engine.loaded, kv_format="int8")
    batch, disk = core(int8, tmp_path)
    _, cached = run(batch)
    assert cached == 0 and disk.hits == 0 and disk.identity["kv_format"] == "int8"
    disk.close(batch.sched.prefix)


def test_a_write_cut_short_is_never_read_and_is_removed_at_start(engine, tmp_path, cold):
    written(engine, tmp_path)
    batch, disk = core(engine, tmp_path)
    ns = disk.dir
    disk.close(batch.sched.prefix)
    # SIGKILL mid-write leaves the temporary file (a dead writer's pid); the final name never held a partial file
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    victim = block_paths(disk)[3]
    leftover = ns / f".tmp.{os.uname().nodename}.{dead.pid}.abcdef"
    leftover.write_bytes(victim.read_bytes()[:1000])
    victim.unlink()                               # its rename never happened
    batch, disk = core(engine, tmp_path)
    assert not leftover.exists()                  # removed by the first scan
    ids, cached = run(batch)
    assert ids == cold and cached == 48 and disk.ignored == 0   # blocks 0-2 read, 3.. computed
    disk.close(batch.sched.prefix)


def test_a_live_writers_temporary_file_is_left_alone(engine, tmp_path):
    batch, disk = core(engine, tmp_path)
    mine = disk.dir / f".tmp.{os.uname().nodename}.{os.getppid()}.abcdef"
    mine.write_bytes(b"x")
    disk.close(batch.sched.prefix)
    batch, disk = core(engine, tmp_path)
    assert mine.exists()
    disk.close(batch.sched.prefix)


def test_the_byte_bound_holds_least_recently_used_first(engine, tmp_path):
    batch, disk = core(engine, tmp_path)
    run(batch)
    disk.flush(10)
    size = max(p.stat().st_size for p in files(disk))
    disk.close(batch.sched.prefix)
    bound = 10 * size                             # room for 10 blocks; 3 prompts of 6 need 18
    batch, disk = core(engine, tmp_path, max_bytes=bound)
    prompts = [[(t + k * 101) % 500 + 3 for t in PROMPT] for k in range(3)]
    for p in prompts:
        run(batch, p)
        disk.flush(10)
        assert disk.bytes_on_disk <= bound
    total = sum(p.stat().st_size for p in disk.root.rglob("*") if p.is_file())
    assert total <= bound and disk.evicted > 0
    last = block_paths(disk, prompts[-1])
    assert all(p.exists() for p in last[:4])      # the most recent prompt kept, its head first
    assert not block_paths(disk, prompts[0])[-1].exists()   # the oldest prompt's tail gone first
    disk.close(batch.sched.prefix)


def test_a_saved_conversation_writes_its_blocks_and_manifest(engine, tmp_path):
    import dataclasses

    batch, disk = core(engine, tmp_path)
    plan = dataclasses.replace(engine.plan(PROMPT, PARAMS), cache_save="conv-1")
    done = []
    batch.add(plan, lambda ev: done.append(ev))
    while batch.has_work:
        batch.step()
    disk.flush(10)
    m = read_manifest(tmp_path, "conv-1")
    assert m["tokens"] == PROMPT and m["cached_tokens"] == 96 and m["namespace"] == disk.ns
    assert [disk.path(bytes.fromhex(h)) for h in m["blocks"]] == block_paths(disk)
    assert all(p.exists() for p in block_paths(disk))
    disk.close(batch.sched.prefix)


@pytest.mark.parametrize("name", ["..", "../x", "a/b", "/etc/passwd", ".hidden", "", "a\\b", "x" * 200, "-rf",
                                  "a..b", "ok\n"])
def test_a_saved_name_cannot_leave_the_directory(name):
    with pytest.raises(CacheNameError):
        check_name(name)


def test_names():   # (sizes: server/settings.py parse_size, tests/server/test_multi_model.py)
    assert check_name("conv-1_v2.final") == "conv-1_v2.final"


def test_the_model_hash_is_memoized(model_path, tmp_path, monkeypatch):
    first = file_hash(model_path, tmp_path)
    memo = json.loads((tmp_path / "model-hashes.json").read_text())
    assert first in memo.values()
    import hashlib

    monkeypatch.setattr(hashlib, "sha256", lambda *a: pytest.fail("hashed again"))
    assert file_hash(model_path, tmp_path) == first


def test_replicas_sharing_one_directory(engine, tmp_path, cold):
    """Ray Serve replicas (docs/scale-out.md): two engine cores on one directory at once, each its own writer,
    both writing the same blocks (the same prompt) and then another's: every file whole, each core reads what
    the other wrote, and a third (a replica started later) reads them all, never a bad file."""
    (a, disk_a), (b, disk_b) = core(engine, tmp_path), core(engine, tmp_path)
    other = [(t + 211) % 500 + 3 for t in PROMPT]
    assert run(a)[0] == cold and run(b)[0] == cold          # the same blocks: b's writer beside a's, or b reads
    disk_a.flush(10)
    disk_b.flush(10)
    run(a, other)                                          # a prompt only `a` computed
    disk_a.flush(10)
    before = disk_b.hits
    ids, cached = run(b, other)                            # `b` reads `a`'s files
    assert cached == 96 and disk_b.hits == before + 6 and ids == run(core(engine)[0], other)[0]
    disk_a.close(a.sched.prefix)
    disk_b.close(b.sched.prefix)
    assert not list(disk_a.dir.glob(".tmp.*"))
    c, disk_c = core(engine, tmp_path)
    for prompt in (PROMPT, other):
        ids, cached = run(c, prompt)
        assert cached == 96
    assert disk_c.ignored == 0 and run(c)[0] == cold
    disk_c.close(c.sched.prefix)
