"""Which names a server answers to: the loopback names, whether a bind address is loopback only, and
the names a `Host` header may carry (`guard.RequestGuard` refuses the others). Plain Python, so a
command line is checked before the web stack is imported."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def allowed_hosts(bound_host: str, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The names a `Host` header may carry for a server bound to `bound_host`: the bound address
    (and every loopback name for a loopback bind) plus `extra`; None (any) when bound to every
    interface, where the names the machine is reached by are not known here."""
    if bound_host in ("0.0.0.0", "::", ""):
        return None
    names = {bound_host.lower().strip("[]"), *(name.lower() for name in extra)}
    if names & LOOPBACK_NAMES or bound_host.startswith("127."):
        names |= LOOPBACK_NAMES
    return frozenset(names)
