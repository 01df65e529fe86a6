"""Digest authentication (kame/sip/digest.py): the RFCs' worked examples, challenges as PBXs write them, and the
server side's verify() and stateless nonces."""

from __future__ import annotations

import hashlib

import pytest

from kame.sip.digest import (
    Challenge,
    DigestError,
    NonceIssuer,
    authorization,
    best_challenge,
    parse_challenge,
    parse_credentials,
    verify,
)

SECRET = b"0123456789abcdef0123456789abcdef"

# RFC 7616 §3.9.1: the server's two challenges, one per header, as unfolded from the RFC's 401
RFC7616_SHA256 = """Digest
    realm="http-auth@example.org",
    qop="auth, auth-int",
    algorithm=SHA-256,
    nonce="7ypf/xlj9XXwfDPEoM4URrv/xwf94BcCAzFZH4GiTo0v",
    opaque="FQhe/qaU925kfnzjCev0ciny7QMkPqMAFRtzCUYo5tdS\""""
RFC7616_MD5 = RFC7616_SHA256.replace("algorithm=SHA-256", "algorithm=MD5")
RFC7616_CNONCE = "f2/wE4q74E6zIJEtWaHKaf5wv/H5QzzpXusqGemxURZJ"


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_rfc_2617_worked_example():
    """RFC 2617 §3.5: qop="auth,auth-int" offered, auth used; the opaque comes back unchanged."""
    challenge = parse_challenge('Digest realm="testrealm@host.com", qop="auth,auth-int", '
                                'nonce="dcd98b7102dd2f0e8b11d0f600bfb0c093", opaque="5ccc069c403ebaf9f0171e9517f40e41"')
    assert challenge == Challenge(realm="testrealm@host.com", nonce="dcd98b7102dd2f0e8b11d0f600bfb0c093",
                                  qop=("auth", "auth-int"), opaque="5ccc069c403ebaf9f0171e9517f40e41")
    value = authorization(challenge, method="GET", uri="/dir/index.html", username="Mufasa",
                          password="Circle Of Life", cnonce="0a4f113b", nc=1)
    params = parse_credentials(value)
    assert params == {"username": "Mufasa", "realm": "testrealm@host.com",
                      "nonce": "dcd98b7102dd2f0e8b11d0f600bfb0c093", "uri": "/dir/index.html",
                      "response": "6629fae49393a05397450978507c4ef1", "algorithm": "MD5", "cnonce": "0a4f113b",
                      "nc": "00000001", "qop": "auth", "opaque": "5ccc069c403ebaf9f0171e9517f40e41"}
    assert value.startswith("Digest ") and "nc=00000001" in value and "qop=auth," in value


def test_rfc_7616_sha256_preferred_and_both_responses():
    """RFC 7616 §3.9.1: SHA-256 is chosen over MD5 whatever the headers' order, and both responses are the RFC's."""
    assert best_challenge([RFC7616_MD5, RFC7616_SHA256]).algorithm == "SHA-256"
    assert best_challenge([RFC7616_SHA256, RFC7616_MD5]).algorithm == "SHA-256"
    expected = {RFC7616_SHA256: "753927fa0e85d155564e2e272a28d1802ca10daf4496794697cf8db5856cb6c1",
                RFC7616_MD5: "8ca523f5e9506fed4657c9700eebdbec"}
    for header, response in expected.items():
        challenge = parse_challenge(header)
        assert challenge.qop == ("auth", "auth-int")
        value = authorization(challenge, method="GET", uri="/dir/index.html", username="Mufasa",
                              password="Circle of Life", cnonce=RFC7616_CNONCE)
        params = parse_credentials(value)
        assert params["response"] == response
        assert params["opaque"] == "FQhe/qaU925kfnzjCev0ciny7QMkPqMAFRtzCUYo5tdS"
        assert params["algorithm"] == challenge.algorithm and params["nc"] == "00000001"


