"""Client IP resolution: nginx realip (recursive) semantics for X-Forwarded-For and RFC 7239.

Expected addresses are written by hand from the rules, and the properties check them against
``ipaddress`` (the implementation parses with ``socket.inet_pton``), never against its own output.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Sequence
from typing import Literal, NoReturn, overload

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.edge.client_ip import UNKNOWN_PEER, ClientIPResolver
from gateway.limits.addresses import client_key

TRUSTED = ("10.0.0.0/8", "fd00::/8")
TRUSTED_NETS = tuple(ipaddress.ip_network(c) for c in TRUSTED)
PROXY = "10.0.0.1"  # the peer in most tests: a trusted proxy
CACHE_SIZES = pytest.mark.parametrize("cache_size", [4096, 0], ids=["cached", "uncached"])

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def xff(cache_size: int = 4096) -> ClientIPResolver:
    return ClientIPResolver(TRUSTED, cache_size=cache_size)


def fwd(cache_size: int = 4096) -> ClientIPResolver:
    return ClientIPResolver(TRUSTED, "forwarded", cache_size=cache_size)


def normalise(address: Address) -> Address:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_trusted(address: Address) -> bool:
    return any(normalise(address) in network for network in TRUSTED_NETS)


def same_address(result: str, expected: Address | str) -> bool:
    return ipaddress.ip_address(result) == normalise(
        ipaddress.ip_address(expected) if isinstance(expected, str) else expected
    )


class Untouchable(Sequence[str]):
    """Header values that fail the test if read: the fast path must not look at them."""

    def __len__(self) -> NoReturn:
        raise AssertionError("header values were read")

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> NoReturn:
        raise AssertionError("header values were read")

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("header values were read")


# --- construction -------------------------------------------------------------------------


def test_bad_cidr_is_refused_with_its_text() -> None:
    with pytest.raises(ValueError, match=r"^invalid trusted proxy CIDR '10\.0\.0\.0/33': "):
        ClientIPResolver(["192.168.0.0/16", "10.0.0.0/33"])
    with pytest.raises(ValueError, match=r"^invalid trusted proxy CIDR 'proxy\.local': "):
        ClientIPResolver(["proxy.local"])


def test_one_string_instead_of_a_list_is_refused() -> None:
    with pytest.raises(TypeError, match="not one string"):
        ClientIPResolver("10.0.0.0/8")


def test_unknown_header_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported client IP header 'x-real-ip'"):
        ClientIPResolver(TRUSTED, "x-real-ip")  # type: ignore[arg-type]


def test_header_name() -> None:
    assert ClientIPResolver([]).header_name == "x-forwarded-for"
    assert ClientIPResolver([], "forwarded").header_name == "forwarded"


def test_host_bits_and_bare_addresses_are_accepted_like_nginx() -> None:
    resolver = ClientIPResolver(["10.1.2.3/8", "192.0.2.7"])
    assert resolver.is_trusted("10.200.0.1")
    assert resolver.is_trusted("192.0.2.7")
    assert not resolver.is_trusted("192.0.2.8")


def test_mapped_ipv6_cidr_trusts_the_ipv4_range() -> None:
    resolver = ClientIPResolver(["::ffff:192.168.0.0/112"])
    assert resolver.is_trusted("192.168.3.4")
    assert resolver.is_trusted("::ffff:192.168.3.4")
    assert not resolver.is_trusted("192.169.0.1")


def test_address_families_are_not_mixed() -> None:
    """IPv6 addresses whose low 32 bits spell a trusted IPv4 address are not trusted."""
    resolver = xff()
    assert not resolver.is_trusted("2001:db8::a00:1")
    assert not resolver.is_trusted("::10.0.0.1")  # IPv4-compatible (deprecated), not mapped
    assert resolver.resolve("2001:db8::a00:1", ["198.51.100.1"]) == "2001:db8::a00:1"


def test_is_trusted() -> None:
    resolver = xff()
    assert resolver.is_trusted("10.9.8.7")
    assert resolver.is_trusted("::ffff:10.9.8.7")
    assert resolver.is_trusted("fd12::1")
    assert not resolver.is_trusted("203.0.113.1")
    assert not resolver.is_trusted("2001:db8::1")
    assert not resolver.is_trusted(None)
    assert not resolver.is_trusted("not-an-ip")
    assert not ClientIPResolver([]).is_trusted("10.0.0.1")


# --- fast path ------------------------------------------------------------------------------


@CACHE_SIZES
def test_untrusted_peer_ignores_the_header_without_reading_it(cache_size: int) -> None:
    assert xff(cache_size).resolve("203.0.113.7", Untouchable()) == "203.0.113.7"
    assert fwd(cache_size).resolve("203.0.113.7", Untouchable()) == "203.0.113.7"
    assert xff(cache_size).resolve("203.0.113.7", ["198.51.100.1"]) == "203.0.113.7"


def test_no_trusted_proxies_means_the_peer_always() -> None:
    resolver = ClientIPResolver([])
    assert resolver.resolve("10.0.0.1", Untouchable()) == "10.0.0.1"
    assert resolver.resolve("127.0.0.1", ["198.51.100.1"]) == "127.0.0.1"


def test_peer_is_normalised_even_on_the_fast_path() -> None:
    resolver = ClientIPResolver([])
    assert resolver.resolve("::ffff:203.0.113.7", Untouchable()) == "203.0.113.7"
    assert resolver.resolve("fe80::1%eth0", Untouchable()) == "fe80::1"
    assert resolver.resolve("2001:DB8:0:0::1", Untouchable()) == "2001:db8::1"


def test_peer_without_an_address() -> None:
    assert xff().resolve(None, ["198.51.100.1"]) == UNKNOWN_PEER
    assert xff().resolve("", ["198.51.100.1"]) == ""
    assert xff().resolve("unix-socket", ["198.51.100.1"]) == "unix-socket"


# --- X-Forwarded-For ------------------------------------------------------------------------


@CACHE_SIZES
@pytest.mark.parametrize(
    ("peer", "header_values", "expected"),
    [
        # one trusted proxy in front
        (PROXY, ["198.51.100.1"], "198.51.100.1"),
        # no header at all, or an empty one: the proxy is the client
        (PROXY, [], PROXY),
        (PROXY, [""], PROXY),
        (PROXY, [" , ,"], PROXY),
        # two trusted proxies: the client's own claims to the left are ignored
        (PROXY, ["198.51.100.1, 10.0.0.2"], "198.51.100.1"),
        (PROXY, ["6.6.6.6, 198.51.100.1, 10.0.0.2"], "198.51.100.1"),
        (PROXY, ["6.6.6.6,198.51.100.1,10.0.0.2"], "198.51.100.1"),
        # the client sent its own header line; the proxies appended theirs
        (PROXY, ["6.6.6.6", "198.51.100.1, 10.0.0.2"], "198.51.100.1"),
        (PROXY, ["6.6.6.6", "198.51.100.1", "10.0.0.2"], "198.51.100.1"),
        # a spoofed trusted-looking address left of the real client changes nothing
        (PROXY, ["10.6.6.6, 198.51.100.1, 10.0.0.2"], "198.51.100.1"),
        # every hop trusted: the left-most
        (PROXY, ["10.0.0.3, 10.0.0.2"], "10.0.0.3"),
        (PROXY, ["fd00::3", "10.0.0.2"], "fd00::3"),
        # empty list elements are skipped (RFC 9110 5.6.1)
        (PROXY, ["198.51.100.1,, 10.0.0.2,"], "198.51.100.1"),
        (PROXY, [" \t198.51.100.1 \t"], "198.51.100.1"),
        # ports are dropped
        (PROXY, ["198.51.100.1:5555"], "198.51.100.1"),
        (PROXY, ["198.51.100.1:5555, 10.0.0.2:80"], "198.51.100.1"),
        # IPv6: bare, bracketed, with port, upper case, uncompressed, with zone id
        (PROXY, ["2001:db8::1"], "2001:db8::1"),
        (PROXY, ["[2001:db8::1]"], "2001:db8::1"),
        (PROXY, ["[2001:db8::1]:443"], "2001:db8::1"),
        (PROXY, ["2001:DB8:0000:0000::0001"], "2001:db8::1"),
        (PROXY, ["fe80::1%eth0"], "fe80::1"),
        (PROXY, ["[fe80::1%25eth0]:80"], "fe80::1"),
        (PROXY, ["2001:db8::1, [fd00::2]:80"], "2001:db8::1"),
        # IPv4-mapped IPv6 is IPv4, both as a hop and as the peer
        (PROXY, ["::ffff:198.51.100.1"], "198.51.100.1"),
        (PROXY, ["198.51.100.1, ::ffff:10.0.0.2"], "198.51.100.1"),
        ("::ffff:10.0.0.1", ["198.51.100.1"], "198.51.100.1"),
        ("::ffff:203.0.113.7", ["198.51.100.1"], "203.0.113.7"),
        # an IPv6 proxy
        ("fd00::1", ["198.51.100.1"], "198.51.100.1"),
        ("[fd00::1]", ["198.51.100.1"], "198.51.100.1"),
    ],
)
def test_x_forwarded_for(
    cache_size: int, peer: str, header_values: list[str], expected: str
) -> None:
    assert xff(cache_size).resolve(peer, header_values) == expected


@CACHE_SIZES
@pytest.mark.parametrize(
    ("header_values", "expected"),
    [
        # A malformed entry stops the walk: the address to its right (the last trusted hop's
        # view) is the client, or the peer when the malformed entry is the right-most.
        (["garbage, 10.0.0.2"], "10.0.0.2"),
        (["198.51.100.1, garbage"], PROXY),
        (["198.51.100.1, garbage, 10.0.0.2"], "10.0.0.2"),
        (["198.51.100.1", "garbage"], PROXY),
        (["unknown"], PROXY),
        (["_hidden"], PROXY),
        (["999.1.1.1"], PROXY),
        (["1.2.3"], PROXY),
        (["01.2.3.4"], PROXY),  # leading zeros: octal in some parsers, refused
        (["0x7f.1"], PROXY),
        (["1.2.3.4.5"], PROXY),
        (["1.2.3.4:"], PROXY),
        (["1.2.3.4:123456"], PROXY),
        (["1.2.3.4:http"], PROXY),
        (["[1.2.3.4]"], PROXY),  # brackets are for IPv6
        (["[2001:db8::1"], PROXY),
        (["[2001:db8::1]x"], PROXY),
        (["[2001:db8::1]:"], PROXY),
        (["2001:db8::g"], PROXY),
        (["1.2.3.4 5.6.7.8"], PROXY),
        (["1.2.3.4%eth0"], PROXY),  # zone ids are IPv6 only
        (["1.2.3.4\x00"], PROXY),
        (["\uff11.2.3.4"], PROXY),  # a full-width digit one
        (['"1.2.3.4"'], PROXY),
        (["for=1.2.3.4"], PROXY),  # Forwarded syntax sent as X-Forwarded-For
    ],
)
def test_x_forwarded_for_malformed_entries(
    cache_size: int, header_values: list[str], expected: str
) -> None:
    assert xff(cache_size).resolve(PROXY, header_values) == expected


# --- Forwarded (RFC 7239) -------------------------------------------------------------------


@CACHE_SIZES
@pytest.mark.parametrize(
    ("header_values", "expected"),
    [
        # RFC 7239 section 4 examples
        (['for="_gazonk"'], PROXY),  # obfuscated: stops the walk
        (['For="[2001:db8:cafe::17]:4711"'], "2001:db8:cafe::17"),
        (["for=192.0.2.60;proto=http;by=203.0.113.43"], "192.0.2.60"),
        (["for=192.0.2.43, for=198.51.100.17"], "198.51.100.17"),
        # section 7.1: the same list as two header lines
        (["for=192.0.2.43", "for=198.51.100.17"], "198.51.100.17"),
        # section 7.4: X-Forwarded-For transition example
        (['for=192.0.2.43, for="[2001:db8:cafe::17]"'], "2001:db8:cafe::17"),
        # section 7.5 example: the right-most hop is unknown, so the proxy is the client
        (['for=192.0.2.43,for="[2001:db8:cafe::17]",for=unknown'], PROXY),
        # section 6.3 obfuscated identifiers
        (["for=_hidden, for=_SEVKISEK"], PROXY),
        # ...and what stops there: the address to the right of the unusable one
        (['for=192.0.2.43, for=unknown, for="[fd00::2]:80"'], "fd00::2"),
        (["for=192.0.2.43, for=_hidden, for=10.0.0.2"], "10.0.0.2"),
        # trusted hops are walked past
        (["for=192.0.2.43, for=10.0.0.3, for=10.0.0.2"], "192.0.2.43"),
        (["for=10.0.0.3;proto=https, for=10.0.0.2"], "10.0.0.3"),
        (["for=6.6.6.6, for=192.0.2.43, for=10.0.0.2"], "192.0.2.43"),
        # parameter order, case, whitespace around separators, empty pairs and elements
        (["proto=https;by=10.0.0.1;FOR=192.0.2.43"], "192.0.2.43"),
        (["for=192.0.2.43 ; proto=https , for=10.0.0.2"], "192.0.2.43"),
        ([";;for=192.0.2.43;;"], "192.0.2.43"),
        (["for=192.0.2.43, ,for=10.0.0.2,"], "192.0.2.43"),
        (['for=192.0.2.43;host="example.com:8080";proto=https'], "192.0.2.43"),
        # quoted forms: IPv4 with port, obfuscated port, escapes, mapped and zone forms
        (['for="192.0.2.43:4711"'], "192.0.2.43"),
        (['for="[2001:db8::17]:_port1"'], "2001:db8::17"),
        (['for="\\192.0.2.43"'], "192.0.2.43"),
        (['for="[::ffff:192.0.2.43]"'], "192.0.2.43"),
        (['for="[fe80::1%25eth0]"'], "fe80::1"),
        (['for=192.0.2.43;ext="a \\"quoted\\" \\\\ value"'], "192.0.2.43"),
        (['for=192.0.2.43;ext="a,b;c=d"'], "192.0.2.43"),
        # the client's malformed text cannot hide the proxies' well-formed part to its right
        (['for="', "for=192.0.2.43"], "192.0.2.43"),
        (['for=", for=192.0.2.43'], "192.0.2.43"),
        (['for=", for="[2001:db8::1]"'], "2001:db8::1"),
        (['for="6.6.6.6\\", for="[2001:db8::1]"'], "2001:db8::1"),
        (['x=", for=192.0.2.43, for="10.0.0.2:80"'], "192.0.2.43"),
    ],
)
def test_forwarded(cache_size: int, header_values: list[str], expected: str) -> None:
    assert fwd(cache_size).resolve(PROXY, header_values) == expected


@CACHE_SIZES
@pytest.mark.parametrize(
    ("header_values", "expected"),
    [
        (["proto=https"], PROXY),  # an element that does not say for whom
        (["for=192.0.2.43, proto=https"], PROXY),
        (["for=192.0.2.43, by=10.0.0.2"], PROXY),
        (["for=192.0.2.43;for=10.0.0.2"], PROXY),  # "for" twice in one element
        (["for=192.0.2.43:80"], PROXY),  # a port needs quotes
        (["for=[2001:db8::1]"], PROXY),  # so does IPv6
        (["for = 192.0.2.43"], PROXY),
        (["for=192.0.2.43 proto=http"], PROXY),
        (["for=192.0.2.43;"], "192.0.2.43"),
        (['for="192.0.2.43'], PROXY),
        (['for=192.0.2.43"'], PROXY),
        (['for=""'], PROXY),
        (["for="], PROXY),
        (["192.0.2.43"], PROXY),  # X-Forwarded-For syntax sent as Forwarded
        (['for="192.0.2.43\x01"'], PROXY),  # a control character inside quotes
        (['for="\\"'], PROXY),
        (["for=192.0.2.43, garbage, for=10.0.0.2"], "10.0.0.2"),
        (["for=192.0.2.43, for=999.0.0.1, for=10.0.0.2"], "10.0.0.2"),
    ],
)
def test_forwarded_malformed(cache_size: int, header_values: list[str], expected: str) -> None:
    assert fwd(cache_size).resolve(PROXY, header_values) == expected


def test_forwarded_long_adversarial_header_is_parsed() -> None:
    """Backslash and quote runs that would make a backtracking parser take quadratic time."""
    hostile = '"\\' * 2000 + "a\\" * 2000 + '"' + "\\" * 1000
    assert fwd().resolve(PROXY, [hostile, "for=192.0.2.43"]) == "192.0.2.43"
    assert fwd().resolve(PROXY, [hostile]) == PROXY
    assert fwd().resolve(PROXY, ["for=" + hostile]) == PROXY


# --- client_key -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ip", "prefix", "expected"),
    [
        ("203.0.113.7", 64, "203.0.113.7"),
        ("2001:db8:1:2:3:4:5:6", 64, "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", 64, "2001:db8:1:2::/64"),
        ("2001:db8:1:2:3:4:5:6", 48, "2001:db8:1::/48"),
        ("2001:db8:1:2:3:4:5:6", 56, "2001:db8:1::/56"),
        ("2001:db8:1:2ff:3:4:5:6", 56, "2001:db8:1:200::/56"),
        ("2001:db8:1:2:3:4:5:6", 128, "2001:db8:1:2:3:4:5:6/128"),
        ("2001:db8:1:2:3:4:5:6", 0, "::/0"),
        ("2001:DB8:1:2::9", 64, "2001:db8:1:2::/64"),
        ("::ffff:203.0.113.7", 64, "203.0.113.7"),
        ("not-an-ip", 64, "not-an-ip"),
        ("", 64, ""),
    ],
)
def test_client_key(ip: str, prefix: int, expected: str) -> None:
    assert client_key(ip, prefix) == expected


def test_client_key_default_prefix_is_64() -> None:
    assert client_key("2001:db8:a:b:c:d:e:f") == "2001:db8:a:b::/64"


@pytest.mark.parametrize("prefix", [-1, 129])
def test_client_key_refuses_an_impossible_prefix(prefix: int) -> None:
    with pytest.raises(ValueError, match=f"ipv6_prefix must be between 0 and 128, got {prefix}"):
        client_key("2001:db8::1", prefix)


def plain_ipv6(address: Address) -> bool:
    return isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None


@given(
    st.ip_addresses(v=6).filter(plain_ipv6),
    st.ip_addresses(v=6).filter(plain_ipv6),
    st.integers(min_value=0, max_value=128),
)
def test_client_key_groups_exactly_the_addresses_of_one_prefix(
    first: ipaddress.IPv6Address, second: ipaddress.IPv6Address, prefix: int
) -> None:
    first_key, second_key = client_key(str(first), prefix), client_key(str(second), prefix)
    assert ipaddress.IPv6Network(first_key) == ipaddress.IPv6Network((first, prefix), strict=False)
    same_prefix = int(first) >> (128 - prefix) == int(second) >> (128 - prefix)
    assert (first_key == second_key) == same_prefix
    assert client_key(first.exploded.upper(), prefix) == first_key


# --- properties -----------------------------------------------------------------------------

trusted_addresses = st.one_of(
    st.ip_addresses(network="10.0.0.0/8"), st.ip_addresses(network="fd00::/8")
)
untrusted_addresses = st.ip_addresses().filter(lambda a: not is_trusted(a))
any_addresses = st.one_of(trusted_addresses, untrusted_addresses)
header_text = st.text(
    alphabet=st.sampled_from(list('0123456789abcdef.:[]%,;=" \t\\_-forFORunknown')), max_size=60
) | st.text(max_size=40)


@st.composite
def xff_spelling(draw: st.DrawFn, address: Address) -> str:
    """One of the ways a proxy may write ``address`` in X-Forwarded-For."""
    if isinstance(address, ipaddress.IPv4Address):
        forms = [str(address), f"{address}:{draw(st.integers(1, 65535))}", f"::ffff:{address}"]
    else:
        forms = [
            str(address),
            address.exploded,
            str(address).upper(),
            f"[{address}]",
            f"[{address}]:{draw(st.integers(1, 65535))}",
        ]
    return draw(st.sampled_from(forms))


@st.composite
def forwarded_spelling(draw: st.DrawFn, address: Address) -> str:
    """One RFC 7239 forwarded-element for ``address``, with other parameters around it."""
    port = draw(st.sampled_from(["", ":4711", ":_abc"]))
    if isinstance(address, ipaddress.IPv4Address):
        node = draw(st.sampled_from([str(address), f'"{address}{port}"']))
    else:
        node = f'"[{address}]{port}"'
    pairs = [f"{draw(st.sampled_from(['for', 'For', 'FOR']))}={node}"]
    pairs += draw(
        st.lists(st.sampled_from(["proto=https", "by=_p", 'host="a.example"']), max_size=2)
    )
    return draw(st.sampled_from([";", " ; "])).join(draw(st.permutations(pairs)))


BAD_XFF = ["unknown", "_hidden", "garbage", "1.2.3", "01.2.3.4", "[1.2.3.4]", "2001:db8::g"]
BAD_FORWARDED = ["for=unknown", 'for="_hidden"', "proto=http", "for=1.2.3.4:80", "for=01.2.3.4"]


def join_lines(draw: st.DrawFn, elements: list[str]) -> list[str]:
    """The elements as one or more header lines, with random list whitespace."""
    lines: list[str] = []
    current: list[str] = []
    for element in elements:
        current.append(element)
        if draw(st.booleans()):
            lines.append(draw(st.sampled_from([",", ", ", " ,\t"])).join(current))
            current = []
    if current or not lines:
        lines.append(", ".join(current))
    return lines


# A hop: an address, or None for an entry the walk cannot use.
Hop = Address | None
hops = st.lists(st.one_of(any_addresses, any_addresses, st.none()), max_size=6)


@st.composite
def rendered_chain(
    draw: st.DrawFn, chain: list[Hop], header: Literal["x-forwarded-for", "forwarded"]
) -> list[str]:
    elements = []
    for hop in chain:
        if header == "x-forwarded-for":
            element = draw(st.sampled_from(BAD_XFF) if hop is None else xff_spelling(hop))
        else:
            element = draw(
                st.sampled_from(BAD_FORWARDED) if hop is None else forwarded_spelling(hop)
            )
        elements.append(element)
    return join_lines(draw, elements)


HEADERS: list[Literal["x-forwarded-for", "forwarded"]] = ["x-forwarded-for", "forwarded"]


@pytest.mark.parametrize("header", HEADERS)
@given(peer=untrusted_addresses, header_values=st.lists(header_text, max_size=4))
def test_untrusted_peer_is_always_its_own_key(
    header: Literal["x-forwarded-for", "forwarded"], peer: Address, header_values: list[str]
) -> None:
    resolver = ClientIPResolver(TRUSTED, header)
    assert same_address(resolver.resolve(str(peer), header_values), peer)


@pytest.mark.parametrize("header", HEADERS)
@settings(max_examples=300)
@given(
    data=st.data(),
    peer=trusted_addresses,
    client=untrusted_addresses,
    proxies=st.lists(trusted_addresses, max_size=3),
    client_text=st.lists(header_text, max_size=3),
    separate_line=st.booleans(),
)
def test_client_text_cannot_change_what_the_proxies_wrote(
    header: Literal["x-forwarded-for", "forwarded"],
    data: st.DataObject,
    peer: Address,
    client: Address,
    proxies: list[Address],
    client_text: list[str],
    separate_line: bool,
) -> None:
    """Whatever the client sends, the proxies' appended view of it is the answer."""
    appended = data.draw(rendered_chain([client, *proxies], header))
    if separate_line or not client_text:
        header_values = [*client_text, *appended]
    else:
        # The first proxy appended to the client's last line, as nginx's $proxy_add_x_... does.
        header_values = [*client_text[:-1], client_text[-1] + ", " + appended[0], *appended[1:]]
    resolver = ClientIPResolver(TRUSTED, header)
    assert same_address(resolver.resolve(str(peer), header_values), client)


