"""The names a server answers to (`rollout.http.hosts`), which the rollout and reward services share."""

from __future__ import annotations

import pytest

from rollout.http.hosts import LOOPBACK_NAMES, allowed_hosts, is_loopback

pytestmark = pytest.mark.timeout(10)


def test_only_loopback_addresses_are_loopback():
    assert all(is_loopback(host) for host in ("127.0.0.1", "127.8.0.1", "::1", "localhost"))
    # a host name may resolve to anything, and 0.0.0.0 is every interface
    assert not any(is_loopback(host) for host in ("0.0.0.0", "::", "10.0.0.1", "example.com", "localhost.evil"))


def test_a_host_header_may_name_the_bound_address_its_loopback_aliases_and_the_extra_names():
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("::") is None  # every interface: any name
    assert allowed_hosts("127.0.0.1") == LOOPBACK_NAMES
    assert allowed_hosts("[::1]") == LOOPBACK_NAMES
    assert allowed_hosts("10.0.0.5", ("Rollout.Internal",)) == {"10.0.0.5", "rollout.internal"}
