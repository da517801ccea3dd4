"""What the bench_peers tests share: the built-in model's folder and a child process that serves /health
and starts a long-sleeping grandchild (test_peers_settle.py imports both through test_peers.py)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILTIN = str(REPO / "worker_proc" / "builtin_model")


CHILD = """
import http.server, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("grandchild", grandchild.pid, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
