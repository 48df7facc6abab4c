"""Database roles on the runtime side: which URL each service kind connects with, the
names of the users dracap creates, and the SCRAM verifiers it sends instead of passwords."""

from __future__ import annotations

import base64
import hashlib
import hmac

from services.runtime.ground.settings import ServiceKind, load_settings
from services.runtime.store.dbroles import group_role, login_user, scram_verifier, url_as


def test_no_role_url_keeps_the_url_and_the_app_role() -> None:
    settings = load_settings({"DRACAP_DATABASE_URL": "postgresql://admin@db/dracap"})
    assert settings.database_urls == {}
    for kind in ServiceKind:
        assert settings.for_service(kind) is settings


def test_a_role_url_connects_as_its_own_user() -> None:
    env = {
        "DRACAP_DATABASE_URL": "postgresql://admin@db/dracap",
        "DRACAP_DATABASE_URL_CLAIMS": "postgresql://claims:pw@db/dracap",
        "DRACAP_DATABASE_URL_ENFORCEMENT": "postgresql://enforcement:pw@db/dracap",
        "DRACAP_DATABASE_URL_AGENT": "postgresql://agents:pw@db/dracap",  # no such kind now
    }
    settings = load_settings(env)
    claims = settings.for_service(ServiceKind.CLAIMS)
    assert (claims.database_url, claims.app_role) == ("postgresql://claims:pw@db/dracap", "")
    assert settings.for_service(ServiceKind.RELAY) is settings
    assert settings.for_service(ServiceKind.ENFORCEMENT).database_url.startswith(
        "postgresql://enforcement"
    )
    assert "agent" not in settings.database_urls  # node agents have no database URL


def test_names_of_roles_and_users() -> None:
    assert group_role(ServiceKind.READONLY) == "dracap_readonly"
    assert login_user(ServiceKind.RESERVATION) == "dracap_reservation_login"


def test_the_scram_verifier_is_postgresqls() -> None:
    """The verifier of RFC 7677's example password and salt, built from its definition."""
    salt = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
    verifier = scram_verifier("pencil", salt=salt, iterations=4096)
    method, _, rest = verifier.partition("$")
    params, _, keys = rest.partition("$")
    assert method == "SCRAM-SHA-256" and params == "4096:W22ZaJ0SNY7soEsUEjb6gQ=="
    salted = hashlib.pbkdf2_hmac("sha256", b"pencil", salt, 4096)
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()
    stored, _, server = keys.partition(":")
    assert base64.b64decode(server) == server_key
    # RFC 7677's ServerSignature for its exchange, from the same ServerKey
    message = (
        "n=user,r=rOprNGfwEbeRWgbNEkqO,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
        "s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096,c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
    )
    signature = hmac.new(server_key, message.encode(), "sha256").digest()
    assert base64.b64encode(signature).decode() == "6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
    # and the client's proof of that exchange checks against the StoredKey
    client_signature = hmac.new(base64.b64decode(stored), message.encode(), "sha256").digest()
    proof = base64.b64decode("dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
    client_key = bytes(x ^ y for x, y in zip(proof, client_signature, strict=True))
    assert hashlib.sha256(client_key).digest() == base64.b64decode(stored)
    assert scram_verifier("pencil") != scram_verifier("pencil")  # a new salt each time


def test_url_as_replaces_the_user_and_quotes_the_password() -> None:
    url = "postgresql://postgres@127.0.0.1:5432/dracap?sslmode=disable"
    assert (
        url_as(url, "u", "p@ss/w")
        == "postgresql://u:p%40ss%2Fw@127.0.0.1:5432/dracap?sslmode=disable"
    )
    assert url_as("postgresql://a:b@h/d", "u", None) == "postgresql://u@h/d"
