"""The shop-front site of the chromium tasks: static files plus a form endpoint.

Runs inside the workspace (``python3 ~/site/server.py``) on 127.0.0.1:8000; every POST
body is appended, url-decoded, to ``~/site/submissions.log``.
"""
import http.server
import os
import urllib.parse

ROOT = os.path.dirname(os.path.abspath(__file__))


class Handler(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *a, **kw):
        super().__init__(*a, directory=ROOT, **kw)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
        fields = urllib.parse.parse_qsl(body)
        with open(os.path.join(ROOT, "submissions.log"), "a") as f:
            f.write("&".join(f"{k}={v}" for k, v in fields) + "\n")
        self.send_response(303)
        self.send_header("Location", "/thanks.html")
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", 8000), Handler).serve_forever()
