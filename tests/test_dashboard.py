"""The web dashboard in a real headless Chromium (Debian's package, driven by Playwright) against a real
server that runs a real tiny job: sign in with a token, watch the job's state change live in the table,
open it, see the loss chart drawn (checked on a screenshot), the per-rank health rows, the log tail, and
cancel a running job with the button."""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import run_cli, tiny_job
from service_server import ServerProcess, cancel_active_jobs, client, make_token
from services import find, skip_reason
from test_session import session_job
from test_sweep import scaled_sweep

from clusterfit.service.migrate import open_store

CHROMIUM = find("chromium")
LAUNCH_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LOSS_COLOUR = (0x1F, 0x6F, 0xD1)  # LINE_COLOURS.loss in dashboard/app.js
VAL_LOSS_COLOUR = (0x7A, 0x3D, 0xB8)  # LINE_COLOURS.valLoss
TOP1_COLOUR = (0x15, 0x80, 0x3D)  # LINE_COLOURS.top1
TRIAL_COLOURS = [(0x1F, 0x6F, 0xD1), (0xE0, 0x52, 0x1B)]  # TRIAL_COLOURS[0:2]: trials 0 and 1 of a sweep

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason=str(skip_reason("chromium")))


@pytest.fixture
def browser_page():  # noqa: ANN201
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="clusterfit-chromium-")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=LAUNCH_FLAGS,
            viewport={"width": 1300, "height": 1000},
        )
        try:
            yield context.new_page()
        finally:
            context.close()
            shutil.rmtree(profile, ignore_errors=True)


def _line_pixels(png: bytes, colour: tuple[int, int, int], tolerance: int = 40) -> int:
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)
    return int((np.abs(pixels - np.array(colour, dtype=np.int16)) <= tolerance).all(axis=-1).sum())


