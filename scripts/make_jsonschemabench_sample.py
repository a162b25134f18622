"""Regenerate tests/fixtures/jsonschemabench_sample.json: a fixed sample of JSONSchemaBench's public schemas
(https://github.com/guidance-ai/jsonschemabench, `data/<subset>/<id>.json`; the same schemas are published by
its authors as the Hugging Face dataset epfl-dlab/JSONSchemaBench under the MIT licence).

The sample: from each of the ten subsets (Github_trivial/easy/medium/hard/ultra, Glaiveai2K, JsonSchemaStore,
Kubernetes, Snowplow, WashingtonPost), `--per-subset` schemas (20) drawn without replacement by
`random.Random(f"{seed}:{subset}")` from the subset's file names in sorted order, then listed in sorted
order. Schemas are kept whole and as they are (minified); each row names its source path.

    git clone https://github.com/guidance-ai/jsonschemabench /tmp/jsb     # or a bare mirror of it
    python scripts/make_jsonschemabench_sample.py /tmp/jsb

`benchmarks/schema_coverage.py --schemas tests/fixtures/jsonschemabench_sample.json` measures it; a bounded
part of it runs in tests/engine/test_schema_coverage.py.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBSETS = ("Github_trivial", "Github_easy", "Github_medium", "Github_hard", "Github_ultra", "Glaiveai2K",
           "JsonSchemaStore", "Kubernetes", "Snowplow", "WashingtonPost")
SEED = 34   # issue 34


def git(repo: Path, *args: str) -> str:
    """`git` on a checkout or a bare repository (the `fetch` tool's mirror is bare)."""
    bare = not (repo / ".git").exists() and (repo / "HEAD").exists()
    where = ["--git-dir", str(repo)] if bare else ["-C", str(repo)]
    return subprocess.run(["git", *where, *args], check=True, capture_output=True, text=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("repo", type=Path, help="a checkout (or bare clone) of guidance-ai/jsonschemabench")
    ap.add_argument("--per-subset", type=int, default=20)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "jsonschemabench_sample.json")
    args = ap.parse_args()

    commit = git(args.repo, "rev-parse", "HEAD").strip()
    rows = []
    for subset in SUBSETS:
        names = sorted(p for p in git(args.repo, "ls-tree", "--name-only", "HEAD", f"data/{subset}/").split()
                       if p.endswith(".json"))
        for path in sorted(random.Random(f"{args.seed}:{subset}").sample(names, min(args.per_subset, len(names)))):
            schema = json.loads(git(args.repo, "show", f"HEAD:{path}"))
            rows.append({"name": f"{subset}/{Path(path).stem}", "path": path, "schema": schema})
    head = {"source": "https://github.com/guidance-ai/jsonschemabench", "commit": commit,
            "licence": "MIT (the authors' Hugging Face dataset epfl-dlab/JSONSchemaBench)",
            "sample": f"{args.per_subset} a subset, random.Random(f'{args.seed}:{{subset}}').sample(sorted names)",
            "regenerate": "python scripts/make_jsonschemabench_sample.py <checkout of guidance-ai/jsonschemabench>"}
    lines = [json.dumps(r, separators=(",", ":"), ensure_ascii=False) for r in rows]
    args.out.write_text('{"about": ' + json.dumps(head, ensure_ascii=False) + ',\n "schemas": [\n'
                        + ",\n".join(lines) + "\n]}\n")
    print(f"{len(rows)} schemas, {args.out.stat().st_size / 1e6:.2f} MB -> {args.out}")


if __name__ == "__main__":
    main()
