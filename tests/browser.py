"""A headless Chromium driven over the Chrome DevTools Protocol, with a standard-library websocket client (no
selenium, no driver, nothing to download): for tests of the pages headlab writes. `chromium()` is None where no
browser is installed; tests skip then (Debian: `apt-get install chromium-headless-shell` or `chromium`)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

BINARIES = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome", "chrome", "headless_shell")


def chromium() -> str | None:
    """The first Chromium binary on PATH ($HEADLAB_CHROMIUM first), or None."""
    names = (os.environ.get("HEADLAB_CHROMIUM"), *BINARIES)
    return next((found for name in names if name and (found := shutil.which(name))), None)


def launch_flags(user_data: Path) -> list[str]:
    return [
        "--headless",
        "--no-sandbox",  # root in containers
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--window-size=1280,900",
        f"--user-data-dir={user_data}",
    ]


class _Socket:
    """The client side of RFC 6455: masked text frames out, (possibly fragmented) frames in."""

    def __init__(self, url: str, timeout: float):
        parts = urlparse(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET {parts.path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += self.sock.recv(1)
        if b" 101 " not in reply.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"websocket handshake failed: {reply[:80]!r}")

    def _exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            piece = self.sock.recv(n - len(data))
            if not piece:
                raise ConnectionError("the browser closed the connection")
            data += piece
        return data

    def send(self, text: str) -> None:
        payload, mask = text.encode(), os.urandom(4)
        n = len(payload)
        head = struct.pack("!B", 0x81)
        if n < 126:
            head += struct.pack("!B", 0x80 | n)
        elif n < 1 << 16:
            head += struct.pack("!BH", 0x80 | 126, n)
        else:
            head += struct.pack("!BQ", 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(head + mask + masked)

    def receive(self) -> str:
        message = b""
        while True:
            first, second = self._exact(2)
            n = second & 0x7F
            if n == 126:
                n = struct.unpack("!H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", self._exact(8))[0]
            payload = self._exact(n)
            opcode = first & 0x0F
            if opcode == 8:
                raise ConnectionError("the browser closed the websocket")
            if opcode in (0, 1, 2):
                message += payload
                if first & 0x80:
                    return message.decode()

    def close(self) -> None:
        self.sock.close()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


class Chromium:
    """A headless browser with one page; `call(method, **params)` is one CDP command, `events` every event seen, and
    `errors()` the console errors and uncaught exceptions among them."""

    def __init__(self, binary: str | None = None, timeout: float = 60.0):
        self.binary = binary or chromium()
        if self.binary is None:
            raise RuntimeError("no Chromium binary found")
        self.timeout, self.events, self._id = timeout, [], 0
        self._dir = tempfile.TemporaryDirectory(prefix="headlab-chromium-")
        user_data = Path(self._dir.name)
        self.process = subprocess.Popen(
            [self.binary, *launch_flags(user_data), "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Its own process group: Debian's /usr/bin/chromium* are shell wrappers that do not exec, so ending the
            # wrapper alone would leave the browser running.
            start_new_session=True,
        )
        port_file, deadline = user_data / "DevToolsActivePort", time.monotonic() + timeout
        while not (port_file.is_file() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.close()
                raise RuntimeError(f"{self.binary} did not open its DevTools port")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout) as reply:
            pages = [t for t in json.loads(reply.read()) if t.get("type") == "page"]
        self.socket = _Socket(pages[0]["webSocketDebuggerUrl"], timeout)
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.socket.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.receive())
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, event: str) -> dict:
        """The first `event` not consumed yet (reading more messages until it arrives)."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            for position, message in enumerate(self.events):
                if message.get("method") == event:
                    return self.events.pop(position)
            self.events.append(json.loads(self.socket.receive()))
        raise TimeoutError(event)

    def open(self, url: str) -> None:
        """Navigate and wait for the load event."""
        self.events = [e for e in self.events if e.get("method") != "Page.loadEventFired"]
        self.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression (a Promise is awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:60]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])

    def errors(self) -> list[str]:
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(str(params["exceptionDetails"].get("exception", {}).get("description")))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(params["entry"].get("text", ""))
        return found

    def close(self) -> None:
        if getattr(self, "socket", None) is not None:
            self.socket.close()
        group = self.process.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(group, sig)  # the wrapper, the browser and its helpers
            except ProcessLookupError:
                break
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _group_alive(group):
                self.process.poll()  # reaps the wrapper
                time.sleep(0.05)
            if not _group_alive(group):
                break
        self.process.wait(10)
        self._dir.cleanup()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def screenshot_file(url: str, out: Path, binary: str | None = None) -> Path:
    """Chromium's own `--screenshot` of `url` into `out` (a PNG)."""
    binary = binary or chromium()
    with tempfile.TemporaryDirectory(prefix="headlab-chromium-") as user_data:
        subprocess.run(
            [binary, *launch_flags(Path(user_data)), f"--screenshot={out}", url],
            check=True,
            capture_output=True,
            timeout=120,
        )
    return Path(out)
