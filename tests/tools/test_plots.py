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
