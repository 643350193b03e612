"""Token authentication (security/tokens.py) with real keys and real
signatures: round trips, each reason a token is refused, and fuzzing that
only AuthenticationError ever leaves the validator, never with the token."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import stat

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from hypothesis import given, settings
from hypothesis import strategies as st

from security.tokens import (
    KEY_FILE_BYTES_MAX,
    TOKEN_BYTES_MAX,
    AuthenticationError,
    Claims,
    TokenValidator,
    create_key_pair,
    create_secret_key,
    create_token,
    load_key,
    load_key_argument,
    show_token,
    write_key_file,
)

NOW = 1_700_000_000.0


@pytest.fixture(scope="module")
def secret() -> bytes:
    return create_secret_key()


@pytest.fixture(scope="module")
def key_pair() -> tuple[bytes, bytes]:
    return create_key_pair()


@pytest.fixture(scope="module")
def other_key_pair() -> tuple[bytes, bytes]:
    return create_key_pair()


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def hand_built(header: dict, claims: dict | bytes, *, secret: bytes | None = None, signature: bytes = b"") -> str:
    """A token made without PyJWT, so that it can be anything: signed with
    HMAC-SHA256 over `secret` when given, else carrying `signature`."""
    payload = claims if isinstance(claims, bytes) else json.dumps(claims).encode()
    signing_input = f"{b64url(json.dumps(header).encode())}.{b64url(payload)}"
    if secret is not None:
        signature = hmac.new(secret, signing_input.encode("ascii"), hashlib.sha256).digest()
    return f"{signing_input}.{b64url(signature)}"


def refused(validator: TokenValidator, token, reason: str, *, now: float = NOW) -> str:
    """The validator refuses `token` with `reason` in a message that holds no part of the token."""
    with pytest.raises(AuthenticationError) as error:
        validator.validate(token, now=now)
    message = str(error.value)
    assert reason in message, message
    if isinstance(token, (str, bytes)) and token:
        text = token.decode("ascii", "replace") if isinstance(token, bytes) else token
        for part in text.split("."):
            assert len(part) < 8 or part not in message, message
    return message


# --- keys -----------------------------------------------------------------------------


def test_a_secret_key_is_32_random_bytes():
    first, second = create_secret_key(), create_secret_key()
    assert len(first) == len(second) == 32 and first != second


def test_a_key_pair_is_an_rsa_2048_pem_pair(key_pair):
    private_pem, public_pem = key_pair
    assert private_pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS8, unencrypted
    assert public_pem.startswith(b"-----BEGIN PUBLIC KEY-----")  # SubjectPublicKeyInfo
    private_key = serialization.load_pem_private_key(private_pem, password=None)
    assert isinstance(private_key, rsa.RSAPrivateKey) and private_key.key_size == 2048
    assert private_key.public_key() == serialization.load_pem_public_key(public_pem)


def test_key_files_raw_and_pem(tmp_path, secret, key_pair):
    (tmp_path / "secret.key").write_bytes(secret)
    (tmp_path / "public.pem").write_bytes(key_pair[1])
    assert load_key(tmp_path / "secret.key") == secret
    assert load_key(str(tmp_path / "public.pem")) == key_pair[1]
    assert load_key_argument(f"file://{tmp_path}/secret.key") == secret
    assert load_key_argument(str(tmp_path / "secret.key")) == secret
    assert load_key_argument("data:;base64," + base64.b64encode(secret).decode()) == secret
    assert load_key_argument("data:application/octet-stream;base64," + base64.b64encode(secret).decode()) == secret


@pytest.mark.parametrize("setup, argument, words", [
    (None, "{tmp}/absent.key", ["{tmp}/absent.key", "no such file"]),
    ("empty", "{tmp}/empty.key", ["empty"]),
    ("directory", "{tmp}/directory", ["is a directory"]),
    ("long", "{tmp}/long.key", ["longer than"]),
    (None, "data:;base64,!!!not base64", ["not valid base64"]),
    (None, "data:,plain", ["data:;base64,"]),
    (None, "data:;base64,", ["empty"]),
    (None, "file://relative/path", ["file:///"]),
    (None, "", ["no key file"]),
])
def test_a_key_that_cannot_be_loaded_is_a_clear_value_error(tmp_path, setup, argument, words):
    (tmp_path / "empty.key").write_bytes(b"")
    (tmp_path / "directory").mkdir()
    (tmp_path / "long.key").write_bytes(b"k" * (KEY_FILE_BYTES_MAX + 1))
    with pytest.raises(ValueError) as error:
        load_key_argument(argument.format(tmp=tmp_path))
    for word in words:
        assert word.format(tmp=tmp_path) in str(error.value), str(error.value)
    assert "kkkk" not in str(error.value)


def test_key_files_are_written_owner_only(tmp_path):
    path = write_key_file(tmp_path / "key", b"secret")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and path.read_bytes() == b"secret"
    # An existing file keeps no looser mode of its own.
    loose = tmp_path / "loose"
    loose.write_bytes(b"old")
    os.chmod(loose, 0o644)
    write_key_file(loose, b"new")
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o600 and loose.read_bytes() == b"new"
    with pytest.raises(FileExistsError):
        write_key_file(loose, b"newer", exclusive=True)
    assert loose.read_bytes() == b"new"


# --- round trips ------------------------------------------------------------------------


def test_hs256_round_trip(secret):
    token = create_token("admin", secret_key=secret, now=NOW, expiry_s=3600, audience="quire")
    assert jwt.get_unverified_header(token)["alg"] == "HS256"
    claims = TokenValidator(secret_key=secret, audience="quire").validate(token, now=NOW + 10)
    assert claims == Claims(role="admin", expires_at=NOW + 3600, audience=("quire",))
    assert TokenValidator(secret_key=secret).validate(token.encode("ascii"), now=NOW).role == "admin"


def test_rs256_round_trip(key_pair):
    private_pem, public_pem = key_pair
    token = create_token("bob", private_key=private_pem, now=NOW)
    assert jwt.get_unverified_header(token)["alg"] == "RS256"
    assert TokenValidator(public_key=public_pem).validate(token, now=NOW + 10**9) == Claims("bob", None, ())


def test_es256_round_trip_with_an_ec_key():
    private_key = ec.generate_private_key(ec.SECP256R1())
    private_pem = private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption())
    public_pem = private_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo)
    token = create_token("carol", private_key=private_pem, now=NOW)
    validator = TokenValidator(public_key=public_pem)
    assert validator.algorithms == ("ES256",)
    assert validator.validate(token, now=NOW).role == "carol"


def test_extra_headers_are_kept(secret):
    token = create_token("admin", secret_key=secret, now=NOW, headers={"kid": "key-1"})
    assert show_token(token)["header"] == {"alg": "HS256", "kid": "key-1", "typ": "JWT"}


def test_the_algorithms_come_from_the_key_and_never_include_none(secret, key_pair):
    assert TokenValidator(secret_key=secret).algorithms == ("HS256",)
    long_secret = os.urandom(64)
    assert TokenValidator(secret_key=long_secret).algorithms == ("HS256", "HS384", "HS512")
    assert TokenValidator(public_key=key_pair[1]).algorithms == ("RS256", "RS384", "RS512")
    # HS512 with a key as long as its hash is accepted.
    token = jwt.encode({"sub": "admin"}, long_secret, algorithm="HS512")
    assert TokenValidator(secret_key=long_secret).validate(token, now=NOW).role == "admin"


# --- bad arguments --------------------------------------------------------------------------


@pytest.mark.parametrize("subject, keys, extra, words", [
    ("", "secret", {}, "subject"),
    ("a\nb", "secret", {}, "printable"),
    ("x" * 257, "secret", {}, "subject"),
    ("admin", "both", {}, "exactly one"),
    ("admin", "neither", {}, "exactly one"),
    ("admin", "secret", {"expiry_s": 0}, "expiry_s"),
    ("admin", "secret", {"expiry_s": float("inf")}, "expiry_s"),
    ("admin", "secret", {"audience": ""}, "audience"),
    ("admin", "secret", {"headers": {"alg": "none"}}, "alg"),
    ("admin", "short secret", {}, "at least 32 bytes"),
    ("admin", "public key as secret", {}, "PEM or SSH key"),
    ("admin", "garbage private key", {}, "not an unencrypted PEM private key"),
])
def test_create_token_refuses_bad_arguments(secret, key_pair, subject, keys, extra, words):
    chosen = {
        "secret": {"secret_key": secret},
        "both": {"secret_key": secret, "private_key": key_pair[0]},
        "neither": {},
        "short secret": {"secret_key": b"short"},
        "public key as secret": {"secret_key": key_pair[1]},
        "garbage private key": {"private_key": b"-----BEGIN PRIVATE KEY-----\nnope\n"},
    }[keys]
    with pytest.raises(ValueError, match=words):
        create_token(subject, now=NOW, **chosen, **extra)


def test_validator_refuses_bad_keys(secret, key_pair):
    with pytest.raises(ValueError, match="exactly one"):
        TokenValidator()
    with pytest.raises(ValueError, match="exactly one"):
        TokenValidator(secret_key=secret, public_key=key_pair[1])
    with pytest.raises(ValueError, match="not a PEM public key"):
        TokenValidator(public_key=b"not a key at all")
    with pytest.raises(ValueError, match="not a PEM public key"):
        TokenValidator(public_key=secret)
    with pytest.raises(ValueError, match="is a private key"):
        TokenValidator(public_key=key_pair[0])
    with pytest.raises(ValueError, match="PEM or SSH key"):
        TokenValidator(secret_key=key_pair[1])
    with pytest.raises(ValueError, match="at least 32 bytes"):
        TokenValidator(secret_key=b"")
    with pytest.raises(ValueError, match="leeway_s"):
        TokenValidator(secret_key=secret, leeway_s=-1)
    with pytest.raises(ValueError, match="audience"):
        TokenValidator(secret_key=secret, audience="")
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key()
    with pytest.raises(ValueError, match="at least 2048 bits"):
        TokenValidator(public_key=small.public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    edwards = ed25519.Ed25519PrivateKey.generate().public_key()
    with pytest.raises(ValueError, match="neither RSA nor EC"):
        TokenValidator(public_key=edwards.public_bytes(serialization.Encoding.PEM,
                                                        serialization.PublicFormat.SubjectPublicKeyInfo))


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize("token, reason", [
    (None, "a token is a string"),
    (42, "a token is a string"),
    (["a.b.c"], "a token is a string"),
    ("", "empty token"),
    (b"", "empty token"),
    ("a" * (TOKEN_BYTES_MAX + 1), f"longer than {TOKEN_BYTES_MAX} bytes"),
    (b"a" * (TOKEN_BYTES_MAX + 1), f"longer than {TOKEN_BYTES_MAX} bytes"),
    ("eyJhbGciOiJIUzI1NiJ9.é.x", "not ASCII"),
    (b"eyJhbGciOiJIUzI1NiJ9.\xff.x", "not ASCII"),
    ("not a token", "malformed"),
    ("a.b.c", "malformed"),
    ("..", "malformed"),
    ("eyJhbGciOiJIUzI1NiJ9.!!!!.sig", "malformed"),
])
def test_refused_before_or_while_decoding(secret, token, reason):
    refused(TokenValidator(secret_key=secret), token, reason)


@pytest.mark.parametrize("algorithm", ["none", "None", "NONE"])
def test_an_unsigned_token_is_refused(secret, key_pair, algorithm):
    token = hand_built({"alg": algorithm, "typ": "JWT"}, {"sub": "admin"})
    refused(TokenValidator(secret_key=secret), token, "alg none")
    refused(TokenValidator(public_key=key_pair[1]), token, "alg none")


def test_a_header_without_an_algorithm_is_refused(secret):
    refused(TokenValidator(secret_key=secret), hand_built({"typ": "JWT"}, {"sub": "a"}, secret=secret), "no algorithm")
    refused(TokenValidator(secret_key=secret), hand_built({"alg": 7}, {"sub": "a"}, secret=secret), "no algorithm")


def test_a_token_signed_with_another_key_is_refused(secret, key_pair, other_key_pair):
    other = create_token("admin", secret_key=create_secret_key(), now=NOW)
    refused(TokenValidator(secret_key=secret), other, "signature does not verify")
    other_rsa = create_token("admin", private_key=other_key_pair[0], now=NOW)
    refused(TokenValidator(public_key=key_pair[1]), other_rsa, "signature does not verify")


def test_a_changed_claim_breaks_the_signature(secret):
    header, _, signature = create_token("alice", secret_key=secret, now=NOW).split(".")
    forged = f"{header}.{b64url(json.dumps({'sub': 'admin'}).encode())}.{signature}"
    refused(TokenValidator(secret_key=secret), forged, "signature does not verify")


def test_the_algorithm_families_do_not_mix(secret, key_pair):
    rsa_token = create_token("admin", private_key=key_pair[0], now=NOW)
    refused(TokenValidator(secret_key=secret), rsa_token, "algorithm RS256 not accepted")
    hmac_token = create_token("admin", secret_key=secret, now=NOW)
    refused(TokenValidator(public_key=key_pair[1]), hmac_token, "algorithm HS256 not accepted")
    # HS512 signed with a 32-byte key: shorter than the hash, so not accepted.
    weak = hand_built({"alg": "HS512"}, {"sub": "admin"}, signature=hmac.new(secret, b"x", hashlib.sha512).digest())
    refused(TokenValidator(secret_key=secret), weak, "algorithm HS512 not accepted")


def test_a_public_key_used_as_an_hmac_secret_is_refused(key_pair):
    # The classic confusion: whoever has the public key signs an HS256
    # token with it, hoping the server verifies HMAC with "its key".
    public_pem = key_pair[1]
    forged = hand_built({"alg": "HS256", "typ": "JWT"}, {"sub": "admin"}, secret=public_pem)
    refused(TokenValidator(public_key=public_pem), forged, "algorithm HS256 not accepted")
    # The same with the algorithm spelt as something unknown.
    unknown = hand_built({"alg": "HS256x"}, {"sub": "admin"}, secret=public_pem)
    assert "HS256x" not in refused(TokenValidator(public_key=public_pem), unknown, "not accepted")


def test_an_unknown_algorithm_name_is_not_echoed(secret):
    token = hand_built({"alg": "<script>evil</script>"}, {"sub": "admin"}, secret=secret)
    assert "script" not in refused(TokenValidator(secret_key=secret), token, "algorithm of the token not accepted")


def test_expiry_is_checked_against_the_given_now(secret):
    token = create_token("admin", secret_key=secret, now=NOW, expiry_s=60)
    validator = TokenValidator(secret_key=secret)
    assert validator.validate(token, now=NOW + 59).expires_at == NOW + 60
    refused(validator, token, "token expired", now=NOW + 60)
    refused(validator, token, "token expired", now=NOW + 10**6)
    lenient = TokenValidator(secret_key=secret, leeway_s=10)
    assert lenient.validate(token, now=NOW + 69).role == "admin"
    refused(lenient, token, "token expired", now=NOW + 70)


def test_now_must_be_a_finite_time(secret):
    # A NaN would compare false with every expiry and let expired tokens in.
    token = create_token("admin", secret_key=secret, now=NOW, expiry_s=60)
    for now in (float("nan"), float("inf"), None, "now"):
        with pytest.raises(ValueError, match="now must be"):
            TokenValidator(secret_key=secret).validate(token, now=now)


def test_not_before_is_checked_against_the_given_now(secret):
    token = hand_built({"alg": "HS256"}, {"sub": "admin", "nbf": NOW + 100}, secret=secret)
    validator = TokenValidator(secret_key=secret)
    refused(validator, token, "not valid yet", now=NOW)
    assert validator.validate(token, now=NOW + 100).role == "admin"
    assert TokenValidator(secret_key=secret, leeway_s=100).validate(token, now=NOW).role == "admin"


@pytest.mark.parametrize("payload, reason", [
    (b'{"sub": "admin", "exp": "tomorrow"}', "exp claim is not a number"),
    (b'{"sub": "admin", "exp": true}', "exp claim is not a number"),
    (b'{"sub": "admin", "exp": null}', "exp claim is not a number"),
    (b'{"sub": "admin", "exp": NaN}', "exp claim is out of range"),
    (b'{"sub": "admin", "exp": Infinity}', "exp claim is out of range"),
    (b'{"sub": "admin", "exp": 1' + b"0" * 400 + b"}", "exp claim is out of range"),
    (b'{"sub": "admin", "nbf": [1]}', "nbf claim is not a number"),
    (b'{"exp": 99999999999}', "no subject"),
    (b'{"sub": 42}', "not a role"),
    (b'{"sub": ""}', "not a role"),
    (b'{"sub": "admin\\nFAKE LOG LINE"}', "not a role"),
    (b'{"sub": "admin", "aud": 5}', "aud claim is not a string"),
    (b'{"sub": "admin", "aud": ["a", 5]}', "aud claim is not a string"),
    (b'["sub", "admin"]', "malformed"),
    (b"not json", "malformed"),
])
def test_bad_claims_are_refused(secret, payload, reason):
    refused(TokenValidator(secret_key=secret), hand_built({"alg": "HS256"}, payload, secret=secret), reason)


def test_audience_rules(secret):
    validator = TokenValidator(secret_key=secret, audience="quire")
    for_quire = create_token("admin", secret_key=secret, now=NOW, audience="quire")
    assert validator.validate(for_quire, now=NOW).audience == ("quire",)
    in_a_list = hand_built({"alg": "HS256"}, {"sub": "admin", "aud": ["other", "quire"]}, secret=secret)
    assert validator.validate(in_a_list, now=NOW).audience == ("other", "quire")
    refused(validator, create_token("admin", secret_key=secret, now=NOW, audience="other"), "another audience")
    refused(validator, hand_built({"alg": "HS256"}, {"sub": "admin", "aud": []}, secret=secret), "another audience")
    refused(validator, create_token("admin", secret_key=secret, now=NOW), "no audience")
    # Without an audience configured, a token's audience is no reason to refuse it (as in Pulsar).
    assert TokenValidator(secret_key=secret).validate(for_quire, now=NOW).role == "admin"


def test_a_token_just_under_the_limit_is_read(secret):
    token = create_token("admin", secret_key=secret, now=NOW, headers={"pad": "p" * (TOKEN_BYTES_MAX // 2)})
    assert len(token) <= TOKEN_BYTES_MAX
    assert TokenValidator(secret_key=secret).validate(token, now=NOW).role == "admin"


# --- show -----------------------------------------------------------------------------------


def test_show_gives_header_and_claims_unverified(key_pair):
    token = create_token("admin", private_key=key_pair[0], now=NOW, expiry_s=60, audience="quire")
    assert show_token(token) == {"header": {"alg": "RS256", "typ": "JWT"},
                                 "claims": {"sub": "admin", "exp": int(NOW) + 60, "aud": "quire"}}
    unsigned = hand_built({"alg": "none"}, {"sub": "anyone"})
    assert show_token(unsigned)["claims"] == {"sub": "anyone"}
    for bad in ("", "not a token", "a.b.c", None):
        with pytest.raises(AuthenticationError):
            show_token(bad)


# --- fuzzing: only AuthenticationError leaves ------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
TIMES = st.integers() | st.floats() | JSON_VALUES
AUDIENCES = st.just("quire") | st.text(max_size=6) | st.lists(st.sampled_from(["quire", "other"]) | JSON_VALUES, max_size=3)
# Mostly well-formed headers and claims with one odd part, so that the
# checks after the signature see the odd values; now and then anything.
HEADERS = (
    st.fixed_dictionaries({"alg": st.just("HS256")}, optional={"typ": st.just("JWT"), "kid": st.text(max_size=5)})
    | st.fixed_dictionaries({"alg": st.sampled_from(["HS256", "HS512", "RS256", "none", "ES256", ""]) | JSON_VALUES},
                            optional={"crit": JSON_VALUES, "b64": JSON_VALUES})
)
CLAIMS = st.fixed_dictionaries(
    {"sub": st.text(min_size=1, max_size=10) | JSON_VALUES},
    optional={"exp": TIMES, "nbf": TIMES, "aud": AUDIENCES | JSON_VALUES, "iat": JSON_VALUES, "jti": JSON_VALUES},
)
PAYLOADS = (CLAIMS.map(lambda claims: json.dumps(claims).encode())
            | JSON_VALUES.map(lambda value: json.dumps(value).encode()) | st.binary(max_size=64))
FUZZ = settings(max_examples=300, deadline=None)


def _validate_or_refuse(validator: TokenValidator, token) -> None:
    try:
        claims = validator.validate(token, now=NOW)
    except AuthenticationError as error:
        text = token.decode("ascii", "replace") if isinstance(token, bytes) else str(token)
        for part in text.split("."):
            assert len(part) < 8 or part not in str(error)
    else:
        assert isinstance(claims, Claims) and claims.role


@FUZZ
@given(token=st.text(max_size=200) | st.binary(max_size=200))
def test_fuzz_arbitrary_text_and_bytes(secret, key_pair, token):
    _validate_or_refuse(TokenValidator(secret_key=secret), token)
    _validate_or_refuse(TokenValidator(public_key=key_pair[1]), token)
    try:
        show_token(token)
    except AuthenticationError:
        pass


@FUZZ
@given(segments=st.lists(st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=.", max_size=40),
                         min_size=1, max_size=5))
def test_fuzz_base64url_looking_segments(secret, segments):
    _validate_or_refuse(TokenValidator(secret_key=secret), ".".join(segments))


@FUZZ
@given(header=HEADERS, payload=PAYLOADS, leeway_s=st.sampled_from([0, 5]))
def test_fuzz_correctly_signed_tokens_reach_the_claims(secret, header, payload, leeway_s):
    # Signed with the validator's own secret, so that arbitrary headers and
    # claims get past the signature and into every check after it.
    token = hand_built(header, payload, secret=secret)
    _validate_or_refuse(TokenValidator(secret_key=secret, leeway_s=leeway_s), token)
    _validate_or_refuse(TokenValidator(secret_key=secret, audience="quire"), token)
    try:
        show_token(token)
    except AuthenticationError:
        pass