@pytest.mark.parametrize("header", HEADERS)
@settings(max_examples=300)
@given(data=st.data(), peer=trusted_addresses, chain=hops)
def test_trusted_peer_walk(
    header: Literal["x-forwarded-for", "forwarded"],
    data: st.DataObject,
    peer: Address,
    chain: list[Hop],
) -> None:
    header_values = data.draw(rendered_chain(chain, header))
    result = ClientIPResolver(TRUSTED, header).resolve(str(peer), header_values)

    # The result is the peer or a hop, never a hop left of an untrusted or unusable one.
    stop = max((i for i, hop in enumerate(chain) if hop is None or not is_trusted(hop)), default=-1)
    candidates = [(i, hop) for i, hop in enumerate(chain) if hop is not None and i >= stop]
    if stop >= 0 and chain[stop] is None:
        candidates = [(i, hop) for i, hop in candidates if i > stop]
    if not candidates:
        assert same_address(result, peer)
        return
    # ...and exactly the left-most of those: the right-most untrusted hop, or the hop to the
    # right of an unusable entry, or the left-most when all are trusted.
    assert same_address(result, candidates[0][1])


@pytest.mark.parametrize("header", HEADERS)
@given(data=st.data(), peer=trusted_addresses, chain=hops)
def test_spelling_does_not_change_the_key(
    header: Literal["x-forwarded-for", "forwarded"],
    data: st.DataObject,
    peer: Address,
    chain: list[Hop],
) -> None:
    """Ports, brackets, case and mapped forms must not let one client hold several keys."""
    resolver = ClientIPResolver(TRUSTED, header, cache_size=0)
    first = resolver.resolve(str(peer), data.draw(rendered_chain(chain, header)))
    second = resolver.resolve(str(peer), data.draw(rendered_chain(chain, header)))
    assert first == second


@given(peer=any_addresses, header_values=st.lists(header_text, max_size=4))
def test_never_raises_and_always_answers_an_address(
    peer: Address, header_values: list[str]
) -> None:
    for header in HEADERS:
        result = ClientIPResolver(TRUSTED, header).resolve(str(peer), header_values)
        assert ipaddress.ip_address(result).version in (4, 6)
