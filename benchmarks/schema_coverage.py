"""Structured-output coverage: how many of a set of JSON schemas the engine takes, and whether its answers
validate against them (issue 34, item 7; docs/structured.md, "Schema coverage").

Each schema is planned as a `response_format` schema would be (`Engine.plan`: rewritten, compiled; a refusal
is counted with its reason), then sampled `--samples` times on the shipped model (or `--model`), all in one
batch. Every answer that ends by itself is validated against the schema as given (`jsonschema`, the schema's
own draft). An answer is *invalid* when it does not validate and nothing said so: the bar is none of those.
An answer whose check (the schema had parts the grammar holds only loosely) says "failed" is *flagged*.

    PYTHONPATH=src .venv/bin/python benchmarks/schema_coverage.py [--schemas FILE_OR_DIR] [--samples 2]

`--samples 0` plans only (coverage, no answers). `--schemas`: a JSON list (of schemas, or of objects with a `schema`), such a list under `"schemas"`
(tests/fixtures/jsonschemabench_sample.json: 200 of JSONSchemaBench's schemas, from
scripts/make_jsonschemabench_sample.py), JSON lines (each a schema, or an object with `json_schema` or `schema`,
as text or JSON: JSONSchemaBench's rows), or a folder of `.json` files (its `data/<subset>/`), or of such
folders (its `data/`: names `subset/id`). The default is
the test corpus (tests/fixtures/schema_corpus.json). Results: benchmarks/results/schema_coverage.json (`--out`).
The sample's measurement (docs/structured.md):

    PYTHONPATH=src .venv/bin/python benchmarks/schema_coverage.py --schemas tests/fixtures/jsonschemabench_sample.json \
        --samples 2 --max-tokens 256 --out benchmarks/results/schema_coverage_jsonschemabench.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import jsonschema

from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.constraint import Constraint
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.errors import ValidationError

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path) -> list[tuple[str, dict]]:
    """(name, schema) pairs from a file or folder (see the module's docstring)."""
    def one(item, name):
        if isinstance(item, dict) and ("schema" in item or "json_schema" in item):
            item = item.get("schema", item.get("json_schema"))
        return name, json.loads(item) if isinstance(item, str) else item

    if path.is_dir():   # JSONSchemaBench's data/ (a folder a subset: names subset/id) or one subset's folder
        subs = sorted(p for p in path.iterdir() if p.is_dir())
        return [one(json.loads(p.read_text()), f"{d.name}/{p.stem}" if subs else p.stem)
                for d in subs or [path] for p in sorted(d.glob("*.json"))]
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [one(json.loads(line), f"{path.stem}:{i}") for i, line in enumerate(text.splitlines()) if line.strip()]
    items = json.loads(text)
    if isinstance(items, dict):   # {"about": ..., "schemas": [...]}: tests/fixtures/jsonschemabench_sample.json
        items = items["schemas"]
    return [one(item, item.get("name", f"{path.stem}:{i}") if isinstance(item, dict) else f"{path.stem}:{i}")
            for i, item in enumerate(items)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schemas", type=Path, default=ROOT / "tests" / "fixtures" / "schema_corpus.json")
    ap.add_argument("--model", default=None, help="a .tinyloop file (default: the shipped model)")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "schema_coverage.json")
    args = ap.parse_args()

    engine = Engine.load(args.model)
    schemas = load(args.schemas)
    refused: dict[str, str] = {}
    warned = 0
    loose: Counter = Counter()   # keywords left to the check after generation, by keyword
    reqs = []
    for name, schema in schemas:
        try:
            c = Constraint.json_schema(schema)
            plan = engine.plan(engine.encode_prompt("JSON:"), SamplingParams(constraint=c))
        except ValidationError as exc:
            refused[name] = str(exc)
            continue
        warned += bool(plan.warnings)
        check = engine.grammars.schema_check(c)
        loose.update({w.split(" at ")[0] for w in (check.loose if check else ())})
        reqs += [(name, schema, (engine.encode_prompt("JSON:"), SamplingParams(
            max_tokens=args.max_tokens, temperature=0.8, seed=seed, constraint=c))) for seed in range(args.samples)]
    t0 = time.perf_counter()
    events = run_to_completion(BatchEngine(engine, max_num_seqs=min(64, len(reqs))), [r for *_, r in reqs]) \
        if reqs else []
    answers: Counter = Counter()
    invalid: list[dict] = []
    flagged: Counter = Counter()
    for (name, schema, _), evs in zip(reqs, events):
        last = evs[-1]
        if last.finish_reason != "stop":
            answers["cut short"] += 1
            continue
        text = "".join(e.text for e in evs)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            valid = cls(schema).is_valid(json.loads(text))
        except ValueError:
            valid = False
        said = last.stats.get("schema_check", "")
        if valid:
            answers["valid"] += 1
        elif said.startswith("failed"):
            answers["flagged"] += 1
            flagged[name] += 1
        else:
            answers["invalid"] += 1
            invalid.append({"schema": name, "answer": text})
    coverage = (len(schemas) - len(refused)) / max(len(schemas), 1)
    print(f"schemas: {len(schemas)}  accepted: {len(schemas) - len(refused)} ({coverage:.1%})  "
          f"with warnings: {warned}  refused: {len(refused)}")
    subsets = Counter(name.split("/")[0] for name, _ in schemas if "/" in name)
    if len(subsets) > 1:   # JSONSchemaBench's rows are named subset/id
        taken = Counter(name.split("/")[0] for name, _ in schemas if name not in refused)
        print("  by subset: " + ", ".join(f"{k} {taken[k]}/{v}" for k, v in subsets.items()))
    if loose:
        print("  schemas with a keyword checked after generation: " + ", ".join(f"{k} {v}" for k, v in loose.items()))
    if len(refused) > 12:   # the reasons, counted (paths and numbers left out)
        reasons = Counter(re.sub(r"\d+", "N", re.sub(r" \(at #.*|, referred to at .*|; while processing .*", "", why))[:120]
                          for why in refused.values())
        for why, n in reasons.most_common():
            print(f"  refused {n}: {why}")
    else:
        for name, why in refused.items():
            print(f"  refused {name}: {why[:240]}")
    print(f"answers ({args.samples} a schema, {time.perf_counter() - t0:.1f} s): " +
          "  ".join(f"{k}: {answers[k]}" for k in ("valid", "flagged", "invalid", "cut short")))
    if flagged:
        print("  flagged by their check: " + ", ".join(f"{k} ({v})" for k, v in flagged.items()))
    for bad in invalid:
        print(f"  INVALID {bad['schema']}: {bad['answer'][:160]}")
    args.out.write_text(json.dumps({
        "schemas": str(args.schemas.relative_to(ROOT) if args.schemas.is_relative_to(ROOT) else args.schemas),
        "n_schemas": len(schemas), "accepted": len(schemas) - len(refused), "coverage": round(coverage, 4),
        "with_warnings": warned, "loose": dict(loose), "refused": refused, "answers": dict(answers), "flagged": dict(flagged), "invalid": invalid,
        "samples": args.samples, "max_tokens": args.max_tokens,
        "seconds": round(time.perf_counter() - t0, 1)}, indent=1) + "\n")
    sys.exit(1 if invalid else 0)


if __name__ == "__main__":
    main()
