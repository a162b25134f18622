"""A local HTTP server that answers the Hugging Face Hub endpoints huggingface_hub uses (point HF_ENDPOINT at
it): model info, the recursive file tree, HEAD and ranged GET of `resolve/`. It serves folders of files as
repositories and can play the Hub's failures: a gated or unauthorised repository, a 5xx, a download cut
halfway (the connection closes after half the bytes)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Repo:
    folder: Path
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    branches: tuple[str, ...] = ("main",)
    gated: bool = False
    files: dict[str, bytes] = field(default_factory=dict)  # extra or replacing files

    def listing(self) -> dict[str, bytes]:
        out = {p.name: p.read_bytes() for p in sorted(self.folder.iterdir())
               if p.is_file() and not p.name.startswith("reference")}
        out.update(self.files)
        return out


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.require_token: str | None = None   # 401 unless `Authorization: Bearer <token>`
        self.cut_file: str | None = None        # the first GET of this file stops after half its bytes ...
        self.fail_after_cut = False             # ... and later GETs of it answer 503 while this is set
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self._cut_done = False
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._answer(self, head=True)

            def do_GET(self):
                hub._answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    # -- answers ----------------------------------------------------------------------------------
    def _send(self, h, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head=False):
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head and body:
            h.wfile.write(body)

    def _error(self, h, status: int, code: str | None, message: str, head=False):
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(h, status, json.dumps({"error": message}).encode(), headers, head)

    def _repo(self, h, repo_id: str, head: bool) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 401 if self.require_token else 404, "RepoNotFound",
                        "Repository not found", head)
            return None
        if self.require_token and h.headers.get("Authorization") != f"Bearer {self.require_token}":
            self._error(h, 401, None, "Invalid credentials in Authorization header", head)
            return None
        if repo.gated and not h.headers.get("Authorization"):
            self._error(h, 401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                        "to it and be authenticated to access it. Please log in.", head)
            return None
        return repo

    def _revision_ok(self, repo: Repo, rev: str) -> bool:
        return rev in repo.branches or rev == repo.sha

    def _answer(self, h, head: bool):
        path = h.path.split("?", 1)[0]
        self.requests.append((h.command, path, h.headers.get("Range")))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            repo = self._repo(h, m.group(1), head)
            if repo is None:
                return
            rev = m.group(2) or "main"
            if not self._revision_ok(repo, rev):
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            files = repo.listing()
            body = {"id": m.group(1), "modelId": m.group(1), "sha": repo.sha, "private": False,
                    "gated": repo.gated, "disabled": False, "tags": [], "downloads": 0, "likes": 0,
                    "siblings": [{"rfilename": n, "size": len(b)} for n, b in files.items()]}
            return self._send(h, 200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", path)
        if m:
            repo = self._repo(h, m.group(1), head)
            if repo is None:
                return
            if not self._revision_ok(repo, m.group(2)):
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {m.group(2)}", head)
            entries = [{"type": "file", "oid": hashlib.sha1(b).hexdigest(), "size": len(b), "path": n}
                       for n, b in repo.listing().items()]
            return self._send(h, 200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, head)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            repo = self._repo(h, m.group(1), head)
            if repo is None:
                return
            if not self._revision_ok(repo, m.group(2)):
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {m.group(2)}", head)
            files = repo.listing()
            name = m.group(3)
            if name not in files:
                return self._error(h, 404, "EntryNotFound", f"{name} does not exist", head)
            return self._file(h, repo, name, files[name], head)
        self._error(h, 404, None, f"no route {path}", head)

    def _file(self, h, repo: Repo, name: str, data: bytes, head: bool):
        etag = hashlib.sha256(data).hexdigest()
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if head:
            return self._send(h, 200, data, headers, head=True)
        if name == self.cut_file and self._cut_done and self.fail_after_cut:
            return self._error(h, 503, None, "Service Unavailable (the test's outage)")
        start = 0
        rng = h.headers.get("Range")
        if rng:
            start = int(re.match(r"bytes=(\d+)-", rng).group(1))
        body = data[start:]
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if name == self.cut_file and not self._cut_done:
            self._cut_done = True
            h.send_response(status)
            for k, v in headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            import socket
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        self._send(h, status, body, headers)
