"""Hypothesis profiles for the property and fuzz tests; import this module to apply them.

HYPOTHESIS_PROFILE picks one (default "ci"):
  ci    derandomized, so CI is repeatable and stays within its time budget: a plain run draws
        QUICK_EXAMPLES (QUICK_ENGINE_EXAMPLES), the `-m slow` run the profile's full count
  long  thorough local runs:  HYPOTHESIS_PROFILE=long python -m pytest -q tests/plugins/test_kv_cache_properties.py tests/core/test_engine_fuzz.py
"""

import os

import pytest
from hypothesis import HealthCheck, settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

# derandomize: CI draws the same examples every run, so a failure there reproduces locally.
settings.register_profile(
    "ci",
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=2000,
    stateful_step_count=120,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
if PROFILE not in ("ci", "long"):
    raise ValueError(f"HYPOTHESIS_PROFILE must be 'ci' or 'long', got {PROFILE!r}")
settings.load_profile(PROFILE)

# Engine runs cost far more than bookkeeping steps: fewer examples, same profile.
ENGINE_EXAMPLES = {"ci": 100, "long": 1000}[PROFILE]

# Under ci a plain run draws a fraction of the examples, and `-m slow` all of them.
QUICK_EXAMPLES = {"ci": 50, "long": 2000}[PROFILE]
QUICK_ENGINE_EXAMPLES = {"ci": 20, "long": 1000}[PROFILE]


def quick_and_thorough(quick: int, thorough: int) -> list:
    """A property test's example counts: `quick` in the default run, `thorough` with -m slow."""
    if quick == thorough:
        return [pytest.param(thorough, id="thorough")]
    return [pytest.param(quick, id="quick"), pytest.param(thorough, id="thorough", marks=pytest.mark.slow)]
