"""The collector's control socket: one JSON line in, one JSON line out, then the server closes.

Protocol (docs/collector.md):
  {"cmd": "status"} -> {"state": "recording"|"starting"|"sealed"|"error", "file", "records", "drops",
                        "errors", "sources", "pid", ...}
  {"cmd": "flush"}  -> {"ok": true, "records": {...}} once the writer has drained and flushed
  {"cmd": "seal"}   -> {"ok": true, "file", "sealed": true} once the file is sealed; then the
                       collector exits. On failure {"ok": false, "error": "..."}.
Unknown or malformed requests get {"ok": false, "error": "..."}.

Why a Unix stream socket with mode 0600: only root (the prolog/epilog) may seal a collector or
learn about a job's processes; the file mode is the access check, no credentials are needed.
"""

from __future__ import annotations

import array
import json
import logging
import os
import socket
import stat
import threading
from pathlib import Path
from typing import Any, Protocol

from gpuprof.collector.errors import CollectorError
from gpuprof.collector.osthread import named_thread


class Controlled(Protocol):
    """What the control socket asks of a collector (daemon.Collector is one); a protocol so that
    this module does not import the daemon, which imports it."""

    state: str
    finished_event: threading.Event

    @property
    def output(self) -> Path: ...

    def status(self) -> dict[str, Any]: ...

    def request_flush(self) -> bool: ...

    def request_stop(self, reason: str) -> None: ...

log = logging.getLogger("gpuprof.collector")

MAX_REQUEST_BYTES = 4096
CLIENT_READ_TIMEOUT_S = 2.0
SEAL_WAIT_S = 120.0
COMMANDS = ("status", "flush", "seal")


class ControlServer:
    """Serves requests one at a time on its own thread (requests are rare and short)."""

    def __init__(self, collector: Controlled, path: Path, *, mode: int = 0o600) -> None:
        self.collector = collector
        self.path = Path(path)
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock = self._bind(mode)

    def _bind(self, mode: int) -> socket.socket:
        _check_socket_dir(self.path.parent)
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise CollectorError(f"{self.path}: exists and is not a socket; refusing to replace it")
            # a stale socket of a dead collector: take its place only if nobody answers on it
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
            except OSError:
                os.unlink(self.path)
            else:
                raise CollectorError(f"{self.path}: another collector is listening there")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # bind under a restrictive umask so the socket is never reachable with wider permissions
        # (no chmod after: by path it would follow a symlink swapped in meanwhile)
        old = os.umask(0o777 & ~mode)
        try:
            sock.bind(str(self.path))
        except OSError as e:
            sock.close()
            raise CollectorError(f"{self.path}: cannot create control socket: {e.strerror}") from None
        finally:
            os.umask(old)
        st = os.lstat(self.path)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & ~mode:
            sock.close()
            raise CollectorError(f"{self.path}: control socket replaced or widened after bind "
                                 f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid}); refusing")
        sock.listen(8)  # blocking: close() wakes the accept with a shutdown (no polling at 5 Hz)
        return sock

    def start(self) -> None:
        self._thread = named_thread(self._serve, "control")
        self._thread.start()

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError as e:  # EINVAL after close()'s shutdown; else (EMFILE...) try again soon
                if self._closing.is_set():
                    return
                log.debug("control accept: %s", e)
                self._closing.wait(0.1)  # not a busy loop while descriptors run out
                continue
            with conn:
                try:
                    self._handle(conn)
                except OSError as e:  # client went away mid-reply
                    log.debug("control client error: %s", e)

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(CLIENT_READ_TIMEOUT_S)
        data = b""
        try:
            while b"\n" not in data and len(data) < MAX_REQUEST_BYTES:
                chunk = conn.recv(MAX_REQUEST_BYTES)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            pass
        try:
            reply = self.dispatch(data.split(b"\n", 1)[0])
        except Exception as e:  # a failed request is answered; the socket keeps serving
            log.exception("control request failed")
            reply = {"ok": False, "error": f"request failed: {type(e).__name__}: {e}"}
        conn.sendall(json.dumps(reply, sort_keys=True).encode() + b"\n")

    def dispatch(self, line: bytes) -> dict[str, Any]:
        try:
            req = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {"ok": False, "error": "request is not one line of JSON"}
        cmd = req.get("cmd") if isinstance(req, dict) else None
        c = self.collector
        if cmd == "status":
            return c.status()
        if cmd == "flush":
            if c.request_flush():
                return {"ok": True, "records": c.status()["records"]}
            return {"ok": False, "error": f"not recording (state {c.state}): {c.status().get('error', '')}"}
        if cmd == "seal":
            c.request_stop("seal requested on the control socket")
            c.finished_event.wait(SEAL_WAIT_S)
            if c.state == "sealed":
                return {"ok": True, "file": str(c.output), "sealed": True}
            return {"ok": False, "file": str(c.output), "sealed": False,
                    "error": c.status().get("error", f"state {c.state}")}
        return {"ok": False, "error": f"unknown cmd {cmd!r}; known: {', '.join(COMMANDS)}"}

    def close(self) -> None:
        """Stop serving (after a request in progress has been answered) and remove the socket."""
        self._closing.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the serving thread's accept (EINVAL)
        except OSError as e:
            log.debug("control socket shutdown: %s", e)  # never listened, or closed already
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(SEAL_WAIT_S)
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _check_socket_dir(d: Path) -> None:
    """The socket's directory must not let anyone else replace the socket: owned by us or root, and
    not writable by group or others unless sticky (the prolog's is <state_dir>/jobs/<job>@<node>,
    0700 root)."""
    try:
        st = os.stat(d)
    except OSError as e:
        raise CollectorError(f"{d}: control socket directory unusable: {e.strerror}") from None
    if st.st_uid not in (0, os.geteuid()):
        raise CollectorError(f"{d}: control socket directory owned by uid {st.st_uid}; refusing")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise CollectorError(f"{d}: control socket directory writable by others "
                             f"({stat.filemode(st.st_mode)}); refusing")


