"""Run the server in a background thread of this process (tests, benchmarks): a real uvicorn on a loopback port."""
from __future__ import annotations

import threading
import time


class BackgroundServer:
    def __init__(self, state, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        from .app import create_app
        self.state = state
        self.app = create_app(state)
        cfg = uvicorn.Config(self.app, host=host, port=port, log_level=log_level, access_log=False,
                             timeout_graceful_shutdown=5, lifespan="on")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, name="peagle-uvicorn", daemon=True)
        self.host, self.port = host, port

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 15.0):
        self.server.should_exit = True
        self.thread.join(timeout)
        self.state.loop.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *a):
        self.stop()
