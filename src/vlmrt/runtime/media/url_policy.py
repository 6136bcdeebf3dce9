"""Which addresses an image URL may reach, and the connection that makes sure it reaches only those.

    policy = AddressPolicy()                      # public addresses only (vlmrt serve, vlmrt batch)
    policy.refusal(ipaddress.ip_address("10.0.0.5"))   # -> "private"; None for a public address
    sock = policy.connect(("images.example.org", 443), timeout=10)   # resolve, check every address, connect to one

A server that fetches the URLs its clients send must not become their way into its own network (SSRF: vLLM's
CVE-2025-6242). So the check is made on the addresses the host name resolves to, not on the URL's text (decimal,
octal or hex IPv4 such as http://2130706433/, IPv4-mapped IPv6, IDN names and names that resolve to 127.0.0.1 all
end up as an address), every address a name resolves to must pass, and the socket is connected to one of the
addresses that were checked: there is no second lookup that a DNS server could answer differently (DNS rebinding).
fetch_url (sources.py) hands `connect` to http.client as its connection factory, so every redirect's host goes
through the same check.

Refused: loopback (127/8, ::1), unspecified (0.0.0.0/8, ::), private (10/8, 172.16/12, 192.168/16, 100.64/10 shared
address space, fc00::/7), link-local (169.254/16 with the cloud metadata address 169.254.169.254, fe80::/10),
multicast, reserved (240/4, the broadcast address, ::/8, documentation and benchmarking ranges, the IETF protocol
assignments), and the IPv6 forms that carry an IPv4 address (IPv4-mapped ::ffff:a.b.c.d, NAT64 64:ff9b::/96 and
64:ff9b:1::/48, 6to4 2002::/16, Teredo) when that IPv4 address is refused. The standard library's `ipaddress` does
the classification.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Callable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


class AddressRefused(OSError):
    """The URL's host is, or resolves to, an address the policy refuses (raised before any connection)."""


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, NAT64, 6to4, Teredo's client), if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if any(ip in net for net in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return None


def address_kind(ip: IPAddress) -> str | None:
    """Why ip is not a public address ("loopback", "private", ...), or None for a public one."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_ipv4(ip)
        if inner is not None:
            kind = address_kind(inner)
            if kind is not None:
                return kind
            if ip.ipv4_mapped is not None or any(ip in net for net in _NAT64):
                return None  # ::ffff:a.b.c.d and NAT64's 64:ff9b::a.b.c.d are a.b.c.d (public); 6to4 and Teredo
                # addresses are judged as IPv6 too
    checks = (("loopback", ip.is_loopback), ("unspecified", ip.is_unspecified), ("link-local", ip.is_link_local),
              ("multicast", ip.is_multicast), ("private", ip.is_private), ("reserved", ip.is_reserved))
    for kind, hit in checks:
        if hit:
            return kind
    return None if ip.is_global else "non-public"  # 100.64/10 and the like: neither private nor global


def _getaddrinfo(host: str, port: int) -> list:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


@dataclass(frozen=True)
class AddressPolicy:
    """What an image URL's host may resolve to: public addresses, plus the networks of `allow`.

    allow_local: every address is allowed (vlmrt serve --allow-local-urls: a trusted network); the connection is
    still made to the address that was resolved. allow: CIDR networks allowed in addition ("192.168.7.0/24").
    resolve(host, port) -> getaddrinfo-style tuples (family, type, proto, canonname, sockaddr); tests inject one.
    """

    allow_local: bool = False
    allow: tuple[str, ...] = ()
    resolve: Callable[[str, int], list] = _getaddrinfo

    def __post_init__(self):
        object.__setattr__(self, "_allowed", tuple(ipaddress.ip_network(n, strict=False) for n in self.allow))

    def refusal(self, ip: IPAddress) -> str | None:
        """Why ip is refused (its kind), or None."""
        if self.allow_local or any(ip.version == n.version and ip in n for n in self._allowed):
            return None
        return address_kind(ip)

    def addresses(self, host: str, port: int) -> list[tuple]:
        """(family, sockaddr) of every address host resolves to; AddressRefused if any of them is refused."""
        try:
            infos = self.resolve(host, port)
        except (socket.gaierror, UnicodeError) as e:
            raise OSError(f"cannot resolve the host ({e.strerror if isinstance(e, socket.gaierror) else e})") from None
        out = []
        for family, _, _, _, sockaddr in infos:
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
            kind = self.refusal(ip)
            if kind is not None:
                raise AddressRefused(f"refused: the host has a {kind} address (this server fetches images only "
                                     "from public addresses)")
            out.append((family, sockaddr))
        if not out:
            raise OSError("cannot resolve the host (no IPv4 or IPv6 address)")
        return out

    def connect(self, address: tuple[str, int], timeout=None, source_address=None) -> socket.socket:
        """socket.create_connection's signature (http.client's _create_connection): a socket connected to one of
        the checked addresses of address[0], tried in the resolver's order."""
        host, port = address
        last: OSError | None = None
        for family, sockaddr in self.addresses(host, port):
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                if isinstance(timeout, (int, float)):  # else socket.create_connection's default sentinel: no timeout
                    sock.settimeout(timeout)
                if source_address:
                    sock.bind(source_address)
                sock.connect(sockaddr)
                return sock
            except OSError as e:
                sock.close()
                last = e
        raise last
