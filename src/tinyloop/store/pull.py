"""`tinyloop pull ORG/NAME[@REVISION][:int4]`: download a Hugging Face repository of a supported looped
family and convert it into the store.

The download goes through `huggingface_hub` into the standard Hugging Face cache (`HF_HOME`, resumable,
`HF_TOKEN` for gated repositories, `HF_ENDPOINT` for a mirror, `HF_HUB_OFFLINE=1` to use only what is
cached). `config.json` comes first and is checked by the converter (`tools/convert.model_config`): an
unsupported architecture is refused before any weight is fetched. The converted file (and, for `:int4`,
its RTN int4 quantization) is written atomically into `$TINYLOOP_HOME/models`, its header's provenance
naming the repository, the commit and the converter's version. A family whose weights are a pickle
(`pytorch_model.bin`, read with `torch.load(weights_only=True)` only: `Family.weights`) gets them fetched, and one
whose tokenizer is a repository of its own (`Family.tokenizer_repo`) gets it too where the model's has none,
named in the provenance. Every failure is a `PullError` (a
`ModelFileError`, so every route that loads a model reports it the same way) that says what to do; no
model file is left half-written.

Resuming (what huggingface_hub 2.x does): a connection cut mid-file is reopened at once with a Range
request from the last 10 MiB chunk written (up to 5 times); files already complete stay in the Hugging Face
cache, so the next pull after a failed one fetches only the files still missing. A file cut part way and
abandoned (Ctrl-C, the Hub gone for good) starts again from its beginning on the next pull: huggingface_hub
2.x does not keep partial files between processes.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import ModelFileError
from ..model.families import FAMILIES, family_of
from .refs import HubRef, store_path

# What a conversion reads (tools/convert.py); nothing else of a repository is downloaded.
PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "model.safetensors", "model.safetensors.index.json",
            "model-*.safetensors", "*.safetensors"]
TOKENIZER_PATTERNS = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]
RETRIES = 3            # network errors: attempts before giving up
RETRY_WAIT_S = 1.0     # first wait between attempts (doubles)
INT4_GROUP_SIZE = 128


class PullError(ModelFileError):
    """A pull that failed; the message says why and what to do."""

    def __init__(self, ref: HubRef, problem: str):
        super().__init__(ref.name, problem)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _is_network_error(exc: BaseException) -> bool:
    """Connection refused, DNS, timeouts, a dropped connection: httpx's (or its fork's) transport errors,
    recognised by name so that no particular HTTP client is imported here."""
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"ConnectError", "TimeoutException", "NetworkError", "RemoteProtocolError",
                         "TransportError", "ConnectionError"})


def _explain(ref: HubRef, exc: BaseException, what: str) -> PullError:
    """huggingface_hub's errors -> one message that says what to do."""
    from huggingface_hub import errors as hf_errors

    endpoint = _endpoint()
    if isinstance(exc, hf_errors.GatedRepoError):
        return PullError(ref, f"{ref.repo_id} is gated on {endpoint}: accept its terms on the model's page, then "
                              "set HF_TOKEN to an access token of that account (export HF_TOKEN=hf_...) and rerun")
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return PullError(ref, f"revision {ref.revision!r} of {ref.repo_id} was not found on {endpoint} (give a "
                              "branch, tag or commit that exists, or no @REVISION for the default branch)")
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        token = "HF_TOKEN is set" if os.environ.get("HF_TOKEN") else "if it is private, set HF_TOKEN"
        return PullError(ref, f"repository {ref.repo_id} was not found on {endpoint} (check the name; {token})")
    if isinstance(exc, hf_errors.OfflineModeIsEnabled) or (
            isinstance(exc, hf_errors.LocalEntryNotFoundError) and os.environ.get("HF_HUB_OFFLINE")):
        return PullError(ref, f"HF_HUB_OFFLINE is set and {what} of {ref.repo_id}"
                              f"{'@' + ref.revision if ref.revision else ''} is not in the Hugging Face cache; "
                              "unset HF_HUB_OFFLINE to download it")
    if isinstance(exc, hf_errors.EntryNotFoundError) and not isinstance(exc, hf_errors.LocalEntryNotFoundError):
        return PullError(ref, f"{what} is not in {ref.repo_id} (a looped family's Hugging Face snapshot has "
                              "config.json, tokenizer.json and safetensors weights)")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return PullError(ref, f"disk full while downloading {what}: free some space (or set HF_HOME to a larger "
                              "disk) and rerun; the download resumes where it stopped")
    if isinstance(exc, hf_errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status == 401:
            return PullError(ref, f"{endpoint} refused the request (401 unauthorised): set HF_TOKEN to a valid "
                                  "access token (export HF_TOKEN=hf_...) and rerun")
        return PullError(ref, f"downloading {what} failed (HTTP {status}): {str(exc).splitlines()[0]}; rerun "
                              "tinyloop pull to resume")
    if _is_network_error(exc) or isinstance(exc, hf_errors.LocalEntryNotFoundError):
        return PullError(ref, f"cannot reach {endpoint} ({type(exc).__name__}) after {RETRIES} attempts: check "
                              "the network (or HF_ENDPOINT) and rerun; a partial download resumes")
    return PullError(ref, f"downloading {what} failed: {type(exc).__name__}: {exc}")


def _with_retries(ref: HubRef, what: str, call: Callable[[], Any]) -> Any:
    wait = RETRY_WAIT_S
    for attempt in range(RETRIES):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - classified below; only transport errors are retried
            from huggingface_hub import errors as hf_errors

            transient = _is_network_error(exc) or (isinstance(exc, hf_errors.LocalEntryNotFoundError)
                                                  and not os.environ.get("HF_HUB_OFFLINE"))
            if not transient or attempt == RETRIES - 1:
                raise _explain(ref, exc, what) from None
            print(f"tinyloop pull: {type(exc).__name__} while downloading {what}; retrying in {wait:.0f} s",
                  file=sys.stderr)
            time.sleep(wait)
            wait *= 2
    raise AssertionError("unreachable")


def download(ref: HubRef, *, progress: bool = True) -> tuple[Path, str]:
    """(snapshot folder in the Hugging Face cache, commit hash): config.json first, checked; then the rest."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    from ..tools.convert import ConvertError, model_config

    (enable_progress_bars if progress else disable_progress_bars)()
    offline = bool(os.environ.get("HF_HUB_OFFLINE"))
    if offline:
        commit = None
    else:
        from huggingface_hub import HfApi

        info = _with_retries(ref, "the repository's information",
                             lambda: HfApi().model_info(ref.repo_id, revision=ref.revision))
        commit = info.sha
    config_path = Path(_with_retries(ref, "config.json", lambda: hf_hub_download(
        ref.repo_id, "config.json", revision=commit or ref.revision)))
    try:
        hf = json.loads(config_path.read_text(encoding="utf-8"))
        model_config(hf, Path(f"{ref.repo_id}@{commit or ref.revision or 'main'}"), [0])
    except (ValueError, ConvertError) as exc:  # JSONDecodeError is a ValueError
        raise PullError(ref, f"{exc}; nothing else was downloaded") from None
    family = FAMILIES.get(family_of(hf))
    patterns = PATTERNS + list(family.weights if family is not None else ())   # (a pickle: only its family's)
    snapshot = Path(_with_retries(ref, "the weights and tokenizer", lambda: snapshot_download(
        ref.repo_id, revision=commit or ref.revision, allow_patterns=patterns)))
    if commit is None:  # offline: the cache's snapshot folder is named by its commit
        commit = snapshot.name
    return snapshot, commit


def pull(ref: HubRef, *, dtype: str = "bfloat16", force: bool = False, progress: bool = True) -> Path:
    """Download and convert `ref` into the store (see the module docstring); returns the model file. A
    model the store already holds is returned as it is unless `force`."""
    from ..modelfile.header import check_writable
    from ..tools.convert import ConvertError, convert

    out = store_path(ref)
    if out.exists() and not force:
        return out
    try:
        check_writable(out)
    except ModelFileError as exc:
        raise PullError(ref, f"the store cannot be written: {exc.problem} (set TINYLOOP_HOME to a writable "
                             "folder)") from None
    started = time.time()
    snapshot, commit = download(ref, progress=progress)
    prov = {"tool": "tinyloop pull", "hub": {"name": ref.name, "repo_id": ref.repo_id,
                                             "revision": ref.revision or "default branch", "commit": commit,
                                             "endpoint": _endpoint()}}
    tokenizer = _separate_tokenizer(ref, snapshot, prov, progress)
    float_out = out if ref.quant is None else out.with_name(f".{out.name}.{os.getpid()}.float.tmp")
    try:
        try:
            convert(snapshot, float_out, dtype=dtype, progress=progress, provenance=prov, tokenizer=tokenizer)
        except ConvertError as exc:
            raise PullError(ref, f"cannot convert {ref.repo_id}@{commit[:12]}: {exc}") from None
        except ModelFileError as exc:  # the write (disk full, ...): nothing is left behind
            raise PullError(ref, f"cannot write the converted model: {exc.problem}") from None
        if ref.quant == "int4":
            _quantize_int4(ref, float_out, out, progress)
    finally:
        if float_out != out:
            float_out.unlink(missing_ok=True)
    print(f"tinyloop pull: {ref.name} ({ref.repo_id}@{commit[:12]}) converted in {time.time() - started:.1f} s",
          file=sys.stderr)
    return out


def _separate_tokenizer(ref: HubRef, snapshot: Path, prov: dict, progress: bool) -> Path | None:
    """A family whose tokenizer is a repository of its own (`Family.tokenizer_repo`) and a snapshot without one: that
    repository's tokenizer files, downloaded (the default branch; its commit goes into `prov`); else None."""
    from huggingface_hub import HfApi, snapshot_download

    hf = json.loads((snapshot / "config.json").read_text(encoding="utf-8"))
    family = FAMILIES.get(family_of(hf))
    if family is None or family.tokenizer_repo is None or (snapshot / "tokenizer.json").exists():
        return None
    tok = HubRef(family.tokenizer_repo)
    commit = None
    if not os.environ.get("HF_HUB_OFFLINE"):
        commit = _with_retries(tok, "the tokenizer repository's information",
                               lambda: HfApi().model_info(tok.repo_id)).sha
    folder = Path(_with_retries(tok, f"{family.name}'s tokenizer", lambda: snapshot_download(
        tok.repo_id, revision=commit, allow_patterns=TOKENIZER_PATTERNS)))
    if not (folder / "tokenizer.json").exists():
        raise PullError(ref, f"{family.tokenizer_repo} has no tokenizer.json; download a tokenizer and convert with "
                             "tinyloop convert --tokenizer DIR")
    prov["tokenizer"] = {"repo_id": tok.repo_id, "commit": commit or folder.name}
    return folder


def _quantize_int4(ref: HubRef, src: Path, out: Path, progress: bool) -> None:
    from ..quant.packing import QuantError
    from ..tools.gptq import QuantSpec
    from ..tools.quantize import quantize_file

    from ..modelfile.header import header_config

    cfg = header_config(src)
    widths = {cfg.dim, cfg.ffn_dim, cfg.n_heads * cfg.head_dim}
    # 128 (real checkpoints); 64 or 32 where a small model's widths need it (the int4 kernels' sizes)
    group = next((g for g in (INT4_GROUP_SIZE, 64, 32) if all(w % g == 0 for w in widths)), None)
    if group is None:
        raise PullError(ref, f"cannot quantize to int4: no group size of 128, 64 or 32 divides the model's widths "
                             f"{sorted(widths)}; pull it without :int4")
    try:
        quantize_file(src, out, QuantSpec(bits=4, group_size=group, method="rtn"), progress=progress)
    except (ModelFileError, QuantError) as exc:
        raise PullError(ref, f"cannot quantize to int4: {exc}") from None


def resolve_pulled(text: str, *, pull_missing: bool = True) -> Path:
    """An `hf:` model name -> its file in the store, pulled first (saying so on stderr) when missing."""
    from .refs import RefError, parse_ref

    try:
        ref = parse_ref(text)
    except RefError as exc:
        raise ModelFileError(text, str(exc)) from None
    path = store_path(ref)
    if not path.exists() and pull_missing:
        print(f"tinyloop: {ref.name} is not in the store; pulling it from {_endpoint()} ...", file=sys.stderr)
        pull(ref, progress=sys.stderr.isatty())
    return path
