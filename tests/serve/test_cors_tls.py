"""Browsers and encryption: --allowed-origins answers CORS preflights (before the API key, which a
preflight never carries) and marks responses for those origins only; --ssl-keyfile/--ssl-certfile
serve HTTPS (a subprocess with a self-signed certificate made by openssl)."""
from __future__ import annotations

import shutil
import signal
import ssl
import subprocess

import httpx
import pytest

from serve.server_config import ServerConfig
from tests.serve.helpers import ServerThread, build, serve_run_usage_error
from tests.serve.test_shutdown import start_server

ORIGIN = "http://localhost:3000"


def test_cors_for_the_origins_given(model_dir):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    cfg = ServerConfig(allowed_origins=(ORIGIN,), api_key="secret", shutdown_timeout_s=1.0)
    with ServerThread(build(model_dir), cfg) as srv:
        r = srv.http.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = srv.http.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer secret"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert srv.http.get("/v1/models", headers={"Origin": ORIGIN}).status_code == 401  # the key still holds
        other = srv.http.options("/v1/models", headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    with ServerThread(build(model_dir)) as srv:  # by default no page of another origin may read the answers
        r = srv.http.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https(model_dir, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    proc, port = start_server(model_dir, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), scheme="https")
    try:
        r = httpx.post(f"https://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                       verify=ssl.create_default_context(cafile=str(cert)), timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # plain HTTP is not served
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and f"https://127.0.0.1:{port}/v1" in out


def test_half_a_key_pair_is_one_line(model_dir, tmp_path):
    lines = serve_run_usage_error(model_dir, "--ssl-keyfile", str(tmp_path / "key.pem"))
    assert len(lines) == 1 and "ssl_keyfile and ssl_certfile go together" in lines[0]
