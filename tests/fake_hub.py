"""A local stand-in for the Hugging Face Hub endpoints that a folder push calls.

The push tests run the real `huggingface_hub` client end to end; this server answers the requests that
huggingface_hub 2.x sends for `create_repo`, `create_branch` and `upload_folder`:

    POST /api/repos/create                           create a repo (409 + url if it exists)
    GET  /api/models/{ns}/{name}                     repo info (create_repo asks it after a 401/403)
    POST /api/models/{ns}/{name}/branch/{branch}     create a branch (409 if it exists)
    POST /api/validate-yaml                          check README.md metadata before hashing
    POST /api/models/{ns}/{name}/preupload/{rev}     ask how each file is to be uploaded
    POST /api/models/{ns}/{name}/commit/{rev}        the commit, as ndjson

and, for downloads (`model_info`, `snapshot_download`, `hf_hub_download` of a repo put there with `add_model`):

    GET  /api/models/{ns}/{name}[/revision/{rev}]    repo info with its files and their sizes (`siblings`)
    GET  /api/models/{ns}/{name}/tree/{rev}          the file list snapshot_download filters
    HEAD /{ns}/{name}/resolve/{rev}/{path}           a file's commit, ETag and size
    GET  /{ns}/{name}/resolve/{rev}/{path}           a file's bytes

The preupload answer is "regular" for every file, so the client sends file contents inline (base64)
in the commit.  That is the Hub protocol's own path for small files; the other answer, "lfs", makes
the client (with `hf_xet` installed, as here) upload through Xet storage: a separate CAS service with
its own token exchange and binary chunk/shard formats, driven by the Rust `hf_xet` library, which
is beyond a test double.  A commit that still carries an `lfsFile` entry is rejected loudly rather
than accepted without content.

Everything the client sends is recorded (`requests`), including headers, so tests can check that the
token arrives; the server's own log (`log`) holds request lines and status codes only.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml


@dataclass
class RecordedRequest:
    method: str
    path: str  # decoded path, without the query string
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def json(self):
        return json.loads(self.body)


@dataclass
class FakeRepo:
    repo_id: str
    visibility: str | None  # as sent by the client; None = namespace default
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    commits: list[dict] = field(default_factory=list)
    preuploads: list[dict] = field(default_factory=list)  # the file entries the client described

    @property
    def private(self) -> bool:
        return self.visibility == "private"


class FakeHub:
    """The server plus its state; use as a context manager (`with FakeHub(token=...) as hub:`)."""

    def __init__(self, token: str | None = None, user: str = "test-user", reject_yaml: bool = False):
        self.token = token
        self.user = user
        self.reject_yaml = reject_yaml
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[RecordedRequest] = []
        self.unexpected: list[str] = []
        self.validated_cards: list[str] = []
        self.log: list[str] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        handler = type("BoundHandler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)  # port 0: a free port
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ state for download tests
    def add_model(self, repo_id: str, files: dict[str, bytes]) -> None:
        """A public model repository holding `files` (name -> bytes) on main, ready to be downloaded."""
        self.repos[repo_id] = FakeRepo(repo_id=repo_id, visibility="public", branches={"main": dict(files)})

    def downloaded(self) -> list[str]:
        """The file names whose bytes were sent (GET .../resolve/...), in order."""
        return ["/".join(r.path.strip("/").split("/")[4:]) for r in self.requests
                if r.method == "GET" and r.path.strip("/").split("/")[2:3] == ["resolve"]]

    # ------------------------------------------------------------------ queries for tests
    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        return dict(self.repos[repo_id].branches[revision])

    def endpoints(self) -> list[str]:
        """The sequence of calls received, as 'METHOD kind' (kind = the endpoint's last fixed word)."""
        return [f"{r.method} {_endpoint_kind(r.path)}" for r in self.requests]


def _endpoint_kind(path: str) -> str:
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "repos", "create"]:
        return "create"
    if parts[:2] == ["api", "validate-yaml"]:
        return "validate-yaml"
    if len(parts) >= 5 and parts[:2] == ["api", "models"]:
        return parts[4]
    if len(parts) == 4 and parts[:2] == ["api", "models"]:
        return "repo-info"
    return path


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    # The default implementation writes to stderr; keep request lines (never headers) in memory.
    def log_message(self, format, *args):  # noqa: A002 - signature fixed by the base class
        self.hub.log.append(format % args)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _reply(self, status: int, payload: dict | list, error_code: str | None = None) -> None:
        headers = {"Content-Type": "application/json"}
        if status >= 400:
            headers["X-Error-Message"] = payload.get("error", "error")
            if error_code:
                headers["X-Error-Code"] = error_code
        self._send(status, json.dumps(payload).encode(), headers)

    def _send(self, status: int, data: bytes, headers: dict[str, str], length: int | None = None) -> None:
        """`data` with `headers`; `length` is the Content-Length a HEAD answer announces without a body."""
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data) if length is None else length))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def do_GET(self):  # noqa: N802 - name fixed by the base class
        self._handle("GET")

    def do_POST(self):  # noqa: N802
        self._handle("POST")

    def do_PUT(self):  # noqa: N802
        self._handle("PUT")

    def do_HEAD(self):  # noqa: N802
        self._handle("HEAD")

    def _handle(self, method: str) -> None:
        split = urlsplit(self.path)
        segments = [unquote(part) for part in split.path.strip("/").split("/")]
        body = self._read_body()
        record = RecordedRequest(
            method=method,
            path="/" + "/".join(segments),
            query=parse_qs(split.query),
            headers={k.lower(): v for k, v in self.headers.items()},
            body=body,
        )
        with self.hub._lock:
            self.hub.requests.append(record)
            try:
                self._route(method, segments, record)
            except Exception as error:  # a bug in the fake must fail the test, not hang the client
                self.hub.unexpected.append(f"{method} {record.path}: {error!r}")
                self._reply(500, {"error": f"fake hub error: {error!r}"})

    def _authorised(self, record: RecordedRequest) -> bool:
        if self.hub.token is None:
            return True
        if record.headers.get("authorization") == f"Bearer {self.hub.token}":
            return True
        self._reply(401, {"error": "Invalid credentials in Authorization header"})
        return False

    def _route(self, method: str, segments: list[str], record: RecordedRequest) -> None:
        if method == "POST" and segments == ["api", "repos", "create"]:
            return self._create_repo(record)
        if method == "POST" and segments == ["api", "validate-yaml"]:
            return self._validate_yaml(record)
        if method == "GET" and segments[:2] == ["api", "models"] and (len(segments) == 4 or segments[4:5] == ["revision"]):
            return self._repo_info(f"{segments[2]}/{segments[3]}", record)
        if method == "GET" and segments[:2] == ["api", "models"] and segments[4:5] == ["tree"]:
            return self._tree(f"{segments[2]}/{segments[3]}", record)
        if method in ("GET", "HEAD") and len(segments) >= 5 and segments[2] == "resolve":
            return self._resolve(f"{segments[0]}/{segments[1]}", "/".join(segments[4:]), method == "GET")
        if method == "POST" and len(segments) == 6 and segments[:2] == ["api", "models"]:
            repo_id, action, ref = f"{segments[2]}/{segments[3]}", segments[4], segments[5]
            if action in ("branch", "preupload", "commit"):
                if not self._authorised(record):
                    return
                repo = self.hub.repos.get(repo_id)
                if repo is None:
                    return self._reply(404, {"error": "Repository not found"}, "RepoNotFound")
                return getattr(self, f"_{action}")(repo, ref, record)
        self.hub.unexpected.append(f"{method} {record.path}")
        self._reply(404, {"error": f"fake hub does not implement {method} {record.path}"})

    # ------------------------------------------------------------------ endpoints
    def _create_repo(self, record: RecordedRequest) -> None:
        if not self._authorised(record):
            return
        payload = record.json()
        repo_id = f"{payload.get('organization') or self.hub.user}/{payload['name']}"
        url = f"{self.hub.url}/{repo_id}"
        if repo_id in self.hub.repos:
            return self._reply(409, {"error": "You already created this model repo", "url": url})
        self.hub.repos[repo_id] = FakeRepo(repo_id=repo_id, visibility=payload.get("visibility"))
        self._reply(200, {"url": url, "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()})

    def _repo_info(self, repo_id: str, record: RecordedRequest) -> None:
        if not self._authorised(record):
            return
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._reply(404, {"error": "Repository not found"}, "RepoNotFound")
        self._reply(200, {"id": repo_id, "modelId": repo_id, "sha": self._sha(repo), "private": repo.private,
                          "siblings": [{"rfilename": name, "size": len(data)} for name, data in repo.branches["main"].items()]})

    @staticmethod
    def _sha(repo: FakeRepo) -> str:
        if repo.commits:
            return repo.commits[-1]["oid"]
        content = repo.branches["main"]  # a repo made with add_model: its content's hash, so a changed repo is new
        return hashlib.sha1(b"".join(name.encode() + hashlib.sha1(data).digest() for name, data in sorted(content.items()))).hexdigest()

    def _tree(self, repo_id: str, record: RecordedRequest) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._reply(404, {"error": "Repository not found"}, "RepoNotFound")
        self._reply(200, [{"type": "file", "path": name, "size": len(content), "oid": hashlib.sha1(content).hexdigest()}
                          for name, content in repo.branches["main"].items()])

    def _resolve(self, repo_id: str, name: str, with_body: bool) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or name not in repo.branches["main"]:
            return self._send(404, b"", {"X-Error-Code": "EntryNotFound" if repo else "RepoNotFound"})
        content = repo.branches["main"][name]
        self._send(200, content if with_body else b"", {"X-Repo-Commit": self._sha(repo),
                                                        "ETag": f'"{hashlib.sha1(content).hexdigest()}"'},
                   length=len(content))

    def _validate_yaml(self, record: RecordedRequest) -> None:
        content = record.json().get("content", "")
        self.hub.validated_cards.append(content)
        problem = None
        if self.hub.reject_yaml:
            problem = "rejected by the test"
        elif not content.startswith("---"):
            # the Hub takes a README without metadata and warns (huggingface_hub #1934: "empty metadata section")
            return self._reply(200, {"errors": [], "warnings": [{"message": "empty or missing yaml metadata in repo card"}]})
        else:
            try:
                metadata = yaml.safe_load(content.split("---", 2)[1])
                if not isinstance(metadata, dict):
                    problem = "metadata is not a mapping"
            except yaml.YAMLError as error:
                problem = f"invalid YAML: {error}"
        if problem:
            return self._reply(400, {"error": problem, "errors": [{"message": problem}], "warnings": []})
        self._reply(200, {"errors": [], "warnings": []})

    def _branch(self, repo: FakeRepo, branch: str, record: RecordedRequest) -> None:
        if branch in repo.branches:
            return self._reply(409, {"error": "Reference already exists"})
        start = (record.json() if record.body else {}).get("startingPoint") or "main"
        repo.branches[branch] = dict(repo.branches[start])
        self._reply(200, {})

    def _preupload(self, repo: FakeRepo, revision: str, record: RecordedRequest) -> None:
        if revision not in repo.branches:
            return self._reply(404, {"error": f"Invalid rev id: {revision}"}, "RevisionNotFound")
        entries = record.json()["files"]
        repo.preuploads.extend(entries)
        answer = [{"path": e["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for e in entries]
        self._reply(200, {"files": answer, "commitOid": None})

    def _commit(self, repo: FakeRepo, revision: str, record: RecordedRequest) -> None:
        if revision not in repo.branches:
            return self._reply(404, {"error": f"Invalid rev id: {revision}"}, "RevisionNotFound")
        lines = [json.loads(line) for line in record.body.decode().splitlines() if line.strip()]
        header = next(item["value"] for item in lines if item["key"] == "header")
        changes: dict[str, bytes | None] = {}
        for item in lines:
            value = item["value"]
            if item["key"] == "file":
                if value.get("encoding") != "base64":
                    return self._reply(400, {"error": f"unsupported encoding {value.get('encoding')!r}"})
                changes[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] == "deletedFile":
                changes[value["path"]] = None
            elif item["key"] != "header":
                return self._reply(422, {"error": f"fake hub accepts inline files only, got {item['key']!r}"})
        files = repo.branches[revision]
        for path, content in changes.items():
            if content is None:
                files.pop(path, None)
            else:
                files[path] = content
        oid = hashlib.sha1(f"{repo.repo_id}@{revision}#{len(repo.commits)}".encode()).hexdigest()
        repo.commits.append(
            {
                "revision": revision,
                "summary": header.get("summary"),
                "description": header.get("description"),
                "paths": sorted(changes),
                "oid": oid,
            }
        )
        self._reply(
            200,
            {
                "success": True,
                "commitOid": oid,
                "commitUrl": f"{self.hub.url}/{repo.repo_id}/commit/{oid}",
                "pullRequestUrl": None,
            },
        )
