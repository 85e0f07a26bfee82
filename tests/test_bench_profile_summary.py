"""benchmarks/profile_summary.py on a small speedscope document."""

from __future__ import annotations

from benchmarks.profile_summary import summarize

DOC = {
    "shared": {
        "frames": [
            {"name": "run", "file": "/x/proc.py", "line": 1},
            {"name": "step", "file": "/x/core.py", "line": 2},
            {"name": "on_token", "file": "/x/output.py", "line": 3},
        ]
    },
    "profiles": [
        {"name": 'Thread 1 "MainThread"', "samples": [[0, 1, 2], [0, 1, 2], [0, 1], [0]]},
        {"name": 'Thread 2 "idle"', "samples": []},
    ],
}


def test_self_and_total_shares_per_thread() -> None:
    text = summarize(DOC)
    lines = text.splitlines()
    assert lines[0] == '== Thread 1 "MainThread": 4 samples'
    assert lines[2].split() == ["50.0", "50.0", "on_token", "(output.py:3)"]
    assert lines[3].split() == ["25.0", "75.0", "step", "(core.py:2)"]
    assert lines[4].split() == ["25.0", "100.0", "run", "(proc.py:1)"]
    assert "idle" not in text  # threads without samples are left out


def test_ranked_by_total_share() -> None:
    lines = summarize(DOC, by="total").splitlines()
    assert [line.split()[2] for line in lines[2:5]] == ["run", "step", "on_token"]
    assert lines[2].split()[:2] == ["25.0", "100.0"]


def test_only_the_samples_under_a_function() -> None:
    lines = summarize(DOC, under="step").splitlines()
    assert lines[0] == '== Thread 1 "MainThread": 3 samples'
    assert lines[2].split()[:3] == ["66.7", "66.7", "on_token"]
    assert summarize(DOC, under="absent") == ""
