"""JSON that closes (issue 57, item 3): how many constrained JSON answers parse at a budget, in-process.

Each schema of JSONSchemaBench's sample (tests/fixtures/jsonschemabench_sample.json, or `--schemas`) is planned as a
`response_format` json_schema (a schema the server refuses is counted apart: it gives no answer), and a
`json_object` request is made for each of 8 chat prompts; every request runs greedy and sampled (temperature 0.8,
`--samples` seeds), `--max-tokens` (256) each, all in one `BatchEngine` batch per model, on the shipped model and
its int4 sibling (or `--models`). Per model and set, the table gives:

- **parse**: answers that `json.loads` reads, over all answers (the issue's bar: >= 95%);
- **stop / length**: how the answers ended; **cut**: answers ended by `max_tokens` that do not parse (a cut answer
  must say `length`: one that parses and says `length` is counted in parse);
- **invalid**: complete answers (`stop`) that do not parse, or do not validate against the schema as sent
  (jsonschema, the schema's own draft) without their `schema_check` saying so (the bar: 0); **flagged**: complete,
  not valid, and their check says so (a keyword the grammar holds loosely, docs/structured.md);
- **tokens**: the mean answer length in tokens.

    PYTHONPATH=src .venv/bin/python benchmarks/json_parse.py [--models A B] [--max-tokens 256] [--samples 1]
        [--limit N] [--no-closing] [--json benchmarks/results/json_parse.json]

Apart from `--no-closing` (the rule off on this tree) and the shortest answers it reports, the script reads only the
engine's public API, so the tree before a change runs it too (`git archive <rev> src | tar -x -C /tmp/before` and
`PYTHONPATH=/tmp/before/src`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import jsonschema

from tinyloop.chat import Chat
from tinyloop.engine import Engine, SamplingParams
from tinyloop.engine.constraint import Constraint
from tinyloop.engine.serving import BatchEngine, run_to_completion
from tinyloop.errors import ValidationError
from hostinfo import host  # (benchmarks/)

ROOT = Path(__file__).resolve().parents[1]
MODELS = [ROOT / "src/tinyloop/assets/models/tinyloop-16m.tinyloop",
          ROOT / "src/tinyloop/assets/models/tinyloop-16m-int4.tinyloop"]
# the json_object prompts (the user: 8 prompts, greedy and sampled)
PROMPTS = ["Give me a JSON object describing a cat.", "Who are you?", "List three fruits as JSON.",
           "A person with a name and an age.", "The king said", "Describe the weather in Paris.",
           "What is 2+2? Answer in JSON.", "A book: title, author, year."]


def requests(engine, schemas, samples: int, max_tokens: int):
    """(set, name, schema or None, prompt ids, params) of every request; refused schemas by name."""
    out, refused = [], {}
    for set_name, name, schema, prompt in [("json_object", f"prompt {i}", None, p) for i, p in enumerate(PROMPTS)] + \
            [("jsonschemabench", n, s, f"Reply with JSON for the schema {n.split('/')[-1]}.") for n, s in schemas]:
        c = Constraint("json_object") if schema is None else Constraint.json_schema(schema)
        ids = engine.encode_prompt(Chat(({"role": "user", "content": prompt},)))
        try:
            engine.plan(ids, SamplingParams(max_tokens=max_tokens, constraint=c))
        except ValidationError as exc:
            refused[name] = str(exc)[:200]
            continue
        for mode, seed in [("greedy", None)] + [("sampled", s) for s in range(samples)]:
            out.append((set_name, mode, name, schema, ids, SamplingParams(
                max_tokens=max_tokens, temperature=0 if mode == "greedy" else 0.8, seed=seed, constraint=c)))
    return out, refused


def shortest(engine, schema) -> int | None:
    """Tokens of the shortest answer the grammar takes from its start, as the closing rule's walk finds it
    (engine/schema_close.py; None on a tree without it, or where the walk finds none): an answer longer than the
    budget cannot close in it whatever decodes it."""
    try:
        c = Constraint("json_object") if schema is None else Constraint.json_schema(schema)
        rule = engine.grammars._entry(c)[2]
    except Exception:  # noqa: BLE001 - the tree before the closing rule
        return None
    return None if rule is None else rule.u0


def judge(schema, text: str, reason: str, said: str) -> str:
    """parsed-valid | parsed-flagged | parsed-invalid | unparsed, for one answer."""
    try:
        value = json.loads(text)
    except ValueError:
        return "unparsed"
    if schema is None:
        return "parsed-valid" if isinstance(value, dict) else "parsed-invalid"
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        ok = cls(schema).is_valid(value)
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot evaluate (a remote $ref): not held against it
        ok = True
    if ok:
        return "parsed-valid"
    return "parsed-flagged" if said.startswith("failed") else "parsed-invalid"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", type=Path, default=MODELS)
    ap.add_argument("--schemas", type=Path, default=ROOT / "tests/fixtures/jsonschemabench_sample.json")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--samples", type=int, default=1, help="sampled answers per request (seeds 0..)")
    ap.add_argument("--limit", type=int, default=0, help="the first N schemas only (0: all)")
    ap.add_argument("--batch", type=int, default=64, help="BatchEngine max_num_seqs")
    ap.add_argument("--json", type=Path, help="write the figures (and every bad answer) here")
    ap.add_argument("--no-closing", action="store_true",
                    help="the closing rule off (matchers made without a budget: engine/schema_close.py), for a before "
                         "and after on one tree")
    args = ap.parse_args()
    if args.no_closing:
        from tinyloop.engine.constraint import Grammars

        matcher = Grammars.matcher
        Grammars.matcher = lambda self, constraint, budget=None: matcher(self, constraint)
    items = json.loads(args.schemas.read_text())
    schemas = [(s["name"], s["schema"]) for s in (items["schemas"] if isinstance(items, dict) else items)]
    schemas = schemas[: args.limit] if args.limit else schemas
    report = {"max_tokens": args.max_tokens, "samples": args.samples, "schemas": str(args.schemas), "host": host(),
              "closing_rule": not args.no_closing,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "models": {}}
    print(f"{'model':<26} {'set':<16} {'mode':<8} {'answers':>7} {'parse':>7} {'stop':>5} {'length':>6} {'cut':>4} "
          f"{'invalid':>7} {'flagged':>7} {'tokens':>6}")
    for model in args.models:
        engine = Engine.load(model)
        reqs, refused = requests(engine, schemas, args.samples, args.max_tokens)
        t0 = time.perf_counter()
        events = run_to_completion(BatchEngine(engine, max_num_seqs=args.batch), [r[4:] for r in reqs])
        seconds = time.perf_counter() - t0
        rows: dict[tuple[str, str], Counter] = {}
        bad, cut = [], []
        for (set_name, mode, name, schema, _, _), evs in zip(reqs, events):
            text = "".join(e.text for e in evs)
            last = evs[-1]
            verdict = judge(schema, text, last.finish_reason, last.stats.get("schema_check", ""))
            row = rows.setdefault((set_name, mode), Counter())
            row["answers"] += 1
            row["tokens"] += sum(len(e.token_ids) for e in evs)
            row[last.finish_reason] += 1
            row["parse"] += verdict != "unparsed"
            if last.finish_reason == "length" and verdict == "unparsed":
                row["cut"] += 1
                u0 = shortest(engine, schema)
                fits = u0 is not None and u0 + 1 <= args.max_tokens
                row["cut_closable"] += fits
                cut.append({"schema": name, "mode": mode, "shortest": u0, "answer": text[-200:]})
            if last.finish_reason != "length" and verdict in ("unparsed", "parsed-invalid"):
                row["invalid"] += 1
                bad.append({"model": model.name, "schema": name, "mode": mode, "answer": text[:400]})
            if last.finish_reason != "length" and verdict == "parsed-flagged":
                row["flagged"] += 1
        entry = {"seconds": round(seconds, 1), "refused": refused, "rows": {}, "invalid": bad, "cut": cut}
        for (set_name, mode), row in sorted(rows.items()) + [(("all", ""), sum(rows.values(), Counter()))]:
            n = row["answers"]
            print(f"{model.name:<26} {set_name:<16} {mode:<8} {n:>7} {row['parse'] / n:>7.1%} {row['stop']:>5} "
                  f"{row['length']:>6} {row['cut']:>4} {row['invalid']:>7} {row['flagged']:>7} "
                  f"{row['tokens'] / n:>6.1f}")
            entry["rows"][f"{set_name} {mode}".strip()] = {k: row[k] for k in (
                "answers", "parse", "stop", "length", "cut", "cut_closable", "invalid", "flagged", "tokens")}
        print(f"  {model.name}: {len(schemas) - len(refused)} of {len(schemas)} schemas taken, "
              f"{len(reqs)} answers in {seconds:.0f} s")
        if cut:
            fits = [c for c in cut if c["shortest"] is not None and c["shortest"] + 1 <= args.max_tokens]
            known = [c for c in cut if c["shortest"] is not None]
            if known:
                print(f"  cut: {len(cut)}; {len(cut) - len(fits)} of them under schemas whose shortest answer (the "
                      f"closing walk's from the start) needs more than {args.max_tokens - 1} tokens, or was not "
                      f"found; the others: " + (", ".join(f"{c['schema']} ({c['mode']})" for c in fits[:12]) or "none")
                      + (f" and {len(fits) - 12} more" if len(fits) > 12 else ""))
                n_ok = sum(r["answers"] for k, r in rows.items()) - (len(cut) - len(fits))
                print(f"  parse rate over the answers that can close in the budget: "
                      f"{(n_ok - len(fits)) / max(n_ok, 1):.1%} ({n_ok - len(fits)} of {n_ok})")
        for b in bad:
            print(f"  INVALID {b['schema']} ({b['mode']}): {b['answer'][:160]!r}")
        report["models"][model.name] = entry
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
