"""Plots (matplotlib PNGs) and progress bars: `tinyloop eval --plot`, `--replot`, and the benchmarks' replots
from their JSON results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tinyloop.cli import main

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def is_png(path: Path) -> bool:
    return path.exists() and path.read_bytes()[:8] == PNG and path.stat().st_size > 5_000


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "t.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    return path


def test_eval_plot_writes_a_png_of_its_rows(tiny_model_path, text_file, tmp_path, capsys):
    png = tmp_path / "ppl.png"
    assert main(["eval", str(tiny_model_path), "--text", str(text_file), "--loops", "1,2", "--seq-len", "32",
                 "--json", "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)["results"]
    assert [r["loops"] for r in rows] == [1, 2] and is_png(png)
    assert "\r" not in err and "window" not in err  # stderr is not a terminal: no progress bar
    # the same rows, replotted from the JSON without running the model
    saved = tmp_path / "eval.json"
    saved.write_text(out)
    png2 = tmp_path / "replot.png"
    assert main(["eval", "--replot", str(saved), "--plot", str(png2)]) == 0 and is_png(png2)
    assert main(["eval", "--replot", str(saved)]) == 2  # --replot without --plot: a clear error
    assert main(["eval", str(tiny_model_path)]) == 2    # no --text and no --replot


def test_model_card_data_replots():
    """docs/img/perplexity-by-loops.png comes from docs/model-card-data.json (the model card's table)."""
    data = json.loads((ROOT / "docs" / "model-card-data.json").read_text())
    assert [r["loops"] for r in data["perplexity"]] == [1, 2, 4, 8, 12, 16]
    assert is_png(ROOT / "docs" / "img" / "perplexity-by-loops.png")


def test_progress_is_quiet_off_a_terminal_and_with_quiet(capsys):
    from tinyloop.tools.progress import progress

    for quiet in (False, True):
        with progress(total=3, desc="x", quiet=quiet) as bar:
            for _ in range(3):
                bar.update()
        assert bar.disable
    assert capsys.readouterr().err == ""


def load_plotting():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_plotting", ROOT / "benchmarks" / "plotting.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["decode", "speculative", "serving"])
def test_benchmark_results_replot(name, tmp_path):
    """Each benchmark's committed JSON replots (told apart by content), and its PNG is committed beside it."""
    plotting = load_plotting()
    src = ROOT / "benchmarks" / "results" / f"{name}.json"
    assert is_png(plotting.plot_any(src, tmp_path / f"{name}.png"))
    assert is_png(src.with_suffix(".png"))


def test_benchmark_replot_refuses_other_json(tmp_path):
    plotting = load_plotting()
    other = tmp_path / "x.json"
    other.write_text('{"rows": []}')
    with pytest.raises(ValueError, match="not a result"):
        plotting.plot_any(other)


@pytest.mark.parametrize("script", ["decode.py", "speculative.py", "serving.py"])
def test_benchmarks_plot_only_runs_nothing(script, tmp_path):
    """`--plot-only` replots the JSON next to it without running the benchmark (and says where it wrote)."""
    name = script.removesuffix(".py")
    src = tmp_path / f"{name}.json"
    src.write_bytes((ROOT / "benchmarks" / "results" / f"{name}.json").read_bytes())
    flag = ["--out", str(src)] if name == "decode" else ["--json", str(src)]
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *flag, "--plot-only"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert is_png(src.with_suffix(".png")) and "wrote" in r.stdout + r.stderr


def test_eval_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path, capsys):
    saved = tmp_path / "eval.json"
    saved.write_text(json.dumps({"results": [{"loops": 1, "perplexity": 10.0}, {"loops": 2, "perplexity": 9.0}]}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["eval", "--replot", str(saved), "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install 'tinyloop[plot]'" in capsys.readouterr().err
