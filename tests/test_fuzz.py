"""A short fuzz campaign in CI; `python tests/fuzz.py --cases 100000` is the long one."""

import fuzz


def test_short_fuzz_campaign():
    assert fuzz.campaign(400) >= 400
