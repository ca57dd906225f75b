"""Headless Chromium (Debian's `chromium`) for the HTML report's browser tests and its bench, driven
over the DevTools protocol (websocket-client; no browser driver library).

`open_page` starts one browser per page with a fresh profile, the network cut (every host resolves to
nothing, so a page that tried to fetch anything would log an error), loads the file, and waits until
the page says its charts are painted (#gp-done[data-painted-ms]) or a condition of the caller's
holds. What comes back: every console message and uncaught exception with its level, the DOM as
serialized after the scripts ran, JS evaluation, and PNG screenshots of the page or of one element.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         "--disable-extensions", "--host-resolver-rules=MAP * ~NOTFOUND", "--disable-background-networking",
         "--remote-debugging-port=0", "--remote-allow-origins=*"]
LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


def chromium() -> str | None:
    for n in CHROMIUM_NAMES:
        p = shutil.which(n)
        if p:
            return p
    return None


@dataclass
class Page:
    ws: Any
    console: list[tuple[str, str]] = field(default_factory=list)  # (level, text); exceptions as ("exception", ...)
    load_s: float = 0.0  # navigation to the load event, wall clock
    _id: int = 0

    def call(self, method: str, timeout_s: float = 60.0, **params: Any) -> dict[str, Any]:
        self._id += 1
        my = self._id
        self.ws.send(json.dumps({"id": my, "method": method, "params": params}))
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            msg = self._recv(end)
            if msg is not None and msg.get("id") == my:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))
        raise TimeoutError(f"{method}: no answer in {timeout_s} s")

    def _recv(self, end: float) -> dict[str, Any] | None:
        self.ws.settimeout(max(0.05, end - time.monotonic()))
        msg: dict[str, Any] = json.loads(self.ws.recv())
        m = msg.get("method")
        if m == "Runtime.consoleAPICalled":
            p = msg["params"]
            self.console.append((p["type"], " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])))
        elif m == "Runtime.exceptionThrown":
            d = msg["params"]["exceptionDetails"]
            self.console.append(("exception", d.get("exception", {}).get("description", d.get("text", ""))))
        elif m == "Log.entryAdded":
            e = msg["params"]["entry"]
            self.console.append((e["level"], e.get("text", "")))
        return msg

    def wait_event(self, method: str, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            msg = self._recv(end)
            if msg is not None and msg.get("method") == method:
                return
        raise TimeoutError(f"no {method} in {timeout_s} s")

    def js(self, expr: str) -> Any:
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expr: str, timeout_s: float = 60.0) -> Any:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            v = self.js(expr)
            if v:
                return v
            time.sleep(0.05)
        raise TimeoutError(f"{expr!r} still false after {timeout_s} s")

    def dom(self) -> str:
        return str(self.js("document.documentElement.outerHTML"))

    def screenshot(self, png: Path, selector: str | None = None) -> Path:
        """The whole page (beyond the viewport), or the element `selector` alone."""
        if selector is None:
            w, h = self.js("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            clip = {"x": 0, "y": 0, "width": w, "height": h, "scale": 1}
        else:
            r = self.js(f"(function(){{var r=document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                        "return [r.left + window.scrollX, r.top + window.scrollY, r.width, r.height];})()")
            clip = {"x": r[0], "y": r[1], "width": r[2], "height": r[3], "scale": 1}
        data = self.call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)["data"]
        png.parent.mkdir(parents=True, exist_ok=True)
        png.write_bytes(base64.b64decode(data))
        return png


@contextmanager
def open_page(page: Path, *, width: int = 1400, height: int = 1000, timeout_s: float = 60.0,
              painted: bool = True) -> Iterator[Page]:
    """The page loaded (and, with `painted`, its charts painted) in a fresh headless Chromium."""
    import websocket

    exe = chromium()
    if exe is None:
        raise RuntimeError("chromium not installed (Debian package 'chromium'; etc/dev/setup.sh installs it)")
    profile = tempfile.mkdtemp(prefix="gpuprof-chromium-")
    proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HOME": profile})
    try:
        assert proc.stderr is not None
        browser_url = None
        end = time.monotonic() + timeout_s
        while browser_url is None and time.monotonic() < end:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError(f"chromium exited {proc.returncode} before listening")
            if m := LISTENING.search(line):
                browser_url = m.group(1)
        if browser_url is None:
            raise TimeoutError("chromium did not start listening")
        browser = websocket.create_connection(browser_url, timeout=timeout_s, suppress_origin=True)
        bp = Page(browser)
        target = bp.call("Target.createTarget", url="about:blank")["targetId"]
        port = browser_url.split(":")[2].split("/")[0]
        ws = websocket.create_connection(f"ws://127.0.0.1:{port}/devtools/page/{target}", timeout=timeout_s,
                                         suppress_origin=True)
        p = Page(ws)
        p.call("Runtime.enable")
        p.call("Log.enable")
        p.call("Page.enable")
        p.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        t0 = time.monotonic()
        p.call("Page.navigate", url=page.resolve().as_uri())
        p.wait_event("Page.loadEventFired", timeout_s)
        p.load_s = time.monotonic() - t0
        if painted:
            p.wait_for("!!(document.getElementById('gp-done') && document.getElementById('gp-done').dataset.paintedMs)",
                       timeout_s)
        yield p
        ws.close()
        browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