def test_no_qop_is_rfc_2069():
    """Without qop the response is H(HA1:nonce:HA2), and no cnonce, nc or qop is sent. The value is RFC 2069 §2.4's
    example as corrected by its erratum (the RFC printed e966c932a9242554e42c8ee200cec7f6)."""
    challenge = parse_challenge('Digest realm="testrealm@host.com", nonce="dcd98b7102dd2f0e8b11d0f600bfb0c093", '
                                'opaque="5ccc069c403ebaf9f0171e9517f40e41"')
    value = authorization(challenge, method="GET", uri="/dir/index.html", username="Mufasa", password="CircleOfLife")
    params = parse_credentials(value)
    assert params["response"] == "1949323746fe6a43ef61f9606e7febea"
    assert not {"cnonce", "nc", "qop"} & params.keys()


def test_auth_int_alone_is_answered_without_qop():
    challenge = parse_challenge('Digest realm="r", nonce="n", qop="auth-int"')
    params = parse_credentials(authorization(challenge, method="INVITE", uri="sip:a@b", username="u", password="p"))
    assert "qop" not in params and "nc" not in params


def test_md5_sess_and_nonce_count():
    """MD5-sess (RFC 2617 §3.2.2.2) hashes the nonce and cnonce into HA1; nc is 8 lower-case hex digits."""
    challenge = parse_challenge('Digest realm="biloxi.com", nonce="abc", algorithm=md5-sess, qop="auth"')
    assert challenge.algorithm == "MD5-sess"
    params = parse_credentials(authorization(challenge, method="REGISTER", uri="sip:biloxi.com", username="bob",
                                             password="zanzibar", cnonce="c0ffee", nc=26))

    def md5(text: str) -> str:
        return hashlib.md5(text.encode()).hexdigest()

    ha1 = md5(f"{md5('bob:biloxi.com:zanzibar')}:abc:c0ffee")
    assert params["response"] == md5(f"{ha1}:abc:0000001a:c0ffee:auth:{md5('REGISTER:sip:biloxi.com')}")
    assert params["nc"] == "0000001a" and params["algorithm"] == "MD5-sess"


def test_a_fresh_cnonce_each_time_unless_given():
    challenge = Challenge(realm="r", nonce="n", qop=("auth",))
    first, second = (parse_credentials(authorization(challenge, method="INVITE", uri="sip:x", username="u",
                                                     password="p"))["cnonce"] for _ in range(2))
    assert first != second and len(first) >= 16


@pytest.mark.parametrize("nc", [0, -1, 0x1_0000_0000])
def test_nonce_count_out_of_range(nc):
    with pytest.raises(DigestError, match="nc"):
        authorization(Challenge(realm="r", nonce="n", qop=("auth",)), method="INVITE", uri="sip:x", username="u",
                      password="p", nc=nc)


@pytest.mark.parametrize(("header", "expected"), [
    # chan_sip: algorithm first, no qop
    ('Digest algorithm=MD5, realm="asterisk", nonce="3b5f12a9"',
     Challenge(realm="asterisk", nonce="3b5f12a9")),
    # res_pjsip: no spaces after commas, algorithm in lower case, an opaque and a nonce with '/'
    ('Digest realm="asterisk",nonce="1718029474/0b8e1d8f5c3c4b0e2a7d",opaque="61d3b1b24b0c4a6e",algorithm=md5,'
     'qop="auth"',
     Challenge(realm="asterisk", nonce="1718029474/0b8e1d8f5c3c4b0e2a7d", qop=("auth",), opaque="61d3b1b24b0c4a6e")),
    # FreeSWITCH: a UUID nonce, qop quoted
    ('Digest realm="pbx.example.com", nonce="a9c4d3e2-6b7f-11ee-8c90-0242ac120002", algorithm=MD5, qop="auth"',
     Challenge(realm="pbx.example.com", nonce="a9c4d3e2-6b7f-11ee-8c90-0242ac120002", qop=("auth",))),
    # a carrier's stale nonce, with the scheme and names in odd cases and a comma inside the realm
    ('DIGEST Realm="sip.carrier.example, east", NONCE="x1", Stale=TRUE, Algorithm=SHA-256',
     Challenge(realm="sip.carrier.example, east", nonce="x1", algorithm="SHA-256", stale=True)),
    # an escaped quote and backslash inside a quoted value; an unquoted opaque
    ('Digest realm="say \\"hi\\" \\\\o/", nonce="n", opaque=abc123',
     Challenge(realm='say "hi" \\o/', nonce="n", opaque="abc123")),
])
def test_parse_challenge_as_servers_send_them(header, expected):
    assert parse_challenge(header) == expected


