"""Test timeouts that stretch on a loaded machine: `scaled(seconds)` multiplies by
CHATGEN_TEST_TIMEOUT_SCALE.

    from timeouts import scaled
    proc.wait(timeout=scaled(60))

CI sets no scale (1): a test that needs more there is too slow. scripts/run_tests_under_load.sh sets
3 while two busy-loop processes share the cores (docs/testing.md). The scale bounds waits only; it
never loosens what a test asserts.
"""

import os

SCALE_ENV = "CHATGEN_TEST_TIMEOUT_SCALE"


def scale() -> float:
    text = os.environ.get(SCALE_ENV, "1")
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(
            f"{SCALE_ENV}={text!r}: give a positive number (1 = the timeouts as "
            "written, 3 on a machine at three times its cores' load)"
        )
    return value


def scaled(seconds: float) -> float:
    """`seconds` times CHATGEN_TEST_TIMEOUT_SCALE (default 1)."""
    return seconds * scale()
