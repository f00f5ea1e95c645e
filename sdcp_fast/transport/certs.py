"""A private CA and per-instance certificates whose URI SAN is the instance's base URI.

`sdcp-fast certs` (`main`) writes, for each instance, a certificate that serves both as TLS
server certificate (DNS/IP SANs of the URI's host plus loopback) and as client certificate
(the URI SAN: ../shared/spec/NOTES.md, Identity). Keys are EC P-256 (OpenSSL and aioquic).

Layout of a certificate directory:
    ca.pem, ca.key                  the CA (reused when the directory already has one)
    <name>.pem, <name>.key          one pair per instance, <name> = instance_file_name(uri)
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
LOOPBACK_DNS = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class CertificateAuthority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


class InstancePaths(NamedTuple):
    uri: str
    cert: Path
    key: Path


@dataclass(frozen=True)
class CertPaths:
    ca_cert: Path
    ca_key: Path
    instances: dict[str, InstancePaths]  # base URI -> its certificate and key files


def instance_file_name(uri: str) -> str:
    """A file-system-safe, stable name for an instance URI ("https://v-1.example:8443/" -> "v-1.example_8443")."""
    parts = urlsplit(uri)
    if parts.scheme != "https" or not parts.hostname:
        raise ValueError(f"instance URI must be https://HOST[:PORT]/...: {uri!r}")
    name = parts.hostname + (f"_{parts.port}" if parts.port else "") + parts.path.rstrip("/")
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name)


def _signed(subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
            signer: ec.EllipticCurvePrivateKey, days: int, not_before: dt.datetime | None = None,
            not_after: dt.datetime | None = None, *, ca: bool,
            extensions: tuple[x509.ExtensionType, ...] = ()) -> x509.Certificate:
    """A certificate for `key` signed by `signer`, valid `days` from 5 minutes ago (clock skew)
    unless `not_before`/`not_after` say otherwise: basic constraints and key usage critical (a
    CA signs certificates, a leaf only signatures), a subject key identifier, `extensions`."""
    now = dt.datetime.now(dt.UTC)
    not_before = not_before or now - dt.timedelta(minutes=5)
    not_after = not_after or now + dt.timedelta(days=days)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=ca,
                          crl_sign=ca, encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    return builder.sign(signer, hashes.SHA256())


def make_ca(common_name: str = "sdcp-fast CA", *, days: int = 3650) -> CertificateAuthority:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = _signed(name, key, name, key, days, ca=True)
    return CertificateAuthority(cert, key)


def make_instance_cert(
    ca: CertificateAuthority,
    uri: str,
    *,
    days: int = 365,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
    key: ec.EllipticCurvePrivateKey | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf for `uri`: URI SAN = uri, DNS/IP SANs for its host and loopback, serverAuth+clientAuth."""
    host = urlsplit(uri).hostname
    if urlsplit(uri).scheme != "https" or not host:
        raise ValueError(f"instance URI must be https://HOST[:PORT]/...: {uri!r}")
    key = key or ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri)]
    names += [x509.DNSName(dns) for dns in dict.fromkeys([host, *LOOPBACK_DNS]) if not _is_ip(dns)]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in dict.fromkeys([host, *LOOPBACK_IPS]) if _is_ip(ip)]
    cert = _signed(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]), key, ca.cert.subject, ca.key,
                   days, not_before, not_after, ca=False, extensions=(
                       x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       x509.SubjectAlternativeName(names),
                       x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key())))
    return cert, key


def write_pair(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, cert_path: Path, key_path: Path) -> None:
    """Write PEM files; the key is created 0600 so it is never readable by others, not even briefly."""
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)


def load_ca(directory: Path) -> CertificateAuthority:
    cert = x509.load_pem_x509_certificate((directory / CA_CERT_FILE).read_bytes())
    key = serialization.load_pem_private_key((directory / CA_KEY_FILE).read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory / CA_KEY_FILE}: expected an EC private key")
    return CertificateAuthority(cert, key)


def make_certs(directory: str | os.PathLike[str], instances: list[str], *, days: int = 365) -> CertPaths:
    """Create (or reuse) the CA in `directory` and write one certificate per instance URI."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    if (root / CA_CERT_FILE).exists() and (root / CA_KEY_FILE).exists():
        ca = load_ca(root)
    else:
        ca = make_ca()
        write_pair(ca.cert, ca.key, root / CA_CERT_FILE, root / CA_KEY_FILE)
    written: dict[str, InstancePaths] = {}
    for uri in instances:
        name = instance_file_name(uri)
        written[uri] = InstancePaths(uri, root / f"{name}.pem", root / f"{name}.key")
        write_pair(*make_instance_cert(ca, uri, days=days), written[uri].cert, written[uri].key)
    return CertPaths(root / CA_CERT_FILE, root / CA_KEY_FILE, written)


def main(argv: list[str] | None = None) -> int:
    """`sdcp-fast certs --dir DIR URI...`: prints one line per file written."""
    parser = argparse.ArgumentParser(prog="sdcp-fast certs", description=main.__doc__)
    parser.add_argument("--dir", required=True, help="directory for ca.pem/ca.key and instance files")
    parser.add_argument("--days", type=int, default=365, help="validity of instance certificates")
    parser.add_argument("instances", nargs="+", metavar="URI", help="instance base URIs (https://...)")
    args = parser.parse_args(argv)
    try:
        paths = make_certs(args.dir, args.instances, days=args.days)
    except (ValueError, OSError) as exc:
        print(f"sdcp-fast certs: {exc}", file=sys.stderr)
        return 2
    print(f"ca\t{paths.ca_cert}")
    for uri, instance in paths.instances.items():
        print(f"{uri}\t{instance.cert}\t{instance.key}")
    return 0


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