@pytest.mark.parametrize(("header", "message"), [
    ('Basic realm="x"', "scheme is 'Basic'"),
    ("", "scheme"),
    ('Digest nonce="n"', "no realm"),
    ('Digest realm="r"', "no nonce"),
    ('Digest realm="r", nonce="n", algorithm=SHA-512-256', "algorithm"),
    ('Digest realm="r", nonce="n", algorithm=AKAv1-MD5', "algorithm"),
    ('Digest realm="r, nonce="n"', "realm"),  # realm's quote closes at nonce's opening one: garbage follows
    ('Digest realm="r", realm="s", nonce="n"', "twice"),
    ('Digest realm="r" nonce="n"', "expected ','"),
    ('Digest realm', "no '='"),
    ('Digest realm=, nonce="n"', "realm: no value"),
    ('Digest realm="r", nonce="n', "closing quote"),
])
def test_parse_challenge_refuses(header, message):
    with pytest.raises(DigestError, match=message):
        parse_challenge(header)


def test_best_challenge_skips_what_it_cannot_answer():
    md5 = 'Digest realm="r", nonce="m"'
    assert best_challenge(['Digest realm="r", nonce="s", algorithm=SHA-512-256', md5]).nonce == "m"
    assert best_challenge([md5, 'Digest realm="r", nonce="other"']).nonce == "m"  # equals: the first offered
    with pytest.raises(DigestError, match="SHA-512-256"):
        best_challenge(['Digest realm="r", nonce="s", algorithm=SHA-512-256', 'Basic realm="r"'])
    with pytest.raises(DigestError, match="no Digest challenge"):
        best_challenge([])


def test_header_value_reads_back():
    challenge = Challenge(realm='kame "voice"', nonce="abc/def=", algorithm="SHA-256", qop=("auth",),
                          opaque="o", stale=True)
    assert parse_challenge(challenge.header_value()) == challenge
    assert parse_challenge(Challenge(realm="r", nonce="n").header_value()) == Challenge(realm="r", nonce="n")


def test_odd_usernames_are_quoted():
    value = authorization(Challenge(realm="r", nonce="n"), method="INVITE", uri="sip:x", username='a"b\\c, d',
                          password="p")
    assert parse_credentials(value)["username"] == 'a"b\\c, d'


PASSWORDS = {"alice": "s3cret", "bob": "zanzibar"}


def _verify(value: str, *, method: str = "INVITE", realm: str = "kame", nonce_ok=lambda nonce: True, **kwargs):
    return verify(value, method=method, realm=realm, password=PASSWORDS.get, nonce_ok=nonce_ok, **kwargs)


@pytest.mark.parametrize("algorithm", ["MD5", "MD5-sess", "SHA-256", "SHA-256-sess"])
@pytest.mark.parametrize("qop", [(), ("auth",), ("auth", "auth-int")])
def test_verify_accepts_our_own_authorization(algorithm, qop):
    issuer = NonceIssuer(SECRET)
    challenge = Challenge(realm="kame", nonce=issuer.issue(), algorithm=algorithm, qop=qop, opaque="xyz")
    value = authorization(challenge, method="INVITE", uri="sip:kame@192.0.2.1", username="alice", password="s3cret")
    assert _verify(value, nonce_ok=issuer.valid) == "alice"
    assert _verify(value, nonce_ok=issuer.valid, uri="sip:kame@192.0.2.1") == "alice"


def _ours(**kwargs) -> str:
    fields = {"method": "INVITE", "uri": "sip:kame@192.0.2.1", "username": "alice", "password": "s3cret"} | kwargs
    return authorization(Challenge(realm="kame", nonce="n0nce", qop=("auth",)), **fields)


