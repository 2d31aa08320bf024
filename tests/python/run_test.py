"""Runs one test module for CTest and maps the outcome to an exit status.

0: every test ran and passed; 1: a failure, an error, or no test at all; 77: nothing failed but
something was skipped (CTest reports the entry as Skipped; tests/python/CMakeLists.txt sets
SKIP_RETURN_CODE 77), with each skip's reason printed. unittest alone exits 0 when tests skip,
which made the only independent numerical reference look green when it had not run.

Usage: run_test.py MODULE   (from tests/python, as CTest runs it)
"""
import sys
import unittest

SKIP_RC = 77


def main(argv):
    if len(argv) != 2:
        print("usage: run_test.py MODULE", file=sys.stderr)
        return 2
    suite = unittest.defaultTestLoader.loadTestsFromName(argv[1])
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    if not result.wasSuccessful():
        return 1
    if result.testsRun == 0:
        print(f"{argv[1]}: no test ran")
        return 1
    if result.skipped:
        for test, why in result.skipped:
            print(f"skipped: {test.id()}: {why}")
        return SKIP_RC
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
