import json
import os
import subprocess
import sys


def run(*args, env=None):
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "tinyloop", *args], capture_output=True, text=True, env=e,
                          timeout=120)


def test_init_info_generate(tmp_path):
    path = tmp_path / "r.tinyloop"
    r = run("init", str(path), "--preset", "tiny", "--seed", "4")
    assert r.returncode == 0, r.stderr
    info = json.loads(run("info", str(path), "--json").stdout)
    assert info["path"] == str(path) and info["dim"] == 64 and info["quant"] == "fp32"
    assert info["draft_exit"] is None
    assert info["provenance"]["tool"] == "tinyloop init"
    # without FILE, info describes the model the server would load ($TINYLOOP_MODEL_PATH)
    info2 = json.loads(run("info", "--json", env={"TINYLOOP_MODEL_PATH": str(path)}).stdout)
    assert info2["path"] == str(path)
    table = run("info", str(path)).stdout
    assert "default_loops" in table and "n_core" in table
    g = run("generate", "The king said", "--model", str(path), "--loops", "2", "--max-tokens", "5",
            "--seed", "1", "--stats")
    assert g.returncode == 0, g.stderr
    stats = json.loads(g.stderr.strip().splitlines()[-1])
    assert stats["completion_tokens"] == 5 and stats["loops_used"] == 2
    s = run("generate", "The king said", "--model", str(path), "--max-tokens", "5", "--stream")
    assert s.returncode == 0 and s.stdout.strip() == g.stdout.strip()


def test_clear_errors(tmp_path):
    bad = tmp_path / "bad.tinyloop"
    bad.write_text("not a model")
    r = run("generate", "hi", "--model", str(bad))
    assert r.returncode == 2 and "not a .tinyloop file" in r.stderr and "Traceback" not in r.stderr
    r = run("info", str(tmp_path / "none.tinyloop"))
    assert r.returncode == 2 and "no such file" in r.stderr
    r = run("init", str(tmp_path / "x.tinyloop"), "--preset", "nope")
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr


