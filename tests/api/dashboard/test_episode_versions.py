"""The episode page in headless Chromium: the token view coloured by policy version (an episode
whose model call spans an in-flight weight update) and the grading tables (tests and what the
grader put back of the patch), over episodes these tests write to the site's database the way
the pipeline does (completions with per-token version runs, trajectories by the real builder)."""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By

from api.dashboard.pages import console_clean, open_page, rows, text
from app.db import session_scope
from app.runconfig import RunConfig
from app.tables import Completion, Episode, Group, Run, TaskInstance, TrainingStep
from app.training.store import build_episode_trajectories

pytestmark = pytest.mark.timeout(300)

# (answer, per-token version runs over its tokens, KV runs): call 1 spans the update from v1 to
# v2 (its 5th token on is v2's) with its KV left from v1 (a `keep` update without KV recompute).
CALLS = [("THOUGHT: Let me read the file.\n\n```bash\ncat calc.py\n```", [[0, 0]], None),
         ("THOUGHT: add subtracts; fix it.\n\n```bash\nsed -i 's/a - b/a + b/' calc.py\n```", [[0, 1], [5, 2]],
          [[0, 1]]),
         ("THOUGHT: Done.\n\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```", [[0, 2]], None)]
# The step that trained the episode produced v3: its trainer held v2, the lags' reference.
STEP_VERSION = 3

SURFACE_REPORT = {
    "resolved": False, "apply": {"applied": True, "method": "git apply"},
    "tests_status": {"FAIL_TO_PASS": {"success": ["tests/test_calc.py::test_add"], "failure": ["tests/test_calc.py::test_big"]},
                     "PASS_TO_PASS": {"success": ["tests/test_calc.py::test_sub"], "failure": []}},
    "reverted_files": {"tests/test_calc.py": "test file"},
    "test_surface": {"layout": {"decided": True, "rule": "test code is what pytest collects"},
                     "reverted": {"tests/test_calc.py": {"rule": "collected test", "why": "collected by pytest from tests/"},
                                  "conftest.py": {"rule": "pytest configuration", "why": "read by pytest at start"}},
                     "kept": {"calc.py": "library code: imported by tests/test_calc.py"}}}
OLDER_REPORT = {"resolved": False, "reverted_files": {"setup.cfg": "pytest configuration"}}


def _chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def _run(s, kind: str) -> tuple[Run, TaskInstance]:
    cfg = RunConfig.model_validate({"kind": kind, "harness": "mini-swe-agent", "task_set": "synthetic",
                                    "group_size": 2, "tasks_per_step": 1, "steps": 1}).model_dump(mode="json")
    now = dt.datetime.now(dt.timezone.utc)
    run = Run(kind=kind, status="completed", config=cfg, policy_version=STEP_VERSION if kind == "train" else 0,
              created_at=now, started_at=now, finished_at=now)
    inst = TaskInstance(task_set="synthetic", instance_id=f"synthetic__calc-{kind}-{now.timestamp()}",
                        repo="synthetic/calc", base_commit="0" * 40, record={})
    s.add_all([run, inst])
    s.flush()
    return run, inst


