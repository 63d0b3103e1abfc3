"""The API emulator's serving certificate: a throwaway self-signed one, so clients talk HTTPS as to a real server.

Local-stack tool, called by `apiserver` at start. It matters for more than looks: client-go (kubectl, Helm) sends a
bearer token only over TLS, so without HTTPS the emulator could not tell users apart and RBAC could not apply.
The certificate (EC P-256, for 127.0.0.1 and localhost, two days) is made with the `openssl` binary and goes into
the kubeconfig as `certificate-authority-data`.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path


def serving_certificate(directory: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files, made fresh in `directory`."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("openssl not found: `make stack-deps` installs it (Debian package openssl)")
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "apiserver.crt", directory / "apiserver.key"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-subj", "/CN=sluice-local-apiserver", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-days", "2", "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    return cert, key


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context
