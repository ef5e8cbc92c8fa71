"""Ports inside a sandbox through ``bunshin serve`` (``sandbox.get_host(port)``: the host
``PORT-ID.DOMAIN`` sent to the server, with the sandbox's traffic token), and signed file
URLs (``upload_url``/``download_url`` of a secure sandbox)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
from e2b import Sandbox

from bunshin_gym.serve import ports

ECHO_SERVER = r"""
import http.server, sys, time
class Echo(http.server.BaseHTTPRequestHandler):
    def answer(self):
        if self.path == "/slow":
            time.sleep(5)
        if self.path == "/huge":
            body = b"x" * int(sys.argv[2])
        else:
            n = int(self.headers.get("Content-Length") or 0)
            body = b"%s %s %s|" % (self.command.encode(), self.path.encode(),
                                    (self.headers.get("X-Probe") or "").encode()) + self.rfile.read(n)
        self.send_response(201 if self.command == "POST" else 200)
        self.send_header("Set-Cookie", "a=1")
        self.send_header("Set-Cookie", "b=2")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = do_PUT = answer
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Echo).serve_forever()
"""


def test_get_host_reaches_a_port_inside_with_the_traffic_token(server, sandbox):
    sandbox.files.write("/tmp/echo.py", ECHO_SERVER)
    sandbox.commands.run(f"python3 /tmp/echo.py 8080 {ports.MAX_BODY + 1}", background=True)
    host = sandbox.get_host(8080)
    assert host.startswith(f"8080-{sandbox.sandbox_id}.")
    token = {ports.TRAFFIC_TOKEN_HEADER: sandbox.traffic_access_token}
    with httpx.Client(base_url=server.url, headers={"Host": host}, timeout=120) as c:
        deadline = time.monotonic() + 20
        while (r := c.get("/hello?q=1", headers={**token, "X-Probe": "p1"})).status_code == 502:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert (r.status_code, r.text) == (200, "GET /hello?q=1 p1|")
        assert r.headers.get_list("set-cookie") == ["a=1", "b=2"]
        r = c.post("/submit", content=b"body \x00 bytes", headers=token)
        assert (r.status_code, r.content) == (201, b"POST /submit |body \x00 bytes")

        assert c.get("/hello").status_code == 401, "no token: refused"
        assert c.get("/hello", headers={ports.TRAFFIC_TOKEN_HEADER: "wrong"}).status_code == 401
        r = c.get("/", headers={**token, "Host": sandbox.get_host(8081)})
        assert r.status_code == 502 and "nothing listens on port 8081" in r.json()["message"]
        assert c.get("/", headers={**token, "Host": "8080-nosuchsandbox.example"}).status_code == 404
        r = c.get("/huge", headers=token)
        assert r.status_code == 502 and "over the limit" in r.json()["message"], "answers are bounded"
        r = c.post("/big", content=b"y" * (ports.MAX_BODY + 1), headers=token)
        assert r.status_code == 413, "requests are bounded"
        r = c.get("/after", headers=token)
        assert r.status_code == 200, "the port still answers after refused requests"

        # a slow port holds up nothing else of the sandbox (the forwarder runs detached)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(c.get, "/slow", headers=token)
            time.sleep(0.5)
            t0 = time.monotonic()
            assert sandbox.commands.run("echo meanwhile").stdout == "meanwhile\n"
            assert time.monotonic() - t0 < 3 and not slow.done()
            assert slow.result().text == "GET /slow |"
        assert sandbox.commands.run("ls -a /tmp | grep -c bunshin-port || true").stdout == "0\n", "no file left"
    with httpx.Client(base_url=server.url) as c:  # the server's own routes are untouched
        assert c.get("/health").status_code == 204


def test_signed_upload_and_download_urls(server, sandbox, opts):
    up = sandbox.upload_url("/tmp/up.txt", use_signature_expiration=60)
    assert up.startswith(server.url) and "signature=v1_" in up
    r = httpx.post(up, files={"file": ("up.txt", b"uploaded through a signed URL")})
    assert r.status_code == 200, r.text
    assert sandbox.files.read("/tmp/up.txt") == "uploaded through a signed URL"
    down = sandbox.download_url("/tmp/up.txt")
    assert httpx.get(down).content == b"uploaded through a signed URL"
    assert httpx.get(sandbox.download_url("/tmp/up.txt", user="root")).content == b"uploaded through a signed URL"

    assert httpx.get(down.replace("up.txt", "other.txt")).status_code == 401, "the path is signed"
    assert httpx.post(down, files={"file": ("x", b"x")}).status_code == 401, "a read URL does not write"
    expired = sandbox.download_url("/tmp/up.txt", use_signature_expiration=-5)
    r = httpx.get(expired)
    assert r.status_code == 401 and "expired" in r.json()["message"]
    other = Sandbox.create("base", **opts)
    try:  # one sandbox's URL reads only from that sandbox
        other.files.write("/tmp/up.txt", "the other one")
        assert httpx.get(down).content == b"uploaded through a signed URL"
        assert httpx.get(other.download_url("/tmp/up.txt")).content == b"the other one"
    finally:
        other.kill()
    assert sandbox.files.read("/tmp/up.txt") == "uploaded through a signed URL"


def test_domain_makes_get_host_a_url_that_curl_reaches(tmp_path):
    import subprocess

    from .conftest import Server, e2b_opts, free_port

    port = free_port()
    srv = Server(tmp_path, "--close-on-exit", "--domain", f"localhost:{port}", port=port)
    try:
        sb = Sandbox.create("base", **e2b_opts(srv))
        try:
            sb.files.write("/tmp/site/index.html", "reached by curl")
            sb.commands.run("python3 -m http.server 8080 --bind 127.0.0.1 --directory /tmp/site", background=True)
            host = sb.get_host(8080)
            assert host == f"8080-{sb.sandbox_id}.localhost:{port}"
            # curl resolves *.localhost to loopback by itself (as browsers do): no Host header to forge
            curl = ["curl", "-s", "-H", f"{ports.TRAFFIC_TOKEN_HEADER}: {sb.traffic_access_token}",
                    f"http://{host}/index.html"]
            deadline = time.monotonic() + 20
            while (out := subprocess.run(curl, capture_output=True, timeout=60).stdout) != b"reached by curl":
                assert time.monotonic() < deadline, out
                time.sleep(0.2)
        finally:
            sb.kill()
    finally:
        srv.stop()
