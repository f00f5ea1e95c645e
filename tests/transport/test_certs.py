"""`sdcp-fast certs`: CA and instance certificates, field by field."""

from __future__ import annotations

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from sdcp_fast.transport import TLSConfig, make_certs
from sdcp_fast.transport.certpolicy import CertificatePolicy, CertificateRejected, uri_identity
from sdcp_fast.transport.certs import instance_file_name, main, make_ca, make_instance_cert

URI = "https://verifier-1.example:8443/"


def test_instance_certificate_fields(tmp_path):
    paths = make_certs(tmp_path, [URI])
    inst = paths.instances[URI]
    assert (inst.cert.name, inst.key.name) == ("verifier-1.example_8443.pem", "verifier-1.example_8443.key")
    cert = x509.load_pem_x509_certificate(inst.cert.read_bytes())
    ca = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [URI]
    assert san.get_values_for_type(x509.DNSName) == ["verifier-1.example", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"),
                                                       ipaddress.ip_address("::1")]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    assert stat.S_IMODE(inst.key.stat().st_mode) == 0o600
    assert stat.S_IMODE(paths.ca_key.stat().st_mode) == 0o600
    assert TLSConfig.for_instance(tmp_path, URI).identity == URI


def test_ca_is_reused_for_later_instances(tmp_path):
    first = make_certs(tmp_path, [URI])
    ca_bytes = first.ca_cert.read_bytes()
    second = make_certs(tmp_path, ["https://drafter-2.example/"])
    assert second.ca_cert.read_bytes() == ca_bytes
    policy = CertificatePolicy(second.ca_cert)
    for paths in (first.instances[URI], second.instances["https://drafter-2.example/"]):
        cert = x509.load_pem_x509_certificate(paths.cert.read_bytes())
        assert policy.check(cert) == paths.uri


def test_ip_host_gets_an_ip_san_only(tmp_path):
    cert, _ = make_instance_cert(make_ca(), "https://10.1.2.3:9000/")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert ipaddress.ip_address("10.1.2.3") in san.get_values_for_type(x509.IPAddress)


@pytest.mark.parametrize("bad", ["http://plain.example/", "verifier-1", "https:///nohost"])
def test_bad_instance_uri_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="https://HOST"):
        instance_file_name(bad)
    assert main(["--dir", str(tmp_path), bad]) == 2


def test_main_writes_and_prints(tmp_path, capsys):
    assert main(["--dir", str(tmp_path), "--days", "2", URI, "https://router.example/"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"ca\t{tmp_path / 'ca.pem'}"
    assert lines[1] == f"{URI}\t{tmp_path / 'verifier-1.example_8443.pem'}\t{tmp_path / 'verifier-1.example_8443.key'}"
    cert = x509.load_pem_x509_certificate((tmp_path / "router.example.pem").read_bytes())
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert 2 * 86400 <= lifetime.total_seconds() <= 2 * 86400 + 600


def test_identity_needs_exactly_one_uri_san():
    ca = make_ca()
    builder_cert, _ = make_instance_cert(ca, URI)
    assert uri_identity(builder_cert) == URI
    no_san = x509.load_pem_x509_certificate(_self_signed_without_san())
    with pytest.raises(CertificateRejected) as info:
        uri_identity(no_san)
    assert info.value.reason == CertificateRejected.NO_IDENTITY


def test_tlsconfig_checks_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="TLSConfig.cert"):
        TLSConfig(tmp_path / "nope.pem", tmp_path / "nope.key", tmp_path / "ca.pem")


def _self_signed_without_san() -> bytes:
    import datetime as dt

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)
