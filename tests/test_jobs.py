"""scripts/lib/jobs.py: a child's marked results come back, its failures say why, its output is
logged."""

import sys
from pathlib import Path

from scripts.lib import jobs

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def child(code: str) -> list[str]:
    head = f"import sys, time\nsys.path.insert(0, {str(SCRIPTS)!r})\nfrom lib import jobs\n"
    return [sys.executable, "-c", head + code]


def test_a_jobs_results_come_back_and_its_output_is_logged(tmp_path):
    log = jobs.Log(str(tmp_path), "bench")
    code = "print('warming up')\njobs.emit({'ms': 1.5})\njobs.emit({'ms': 2.0})"
    results, why = jobs.run(child(code), {"kind": "time"}, 60, log)
    assert results == [{"ms": 1.5}, {"ms": 2.0}] and why == ""
    text = (tmp_path / "bench.log").read_text()
    assert '## job {"kind": "time"}' in text and "warming up" in text


def test_a_failed_job_keeps_what_it_emitted_and_says_why(tmp_path):
    log = jobs.Log(None, "bench")
    code = "jobs.emit({'ms': 1.0})\nsys.exit('out of memory')"
    results, why = jobs.run(child(code), {"kind": "time"}, 60, log)
    assert results == [{"ms": 1.0}] and why == "exit 1: out of memory"


def test_a_job_past_its_time_is_stopped_with_what_it_emitted(tmp_path):
    log = jobs.Log(None, "bench")
    code = "jobs.emit({'ms': 1.0})\ntime.sleep(30)"
    results, why = jobs.run(child(code), {"kind": "time"}, 2, log)
    assert results == [{"ms": 1.0}] and why == "timed out after 2 s"
