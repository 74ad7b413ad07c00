"""``[security]``: tokens from files, secrets refused as flags, TLS contexts, the start line."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
from pegaflow.connector.settings import ConnectorSettings

from pegaflow.auth import authenticator, cluster_token, secret, tenant_tokens
from pegaflow.config import ConfigError, SecurityConfig
from pegaflow.errors import Unauthorized
from pegaflow.runner import build_parser
from pegaflow.tls import client_context, describe, server_context


@pytest.mark.parametrize("flag", ["--security-token", "--security-tenant-tokens"])
def test_a_secret_flag_is_refused_pointing_to_its_file(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser("pegaflow-node", None, ["security"])
    with pytest.raises(SystemExit) as e:
        parser.parse_args([flag, "s3cret"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}-file FILE" in err and "s3cret" not in err, err


def test_the_etcd_password_comes_from_a_file_never_a_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser("pegaflow-coordinator", None, ["etcd"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--etcd-password", "s3cret"])
    err = capsys.readouterr().err
    assert "--etcd-password-file FILE" in err and "s3cret" not in err, err
    path = _secret(tmp_path, "s3cret\n")
    assert parser.parse_args(["--etcd-password-file", path]).etcd__password_file == path
    assert secret("", path, "[etcd] password") == "s3cret"
    assert secret("direct", "", "[etcd] password") == "direct"  # config file or environment
    with pytest.raises(ConfigError, match="not both"):
        secret("a", path, "[etcd] password")


def test_the_file_flags_are_taken() -> None:
    args = build_parser("pegaflow-node", None, ["security"]).parse_args(
        ["--security-token-file", "/t", "--security-tenant-tokens-file", "/tt"]
    )
    assert (args.security__token_file, args.security__tenant_tokens_file) == ("/t", "/tt")


def _secret(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    p = tmp_path / "secret"
    p.write_text(text)
    p.chmod(mode)
    return str(p)


def test_tokens_come_from_their_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sec = SecurityConfig(token_file=_secret(tmp_path, "s3cret\n"))
    with caplog.at_level(logging.WARNING):
        assert cluster_token(sec) == "s3cret"
    assert not caplog.records
    tenants = tmp_path / "tenants"
    tenants.write_text("# tenants\nacme=a-secret\n\nglobex=g-secret\n")
    tenants.chmod(0o600)
    sec = SecurityConfig(tenant_tokens_file=str(tenants))
    assert tenant_tokens(sec) == ["acme=a-secret", "globex=g-secret"]
    assert authenticator(sec).authenticate("g-secret") == "globex"
    with pytest.raises(Unauthorized):
        authenticator(sec).authenticate("s3cret")


def test_a_token_file_others_may_read_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sec = SecurityConfig(token_file=_secret(tmp_path, "s3cret", 0o644))
    with caplog.at_level(logging.WARNING):
        assert cluster_token(sec) == "s3cret"
    assert "chmod 600" in caplog.text and "s3cret" not in caplog.text


def test_bad_token_settings_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not both"):
        cluster_token(SecurityConfig(token="a", token_file=_secret(tmp_path, "b")))
    with pytest.raises(ConfigError, match="holds no token"):
        cluster_token(SecurityConfig(token_file=_secret(tmp_path, "\n# none\n")))
    with pytest.raises(ConfigError, match="cannot read"):
        cluster_token(SecurityConfig(token_file=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="not both"):
        tenant_tokens(SecurityConfig(tenant_tokens=["a=b"], tenant_tokens_file="/x"))


def test_tls_contexts(tmp_path: Path) -> None:
    assert server_context(SecurityConfig()) is None and client_context(SecurityConfig()) is None
    with pytest.raises(ConfigError, match="set both"):
        server_context(SecurityConfig(tls_cert="/c"))
    with pytest.raises(ConfigError, match="cannot load"):
        server_context(SecurityConfig(tls_cert=str(tmp_path / "c"), tls_key=str(tmp_path / "k")))
    with pytest.raises(ConfigError, match="cannot load"):
        client_context(SecurityConfig(tls_ca=str(tmp_path / "ca")))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_a_tls_key_others_may_read_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "k.pem",
         "-out", "c.pem", "-days", "1", "-subj", "/CN=t"],
        cwd=tmp_path, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    (tmp_path / "k.pem").chmod(0o644)
    sec = SecurityConfig(tls_cert=str(tmp_path / "c.pem"), tls_key=str(tmp_path / "k.pem"))
    with caplog.at_level(logging.WARNING):
        assert server_context(sec) is not None
    assert "tls_key" in caplog.text and "chmod 600" in caplog.text


def test_the_start_line_names_tls_and_the_tokens() -> None:
    assert describe(SecurityConfig()) == (
        "security: TLS off, no token (connections are not authenticated)"
    )
    line = describe(SecurityConfig(tls_cert="c.pem", tls_key="k", token_file="/t"))
    assert line == "security: TLS on (serving with c.pem), token from /t"
    assert "s3cret" not in describe(SecurityConfig(token="s3cret", tenant_tokens=["a=b"]))


def test_the_connector_takes_a_token_file_and_a_ca() -> None:
    env = {"PEGAFLOW_SECURITY_TOKEN_FILE": "/t", "PEGAFLOW_SECURITY_TLS_CA": "/env-ca"}
    s = ConnectorSettings.load({"tls_ca": "/ca"}, env=env)
    assert s.security() == SecurityConfig(token_file="/t", tls_ca="/ca")


def test_a_token_in_the_engine_command_line_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "pegaflow.connector"):
        ConnectorSettings.load({"token": "s3cret"}, env={})
    assert "token_file" in caplog.text and "s3cret" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "pegaflow.connector"):
        ConnectorSettings.load({"token_file": "/t"}, env={})
    assert not caplog.records
