"""Full-page screenshots with headless Chromium, driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: Chromium reads commands on fd 3 and answers on fd 4, each message
JSON ending with a NUL byte). ``--screenshot`` alone captures only the window, cutting off a
long page; here the viewport is resized to the page's own size first."""

from __future__ import annotations

import base64
import json
import math
import os
import select
import shutil
import subprocess
import tempfile
import time
from typing import Any


def browser() -> str | None:
    """A headless-capable Chromium on this machine, if any."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class _Pipe:
    def __init__(self, proc: subprocess.Popen[bytes], write_fd: int, read_fd: int, deadline: float) -> None:
        self.proc, self.write_fd, self.read_fd, self.deadline = proc, write_fd, read_fd, deadline
        self.next_id = 0
        self.buffer = b""
        self.seen: list[dict[str, Any]] = []  # events that arrived while waiting for a reply

    def _message(self) -> dict[str, Any]:
        while b"\0" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise RuntimeError("Chromium did not answer in time")
            chunk = os.read(self.read_fd, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited (status {self.proc.poll()})")
            self.buffer += chunk
        msg, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(msg)  # type: ignore[no-any-return]

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self.write_fd, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._message()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"Chromium: {method}: {reply['error'].get('message')}")
                return reply.get("result", {})  # type: ignore[no-any-return]
            self.seen.append(reply)

    def wait_event(self, method: str) -> None:
        while not any(m.get("method") == method for m in self.seen):
            self.seen.append(self._message())


def screenshot(page: str, png: str, width: int = 1400, timeout: float = 120.0) -> str:
    """Renders ``page`` with headless Chromium into ``png``: the whole page, ``width`` CSS
    pixels wide (more if the page is wider) and as tall as the page."""
    exe = browser()
    if exe is None:
        raise RuntimeError("no Chromium found for the PNG (Debian: apt-get install chromium)")
    to_chrome, chrome_in = os.pipe()
    chrome_out, from_chrome = os.pipe()
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--remote-debugging-pipe",
            "--no-first-run", "--no-default-browser-check", "about:blank"]
    # fd 3: what Chromium reads; fd 4: what it writes.
    cmd = ["sh", "-c", f'exec "$0" "$@" 3<&{to_chrome} 4>&{from_chrome}', exe, *args]
    log = tempfile.TemporaryFile()  # Chromium's stderr, for the error message (a pipe could fill up)
    proc = subprocess.Popen(cmd, pass_fds=(to_chrome, from_chrome), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=log)
    os.close(to_chrome)
    os.close(from_chrome)
    pipe = _Pipe(proc, chrome_in, chrome_out, time.monotonic() + timeout)
    try:
        target = pipe.call("Target.createTarget", url="about:blank")["targetId"]
        session = pipe.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        pipe.call("Page.enable", session)
        # The content size is at least the viewport: measure with a short one, widen to the
        # page's width (a wide table), measure again there (text wraps less), then size to it.
        w, h = width, 100
        metrics = {"deviceScaleFactor": 1, "mobile": False}
        pipe.call("Emulation.setDeviceMetricsOverride", session, width=w, height=h, **metrics)
        pipe.call("Page.navigate", session, url="file://" + os.path.abspath(page))
        pipe.wait_event("Page.loadEventFired")
        for _ in range(3):
            size = pipe.call("Page.getLayoutMetrics", session)["cssContentSize"]
            need_w, h = max(width, math.ceil(size["width"])), math.ceil(size["height"])
            if need_w == w:
                break
            w = need_w
            pipe.call("Emulation.setDeviceMetricsOverride", session, width=w, height=100, **metrics)
        pipe.call("Emulation.setDeviceMetricsOverride", session, width=w, height=h, **metrics)
        data = pipe.call("Page.captureScreenshot", session, format="png")["data"]
        with open(png, "wb") as f:
            f.write(base64.b64decode(data))
        try:
            pipe.call("Browser.close")
        except RuntimeError:
            pass
    except (OSError, RuntimeError, KeyError, ValueError) as e:
        proc.kill()
        proc.wait()
        log.seek(0)
        err = log.read().decode(errors="replace")
        raise RuntimeError(f"Chromium could not render {page}: {e} {err.strip()[-500:]}") from e
    finally:
        os.close(chrome_in)
        os.close(chrome_out)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return png
