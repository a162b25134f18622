"""Server settings, read once at start-up from the environment (and `tinyloop serve` flags).

Environment (see docs/server.md):

    TINYLOOP_MODEL_PATH     model file (default: the model shipped in the package)
    TINYLOOP_SERVED_MODEL_NAME  the model's names in the API, comma-separated (`--served-model-name`); the
                            first is its id. Default: the file's stem and "tinyloop" (and its path)
    TINYLOOP_STRICT_MODEL_NAMES  1: a request's `model` must be one of those names, else 404 model_not_found
                            (`--strict-model-names`); default 0: any name is accepted and echoed (the seed API)
    TINYLOOP_MAX_SEQ_LEN    cap on prompt_tokens + max_tokens (default: the model's max_seq_len)
    TINYLOOP_KV_INT8        1 -> KV cache mode "int8"
    TINYLOOP_KV_INT4        1 -> "int4"; with TINYLOOP_KV_H_MODE=1 -> "int4-h"
    TINYLOOP_KV_H_MODE      Hadamard rotation before int4 quantization (only with TINYLOOP_KV_INT4)
    TINYLOOP_DRAFT_EXIT     draft exits for speculation: "auto" (default: the model's
                            <model>.draft.safetensors if present), "none", or a file path
    TINYLOOP_COMMIT         reported as runtime.commit
    TINYLOOP_API_KEY        when set, every endpoint but /health needs `Authorization: Bearer <key>` (or `x-api-key`);
                            several keys: separated by commas (each compared in constant time)
    TINYLOOP_CORS_ORIGINS   comma-separated origins allowed by CORS ("*" for any); default none (CORS off)
    TINYLOOP_LOG_FORMAT     "text" (default) or "json": one JSON object per log line
    TINYLOOP_MAX_TOKENS     the largest max_tokens a request may ask for (default and upper bound 8192)
    TINYLOOP_MAX_BODY_BYTES request bodies above this get 413 (default 1 MiB)
    TINYLOOP_MAX_QUEUE      requests waiting for the engine above this get 429 (default 64)
    TINYLOOP_SSE_KEEPALIVE_S  seconds without an event before a `: keepalive` comment (default 2)
    TINYLOOP_MAX_NUM_SEQS   sequences in the running batch at most (default 32)
    TINYLOOP_MAX_BATCHED_TOKENS  tokens per batched step: decode tokens + prefill chunks (default 512)
    TINYLOOP_KV_POOL_MB     KV page pool size (default: max_num_seqs full contexts, at most 1024 MiB)
    TINYLOOP_PREFIX_CACHING 0 turns prefix caching off (default 1: full KV blocks shared across requests)
    TINYLOOP_PROMPT_CACHE_DIR  the prompt cache on disk (`--prompt-cache-dir`): the prefix cache's blocks kept in
                            files there, read back after a restart (default: none, off; engine/disk_cache.py)
    TINYLOOP_PROMPT_CACHE_BYTES  its bound (`--prompt-cache-bytes`, e.g. 4G, 512M; default 4G): least recently
                            used files go first
    TINYLOOP_PROMPT_CACHE_PRELOAD  0: no read-back at start (the last conversation before serving, the other
                            recent blocks while idle); default 1. Blocks are read at admission either way
    TINYLOOP_REQUEST_TIMEOUT_S  default per-request time limit, 0 = none (a request's `timeout_s` wins)
    TINYLOOP_SHUTDOWN_GRACE_S  on shutdown, in-flight requests get this long to finish (default 10)
    TINYLOOP_RESPONSES_STORE_SIZE  /v1/responses kept in memory for GET and previous_response_id, the least
                            recently used first out (default 1000; 0 keeps none)
    TINYLOOP_REASONING_PARSER  thinking blocks split from the answer: "auto" (default: models whose template or
                            tokenizer has <think> tags), "none" (never), "think" (<think>...</think> for any model)
    TINYLOOP_KEEP_ALIVE     how long a model stays loaded after its last request (`--keep-alive`; Ollama's keep_alive:
                            seconds or a duration such as 5m; negative: pinned; 0: unloaded after each answer).
                            Default: until its room is needed (server/models.py)
    TINYLOOP_MAX_LOADED_MODELS  several models served: at most this many loaded at once (`--max-loaded-models`);
                            the least recently used one that is not pinned is unloaded first. Default: no bound
    TINYLOOP_MAX_MEMORY     several models served: a memory budget for the loaded models' weights and KV pools
                            (`--max-memory`, e.g. 8G); default: none
    TINYLOOP_TEMPERATURE    the temperature of a request that gives none (`--temperature`, 0..2; default: the
                            API's own, 1.0). Claude Code and Codex send none: a small model decodes them at this
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.knobs import DECIMAL, KEEP_ALIVE_PATTERN
from ..errors import ValidationError

# -- keep_alive and sizes (the model pool's, server/models.py; the request schemas show the pattern) ----------
PINNED = math.inf           # keep_alive < 0: never unloaded
_DURATION = re.compile(f"({DECIMAL})(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any, param: str = "keep_alive") -> float | None:
    """Ollama's keep_alive -> seconds (PINNED when negative), None when not given. A number is seconds; a
    string is a number or a Go duration ("5m", "1h30m", "300ms", "-1m")."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValidationError(f"{param}: must be a number of seconds or a duration such as \"5m\", got {value!r}",
                              param=param)
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        if not re.fullmatch(KEEP_ALIVE_PATTERN, value):
            raise ValidationError(f"{param}: must be a number of seconds or a duration such as \"5m\", \"1h30m\", "
                                  f"\"300ms\" (negative: keep loaded), got {value!r}", param=param)
        sign = -1.0 if value.startswith("-") else 1.0
        body = value.lstrip("+-")
        parts = _DURATION.findall(body)
        seconds = sign * (sum(float(n) * _UNIT_S[u] for n, u in parts) if parts else float(body))
    else:
        raise ValidationError(f"{param}: must be a number of seconds or a duration such as \"5m\", got {value!r}",
                              param=param)
    if math.isnan(seconds):
        raise ValidationError(f"{param}: must be a number, got {value!r}", param=param)
    return PINNED if seconds < 0 else seconds


