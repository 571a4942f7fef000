"""A real S3 API on 127.0.0.1 for tests and the data benchmark: moto's server, behind a small
proxy that can add latency, answer 503s, drop connections mid-body or stop answering (an outage),
so the storage client's retries and the run's errors are exercised against real HTTP."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# the client reads these: no real credentials exist anywhere near a test
FAKE_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


class Faults:
    """What the proxy does to the next requests (thread-safe counters)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latency_s = 0.0
        self.fail_next = 0        # answer 503 SlowDown
        self.drop_next = 0        # send half the body, then close
        self.down = False         # every request 503 (an outage)
        self.requests = 0
        self.gets = 0
        self.ranged = 0           # GETs of a byte range (chunk reads)

    def take(self, name: str) -> bool:
        with self.lock:
            left = getattr(self, name)
            if left > 0:
                setattr(self, name, left - 1)
                return True
            return False


def _handler(upstream: tuple[str, int], faults: Faults):
    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _forward(self) -> None:
            with faults.lock:
                faults.requests += 1
                faults.gets += self.command == "GET"
                faults.ranged += self.command == "GET" and "Range" in self.headers
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            if faults.latency_s:
                time.sleep(faults.latency_s)
            if faults.down or faults.take("fail_next"):
                msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                self.send_response(503)
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)
                return
            conn = http.client.HTTPConnection(*upstream, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            drop = self.command == "GET" and len(data) > 64 and faults.take("drop_next")
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if drop:
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            self.wfile.write(data)
            conn.close()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

    return Proxy


class LocalS3:
    """moto's S3 server and the fault proxy in front of it; `endpoint` is the proxy's URL."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        self.faults = Faults()
        self.proxy = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.moto.get_host_and_port(), self.faults))
        self.proxy.daemon_threads = True
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.proxy.server_address[1]}"

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server (fake credentials, the endpoint)."""
        return {**FAKE_AWS, "AWS_ENDPOINT_URL": self.endpoint}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=f"http://{':'.join(map(str, self.moto.get_host_and_port()))}",
                            region_name="us-east-1", aws_access_key_id="testing",
                            aws_secret_access_key="testing-secret")

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def upload_dir(self, local: Path, url: str) -> None:
        """Copy a local store folder to `url` (s3://bucket/key) as plain objects."""
        bucket, _, key = url[len("s3://"):].partition("/")
        c = self.client()
        for f in sorted(Path(local).rglob("*")):
            if f.is_file():
                c.upload_file(str(f), bucket, "/".join(p for p in (key, f.relative_to(local).as_posix()) if p))

    def stop(self) -> None:
        self.proxy.shutdown()
        self.moto.stop()
