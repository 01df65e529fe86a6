"""`kame serve --knowledge DIR`: indexed at start-up (the stats logged), re-indexed on SIGHUP (a real
server process) and when files change (the watch)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

from .server_harness import free_port, running_server, wait_until
from .test_first_run import wait_healthy


def wait_for_line(log: Path, text: str, server: subprocess.Popen, limit_s: float = 30) -> str:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        content = log.read_text()
        if text in content:
            return content
        assert server.poll() is None, content[-2000:]
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in the log within {limit_s} s:\n{log.read_text()[-2000:]}")


def test_serve_indexes_at_start_and_again_on_sighup(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "hours.md").write_text("# Hours\n\nThe shop opens at nine.\n")
    config = tmp_path / "kame.toml"
    config.write_text("[knowledge]\nwatch_interval_s = 0  # only on SIGHUP\nlimit = 2\n")
    port, log = free_port(), tmp_path / "serve.log"
    command = [str(Path(sys.executable).parent / "kame"), "serve", "--config", str(config), "--knowledge", str(notes),
               "--frontend", "tiny-copy", "--asr", "none", "--llm", "local", "--port", str(port)]
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, server, 120)
        wait_for_line(log, f"knowledge base {notes}: 1 documents, 1 passages (1 added", server)
        (notes / "returns.txt").write_text("Returns are free within thirty days.\n")
        time.sleep(0.5)
        assert "SIGHUP" not in log.read_text()  # no watch: nothing happens by itself
        server.send_signal(signal.SIGHUP)
        wait_for_line(log, "SIGHUP: knowledge base re-indexed: 2 documents, 2 passages (1 added", server)
        server.send_signal(signal.SIGTERM)
        exit_code = server.wait(30)
    finally:
        if server.poll() is None:
            server.kill()
    assert exit_code == 0, log.read_text()[-2000:]


def test_changed_files_are_reindexed_by_the_watch(tmp_path, tiny_copy):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "hours.md").write_text("# Hours\n\nThe shop opens at nine.\n")
    knowledge = {"dir": notes, "watch_interval_s": 0.2}
    with running_server(asr="none", max_sessions=1, knowledge=knowledge) as (url, services):
        base = services.runtime.knowledge
        assert not base.search("refund within thirty days")
        (notes / "returns.md").write_text("# Returns\n\nA refund within thirty days, with the receipt.\n")
        asyncio.run(wait_until(lambda: base.search("refund within thirty days"), "the new file to be indexed", 15))
        assert base.search("refund within thirty days")[0].source == "returns.md"
