"""The storage tiers are named on the wire (the listener's feed, the admin JSON) by their string values: a name
read from the feed is the member itself, and a member written out is its bare name."""

from __future__ import annotations

import json

from listener.block_chains import GPU, WARM
from picker.shared.feed_records import PB_TIERS, decode_tier
from picker.shared.tiers import StorageTier


def test_a_tier_name_read_from_the_wire_is_the_member_itself() -> None:
    """The KV index compares tiers by identity (``tier is StorageTier.GPU_HOT``): a parsed name must be the member."""
    assert StorageTier("gpu_hot") is StorageTier.GPU_HOT
    assert decode_tier("storage_warm") is StorageTier.STORAGE_WARM


def test_a_tier_is_written_as_its_bare_name_in_json_logs_and_keys() -> None:
    assert json.dumps({"tier": StorageTier.GPU_HOT}) == '{"tier": "gpu_hot"}'
    assert f"tier={StorageTier.STORAGE_WARM}" == "tier=storage_warm"
    assert {"none": 1}[StorageTier.NONE] == 1  # a plain-string key finds the member's entry


def test_the_listener_and_the_feed_name_the_tiers_a_block_can_be_in() -> None:
    held = {t.value for t in StorageTier if t is not StorageTier.NONE}
    assert {GPU, WARM} == held == set(PB_TIERS)
