"""Endpoint socket addresses (``Endpoint.local_sockaddr`` / ``remote_sockaddr``)."""

from __future__ import annotations

import pytest

import gpucx

pytestmark = pytest.mark.timeout(30)


def test_sockaddrs_of_a_listener_connection():
    with gpucx.Context(features={"tag"}) as ctx:
        w = ctx.create_worker()
        lst = w.listen(0, "127.0.0.1")
        client = w.connect(("127.0.0.1", lst.port))
        server = lst.accept(timeout=10)
        client.flush(timeout=10)
        assert client.remote_sockaddr == ("127.0.0.1", lst.port)
        # Each side's local address is the other side's remote address.
        assert client.local_sockaddr == server.remote_sockaddr
        assert server.local_sockaddr == client.remote_sockaddr
        host, port = client.local_sockaddr
        assert host == "127.0.0.1" and 0 < port < 65536 and port != lst.port


def test_sockaddrs_of_an_address_endpoint_are_none():
    with gpucx.Context(features={"tag"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address)
        assert ep.local_sockaddr is None
        assert ep.remote_sockaddr is None


def test_sockaddrs_of_a_closed_endpoint_raise():
    with gpucx.Context(features={"tag"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address)
        ep.close(force=True)
        with pytest.raises(gpucx.ClosedError):
            _ = ep.local_sockaddr
