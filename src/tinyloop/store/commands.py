"""The command line of the model store: `tinyloop pull`, `tinyloop list`, `tinyloop rm`.

Registered by `cli.build_parser`; `list` and `rm` import neither torch nor huggingface_hub.
"""

from __future__ import annotations

import argparse
import json
import sys


def _fail(msg: str) -> int:
    print(f"tinyloop: error: {msg}", file=sys.stderr)
    return 2


def _pull(args: argparse.Namespace) -> int:
    from .pull import PullError, pull
    from .refs import RefError, parse_ref

    try:
        ref = parse_ref(args.model)
        if args.quant:
            ref = ref.__class__(ref.repo_id, ref.revision, args.quant)
        path = pull(ref, dtype=args.dtype, force=args.force, progress=not args.quiet and sys.stderr.isatty())
    except (RefError, PullError) as exc:
        return _fail(str(exc))
    print(f"{ref.name} -> {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    print(f"use it anywhere a model path goes: tinyloop serve --model {ref.name}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from .catalog import list_store
    from .refs import models_dir

    entries = list_store()
    if args.json:
        print(json.dumps([e.to_dict() for e in entries], indent=2))
        return 0
    if not entries:
        print(f"the store ({models_dir()}) is empty: tinyloop pull ORG/NAME adds a model")
        return 0
    rows = [("NAME", "FAMILY", "SIZE", "QUANT", "SOURCE")]
    rows += [(e.name, e.family, f"{e.size_bytes / 2**30:.2f} GiB", e.quant,
              e.source if not e.problem else f"unreadable: {e.problem}") for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    return 0


def _rm(args: argparse.Namespace) -> int:
    from .catalog import remove
    from .refs import RefError

    try:
        for name in args.models:
            print(f"removed {remove(name)}")
    except (RefError, FileNotFoundError) as exc:
        return _fail(str(exc))
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("pull", help="download a Hugging Face model of a looped family and convert it into the store",
                       description="Families: {families}. "
                       "Downloads ORG/NAME[@REVISION] with huggingface_hub (its cache, resumable; "
                       "HF_TOKEN for gated repositories), converts it to a .tinyloop file in $TINYLOOP_HOME "
                       "(default ~/.cache/tinyloop) and records the repository and commit in its header. "
                       "config.json is read first: an unsupported architecture is refused before any weight "
                       "is fetched. See docs/models.md.")
    p.add_argument("model", help="ORG/NAME[@REVISION][:int4], e.g. ByteDance/Ouro-1.4B")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weights of the converted file; default: %(default)s")
    p.add_argument("--quant", choices=["int4"], help="also quantize (RTN int4, group 128) in the same command; "
                   "the same as the :int4 suffix")
    p.add_argument("--force", action="store_true", help="convert again even if the store holds the model")
    p.add_argument("--quiet", action="store_true", help="no progress bars (none on a redirected stderr)")
    p.set_defaults(func=_pull)

    ls = sub.add_parser("list", help="the models in the store (tinyloop pull)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_list)

    rm = sub.add_parser("rm", help="remove pulled models from the store")
    rm.add_argument("models", nargs="+", help="hf:ORG/NAME[@REVISION][:int4] as `tinyloop list` shows it")
    rm.set_defaults(func=_rm)
