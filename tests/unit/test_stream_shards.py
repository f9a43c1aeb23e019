"""Stream shards' routing rules (shellrl/streams/shards.py): which Redis a group's episodes go to,
the tagged entry ids of a sharded consumer, and the setting that lists the shards."""

from __future__ import annotations

import zlib

import pytest
from pydantic import ValidationError

from shellrl.service.settings import ServiceSettings
from shellrl.streams import shard_of, tag, untag
from shellrl.streams.shards import parse_shard_urls


def test_a_group_goes_to_one_plus_its_crc32_mod_the_shards():
    assert shard_of("g-1", 3) == 1 + 3274530402 % 3 == 1  # zlib.crc32(b"g-1") = 3274530402
    assert zlib.crc32(b"g-1") == 3274530402  # the one function on every host and Python
    assert shard_of("abc", 2) == 1 + 891568578 % 2 == 1  # zlib.crc32(b"abc") = 891568578
    assert {shard_of(f"group-{i}", 4) for i in range(200)} == {1, 2, 3, 4}


def test_without_shards_or_a_group_id_the_control_redis_holds_it():
    assert shard_of("group-7", 0) == 0
    assert shard_of("", 3) == 0  # an evaluation episode: its result goes to shellrl:evaluations
    with pytest.raises(ValueError, match="shards must be >= 0"):
        shard_of("g", -1)


def test_tagged_ids_round_trip_and_the_control_redis_ids_stay_plain():
    assert tag("1733-0", 0) == "1733-0" and untag("1733-0") == (0, "1733-0")
    assert tag("1733-5", 2) == "2@1733-5" and untag("2@1733-5") == (2, "1733-5")
    for bad in ("x@1-0", "0@1-0", "@1-0", "1@"):
        with pytest.raises(ValueError, match="not a sharded stream entry id"):
            untag(bad)


def test_shard_urls_parse_and_bad_ones_name_the_setting():
    assert parse_shard_urls(" redis://a:1/0 ,, redis://b:2/0 ") == [
        "redis://a:1/0",
        "redis://b:2/0",
    ]
    assert parse_shard_urls("") == []
    settings = ServiceSettings(stream_shard_urls="redis://a:1/0", auth_disabled=True)
    assert settings.shard_urls == ["redis://a:1/0"]
    for value, message in (
        ("http://a:1", "is not a redis://"),
        ("redis://a:1/0,redis://a:1/0", "given twice"),
        ("redis://127.0.0.1:6379/0", "is redis_url"),
    ):
        with pytest.raises(ValidationError, match="stream_shard_urls") as err:
            ServiceSettings(stream_shard_urls=value, auth_disabled=True)
        assert message in str(err.value)
