"""SIP over TLS: with a certificate configured, `kame serve --sip` also listens for TLS (the port + 1 by default);
a client that checks the certificate gets its OPTIONS answered on the encrypted connection."""

from __future__ import annotations

import datetime
import socket
import ssl

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .server_harness import running_server
from .sip_peers import free_udp_tcp_port


def self_signed(directory) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kame.test")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName("kame.test")]), critical=False)
                   .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_options_over_tls_are_answered(tmp_path):
    cert, key = self_signed(tmp_path)
    port, tls_port = free_udp_tcp_port(), free_udp_tcp_port()
    with running_server(asr="none", sip={"listen": f"127.0.0.1:{port}", "tls_certificate": cert, "tls_key": key,
                                         "tls_port": tls_port}):
        context = ssl.create_default_context(cafile=cert)
        with socket.create_connection(("127.0.0.1", tls_port), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname="kame.test") as tls:
            tls.sendall(b"OPTIONS sip:kame@kame.test SIP/2.0\r\n"
                         b"Via: SIP/2.0/TLS 127.0.0.1:5999;branch=z9hG4bKtls1\r\n"
                         b"Max-Forwards: 70\r\nFrom: <sip:probe@kame.test>;tag=t1\r\nTo: <sip:kame@kame.test>\r\n"
                         b"Call-ID: tls-probe-1\r\nCSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = tls.recv(4096)
                assert chunk, answer
                answer += chunk
    status_line, _, headers = answer.decode().partition("\r\n")
    assert status_line == "SIP/2.0 200 OK", answer
    assert "Call-ID: tls-probe-1" in headers and "INVITE" in headers  # its Allow lists what the server takes