def request(socket_path: str | os.PathLike[str], cmd: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """Send one command to a collector and return its reply; CollectorError on any failure."""
    if cmd not in COMMANDS:
        raise CollectorError(f"unknown control command {cmd!r}; known: {', '.join(COMMANDS)}")
    return exchange(socket_path, {"cmd": cmd}, timeout_s=timeout_s)


def exchange(socket_path: str | os.PathLike[str], req: dict[str, Any], *, fd: int | None = None,
             timeout_s: float = 5.0, who: str = "collector",
             absent: str = "collector not started or exited") -> dict[str, Any]:
    """One JSON line to a collector's unix socket (with a file descriptor beside it when `fd` is
    given: SCM_RIGHTS) and its one-line JSON object reply; CollectorError naming the socket and
    the request on any failure. `who`/`absent` word the errors (the job collector's control socket,
    the continuous collector's API)."""
    what = req.get("cmd")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(os.fspath(socket_path))
        payload = json.dumps(req).encode() + b"\n"
        if fd is not None:
            s.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        else:
            s.sendall(payload)
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except FileNotFoundError:
        raise CollectorError(f"{socket_path}: no {who} socket ({absent})") from None
    except ConnectionRefusedError:
        raise CollectorError(f"{socket_path}: nobody listening ({who} exited)") from None
    except TimeoutError:
        raise CollectorError(f"{socket_path}: no reply to '{what}' within {timeout_s} s") from None
    except OSError as e:
        raise CollectorError(f"{socket_path}: request '{what}' failed: {e.strerror or e}") from None
    finally:
        s.close()
    try:
        reply = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CollectorError(f"{socket_path}: reply to '{what}' is not JSON: {data[:200]!r}") from None
    if not isinstance(reply, dict):
        raise CollectorError(f"{socket_path}: reply to '{what}' is not a JSON object")
    return reply
