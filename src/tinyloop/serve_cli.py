"""`tinyloop serve` and `tinyloop ps` (registered by cli.build_parser): the flags that become the server's
settings (docs/server.md), several models and their config files, the checks that stop a model that cannot load
before torch, the port or Ray, and the Ray Serve scale-out (docs/scale-out.md). Nothing here imports torch,
FastAPI or Ray until the command runs."""

from __future__ import annotations

import argparse
import os

from .errors import CommandError


def add_commands(sub) -> None:
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
    s.set_defaults(func=serve_command, own_sigterm=True)

    ps = sub.add_parser("ps", help="the models a running server serves: state, memory, keep_alive (as `ollama ps`)")
    ps.add_argument("--url", default=os.environ.get("TINYLOOP_URL", "http://127.0.0.1:8000"),
                    help="the server (default: $TINYLOOP_URL or %(default)s); its key from $TINYLOOP_API_KEY")
    ps.add_argument("--json", action="store_true", help="the /v1/models cards as JSON")
    ps.set_defaults(func=ps_command)


def serve_command(args: argparse.Namespace) -> int:
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
            raise CommandError("give the models as arguments or --model, not both")
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
        raise CommandError(f"cannot load the model: {' '.join(str(exc).split())}", status=1) from None
    scaled = (args.replicas, args.min_replicas, args.max_replicas, args.ray_address) != (None, None, None, None)
    if scaled:   # several models: a deployment each (docs/scale-out.md); what cannot apply there is refused now
        from .scaleout import refusal

        why = refusal(settings, args.min_replicas)
        if why:
            raise CommandError(why)
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
        raise CommandError(f"--replicas needs Ray Serve: pip install 'tinyloop[ray]' ({exc})")
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


def ps_command(args: argparse.Namespace) -> int:
    from .ps import run

    return run(args.url, args.json)
