"""Prerequisites of the Python tests: skipped loudly on a developer's machine, required in CI.

A prerequisite is something the build or tools/setup.sh provides (the engine probe, a generated
model). Missing on a developer's machine, the test is skipped with the reason (run_test.py then
exits 77 and CTest lists it as Skipped); under CI=true it fails, so CI never passes a check that
did not run.
"""
import os


def require(test, ok, reason):
    """Fails (CI=true) or skips `test` with `reason` unless `ok`."""
    if ok:
        return
    if os.environ.get("CI") == "true":
        test.fail(f"{reason} (CI=true: this prerequisite is required)")
    test.skipTest(reason)
