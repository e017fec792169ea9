"""A short fuzz campaign in CI; `python tests/fuzz.py --cases 100000` is the long one."""

import os

import fuzz


def test_short_fuzz_campaign():
    # Fixed cases under CI (see conftest.py); new ones on every local run.
    assert fuzz.campaign(400, derandomize=bool(os.environ.get("CI"))) >= 400


def test_short_fuzz_campaign_of_gradients_sharing_memory():
    assert fuzz.shared_campaign(60, derandomize=bool(os.environ.get("CI"))) >= 60
