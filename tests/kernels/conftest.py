"""Kernel-test helpers: a fresh random seed per test, reported on failure."""

from __future__ import annotations

import random

import pytest
import torch


@pytest.fixture
def seed() -> int:
    """Seed torch from fresh entropy; the value is printed, so a failure shows how to replay."""
    value = random.SystemRandom().randrange(2**31)
    torch.manual_seed(value)
    print(f"torch seed: {value}")
    return value
