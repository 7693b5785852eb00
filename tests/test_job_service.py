"""The job-service layer: the cursor log reader behind `clusterfit logs` and the HTTP API."""

from __future__ import annotations

from pathlib import Path

from clusterfit.service.logview import read_logs


# --- the cursor log reader ---------------------------------------------------------------------------------
def test_log_lines_end_like_a_text_file_and_a_half_line_is_not_more(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"a\r\nb\rc\nd\r")
    first = read_logs(tmp_path, None)
    # The trailing \r waits: a \n may follow it. A line without its end is not "more", or followers would spin.
    assert (first.lines, first.more) == (["[rank0] a", "[rank0] b", "[rank0] c"], False)
    with log.open("ab") as f:
        f.write(b"\nlast")
    second = read_logs(tmp_path, first.cursor)
    assert (second.lines, second.more) == (["[rank0] d"], False)
    assert read_logs(tmp_path, second.cursor, final=True).lines == ["[rank0] last"]
