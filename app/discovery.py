"""Node discovery: the set of node URLs, with `dns+http(s)://NAME:PORT` entries resolved by DNS.

A `[nodes] urls` entry (or ZEN_NODES) such as `dns+http://zen-node.zen.svc.cluster.local:8001`
names a headless Service: every address the name resolves to (through socket.getaddrinfo) is one
node, `http://ADDRESS:8001`. Only the addresses of the family getaddrinfo lists first are taken: a
dual-stack Service answers an A and an AAAA record for each pod, which would count every node twice. Names are resolved again every
`[nodes] dns_refresh_s`, so that nodes come as pods start and go as they stop. Plain http(s)
URLs are nodes as they are. A name that no longer exists stands for no node; a resolver that
fails for another reason (a DNS timeout) keeps the name's last answer, so a DNS blip does not
empty the pool.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from typing import Callable, Iterable, Sequence
from urllib.parse import urlparse

log = logging.getLogger("zen.gateway")

DNS_PREFIX = "dns+"

# (host, port) -> the addresses the name stands for, IPv4 or IPv6, in the resolver's order.
Resolver = Callable[[str, int], Sequence[str]]


class NameNotFound(LookupError):
    """The name exists no more (NXDOMAIN, no address): it stands for no node."""


def is_dns_url(url: str) -> bool:
    return url.startswith(DNS_PREFIX)


def resolve_addresses(host: str, port: int) -> list[str]:
    """The addresses of `host` of the family getaddrinfo lists first (IPv4 or IPv6: a dual-stack pod has
    one of each), without duplicates, in getaddrinfo's order."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise NameNotFound(f"{host}: {exc.strerror}") from None
        raise
    infos = [info for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)]
    addresses: list[str] = []
    for family, _, _, _, sockaddr in infos:
        if family == infos[0][0] and sockaddr[0] not in addresses:
            addresses.append(sockaddr[0])
    return addresses


def address_url(scheme: str, address: str, port: int) -> str:
    """`scheme://address:port`, with an IPv6 address in brackets."""
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"{scheme}://{host}:{port}"


class NodeDiscovery:
    """The current node URLs: the plain ones as given, the dns+ ones as last resolved."""

    def __init__(self, urls: Iterable[str], refresh_s: float, resolver: Resolver = resolve_addresses,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.refresh_s = refresh_s
        self._resolver = resolver
        self._clock = clock
        self._entries = tuple(urls)
        self._answers: dict[str, tuple[str, ...]] = {u: () for u in self._entries if is_dns_url(u)}
        self._resolved_at: float | None = None
        self._answered = False
        self._lock = threading.Lock()

    @property
    def dynamic(self) -> bool:
        """Whether any entry is resolved by DNS (the set can change)."""
        return bool(self._answers)

    def known(self) -> list[str]:
        """The current URLs without resolving anything: plain entries, then each name's last answer."""
        out: list[str] = []
        for entry in self._entries:
            for url in self._answers.get(entry, (entry,)):
                if url not in out:
                    out.append(url)
        return out

    def entry_of(self, url: str) -> str | None:
        """The configured entry a current URL comes from: itself when plain, its dns+ name when a pod of it
        (a bounded metric label: pod addresses change with every rollout); None when not current."""
        for entry in self._entries:
            if url in self._answers.get(entry, (entry,)):
                return entry
        return None

    def server_name(self, url: str) -> str | None:
        """The name a node found under a dns+https:// name proves in its TLS certificate: that name (a
        pod's address changes as it restarts; its certificate names the Service). None for other URLs."""
        for entry, answer in self._answers.items():
            if url in answer and entry.startswith(DNS_PREFIX + "https:"):
                return urlparse(entry[len(DNS_PREFIX):]).hostname
        return None

    def due(self) -> bool:
        """Whether urls() would resolve the dns+ entries again now."""
        return self.dynamic and (self._resolved_at is None or self._clock() - self._resolved_at >= self.refresh_s)

    @property
    def answered(self) -> bool:
        """Whether the dns+ entries have been resolved once (plain entries need no answer)."""
        return not self.dynamic or self._answered

    def urls(self) -> list[str]:
        """The current URLs, resolving the dns+ entries again if dns_refresh_s has passed. Once answered,
        a caller that finds another thread resolving gets the last answer at once: a resolver that hangs
        holds up that one thread, not every request."""
        if not self._lock.acquire(blocking=not self._answered):
            return self.known()
        try:
            if self.due():
                self._resolved_at = self._clock()
                for entry in self._answers:
                    try:
                        self._answers[entry] = self._resolve(entry)
                    except ValueError as exc:   # a malformed entry (a bad port) stands for no node; the others go on
                        self._answers[entry] = ()
                        log.warning("node name not resolvable", extra={"event": "node_dns_bad_entry", "node": entry,
                                                                        "reason": str(exc)})
                self._answered = True
            return self.known()
        finally:
            self._lock.release()

    def _resolve(self, entry: str) -> tuple[str, ...]:
        parsed = urlparse(entry[len(DNS_PREFIX):])
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            addresses = self._resolver(parsed.hostname or "", port)
        except NameNotFound as exc:
            addresses = []
            log.warning("node name not found", extra={"event": "node_dns_empty", "node": entry,
                                                       "reason": str(exc)})
        except OSError as exc:
            log.warning("node name not resolved, keeping its last answer",
                        extra={"event": "node_dns_error", "node": entry, "reason": str(exc)})
            return self._answers[entry]
        return tuple(address_url(parsed.scheme, a, port) for a in addresses)


def sync_views(views: dict, urls: Sequence[str], new_view: Callable[[str], object],
               on_dropped: Callable[[str], None] | None = None) -> None:
    """Make `views` (URL -> view) hold exactly `urls`: a new URL gets a fresh view, a gone one is
    forgotten and handed to `on_dropped` (its streams in flight hold their own connections and go on)."""
    added = [u for u in urls if u not in views]
    dropped = [u for u in views if u not in urls]
    for url in dropped:
        del views[url]
        if on_dropped is not None:
            on_dropped(url)
        log.info("node dropped", extra={"event": "node_dropped", "node": url})
    for url in added:
        views[url] = new_view(url)
        log.info("node discovered", extra={"event": "node_discovered", "node": url})