def show_keep_alive(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return "-1 (pinned)" if seconds == PINNED else f"{seconds:g}s"


def parse_size(text: str) -> int:
    """'8G', '512M', '1.5GiB', '1000000' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 8G, 512M)")
    return int(float(m.group(1)) * (1 << (10 * " kmgt".index(m.group(2) or " "))))

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}
MAX_TOKENS = 8192  # SamplingParams.validate's bound on max_tokens


def _flag(env: dict[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in TRUE


def _switch_env(env: dict[str, str], name: str, default: bool) -> bool:
    """An on/off setting: 1/true/yes/on or 0/false/no/off; anything else stops start-up with a message."""
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    if value in TRUE or value in FALSE:
        return value in TRUE
    raise SystemExit(f"tinyloop serve: {name} must be 1 or 0 (or true/false, yes/no, on/off), got {env[name]!r}")


REASONING_PARSERS = ("auto", "none", "think")


def _reasoning_env(env: dict[str, str]) -> str:
    value = env.get("TINYLOOP_REASONING_PARSER", "").strip().lower() or "auto"
    if value not in REASONING_PARSERS:
        raise SystemExit(f"tinyloop serve: TINYLOOP_REASONING_PARSER must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {env['TINYLOOP_REASONING_PARSER']!r}")
    return value


def kv_cache_mode_from_env(env: dict[str, str]) -> tuple[str, list[str]]:
    """The spec's env -> KV cache mode mapping: (mode, warnings about ignored or conflicting flags).

    INT4 + H_MODE -> "int4-h"; INT4 -> "int4"; INT8 -> "int8"; nothing -> "fp16". INT4 wins over INT8
    (fewer bytes were asked for twice); H_MODE without INT4 is ignored. Both cases are reported.
    """
    int8, int4, h = _flag(env, "TINYLOOP_KV_INT8"), _flag(env, "TINYLOOP_KV_INT4"), _flag(env, "TINYLOOP_KV_H_MODE")
    warnings = []
    if int4 and int8:
        warnings.append("TINYLOOP_KV_INT4 and TINYLOOP_KV_INT8 are both set; using int4")
    if h and not int4:
        warnings.append("TINYLOOP_KV_H_MODE only applies with TINYLOOP_KV_INT4=1; ignored")
    if int4:
        return ("int4-h" if h else "int4"), warnings
    if int8:
        return "int8", warnings
    return "fp16", warnings


def _int_env(env: dict[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"tinyloop serve: {name}={raw!r} is not an integer") from None


def _float_env(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"tinyloop serve: {name}={raw!r} is not a number") from None


def _temperature_env(env: dict[str, str]) -> float | None:
    if not env.get("TINYLOOP_TEMPERATURE", "").strip():
        return None
    value = _float_env(env, "TINYLOOP_TEMPERATURE", 1.0)
    if not 0 <= value <= 2:
        raise SystemExit(f"tinyloop serve: TINYLOOP_TEMPERATURE must be in 0..2, got {value}")
    return value


def _draft_exit_env(env: dict[str, str]) -> Path | bool:
    raw = env.get("TINYLOOP_DRAFT_EXIT", "").strip()
    if raw.lower() in ("", "auto"):
        return True
    if raw.lower() in ("none", "off", "0", "false"):
        return False
    return Path(raw)


def _max_tokens_env(env: dict[str, str]) -> int:
    value = _int_env(env, "TINYLOOP_MAX_TOKENS", MAX_TOKENS)
    if not 1 <= value <= MAX_TOKENS:
        raise SystemExit(f"tinyloop serve: TINYLOOP_MAX_TOKENS must be in 1..{MAX_TOKENS}, got {value}")
    return value


def _log_format_env(env: dict[str, str]) -> str:
    value = env.get("TINYLOOP_LOG_FORMAT", "").strip().lower() or "text"
    if value not in ("text", "json"):
        raise SystemExit(f"tinyloop serve: TINYLOOP_LOG_FORMAT must be 'text' or 'json', got {value!r}")
    return value


def _size_env(env: dict[str, str], name: str, default: int | None) -> int | None:
    """A byte size from `name` ("4G", "512M", "1000000"; at least 1M), else `default`."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse_size(raw)
    except ValueError as exc:
        raise SystemExit(f"tinyloop serve: {name}: {exc}") from None
    if value < 1 << 20:
        raise SystemExit(f"tinyloop serve: {name} must be at least 1M, got {raw!r}")
    return value


def _keep_alive_env(env: dict[str, str]) -> float | None:
    raw = env.get("TINYLOOP_KEEP_ALIVE", "").strip()
    if not raw:
        return None
    try:
        return parse_keep_alive(raw, "TINYLOOP_KEEP_ALIVE")
    except ValidationError as exc:
        raise SystemExit(f"tinyloop serve: {exc.message}") from None


def _max_loaded_env(env: dict[str, str]) -> int | None:
    value = _int_env(env, "TINYLOOP_MAX_LOADED_MODELS", None)
    if value is not None and value < 1:
        raise SystemExit(f"tinyloop serve: TINYLOOP_MAX_LOADED_MODELS must be 1 or more, got {value}")
    return value


def _store_size_env(env: dict[str, str]) -> int:
    value = _int_env(env, "TINYLOOP_RESPONSES_STORE_SIZE", 1000)
    if value < 0:
        raise SystemExit(f"tinyloop serve: TINYLOOP_RESPONSES_STORE_SIZE must be 0 or more, got {value}")
    return value


@dataclass
class Settings:
    model_path: Path | None = None          # None -> modelfile.resolve_model_path(None)
    served_model_names: list[str] = field(default_factory=list)  # [] -> the file's stem, "tinyloop", its path
    strict_model_names: bool = False        # True: a request naming another model is a 404 (else any name goes)
    max_seq_len: int | None = None
    kv_cache_mode: str = "fp16"
    commit: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_queue: int = 64
    keepalive_s: float = 2.0
    max_num_seqs: int = 32
    max_batched_tokens: int = 512
    kv_pool_mb: int | None = None
    prefix_caching: bool = True
    prompt_cache_dir: Path | None = None    # the prompt cache on disk (engine/disk_cache.py); None: off
    prompt_cache_bytes: int = 4 << 30       # its bound in bytes
    prompt_cache_preload: bool = True       # read its recent blocks into memory while idle after a start
    request_timeout_s: float = 0.0
    shutdown_grace_s: float = 10.0
    draft_exit: Path | bool = True          # True: the model's own draft-exit file if any; False: none
    max_tokens: int = MAX_TOKENS            # the largest max_tokens a request may ask for
    cors_origins: list[str] = field(default_factory=list)
    log_format: str = "text"                # text | json
    responses_store_size: int = 1000        # stored /v1/responses (an in-memory LRU; 0: none)
    reasoning_parser: str = "auto"          # auto | none | think (docs/server.md, "Reasoning")
    temperature: float | None = None        # a request's temperature when it gives none (None: the API's, 1.0)
    default_loops: int | None = None        # the depth of a request that names none (None: the model's default_loops)
    keep_alive: float | None = None         # seconds a model stays after its last request (inf: pinned; None: until
                                            # its room is needed); a request's keep_alive wins (server/models.py)
    max_loaded_models: int | None = None    # several models: at most this many loaded (LRU unloads the others)
    max_memory: int | None = None           # several models: bytes the loaded ones may hold
    models: list = field(default_factory=list)   # several models: models.ModelSpec each ([]: model_path alone)
    warnings: list[str] = field(default_factory=list)

    @property
    def api_keys(self) -> list[str]:
        """`api_key` may hold several keys, comma-separated (so keys can be rotated without downtime)."""
        return [k.strip() for k in (self.api_key or "").split(",") if k.strip()]

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, *, model_path: str | Path | None = None,
                 served_model_names: list[str] | None = None) -> "Settings":
        env = dict(os.environ if env is None else env)
        names = served_model_names or [n.strip() for n in env.get("TINYLOOP_SERVED_MODEL_NAME", "").split(",")
                                       if n.strip()]
        for name in names:
            if "@loops=" in name:
                raise SystemExit(f"tinyloop serve: a served model name cannot hold '@loops=' (a request's depth "
                                 f"suffix), got {name!r}")
        mode, warnings = kv_cache_mode_from_env(env)
        max_seq_len = _int_env(env, "TINYLOOP_MAX_SEQ_LEN", None)
        if max_seq_len is not None and max_seq_len < 1:
            raise SystemExit(f"tinyloop serve: TINYLOOP_MAX_SEQ_LEN={max_seq_len} must be a positive number of "
                             "tokens (unset it to serve the model's whole context)")
        path = model_path if model_path is not None else env.get("TINYLOOP_MODEL_PATH") or None
        return cls(
            model_path=Path(path) if path else None,
            served_model_names=names,
            strict_model_names=_switch_env(env, "TINYLOOP_STRICT_MODEL_NAMES", False),
            max_seq_len=max_seq_len,
            kv_cache_mode=mode,
            commit=env.get("TINYLOOP_COMMIT") or None,
            api_key=env.get("TINYLOOP_API_KEY") or None,
            max_body_bytes=_int_env(env, "TINYLOOP_MAX_BODY_BYTES", 1 << 20),
            max_queue=_int_env(env, "TINYLOOP_MAX_QUEUE", 64),
            keepalive_s=_float_env(env, "TINYLOOP_SSE_KEEPALIVE_S", 2.0),
            max_num_seqs=_int_env(env, "TINYLOOP_MAX_NUM_SEQS", 32),
            max_batched_tokens=_int_env(env, "TINYLOOP_MAX_BATCHED_TOKENS", 512),
            kv_pool_mb=_int_env(env, "TINYLOOP_KV_POOL_MB", None),
            prefix_caching=_switch_env(env, "TINYLOOP_PREFIX_CACHING", True),
            prompt_cache_dir=Path(env["TINYLOOP_PROMPT_CACHE_DIR"].strip()).expanduser()
            if env.get("TINYLOOP_PROMPT_CACHE_DIR", "").strip() else None,
            prompt_cache_bytes=_size_env(env, "TINYLOOP_PROMPT_CACHE_BYTES", Settings.prompt_cache_bytes),
            prompt_cache_preload=_switch_env(env, "TINYLOOP_PROMPT_CACHE_PRELOAD", True),
            request_timeout_s=_float_env(env, "TINYLOOP_REQUEST_TIMEOUT_S", 0.0),
            shutdown_grace_s=_float_env(env, "TINYLOOP_SHUTDOWN_GRACE_S", 10.0),
            draft_exit=_draft_exit_env(env),
            max_tokens=_max_tokens_env(env),
            cors_origins=[o.strip() for o in env.get("TINYLOOP_CORS_ORIGINS", "").split(",") if o.strip()],
            log_format=_log_format_env(env),
            responses_store_size=_store_size_env(env),
            reasoning_parser=_reasoning_env(env),
            temperature=_temperature_env(env),
            keep_alive=_keep_alive_env(env),
            max_loaded_models=_max_loaded_env(env),
            max_memory=_size_env(env, "TINYLOOP_MAX_MEMORY", None),
            warnings=warnings,
        )
