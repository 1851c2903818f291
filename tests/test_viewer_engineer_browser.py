"""An engineer round's page in a real Chromium: the K candidates of one group, each with
its validity, in-batch and held-out Δ_B with intervals, reward and advantage as the
trainer computes it (the invalid candidate in the group with its penalty). The round is
recorded on the proxy exactly as ``tracetap engineer`` finishes its episodes
(``analysis.engineer.loop._finish``)."""

# ruff: noqa: F811 - the tests take helpers.viewer_site's fixtures by name

from __future__ import annotations

from helpers.http import finish, register
from helpers.viewer_site import (  # noqa: F401 - fixtures, used by name
    browser,
    expect,
    page,
    session_state,
    site,
)

from tracetap.analysis.engineer.loop import Row, _finish

GROUP = "r1.batch-0123456789"


def _round(site) -> list[Row]:
    rows = [
        Row(episode_id=f"{GROUP}.c0", group=GROUP, candidate=0, patch="eng-aaaa",
            sha256="a" * 64, valid=True, why=None, delta=0.375, interval=(0.0, 0.75),
            held_out_tasks=2, held_out_delta=0.0, held_out_interval=(0.0, 0.0),
            fixed=["t1"], reward=0.375, reward_from="in-batch"),
        Row(episode_id=f"{GROUP}.c1", group=GROUP, candidate=1, patch="eng-bbbb",
            sha256="b" * 64, valid=True, why=None, delta=0.0, interval=(0.0, 0.0),
            held_out_tasks=2, held_out_delta=0.0, held_out_interval=(0.0, 0.0),
            reward=0.0, reward_from="in-batch"),
        Row(episode_id=f"{GROUP}.c2", group=GROUP, candidate=2, patch="eng-cccc",
            sha256="c" * 64, valid=False, why="after_model failed on a recorded call",
            reward=-1.0),
    ]
    for row in rows:
        register(site.proxy, row.episode_id, group_id=GROUP, task_id=GROUP,
                 metadata={"engineer": "r1", "candidate": row.candidate,
                           "packets": ["packet-episode"]})
        done = _finish(row)
        finish(site.proxy, row.episode_id, done.reward, outcome=done.outcome, info=done.info)
    return rows


def test_an_engineer_round_shows_every_candidate_and_the_trainers_advantages(site, page):
    _round(site)
    page.goto(site.url + f"/engineer/{GROUP}")
    expect(page.locator("h1")).to_contain_text(GROUP)
    rows = page.locator("#engineer-round tbody tr")
    expect(rows).to_have_count(3)
    # The demo's group [0.375, 0, -1]: population std, the invalid candidate included.
    expect(rows.locator(".advantage")).to_have_text(["+1.005", "+0.359", "-1.364"])
    expect(rows.locator(".validity")).to_have_text(
        ["yes", "yes", "no after_model failed on a recorded call"])
    expect(rows.nth(0).locator(".in-batch")).to_have_text("+0.375")
    expect(rows.nth(0).locator(".held-out")).to_have_text("+0.000 (2 tasks)")
    expect(rows.nth(0).locator(".interval").first).to_have_text("[+0.000, +0.750]")
    expect(rows.nth(2).locator(".in-batch")).to_have_text("\u2013")  # an en dash: none
    expect(rows.nth(2).locator(".reward")).to_have_text("-1.000")
    page.click(f"#engineer-round a[href$='{GROUP}.c2']")
    expect(page.locator("h1")).to_have_text(f"{GROUP}.c2")


def test_a_group_with_no_engineer_episode_is_a_404(site, page):
    reply = page.goto(site.url + "/engineer/no-such-round")
    assert reply.status == 404
