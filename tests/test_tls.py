"""server.tls_cert / server.tls_key: a real HTTPS request to a real gateway, both servers."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway_proc import GatewayProc, free_port, write_config


def _self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is available")
        args = "req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1"
        args += " -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1"
        command = ["openssl", *args.split(), "-keyout", str(key), "-out", str(cert)]
        subprocess.run(command, check=True, capture_output=True)
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key


@pytest.mark.parametrize("http_server", ["granian", "uvicorn"])
def test_https_health(chat_model: Path, tmp_path: Path, http_server: str) -> None:
    cert, key = _self_signed(tmp_path)
    models = [{"name": "chat", "source": str(chat_model)}]
    gw = GatewayProc(models, http_server=http_server, tls_cert=str(cert), tls_key=str(key))
    context = ssl.create_default_context(cafile=str(cert))
    try:
        url = f"https://127.0.0.1:{gw.port}/health"
        deadline = time.monotonic() + 60
        while True:
            assert gw.proc.poll() is None, gw.logs()
            try:
                response = httpx.get(url, verify=context, timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, gw.logs()
                time.sleep(0.2)
        assert response.status_code == 200
        assert response.json()["status"] == "ok"
    finally:
        gw.stop()


def test_missing_tls_file_is_a_clear_error(tmp_path: Path) -> None:
    server = {
        "port": free_port(),
        "run_dir": str(tmp_path),
        "tls_cert": str(tmp_path / "nope.pem"),
        "tls_key": str(tmp_path / "nope.key"),
    }
    config = write_config(tmp_path / "config.toml", [], server)
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--config", str(config), "serve"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "server.tls_cert: no such file" in done.stderr