def test_eval_reports_per_loop(tmp_path, tokenizer):
    path = tmp_path / "r.tinyloop"
    run("init", str(path), "--preset", "tiny")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    r = run("eval", str(path), "--text", str(text), "--loops", "1,2", "--seq-len", "64", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [x["loops"] for x in out["results"]] == [1, 2]
    n = len(tokenizer.encode(text.read_text()))
    assert all(x["tokens_scored"] == n - 1 for x in out["results"])
    r = run("eval", str(path), "--text", str(text), "--loops", "0")
    assert r.returncode == 2 and "--loops" in r.stderr


def test_packaged_models_by_name():
    # no FILE: the package's default model, the GPTQ int4 one; packaged models are also usable by name
    info = json.loads(run("info", "--json", env={"TINYLOOP_MODEL_PATH": ""}).stdout)
    assert info["path"].endswith("tinyloop-16m-int4.tinyloop") and info["quant"] == "int4"
    assert info["quant_method"] == "gptq" and info["provenance"]["tool"] == "tinyloop quantize"
    fp16 = json.loads(run("info", "tinyloop-16m", "--json").stdout)
    assert fp16["path"].endswith("tinyloop-16m.tinyloop") and fp16["quant"] == "fp16"
    # both use the packaged draft exits (the int4 file through its source model's name)
    assert info["draft_exit"].endswith("tinyloop-16m.draft.safetensors") and info["draft_exit"] == fp16["draft_exit"]
    r = run("generate", "hi", "--model", "tinyloop-99m")
    assert r.returncode == 2 and "no such file" in r.stderr and "tinyloop-16m-int4.tinyloop" in r.stderr


def test_generate_defaults_are_sampling_params():
    from tinyloop.cli import build_parser
    from tinyloop.engine import SamplingParams

    args = build_parser().parse_args(["generate", "hi"])
    want = SamplingParams()
    for name in ("max_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "cache_window", "mode", "draft_loops", "verify_loops", "draft_ahead",
                 "k_branches", "loops"):
        assert getattr(args, name) == getattr(want, name), name


def test_a_closed_pipe_and_ctrl_c_end_quietly(tmp_path):
    import subprocess
    import sys

    from tinyloop.config import preset
    from tinyloop.model import build_model
    from tinyloop.modelfile.loader import write_model
    from tinyloop.tokenizer import Tokenizer

    path = write_model(tmp_path / "m.tinyloop", build_model(preset("tiny")), tokenizer=Tokenizer.gpt2())
    cmd = f"{sys.executable} -m tinyloop generate hello --model {path} --max-tokens 200 --stream | head -c 5"
    r = subprocess.run(["bash", "-c", "set -o pipefail; " + cmd], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr and r.returncode in (0, 141), r.stderr
    # (Python's own Ctrl-C handler first: a background job's children inherit SIGINT ignored)
    proc = subprocess.Popen([sys.executable, "-c", "import signal, os, tinyloop.cli as c; "
                             "signal.signal(signal.SIGINT, signal.default_int_handler); "
                             "c._generate = lambda a: os.kill(os.getpid(), signal.SIGINT); "
                             f"import sys; sys.exit(c.main(['generate', 'x', '--model', '{path}']))"],
                            stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err


def test_sigterm_leaves_no_half_written_file(tmp_path):
    # `kill` during `tinyloop quantize`: the writer's `with` block unwinds, the temporary file goes, status 143
    from tinyloop.config import preset
    from tinyloop.model import build_model
    from tinyloop.modelfile.loader import write_model
    from tinyloop.tokenizer import Tokenizer

    src = write_model(tmp_path / "m.tinyloop", build_model(preset("tiny")), tokenizer=Tokenizer.gpt2())
    out = tmp_path / "out"
    out.mkdir()
    script = ("import os, signal, sys, time\n"
              "import tinyloop.cli as c\n"
              "from tinyloop.modelfile.writer import ModelFileWriter\n"
              "add = ModelFileWriter.add\n"
              "def slow_add(self, name, t):\n"
              "    add(self, name, t)\n"
              "    if len(self.written) == 3:\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "        time.sleep(30)\n"
              "ModelFileWriter.add = slow_add\n"
              f"sys.exit(c.main(['quantize', '{src}', '{out / 'q.tinyloop'}', '--method', 'rtn', '--quiet']))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 143 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert list(out.iterdir()) == []


def test_quick_commands_answer_without_importing_torch(tmp_path):
    # --help, info, list and a refused flag value are parsed and answered before torch is imported
    probe = ("import sys\nfrom tinyloop.cli import main\ntry:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    rc = e.code\nassert 'torch' not in sys.modules, 'torch was imported'\nprint('rc', rc)\n")
    for args in (["--help"], ["generate", "--help"], ["info", "--json"], ["info"], ["list"],
                 ["generate", "x", "--loops", "0"], ["generate", "x", "--top-p", "0"]):
        r = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "TINYLOOP_HOME": str(tmp_path)})
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr)
        rc = r.stdout.strip().splitlines()[-1]
        assert rc == ("rc 2" if args[0] == "generate" and args[1] == "x" else "rc 0"), (args, r.stdout, r.stderr)
    r = run("generate", "x", "--loops", "0")
    assert r.returncode == 2 and "loops: must be an integer in 1..64" in r.stderr


def test_info_table_shows_family_tokenizer_template_and_provenance():
    table = run("info", "tinyloop-16m").stdout
    for key in ("family", "tokenizer", "chat_template", "provenance.tool", "draft_exit"):
        assert key in table, key
    assert "gpt2-bpe" in table and "tinyloop train" in table


def test_info_names_the_real_weight_format():
    """The int4 file's float tensors are float16, but its weights are int4: `info` says what they are."""
    info = json.loads(run("info", "tinyloop-16m-int4", "--json").stdout)
    assert info["weights"] == "int4 gptq group 32, int8 head, float16 embedding and norms", info["weights"]
    assert info["float_dtype"] == "float16" and "weights_dtype" not in info
    table = run("info", "tinyloop-16m-int4").stdout
    assert any(line.split(None, 1) == ["weights", "int4 gptq group 32, int8 head, float16 embedding and norms"]
               for line in table.splitlines()), table
    assert json.loads(run("info", "tinyloop-16m", "--json").stdout)["weights"] == "float16"


def test_generate_ends_its_line(tmp_path):
    path = tmp_path / "r.tinyloop"
    assert run("init", str(path), "--preset", "tiny", "--seed", "4").returncode == 0
    for extra in ([], ["--stream"]):
        g = run("generate", "The king said", "--model", str(path), "--max-tokens", "5", "--seed", "1", *extra)
        assert g.returncode == 0 and g.stdout.endswith("\n") and g.stdout.strip(), (extra, g.stdout, g.stderr)


def test_serve_help_names_what_model_takes():
    out = " ".join(run("serve", "--help").stdout.split())
    assert "a packaged model's name" in out and "hf:ORG/NAME" in out and "exit status 1" in out


def test_info_says_the_pytorch_path_serves_a_model_the_native_executor_refuses(tmp_path):
    """`tinyloop info`'s executor row is the one a load would use: a config the native executor refuses (here a
    head_dim that is not a multiple of 8) reads "torch" and why, not the library's ISA."""
    from tinyloop.kernels.lib import describe

    path = tmp_path / "odd.tinyloop"
    r = run("init", str(path), "--preset", "tiny", "--seed", "4", "--overrides", '{"head_dim": 12}')
    assert r.returncode == 0, r.stderr
    executor = json.loads(run("info", str(path), "--json").stdout)["executor"]
    if describe().startswith("native"):
        assert executor.startswith("torch (the native executor does not run this model: ") and "multiples of 8" in executor
    else:   # no library here: the row says so as before
        assert executor == describe()
