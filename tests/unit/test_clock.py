"""The process's start on the wall clock: the origin of a run's ``first_step_s``."""

import subprocess
import sys
import time

from sparkcnn.clock import process_started


def test_a_process_started_before_the_import_that_asks():
    # the child sleeps 1 s before it imports the module: the start must be the process's, not the import's
    code = ("import time; time.sleep(1.0); from sparkcnn.clock import process_started; "
            "print(time.time() - process_started())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    age = float(out)
    assert 1.0 <= age < 60.0


def test_this_process_started_in_the_past():
    assert process_started() < time.time()