@pytest.fixture(scope="module")
def version_episode(site) -> int:
    """A train run's episode of three chat calls merged into one sequence, sampled by v0, v1 then
    v2, and v2; trained by a completed step (and its group's sibling, trained with it)."""
    from app.api.tokenizer import smollm2_tokenizer

    tok = smollm2_tokenizer()
    im_end = tok.token_to_id("<|im_end|>")
    with session_scope() as s:
        run, inst = _run(s, "train")
        s.add(Group(run_id=run.id, group_index=0, instance_id=inst.id, status="trained", step=0, policy_version=0))
        eps = [Episode(run_id=run.id, instance_id=inst.id, step=0, group_index=0, sample_index=k, status="completed",
                       attempts=1, policy_version=0, reward=float(k == 0), resolved=k == 0, exit_status="submitted")
               for k in range(2)]
        s.add_all(eps)
        s.flush()
        messages = [{"role": "system", "content": "You are a shell agent."},
                    {"role": "user", "content": "Fix calc.add: add(2, 3) returns -1."}]
        prompt = tok.encode(_chatml(messages), add_special_tokens=False).ids
        for seq, (answer, runs, kv) in enumerate(CALLS):
            sampled = tok.encode(answer, add_special_tokens=False).ids + [im_end]
            s.add(Completion(episode_id=eps[0].id, seq=seq, request_key=f"v{seq}", api="chat", model="smollm2",
                             raw_request={"messages": messages}, normalized_request={"messages": messages},
                             prompt_ids=list(prompt), sampled_ids=sampled, logprobs=[-0.05 * (i % 7) for i in range(len(sampled))],
                             finish_reason="stop", policy_version=runs[0][1], policy_versions=runs, kv_versions=kv))
            observation = "<returncode>0</returncode>"
            messages = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": observation}]
            prompt = prompt + sampled + tok.encode(f"\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n",
                                                   add_special_tokens=False).ids
        s.flush()
        rows_, _ = build_episode_trajectories(s, eps[0].id, "prefix_merging")
        assert len(rows_) == 1  # one merged sequence holds all three calls
        s.add(TrainingStep(run_id=run.id, step=0, status="completed", policy_version=STEP_VERSION,
                           episode_ids=[e.id for e in eps]))
        return eps[0].id


def _tokens(browser) -> list[dict]:
    """Each sampled token of the view: its version, classes, title and computed background."""
    return browser.execute_script("""
        return [...document.querySelectorAll('#tokens .tokens .tok')].map((t) => ({
            version: t.dataset.version, cls: t.className, title: t.title,
            background: getComputedStyle(t).backgroundColor}));""")


