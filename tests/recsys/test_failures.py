"""The launcher reports the earliest failure of a run, with its traceback, and only that one.

A failing rank makes the others fail too (a peer closed the connection); each rank records its failure
(recsys.failures) and the launcher prints the earliest. These tests drive the records and the launcher's
report directly, with stand-ins for finished worker processes.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from recsys.errors import UserError
from recsys.failures import first_failure, record_failure
from recsys.launch import EXIT_USAGE, _outcome


def _raised(err: BaseException) -> BaseException:
    try:
        raise err
    except BaseException as caught:  # noqa: BLE001 - a test helper that returns what it raised
        return caught


def test_a_record_holds_the_traceback_of_an_error_and_none_for_a_user_error(tmp_path):
    assert record_failure(tmp_path, 1, _raised(RuntimeError("gloo  peer\\nclosed")))
    assert record_failure(tmp_path, 0, _raised(UserError("store is full")))
    one = json.loads((tmp_path / ".failed_rank_1.json").read_text())
    assert one["message"] == "RuntimeError: gloo peer\\nclosed"
    assert one["detail"].startswith("Traceback (most recent call last)") and "_raised" in one["detail"]
    assert json.loads((tmp_path / ".failed_rank_0.json").read_text())["detail"] == ""


def test_an_error_re_raised_further_up_is_recorded_once(tmp_path):
    err = _raised(RuntimeError("first"))
    record_failure(tmp_path, 0, err)
    before = (tmp_path / ".failed_rank_0.json").read_text()
    assert record_failure(tmp_path, 0, err)  # already recorded: reported as delivered, left as it was
    assert (tmp_path / ".failed_rank_0.json").read_text() == before
    record_failure(tmp_path, 0, _raised(RuntimeError("second")))  # another error is recorded
    assert first_failure(tmp_path).message == "RuntimeError: second"


def test_a_record_that_reaches_no_one_says_so(tmp_path):
    assert not record_failure(tmp_path / "missing", 0, _raised(RuntimeError("x")))


def _workers(*codes: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(exitcode=c) for c in codes]


def _failures(tmp_path, errors: dict[int, BaseException]):
    for rank, err in errors.items():  # in order: the first is the earliest
        record_failure(tmp_path, rank, err)
    return []  # nothing through the pipes: the launcher reads the records in the run directory


def test_the_launcher_prints_the_root_cause_traceback_and_not_the_echo(tmp_path, capsys):
    failures = _failures(
        tmp_path, {1: _raised(RuntimeError("injected root cause")), 0: _raised(RuntimeError("peer closed"))}
    )
    signals = SimpleNamespace(first=0)
    code = _outcome(_workers(1, 1), 0, signals, failures, tmp_path)
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("Traceback (most recent call last)") == 1 and "peer closed" not in err
    assert err.strip().splitlines()[-1] == "recsys: error: worker 1 failed: RuntimeError: injected root cause"


def test_a_user_error_first_is_one_line_though_an_echo_exited_first(tmp_path, capsys):
    failures = _failures(
        tmp_path, {1: _raised(UserError("store x is full")), 0: _raised(RuntimeError("peer"))}
    )
    code = _outcome(_workers(1, EXIT_USAGE), 0, SimpleNamespace(first=0), failures, tmp_path)
    assert code == EXIT_USAGE
    assert capsys.readouterr().err == "recsys: error: store x is full\n"
