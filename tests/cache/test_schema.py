import pytest

from dsv4.cache.schema import CacheSchema
from dsv4.config import get_preset


def test_bytes_per_token_match_spec():
    assert CacheSchema(get_preset("v4-pro")).min_bytes_per_token() == 5031.4375
    assert CacheSchema(get_preset("v4-flash")).min_bytes_per_token() == 3514.25


def test_ratio_class_paging():
    s = CacheSchema(get_preset("v4-flash"))
    csa, hca = s.ratio_classes[4], s.ratio_classes[128]
    assert (csa.entries_per_page, hca.entries_per_page) == (64, 2)
    assert csa.entry_page_bytes == 37440 and csa.key_page_bytes == 64 * 68 and hca.key_page_bytes == 0
    assert hca.entry_page_bytes == 1728  # 2 * 584 = 1168 padded to a multiple of 576
    assert len(csa.layers) == 21 and len(hca.layers) == 20
    assert csa.pages_for_tokens(0) == 0 and csa.pages_for_tokens(3) == 0 and csa.pages_for_tokens(4) == 1
    assert csa.pages_for_tokens(256) == 1 and csa.pages_for_tokens(260) == 2
    assert hca.pages_for_tokens(255) == 1 and hca.pages_for_tokens(256) == 1 and hca.pages_for_tokens(384) == 2


def test_per_request_state_bytes():
    s = CacheSchema(get_preset("v4-pro"))
    assert s.compressor_state_bytes(2) == 65536 + 16384  # CSA main + indexer
    assert s.compressor_state_bytes(3) == 5 * 512 * 4 + 4  # HCA, online: max, den, acc, raw kv + score, position
    ring = CacheSchema(get_preset("v4-pro"), online_state=False)  # the reference layout: 128 kv + score rows
    assert ring.compressor_state_bytes(3) == 524288 and ring.compressor_state_bytes(2) == 65536 + 16384
    assert s.compressor_state_bytes(61) == 0  # MTP, SWA-only
    assert s.per_request_fixed_bytes_by_region()["compressor_state"] == 30 * 81920 + 31 * 10244  # 2.6 MiB
    assert ring.per_request_fixed_bytes_by_region()["compressor_state"] == 30 * 81920 + 31 * 524288  # 17.8 MiB
    assert s.ring_page_bytes == 74880  # 128 * 584 = 74752, padded to a multiple of 576


def test_bad_block_tokens():
    with pytest.raises(ValueError, match="multiple of every compression ratio"):
        CacheSchema(get_preset("tiny"), block_tokens=100)
    with pytest.raises(ValueError, match="block_tokens"):
        CacheSchema(get_preset("tiny"), block_tokens=0)
