"""The ladder bench's four-stream rate counts only the window in which every stream decodes."""

from bench.metrics import RequestRecord
from bench.model_ladder import together_rate


def _record(index: int, times: list[float]) -> RequestRecord:
    record = RequestRecord(index, prompt_len=8, expected_output_len=len(times), send_time=0.0)
    for at in times:
        record.add_chunk(at, 1)
    record.end_time = times[-1]
    return record


def test_together_rate_counts_tokens_while_all_streams_decode() -> None:
    # Stream 0 decodes alone from t=1 (the other prompt is prefilled meanwhile); both decode from t=5
    # to t=8, at one token a second each.
    early = _record(0, [1.0, 1.5, 2.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    late = _record(1, [5.0, 6.0, 7.0, 8.0])
    assert together_rate([early, late]) == 6 / 3


def test_together_rate_needs_every_stream() -> None:
    failed = _record(1, [5.0, 6.0])
    failed.error = "closed"
    assert together_rate([_record(0, [1.0, 2.0, 3.0]), failed]) is None
    assert together_rate([_record(0, [1.0, 2.0]), _record(1, [3.0, 4.0])]) is None
