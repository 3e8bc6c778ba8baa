"""The one size parser and the one address parser every command uses (deepco.parsing)."""

from __future__ import annotations

import pytest
from deepco_server.split_jobs import peer_allowed

from deepco.cluster import ClusterError, parse_cluster
from deepco.errors import UserError
from deepco.parsing import is_address, parse_size, split_address


@pytest.mark.parametrize("text, size", [("224x224", (224, 224)), ("720X1280", (720, 1280)),
                                        (" 32 x 48 ", (32, 48)), ("0224x1", (224, 1))])
def test_sizes_read_as_height_and_width(text: str, size: tuple[int, int]) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "224", "224x", "x224", "0x224", "224x0", "-1x5", "+224x224", "2_24x224",
                                  "224x224x3", "224*224", "²x2", "224.0x224"])
def test_a_bad_size_names_the_flag_and_the_form(text: str) -> None:
    with pytest.raises(UserError, match=r"--input-size must be HxW with positive integers \(e.g. 224x224\), got"):
        parse_size(text)


@pytest.mark.parametrize("text, parts", [("127.0.0.1:50051", ("127.0.0.1", 50051)), ("edge:1", ("edge", 1)),
                                         ("[::1]:65535", ("[::1]", 65535))])
def test_addresses_split_into_host_and_port(text: str, parts: tuple[str, int]) -> None:
    assert split_address(text) == parts and is_address(text)


@pytest.mark.parametrize("text", ["", "host", ":50051", "host:", "host:0", "host:65536", "host:-1", "host:²",
                                  "host:5_0", "host: 50"])
def test_a_bad_address_is_refused_with_the_form(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected host:port with a port in 1\.\.65535, got"):
        split_address(text)
    assert not is_address(text)


def test_the_cluster_file_and_the_server_peers_use_the_same_rule() -> None:
    with pytest.raises(ClusterError, match=r"must be host:port with a port in 1\.\.65535"):
        parse_cluster({"servers": [{"name": "s", "address": "s:²"}]}, require_device=False)  # was a ValueError
    assert peer_allowed("127.0.0.1:50051", frozenset()) and peer_allowed("edge:7", frozenset({"edge:7"}))
    assert not peer_allowed("127.0.0.1:0", frozenset()) and not peer_allowed("127.0.0.1", frozenset())
    assert not peer_allowed("10.0.0.2:50051", frozenset())