def _backgrounds(tokens: list[dict]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for t in tokens:
        out.setdefault(t["version"], set()).add(t["background"])
    return out


def test_the_token_view_colours_tokens_by_version_with_a_legend(browser, site, shots, version_episode):
    open_page(browser, site, f"/episodes/{version_episode}")
    assert text(browser, "#tokens-head") == "Trained sequences"
    tokens = _tokens(browser)
    per_call = [len(tok_ids) for tok_ids in _sampled_ids(version_episode)]
    assert len(tokens) == sum(per_call)
    # the call spanning the update: its first 5 tokens are v1's, the rest v2's
    spanning = tokens[per_call[0]:per_call[0] + per_call[1]]
    assert [t["version"] for t in spanning] == ["1"] * 5 + ["2"] * (per_call[1] - 5)
    assert {t["version"] for t in tokens} == {"0", "1", "2"}
    lag = {"2": "lag-0", "1": "lag-1", "0": "lag-2"}  # behind v2, the weights step 0 trained
    assert all(lag[t["version"]] in t["cls"].split() for t in tokens)
    assert all(f"policy v{t['version']}" in t["title"] for t in tokens)
    assert all("KV v1" in t["title"] for t in spanning[5:])  # sampled by v2 over v1's KV
    assert not any("KV" in t["title"] for t in spanning[:5] + tokens[:per_call[0]])
    # by logprob first (the existing colouring): the version legend is hidden
    assert browser.find_element(By.ID, "colour-by-logprob").is_selected()
    assert browser.find_element(By.ID, "legend-logprob").is_displayed()
    assert not browser.find_element(By.ID, "legend-version").is_displayed()
    by_logprob = _backgrounds(tokens)
    assert len(set().union(*by_logprob.values())) > 3  # one colour per probability, not per version

    browser.find_element(By.ID, "colour-by-version").click()
    by_version = _backgrounds(_tokens(browser))
    assert all(len(colours) == 1 for colours in by_version.values()), by_version  # one colour per version
    assert len({next(iter(c)) for c in by_version.values()}) == 3  # and a distinct one for each
    assert browser.find_element(By.ID, "legend-version").is_displayed()
    assert not browser.find_element(By.ID, "legend-logprob").is_displayed()
    assert text(browser, "#version-reference") == "v2"
    legend = browser.find_elements(By.CSS_SELECTOR, "#legend-version .tok")
    assert [e.text for e in legend] == ["v2 · lag 0", "v1 · lag 1", "v0 · lag 2"]
    swatch = {e.get_attribute("data-version"): browser.execute_script(
        "return getComputedStyle(arguments[0]).backgroundColor", e) for e in legend}
    assert {v: {c} for v, c in swatch.items()} == by_version  # the legend's colours are the tokens'
    _shot(browser, shots / "episode-token-versions.png")

    browser.find_element(By.ID, "colour-by-logprob").click()
    assert _backgrounds(_tokens(browser)) == by_logprob  # back to the logprob colours
    open_page(browser, site, f"/episodes/{version_episode}?colour=version")  # a link that opens by version
    assert browser.find_element(By.ID, "colour-by-version").is_selected()
    assert _backgrounds(_tokens(browser)) == by_version
    console_clean(browser)


def _sampled_ids(episode_id: int) -> list[list[int]]:
    with session_scope() as s:
        return [list(c.sampled_ids) for c in s.query(Completion).filter_by(episode_id=episode_id).order_by(Completion.seq)]


def _shot(browser, path: Path) -> None:
    """A small picture of the token section: the toggle, the legend and the first sequence."""
    section = browser.find_element(By.ID, "tokens")
    browser.execute_script("arguments[0].scrollIntoView()", section)
    section.screenshot(str(path))


@pytest.fixture(scope="module")
def graded_episodes(site) -> dict[str, int]:
    with session_scope() as s:
        run, inst = _run(s, "eval")
        ids = {}
        for k, (label, report) in enumerate((("surface", SURFACE_REPORT), ("older", OLDER_REPORT))):
            ep = Episode(run_id=run.id, instance_id=inst.id, step=0, group_index=0, sample_index=k, status="completed",
                         attempts=1, policy_version=0, reward=0.0, resolved=False, grading_report=report)
            s.add(ep)
            s.flush()
            ids[label] = ep.id
        s.add(Group(run_id=run.id, group_index=0, instance_id=inst.id, status="done"))
        return ids


def _cells(row) -> list[str]:
    return [td.text for td in row.find_elements(By.TAG_NAME, "td")]


def test_the_grading_tables_show_the_tests_and_what_the_grader_put_back(browser, site, shots, graded_episodes):
    open_page(browser, site, f"/episodes/{graded_episodes['surface']}")
    surface = [_cells(r) for r in rows(browser, "#test-surface")]
    assert surface == [
        ["tests/test_calc.py", "put back", "collected test", "collected by pytest from tests/"],
        ["conftest.py", "put back", "pytest configuration", "read by pytest at start"],
        ["calc.py", "kept", "library code", "library code: imported by tests/test_calc.py"]]
    assert not browser.find_elements(By.ID, "layout-undecided")  # the layout was decided
    tests = {(c[0], c[1]): (c[2], r.get_attribute("class")) for r in rows(browser, "#tests") for c in [_cells(r)]}
    assert tests == {("FAIL_TO_PASS", "tests/test_calc.py::test_big"): ("failed", "fail"),
                     ("FAIL_TO_PASS", "tests/test_calc.py::test_add"): ("passed", "pass"),
                     ("PASS_TO_PASS", "tests/test_calc.py::test_sub"): ("passed", "pass")}
    browser.find_element(By.ID, "grading").screenshot(str(shots / "episode-grading.png"))
    console_clean(browser)

    open_page(browser, site, f"/episodes/{graded_episodes['older']}")  # a report from before test_surface
    assert [_cells(r) for r in rows(browser, "#test-surface")] == [["setup.cfg", "put back", "-", "pytest configuration"]]
    assert "No test results recorded." in text(browser, "#grading")
    console_clean(browser)