def _wait_for_state(job_id: str, states: set[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = open_store().get(job_id).state
        if state in states:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still {open_store().get(job_id).state} after {timeout} s")


@pytest.fixture
def no_jobs_left_behind():  # noqa: ANN201
    yield
    cancel_active_jobs()


def test_dashboard_shows_a_real_job_live(
    browser_page,  # noqa: ANN001
    tmp_path: Path,
    tiny_imagefolder: Path,
    no_jobs_left_behind,  # noqa: ANN001
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    submitter = make_token("submit", name="dashboard-user")
    data = {"train": str(tiny_imagefolder / "train"), "val": str(tiny_imagefolder / "val"), "num_classes": None}
    job = tiny_job(tmp_path / "out", epochs=2, steps_per_epoch=4, log_every_steps=1, data=data)
    with ServerProcess() as server, client(server.url, submitter) as http:
        page.goto(server.url + "/")
        expect(page.locator("#login")).to_be_visible()
        page.fill("#token", "cf_wrong")
        page.click("#login-form button")
        expect(page.locator("#login-error")).to_contain_text("unknown token")
        expect(page.locator("#jobs")).to_be_hidden()

        page.fill("#token", submitter)
        page.click("#login-form button")
        expect(page.locator("#who")).to_have_text("dashboard-user (submit)")
        expect(page.locator("#jobs-empty")).to_be_visible()

        # Submitted after the page opened: the table shows it and its state changes without a reload.
        job_id = http.post("/api/jobs", json={"spec": yaml.safe_dump(job)}).json()["id"]
        row = page.locator(f"#jobs-table tr[data-id='{job_id}']")
        expect(row).to_be_visible(timeout=10_000)
        seen = {row.locator("td").nth(2).inner_text()}
        deadline = time.monotonic() + 240
        while "SUCCEEDED" not in seen and time.monotonic() < deadline:
            page.wait_for_timeout(300)
            seen.add(row.locator("td").nth(2).inner_text())
        assert "SUCCEEDED" in seen, (seen, open_store().get(job_id).cause_detail)
        assert seen & {"QUEUED", "STAGING", "RUNNING"}, seen  # it was seen before it ended

        row.click()
        expect(page.locator("#job-state")).to_have_text("SUCCEEDED")
        expect(page.locator("#ranks-table tbody tr")).to_have_count(2)
        expect(page.locator("#ranks-table tbody tr").first).to_contain_text("ended")
        expect(page.locator("#log")).to_contain_text("[rank0", timeout=10_000)
        expect(page.locator("#log")).to_contain_text("exported")
        expect(page.locator("#cancel")).to_be_hidden()
        page.wait_for_timeout(1500)  # one more poll: the chart is drawn from the same response as the rows
        chart = page.locator("#loss-chart").screenshot()
        page.screenshot(path=str(tmp_path / "job-page.png"), full_page=True)  # kept for a human to look at
        assert _line_pixels(chart, LOSS_COLOUR) > 200  # the line and its markers, not just the axes
        assert _line_pixels(chart, VAL_LOSS_COLOUR) > 50  # validation loss beside it: two epochs, two markers
        # Validation accuracy per epoch, the best epoch named and marked.
        expect(page.locator("#val-figure")).to_be_visible()
        expect(page.locator("#val-caption")).to_contain_text("best top-1")
        assert _line_pixels(page.locator("#val-chart").screenshot(), TOP1_COLOUR) > 100

        # A job that would run for long: cancelled from its page.
        long_job = tiny_job(tmp_path / "long", steps_per_epoch=100_000)
        long_id = http.post("/api/jobs", json={"spec": yaml.safe_dump(long_job)}).json()["id"]
        page.goto(f"{server.url}/#/jobs/{long_id}")
        expect(page.locator("#cancel")).to_be_visible(timeout=10_000)
        _wait_for_state(long_id, {"STAGING", "RUNNING"}, timeout=60)  # its processes are starting or training
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#cancel")
        expect(page.locator("#job-state")).to_have_text("CANCELLED", timeout=60_000)
        expect(page.locator("#job-cause")).to_contain_text("cancelled by user")


def test_dashboard_charts_a_user_script_s_own_metric(
    browser_page,  # noqa: ANN001
    tmp_path: Path,
    no_jobs_left_behind,  # noqa: ANN001
) -> None:
    """A command job whose script reports through clusterfit.session, without a loss: its own metric is charted."""
    from playwright.sync_api import expect

    page = browser_page
    submitter = make_token("submit", name="dashboard-user")
    job = yaml.safe_load(session_job(tmp_path, "script", "python session_user.py --steps 8").read_text())
    with ServerProcess("--allow-command-jobs") as server, client(server.url, submitter) as http:
        job_id = http.post("/api/jobs", json={"spec": yaml.safe_dump(job)}).json()["id"]
        assert _wait_for_state(job_id, {"SUCCEEDED", "FAILED"}, timeout=120) == "SUCCEEDED"
        page.goto(f"{server.url}/#/jobs/{job_id}")
        page.fill("#token", submitter)
        page.click("#login-form button")
        expect(page.locator("#loss-caption")).to_have_text("score", timeout=10_000)
        expect(page.locator("#job-summary")).to_contain_text("step 7/8")
        expect(page.locator("#job-summary")).to_contain_text("; score ")
        page.wait_for_timeout(1500)  # one more poll: the chart is drawn from the same response as the rows
        assert _line_pixels(page.locator("#loss-chart").screenshot(), LOSS_COLOUR) > 200


def test_dashboard_shows_a_sweep_with_every_trial_s_curve(
    browser_page,  # noqa: ANN001
    tmp_path: Path,
    postgres_server,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sweep driven by the CLI with a PostgreSQL job store keeps its study in that database, where the server
    sharing the store finds it: the sweeps list, the trials best first with the pruned one, and one line per
    trial on the chart."""
    from playwright.sync_api import expect

    monkeypatch.setenv("CLUSTERFIT_DATABASE_URL", postgres_server.new_database())
    swept = run_cli("sweep", "run", str(scaled_sweep(tmp_path)), "--poll", "0.2")
    assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
    assert not (Path(os.environ["CLUSTERFIT_HOME"]) / "sweeps.db").exists()  # not beside it: in it
    page = browser_page
    reader = make_token("read", name="watcher")
    with ServerProcess() as server, client(server.url, reader) as http:
        assert http.get("/api/sweeps/nope").status_code == 404
        page.goto(server.url + "/")
        page.fill("#token", reader)
        page.click("#login-form button")
        page.click("#nav-sweeps")
        row = page.locator("#sweeps-table tr[data-name='scaled']")
        expect(row).to_contain_text("score (maximize)")
        row.click()
        trials = page.locator("#trials-table tbody tr")
        expect(trials).to_have_count(2)
        expect(trials.first).to_contain_text("COMPLETE")  # best first
        expect(trials.nth(1)).to_contain_text("PRUNED")
        expect(page.locator("#sweep-summary")).to_contain_text("best: trial 0, 12.0000")
        page.wait_for_timeout(500)
        chart = page.locator("#sweep-chart").screenshot()
        assert _line_pixels(chart, TRIAL_COLOURS[0]) > 200  # the full curve of the winner
        assert _line_pixels(chart, TRIAL_COLOURS[1]) > 30  # the pruned trial's short one
