"""Headless Chromium driven over the DevTools protocol (a websocket): open a page, evaluate JavaScript in it,
wait for a condition, take a screenshot. Enough to click through the documentation site like a reader."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, profile: Path, timeout: float = 30.0):
        self.timeout = timeout
        self.process = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", "--window-size=1200,900", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        port = self._until(lambda: port_file.exists() and port_file.read_text().split("\n")[0], "Chromium's DevTools port")
        self.endpoint = f"http://127.0.0.1:{port}"
        target = next(t for t in self._json("/json/list") if t["type"] == "page")
        from websockets.sync.client import connect

        self.socket = connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=timeout).__enter__()
        self.ids = 0

    def _json(self, path: str):
        with urllib.request.urlopen(self.endpoint + path, timeout=self.timeout) as response:
            return json.load(response)

    def _until(self, condition, what: str, timeout: float | None = None):
        deadline = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"no {what} within {timeout or self.timeout:.0f} s")

    def send(self, method: str, **params):
        self.ids += 1
        self.socket.send(json.dumps({"id": self.ids, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=self.timeout))
            if message.get("id") == self.ids:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        """Go to `url` and wait until it has loaded."""
        self.evaluate("window.__left = true")  # gone once the new page has replaced this one
        self.send("Page.navigate", url=url)
        self._until(lambda: self.evaluate("!window.__left && document.readyState === 'complete'"), f"the page {url}")

    def wait_for(self, expression: str, what: str):
        """The value of `expression` once it is truthy."""
        return self._until(lambda: self.evaluate(expression), what)

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        try:
            self.socket.close()
        finally:
            self.process.terminate()
            self.process.wait(timeout=30)