@pytest.mark.parametrize(("value", "kwargs"), [
    (_ours(password="wrong"), {}),
    (_ours().replace("sip:kame@192.0.2.1", "sip:kame@203.0.113.9"), {}),  # the uri changed after signing
    (_ours(), {"uri": "sip:other@192.0.2.1"}),  # signed for another Request-URI
    (_ours(), {"method": "BYE"}),  # replayed on another method
    (_ours(), {"realm": "elsewhere"}),
    (_ours(username="mallory"), {}),  # no such user
    (_ours(), {"nonce_ok": lambda nonce: False}),
    (_ours().replace("nc=00000001", "nc=00000002"), {}),  # the nonce count is part of the response
    (_ours().replace("qop=auth", "qop=auth-int"), {}),
    (_ours().replace(", nc=00000001", ""), {}),
    (_ours().replace("algorithm=MD5", "algorithm=SHA-512-256"), {}),
    ("Basic YWxpY2U6czNjcmV0", {}),
    ('Digest username="alice", realm="kame"', {}),
    ('Digest username="alice", realm="kame", nonce="n0nce", uri="sip:x", response="\u00e9\u00e9"', {}),
    ("Digest garbage", {}),
])
def test_verify_refuses(value, kwargs):
    assert _verify(value, **kwargs) is None


def test_verify_refuses_an_expired_nonce():
    clock = FakeClock()
    issuer = NonceIssuer(SECRET, lifetime_s=300.0, clock=clock)
    value = authorization(Challenge(realm="kame", nonce=issuer.issue(), qop=("auth",)), method="INVITE",
                          uri="sip:kame@192.0.2.1", username="bob", password="zanzibar")
    clock.now += 299.0
    assert _verify(value, nonce_ok=issuer.valid) == "bob"
    clock.now += 2.0
    assert _verify(value, nonce_ok=issuer.valid) is None


def test_nonces_are_unique_and_verifiable_without_storage():
    clock = FakeClock()
    issuer = NonceIssuer(SECRET, lifetime_s=60.0, clock=clock)
    nonces = {issuer.issue() for _ in range(200)}  # one millisecond: the random part keeps them apart
    assert len(nonces) == 200
    restarted = NonceIssuer(SECRET, lifetime_s=60.0, clock=clock)  # same key, nothing remembered
    assert all(restarted.valid(nonce) for nonce in nonces)
    assert not any(NonceIssuer(b"another key, 16+ bytes", clock=clock).valid(nonce) for nonce in nonces)


def test_nonce_expiry_and_clock_going_back():
    clock = FakeClock()
    issuer = NonceIssuer(SECRET, lifetime_s=60.0, clock=clock)
    nonce = issuer.issue()
    clock.now += 60.0
    assert issuer.valid(nonce)
    clock.now += 0.01
    assert not issuer.valid(nonce)
    clock.now -= 120.0  # issued "in the future": not ours to trust
    assert not issuer.valid(nonce)


def test_a_nonce_is_valid_the_moment_it_is_issued():
    clock = FakeClock(1_700_000_000.0009)  # a stamp rounded up to ...001 would look issued in the future
    issuer = NonceIssuer(SECRET, clock=clock)
    assert issuer.valid(issuer.issue())


def test_forged_and_garbled_nonces_are_refused():
    issuer = NonceIssuer(SECRET)
    nonce = issuer.issue()
    flipped = nonce[:10] + ("A" if nonce[10] != "A" else "B") + nonce[11:]
    for bad in (flipped, nonce + "!", nonce[:-1], "", "dcd98b7102dd2f0e8b11d0f600bfb0c093", "é" * 43, nonce + "="):
        assert not issuer.valid(bad), bad


def test_nonce_issuer_arguments():
    with pytest.raises(ValueError, match="secret"):
        NonceIssuer(b"short")
    with pytest.raises(ValueError, match="lifetime_s"):
        NonceIssuer(SECRET, lifetime_s=0)
