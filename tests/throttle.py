"""A TCP proxy on loopback that slows one direction down: a slow network
link, for tests of what happens while long messages are in flight."""

import socket
import threading
import time


class ThrottledProxy:
    """Forwards connections to ``upstream`` (``host:port``); bytes coming
    back from upstream pass at ``rate`` bytes per second at most."""

    def __init__(self, upstream: str, rate: float):
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._rate = rate
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self._server.getsockname()[1]
        self._socks: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                down, _ = self._server.accept()
            except OSError:
                return
            up = socket.create_connection(self._upstream)
            self._socks += [down, up]
            threading.Thread(target=self._pump, args=(down, up, None),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, self._rate),
                             daemon=True).start()

    @staticmethod
    def _pump(src, dst, rate):
        chunk = 65536 if rate is None else max(1, min(65536, int(rate / 50)))
        try:
            while True:
                data = src.recv(chunk)
                if not data:
                    break
                dst.sendall(data)
                if rate is not None:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def drop(self):
        """Cut every connection made so far (a network failure); new ones
        are still accepted."""
        socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self._server.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass
