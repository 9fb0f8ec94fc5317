"""The shared-secret handshake's pure parts: proofs, where the secret comes from, what counts as
loopback, rate-limited warnings, and secrets kept out of environment snapshots."""
import dataclasses
import logging

import pytest

from fleetx import env
from fleetx.ps import PSConfigError, PSConfig
from fleetx.ps import handshake as hs
from fleetx.ps.acceptor import RateLimitedLog
from fleetx.ps.api import settings_from_env

KEY = b"k3y"


def answer(key, server_nonce, client_nonce=b"c" * 32, label=b"client"):
    return client_nonce + hs._mac(key, label, server_nonce, client_nonce)


def test_only_an_answer_made_with_the_key_for_this_challenge_passes():
    ch = hs.Challenge(KEY)
    assert ch.message()[:5] == b"FXPA\x01" and len(ch.message()) == hs.CHALLENGE.size
    verdict = ch.verdict(answer(KEY, ch.nonce))
    assert verdict[:1] == hs.OK and len(verdict) == hs.VERDICT_OK_BYTES
    assert ch.verdict(answer(b"other", ch.nonce)) is None
    assert ch.verdict(answer(KEY, hs.Challenge(KEY).nonce)) is None  # another challenge's
    assert ch.verdict(answer(KEY, ch.nonce)[:-1]) is None
    # a server's proof reflected back as a client's answer does not pass
    assert ch.verdict(answer(KEY, ch.nonce, label=b"server")) is None


def test_the_secret_comes_from_the_value_or_the_file(tmp_path):
    base = dict(servers=("127.0.0.1:1",), num_workers=1)
    assert hs.resolve_secret(PSConfig(**base)) is None
    assert hs.resolve_secret(PSConfig(**base, secret="abc")) == b"abc"
    path = tmp_path / "s"
    path.write_text("  abc\n")
    assert hs.resolve_secret(PSConfig(**base, secret_file=str(path))) == b"abc"
    with pytest.raises(PSConfigError, match="both FLEETX_PS_SECRET and FLEETX_PS_SECRET_FILE"):
        hs.resolve_secret(PSConfig(**base, secret="abc", secret_file=str(path)))
    path.write_text(" \n")
    with pytest.raises(PSConfigError, match=f"FLEETX_PS_SECRET_FILE={path}: the file is empty"):
        hs.resolve_secret(PSConfig(**base, secret_file=str(path)))
    assert "abc" not in repr(PSConfig(**base, secret="abc"))
    assert "secret" not in PSConfig(**base, secret="abc").to_dict()


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setattr(env, "environ", {"FLEETX_PS_SECRET": "s", "FLEETX_PS_MAX_FRAME_MB": "8"})
    links = settings_from_env()
    assert {k: getattr(links, k) for k in ("secret", "secret_file", "max_frame_bytes",
                                           "transport", "local_sockets")} == \
        {"secret": "s", "secret_file": None, "max_frame_bytes": 8 << 20, "transport": "tcp",
         "local_sockets": True}


def test_unset_variables_give_the_configs_own_defaults():
    # the frame limit and the local sockets are declared twice (MiB and "1" in fleetx/env.py,
    # bytes and True in PSConfig): the two must agree
    base = PSConfig(servers=("127.0.0.1:1",), num_workers=1)
    assert settings_from_env({}).config(base.servers, 1) == dataclasses.replace(
        base, log_interval=env.default("FLEETX_LOG_INTERVAL"))  # a server's own default: 60 s


def test_the_local_sockets_variable_takes_0_or_1(monkeypatch):
    monkeypatch.setattr(env, "environ", {"FLEETX_PS_LOCAL_SOCKETS": "0"})
    assert settings_from_env().local_sockets is False
    monkeypatch.setattr(env, "environ", {"FLEETX_PS_LOCAL_SOCKETS": "yes"})
    with pytest.raises(env.EnvError, match="FLEETX_PS_LOCAL_SOCKETS='yes': expected 1 .* or 0"):
        settings_from_env()


def test_the_transport_variable_takes_only_known_transports(monkeypatch):
    monkeypatch.setattr(env, "environ", {"FLEETX_PS_TRANSPORT": "zmq"})
    assert settings_from_env().transport == "zmq"
    monkeypatch.setattr(env, "environ", {"FLEETX_PS_TRANSPORT": "udp"})
    with pytest.raises(env.EnvError, match="FLEETX_PS_TRANSPORT='udp': expected one of tcp, zmq"):
        settings_from_env()


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.9.9.9", True),
                                            ("localhost", True), ("0.0.0.0", False),
                                            ("10.1.2.3", False), ("no-such-host.invalid", False)])
def test_what_counts_as_loopback(host, loopback):
    assert hs.is_loopback(host) is loopback


def test_warnings_are_rate_limited_but_every_event_is_counted(caplog):
    events = RateLimitedLog(interval=3600)
    with caplog.at_level(logging.WARNING, logger="fleetx.ps"):
        for i in range(5):
            events.warning("auth_failed", "failed %d", i)
        events.count("accepted")
    assert events.counts == {"auth_failed": 5, "accepted": 1}
    assert [r.getMessage() for r in caplog.records] == ["failed 0"]
    events.interval = 0
    with caplog.at_level(logging.WARNING, logger="fleetx.ps"):
        events.warning("auth_failed", "failed %d", 5)
    assert caplog.records[-1].getMessage() == \
        "failed 5 (4 more since the last such warning, 6 in all)"


def test_environment_snapshots_leave_the_secret_out():
    snap = env.snapshot({"FLEETX_PS_SECRET": "hunter2", "FLEETX_PS_SECRET_FILE": "/s",
                         "FLEETX_TIMEOUT": "9"})
    assert snap == {"FLEETX_PS_SECRET_FILE": "/s", "FLEETX_TIMEOUT": "9"}
    assert env.VARIABLES["FLEETX_PS_SECRET"].secret
